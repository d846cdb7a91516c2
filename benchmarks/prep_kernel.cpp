// The recurrent forward's pre-processing pass alone (kda::kernels::<isa>::prep_tokens): l2 norm
// and scale of q and k, softplus gate with exp(A_log) and dt_bias, the decay exp(g) and
// decay * khat, sigmoid beta (the configuration of benchmarks/ab_libs.py), fp32, without the
// recurrence, the driver, ATen or Python.
//
// B = 1, H = HV = 4, K = 128, one thread. Two cases per run:
//   - "cache": the pass over the same `tokens` tokens again and again (inputs and outputs in L1/L2
//     when tokens * 14 KB fits);
//   - "stream": the op's pattern at T = 8192: the inputs read once from memory (24 MB at H4),
//     the outputs written into a block workspace of `block` tokens (the op's plan_blocks: 1024 at
//     H4, 8 MB), block after block.
// Prints the best of `reps` passes (process CPU time) in ns per token and head, the bytes the pass
// moves per token and head, and the read rate of x.sum()-like loop over 64 MB in the same process.
// Build against a source tree and run, e.g.:
//
//   g++ -O3 -ffp-contract=fast -std=c++17 -Wno-psabi -mavx512f -mavx512vl -mavx512bw -mavx512dq
//       -mavx2 -mfma -mf16c -mprefer-vector-width=512 -DKDA_ISA=avx512 -Icsrc
//       benchmarks/prep_kernel.cpp csrc/cpu/kernels/recurrent_kernels.cpp -o /tmp/prep_kernel
//   /tmp/prep_kernel 64 1024 15 [FILE]   # tokens of the cache case, block of the stream case,
//                                         # repetitions, file for the last block's outputs
//
// (KDA_ISA=avx2 with -mavx2 -mfma -mf16c, or generic without flags, for the other kernels.)
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu_clock.h"
#include "kernel_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

// GB/s of one thread summing 64 MB (8 independent sums).
double read_rate() {
  const size_t n = size_t(16) << 20;
  AlignedFloats x(n);
  for (size_t i = 0; i < n; ++i) x.p[i] = 1.0f + (i & 7);
  double best = 0;
  float sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = cpu_seconds();
    float s[16] = {};
    for (size_t i = 0; i < n; i += 16) {
      for (int j = 0; j < 16; ++j) s[j] += x.p[i + j];
    }
    const double t = cpu_seconds() - t0;
    for (float z : s) sink += z;
    best = std::max(best, n * 4.0 / t / 1e9);
  }
  if (sink == 1.f) std::puts("");
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kda::kernels;
  const int64_t H = 4, K = 128;
  const int64_t Tc = argc > 1 ? std::atoll(argv[1]) : 64;
  const int64_t block = argc > 2 ? std::atoll(argv[2]) : 1024;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 15;
  const int64_t Ts = 8192;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  // Raw inputs [T, H, K] (q, k, g) and [T, H] (beta), as the op reads them.
  AlignedFloats q(Ts * H * K), k(Ts * H * K), g(Ts * H * K), beta(Ts * H), bias(H * K), expA(H);
  for (int64_t i = 0; i < Ts * H * K; ++i) q.p[i] = nd(rng), k.p[i] = nd(rng), g.p[i] = nd(rng);
  for (int64_t i = 0; i < Ts * H; ++i) beta.p[i] = nd(rng);
  for (int64_t i = 0; i < H * K; ++i) bias.p[i] = 0.5f * nd(rng);
  for (int64_t h = 0; h < H; ++h) expA.p[h] = std::exp(2.7f * (h + 0.5f) / H);
  const int64_t rows = std::max(Tc, block);
  AlignedFloats qo(H * rows * K), ko(H * rows * K), ao(H * rows * K), ako(H * rows * K), bo(H * rows);

  PrepArgs<float> P;
  P.H = H, P.HV = H, P.K = K;
  P.q = q.p, P.k = k.p, P.g = g.p, P.beta = beta.p;
  P.expA = expA.p, P.dt_bias = bias.p;
  P.scale = 1.0f / std::sqrt(float(K));
  P.l2norm = true;
  P.gate = GateMode::kSoftplus;
  P.beta_sigmoid = true;
  P.q_out = qo.p, P.k_out = ko.p, P.a_out = ao.p, P.ak_out = ako.p, P.beta_out = bo.p;
  const Table& tab = KDA_ISA::get();

  // cache: tokens [0, Tc) again and again, whole arrays (BT = Tc).
  P.BT = Tc;
  const int64_t inner = std::max<int64_t>(1, 8192 / Tc);
  double best_c = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = cpu_seconds();
    for (int64_t r = 0; r < inner; ++r) tab.prep_f32(P, 0, Tc);
    best_c = std::min(best_c, (cpu_seconds() - t0) / inner);
  }
  // stream: T = 8192 in blocks of `block` tokens (outputs at t - b0).
  P.BT = block;
  double best_s = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = cpu_seconds();
    for (int64_t b0 = 0; b0 < Ts; b0 += block) {
      P.out_shift = b0;
      tab.prep_f32(P, b0, std::min(Ts, b0 + block));
    }
    best_s = std::min(best_s, cpu_seconds() - t0);
  }
  // The last block's outputs, for a bitwise comparison of two builds (optional 4th argument).
  if (argc > 4) {
    if (FILE* f = std::fopen(argv[4], "wb")) {
      for (const AlignedFloats* b : {&qo, &ko, &ao, &ako, &bo}) {
        std::fwrite(b->p, sizeof(float), b == &bo ? H * rows : H * rows * K, f);
      }
      std::fclose(f);
    }
  }
  double check = 0;
  for (int64_t i = 0; i < H * block * K; ++i) check += ako.p[i] + qo.p[i];
  // Bytes per token and head: q, k, g read (3 K floats), q, k, a, ak written (4 K floats).
  const double bytes = (3 + 4) * K * 4.0;
  std::printf("%s cache T%lld: %.1f ns per token and head; stream T%lld block %lld: %.1f ns "
              "(%.2f GB/s of %.0f B per token and head); one-thread read %.1f GB/s; check %.6g\n",
              tab.isa, static_cast<long long>(Tc), best_c * 1e9 / (Tc * H),
              static_cast<long long>(Ts), static_cast<long long>(block),
              best_s * 1e9 / (Ts * H), bytes * Ts * H / best_s / 1e9, bytes, read_rate(), check);
  return 0;
}
