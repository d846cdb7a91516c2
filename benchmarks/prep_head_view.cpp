// The chunk forward's pre-processing of one head's rows alone: prep_tokens (one instruction set)
// on a view of one head, as csrc/cpu/chunk_fwd.cpp's prep_chunk_rows calls it for each chunk of
// 64 tokens (H = HV = 1, the whole arrays' token strides; bf16 q, k, g, v and beta widened as
// they are read; l2 norms, softplus gate with exp(A_log) and dt_bias, or g given as a log decay,
// sigmoid beta), B1 T8192 K = V = 128, one thread, without the chunk kernel, the driver, ATen or
// Python.
//
// Three cases, best of `reps` passes (process CPU time), ns per token and head:
//   - "op pattern": every chunk of every head in the op's order (chunk by chunk, each chunk's
//     heads one after the other), reading one head's 256-byte rows 4 KB apart at H16;
//   - "head-major inputs": the same items on inputs laid out [H, T, K] (a head's rows contiguous:
//     what the strided reads cost);
//   - "in cache": one item again and again (the arithmetic alone).
// docs/benchmarks.md, "The chunk forward as data flow" ("Where each thread's time goes"). Build
// against a source tree and run, e.g.:
//
//   g++ -O3 -ffp-contract=fast -std=c++17 -Wno-psabi -mavx512f -mavx512vl -mavx512bw -mavx512dq
//       -mavx2 -mfma -mf16c -mprefer-vector-width=512 -DKDA_ISA=avx512 -Icsrc
//       benchmarks/prep_head_view.cpp csrc/cpu/kernels/recurrent_kernels.cpp -o /tmp/prep_head_view
//   /tmp/prep_head_view 16 1 7     # heads, gate (1: softplus in the op, 0: g a log decay), reps
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu_clock.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

// float to bf16 bits, round to nearest even (finite inputs).
uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kda::kernels;
  const int64_t H = argc > 1 ? std::atoll(argv[1]) : 16;
  const bool gate = argc > 2 ? std::atoi(argv[2]) != 0 : true;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 7;
  const int64_t K = 128, V = 128, T = 8192, C = 64, chunks = T / C;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> q(T * H * K), k(T * H * K), g(T * H * K), v(T * H * V), beta(T * H);
  for (auto* a : {&q, &k, &v}) {
    for (auto& x : *a) x = to_bf16(nd(rng));
  }
  for (auto& x : g) x = to_bf16(gate ? nd(rng) : -0.1f * std::fabs(nd(rng)));
  for (auto& x : beta) x = to_bf16(nd(rng));
  std::vector<float> bias(H * K), expA(H);
  for (auto& x : bias) x = 0.5f * nd(rng);
  for (int64_t h = 0; h < H; ++h) expA[h] = std::exp(2.7f * (h + 0.5f) / H);
  std::vector<float> qo(C * K), ko(C * K), ao(C * K), bo(C), vo(C * V);

  PrepArgs<float> base;
  base.K = K;
  base.H = base.HV = 1;
  base.BT = C;
  base.VW = V;
  base.q_store = base.g_store = base.beta_store = base.v_store = Storage::kBf16;
  base.scale = 1.0f / std::sqrt(float(K));
  base.l2norm = true;
  base.gate = gate ? GateMode::kSoftplus : GateMode::kNone;
  base.beta_sigmoid = true;
  base.q_out = qo.data(), base.k_out = ko.data(), base.a_out = ao.data();
  base.beta_out = bo.data(), base.v_out = vo.data();
  const Table& tab = KDA_ISA::get();
  // Chunk c of head h, from token-major inputs [T, H, *] or head-major ones [H, T, *].
  auto item = [&](int64_t h, int64_t c, bool token_major) {
    PrepArgs<float> P = base;
    const int64_t row = token_major ? h : h * T;  // offset of the head's first row, in rows
    P.q_ld = P.g_ld = token_major ? H * K : K;
    P.beta_ld = token_major ? H : 1;
    P.v_ld = token_major ? H * V : V;
    P.q16 = q.data() + row * K;
    P.k16 = k.data() + row * K;
    P.g16 = g.data() + row * K;
    P.v16 = v.data() + row * V;
    P.beta16 = beta.data() + row;
    P.expA = expA.data() + h;
    P.dt_bias = gate ? bias.data() + h * K : nullptr;
    P.out_shift = c * C;
    tab.prep_f32(P, c * C, c * C + C);
  };
  const char* names[3] = {"op pattern (rows 4 KB apart at H16)", "head-major inputs",
                          "one item again and again (in cache)"};
  for (int mode = 0; mode < 3; ++mode) {
    double best = 1e30;
    for (int rep = 0; rep < reps; ++rep) {
      const double t0 = cpu_seconds();
      for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t h = 0; h < H; ++h) {
          if (mode == 2) {
            item(H / 2, chunks / 2, true);
          } else {
            item(h, c, mode == 0);
          }
        }
      }
      best = std::min(best, cpu_seconds() - t0);
    }
    std::printf("%s %s H%lld gate %d: %.1f ns per token and head\n", tab.isa, names[mode],
                static_cast<long long>(H), gate ? 1 : 0, best * 1e9 / (T * H));
  }
  double check = 0;
  for (int64_t i = 0; i < C * K; ++i) check += qo[i] + ao[i] + vo[i];
  std::printf("check %.6g\n", check);
}
