// Where the chunk forward's time goes, piece by piece, on one thread: the three per-chunk pieces
// of csrc/cpu/chunk_common.h (decays_and_am, forward_solve, state_step) timed separately over the
// chunks of one sequence, with the products the forward would use (fp32, or bf16 with fp32
// accumulation), against the rate of one product of the state step's shape ([64, 128] x
// [128, 128]) through the same library call, measured in the same process.
//
// Inputs are synthetic but shaped like the pre-processed ones (docs/math.md "Chunkwise form"):
// unit-norm k, q scaled by K^-1/2, beta in (0, 1), v ~ N(0, 1), decays a = exp(-s softplus(z))
// with z ~ N(0, 1) per channel and token (s = 1: benchmark-like gates; s = 0.01: weak gates),
// K = V = 128, one (sequence, head) unit of T = chunks x 64 tokens, one thread. Prints the best of
// 9 passes (wall time per chunk, µs), each piece's share and its GFLOP/s at the FLOP counts in
// main() (docs/benchmarks.md, "The chunk forward, piece by piece"). Build it against an installed
// wheel:
//
//   TORCH=$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')
//   KDA=$(python -c 'import torch_kda, os; print(os.path.dirname(torch_kda.__file__))')
//   g++ -O2 -std=c++17 -Icsrc -isystem $TORCH/include
//       -isystem $TORCH/include/torch/csrc/api/include
//       -D_GLIBCXX_USE_CXX11_ABI=1 benchmarks/chunk_fwd_breakdown.cpp -o /tmp/chunk_breakdown
//       -L$TORCH/lib -L$KDA -Wl,-rpath,$TORCH/lib -Wl,-rpath,$KDA -l:libkda.so -ltorch_cpu -lc10
//   /tmp/chunk_breakdown 128 1 bf16     # chunks, gate strength s, products: fp32 | bf16 | emulated
//   /tmp/chunk_breakdown 256 1 bf16 32  # the same tokens in chunks of 32 (the pieces take any
//                                       # n <= 64 tokens: what a shorter chunk would cost)
#include "cpu/chunk_common.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace chunk = kda::detail::chunk;
using kda::detail::Carver;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Aligned {
  std::vector<char> raw;
  char* base;
  explicit Aligned(int64_t bytes) : raw(bytes + 64) {
    base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) / 64 * 64);
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t chunks = argc > 1 ? std::atoll(argv[1]) : 128;
  const float s = argc > 2 ? std::atof(argv[2]) : 1.0f;
  const std::string mode = argc > 3 ? argv[3] : "fp32";
  const int64_t K = 128, V = 128, C = argc > 4 ? std::atoll(argv[4]) : chunk::kC, T = chunks * C;
  if (C < 1 || C > chunk::kC) {
    std::printf("the chunk length must lie in [1, %lld]\n", static_cast<long long>(chunk::kC));
    return 1;
  }
  const chunk::Products products = mode == "bf16"       ? chunk::Products::kBf16
                                   : mode == "emulated" ? chunk::Products::kBf16Emulated
                                                        : chunk::Products::kNative;
  if (products == chunk::Products::kBf16 && !chunk::bf16_products_in_hardware()) {
    std::printf("this CPU has no bf16 product hardware (AMX or AVX-512 BF16); try emulated\n");
    return 1;
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(T * K), k(T * K), a(T * K), beta(T), v(T * V), o(T * V);
  for (int64_t t = 0; t < T; ++t) {
    float nk = 0, nq = 0;
    for (int64_t d = 0; d < K; ++d) {
      k[t * K + d] = nd(rng);
      q[t * K + d] = nd(rng);
      nk += k[t * K + d] * k[t * K + d];
      nq += q[t * K + d] * q[t * K + d];
      const float z = nd(rng);
      a[t * K + d] = std::exp(-s * std::log1p(std::exp(z)));
    }
    for (int64_t d = 0; d < K; ++d) {
      k[t * K + d] /= std::sqrt(nk);
      q[t * K + d] /= std::sqrt(nq) * std::sqrt(float(K));
    }
    beta[t] = 1.0f / (1.0f + std::exp(-nd(rng)));
    for (int64_t e = 0; e < V; ++e) v[t * V + e] = nd(rng);
  }
  const bool bf16 = products != chunk::Products::kNative;
  Carver sizer(nullptr);
  chunk::ChunkWork<float> sized(sizer, K, V);
  if (bf16) sized.prod = chunk::ProductWork(products, sizer, K, V);
  chunk::bind_results(sized, sizer, K, V, bf16);
  Aligned ws(sizer.bytes());
  Carver c(ws.base);
  chunk::ChunkWork<float> w(c, K, V);
  if (bf16) w.prod = chunk::ProductWork(products, c, K, V);
  chunk::bind_results(w, c, K, V, bf16);
  std::vector<float> S(K * V);

  chunk::FlushDenormals ftz;
  constexpr int kPieces = 3;
  const char* names[kPieces] = {"decays_and_am", "forward_solve", "state_step"};
  // FLOPs per full chunk (multiply-adds count 2): A0 and M (2 x C^2/2 x K x 2), the solve
  // (T = (I + A)^-1: C^3 / 3; with fp32 products also T R: 2 C^2 (K + V)), the state step's
  // products W S (bf16: (beta Gam . K) S), (Q . Gam) S and Kdec^T Vn (2 C K V each), M Vn
  // (2 C^2 V, counted full: its upper half is zero) and with bf16 products T R' (2 C^2 V). In all
  // 10.6 MFLOP (bf16: 9.5) at K = V = C * 2 = 128, 1.26x (1.13x) the recurrent form's 8 K V per
  // token (8.4 MFLOP).
  const double flops[kPieces] = {
      2.0 * C * C * K, C * C * C / 3.0 + (bf16 ? 0.0 : 2.0 * C * C * (K + V)),
      6.0 * C * K * V + 2.0 * C * C * V + (bf16 ? 2.0 * C * C * V : 0.0)};
  double best[kPieces], best_total = 1e30;
  std::fill(best, best + kPieces, 1e30);
  for (int pass = 0; pass < 9; ++pass) {
    double spent[kPieces] = {0, 0, 0};
    std::fill(S.begin(), S.end(), 0.0f);
    const double t_all = now();
    for (int64_t ci = 0; ci < chunks; ++ci) {
      chunk::ChunkIn<float> in;
      in.n = C;
      in.K = K;
      in.V = V;
      in.q = q.data() + ci * C * K;
      in.k = k.data() + ci * C * K;
      in.a = a.data() + ci * C * K;
      in.beta = beta.data() + ci * C;
      in.v = v.data() + ci * C * V;
      in.ldv = V;
      double t0 = now();
      chunk::decays_and_am(in, w);
      double t1 = now();
      chunk::forward_solve(in, w);
      double t2 = now();
      chunk::state_step(in, w, S.data(), o.data() + ci * C * V, V);
      double t3 = now();
      spent[0] += t1 - t0;
      spent[1] += t2 - t1;
      spent[2] += t3 - t2;
    }
    const double total = now() - t_all;
    for (int i = 0; i < kPieces; ++i) best[i] = std::min(best[i], spent[i]);
    best_total = std::min(best_total, total);
  }
  chunk::gemm_release(products);

  // The yardstick: one [C, K] x [K, V] product through the same library call, repeated.
  std::vector<float> A(C * K), B(K * V), Cm(C * V);
  for (auto& x : A) x = nd(rng);
  for (auto& x : B) x = nd(rng);
  double gemm_best = 1e30;
  const int reps = 400;
  for (int pass = 0; pass < 5; ++pass) {
    const double t0 = now();
    if (bf16 && products == chunk::Products::kBf16) {
      std::vector<at::BFloat16> A16(C * K);
      for (int64_t i = 0; i < C * K; ++i) A16[i] = at::BFloat16(A[i]);
      chunk::pack_b(w.prod, K, V, K, B.data(), V, w.prod.s);
      const double t1 = now();
      for (int r = 0; r < reps; ++r) {
        chunk::gemm16(w.prod, C, V, K, A16.data(), K, w.prod.s, Cm.data(), V, true);
      }
      gemm_best = std::min(gemm_best, now() - t1);
      continue;
    }
    for (int r = 0; r < reps; ++r) {
      chunk::gemm(C, V, K, A.data(), K, B.data(), V, Cm.data(), V, true);
    }
    gemm_best = std::min(gemm_best, now() - t0);
  }
  chunk::gemm_release(products);
  const double gemm_rate = 2.0 * C * K * V * reps / gemm_best / 1e9;

  const double per_chunk = best_total / chunks * 1e6;
  std::printf("chunks %lld  gate s %.3g  products %s  (K = V = %lld, chunk %lld, 1 thread)\n",
              static_cast<long long>(chunks), s, mode.c_str(), static_cast<long long>(K),
              static_cast<long long>(C));
  std::printf("%-14s %9s %7s %9s\n", "piece", "us/chunk", "share", "GFLOP/s");
  double sum = 0;
  for (int i = 0; i < kPieces; ++i) sum += best[i];
  for (int i = 0; i < kPieces; ++i) {
    std::printf("%-14s %9.2f %6.1f%% %9.1f\n", names[i], best[i] / chunks * 1e6,
                100.0 * best[i] / sum, flops[i] * chunks / best[i] / 1e9);
  }
  double all_flops = 0;
  for (double f : flops) all_flops += f;
  std::printf("%-14s %9.2f %7s %9.1f\n", "whole chunk", per_chunk, "", all_flops / per_chunk / 1e3);
  std::printf("yardstick: [%lld, %lld] x [%lld, %lld] product, same call: %.1f GFLOP/s "
              "(the whole chunk at that rate: %.2f us)\n",
              static_cast<long long>(C), static_cast<long long>(K), static_cast<long long>(K),
              static_cast<long long>(V), gemm_rate, all_flops / gemm_rate / 1e3);
  std::printf("checksum %.6g\n", static_cast<double>(o[T * V - 1] + S[0]));
  return 0;
}
