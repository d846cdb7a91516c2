// The recurrent forward's kernel alone (kda::kernels::<isa>::fwd_unit), without the pre-processing
// pass, the driver, ATen or Python: how fast the row sweep of csrc/cpu/kernels/recurrent_kernels.cpp
// runs, against the FP peak of the same core measured in the same process.
//
// Inputs are synthetic but shaped like the pre-processed ones (docs/math.md "Forward recurrence"):
// unit-norm k, q scaled by K^-1/2, beta = 0.5, v ~ N(0, 1), decays a = exp(-s (h + 1) softplus(z))
// with z ~ N(0, 1) per channel and token, h the head (s = 1: benchmark-like gates, up to e^-12 per
// token; s = 0.01: weak gates). B = 1, H = 4, K = V = 128, one thread, all tokens in one range.
// Prints the best of 15 calls (process CPU time): ms, GFLOP/s at 8 K V FLOPs per token and head,
// ns per state row (K x 32 slice rows) and token, and the peak of 512-bit (or 256-bit) FMAs measured
// with 12 independent chains (32 / 16 FLOPs each). Build it against a source tree and run, e.g.:
//
//   g++ -O3 -ffp-contract=fast -std=c++17 -Wno-psabi -mavx512f -mavx512vl -mavx512bw -mavx512dq
//       -mavx2 -mfma -mf16c -mprefer-vector-width=512 -DKDA_ISA=avx512 -Icsrc
//       benchmarks/fwd_kernel.cpp csrc/cpu/kernels/recurrent_kernels.cpp -o /tmp/fwd_kernel
//   /tmp/fwd_kernel 256 0.01; /tmp/fwd_kernel 2048 1     # tokens, gate strength s
//
// (KDA_ISA=avx2 with -mavx2 -mfma -mf16c, or generic without flags, for the other kernels.)
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu_clock.h"
#include "kernel_inputs.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

// GFLOP/s of independent FMA chains (12: more than latency x ports on current x86 cores).
double fma_peak(float seed) {
  constexpr int kChains = 12;
  const long n = 50'000'000;
#if defined(__AVX512F__)
  using V = __m512;
  auto set = [](float x) { return _mm512_set1_ps(x); };
  auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  constexpr int kLanes = 16;
#else
  using V = __m256;
  auto set = [](float x) { return _mm256_set1_ps(x); };
  auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  constexpr int kLanes = 8;
#endif
  V c[kChains];
  for (int j = 0; j < kChains; ++j) c[j] = set(seed + 0.001f * j);  // distinct: no merged chains
  const V a = set(0.999f), b = set(1e-4f);
  const double t0 = cpu_seconds();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < kChains; ++j) c[j] = fma(c[j], a, b);
  }
  const double t = cpu_seconds() - t0;
  float sink = 0;
  for (int j = 0; j < kChains; ++j) sink += reinterpret_cast<const float*>(&c[j])[0];
  if (sink == 12345.f) std::puts("");  // keeps the chains
  return 2.0 * kLanes * kChains * n / t / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kda::kernels;
  const int64_t H = 4, K = 128, V = 128;
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 1024;
  const float strength = argc > 2 ? static_cast<float>(std::atof(argv[2])) : 1.0f;
  KernelInputs in(H, T, K, V, strength);
  std::vector<float> o(T * H * V), ht(H * K * V);
  int64_t start = 0, end = T, origin = 0, slot_base = 0;
  FwdArgs<float> A;
  A.seqs.n_seq = 1;
  A.seqs.seq_start = &start;
  A.seqs.seq_end = &end;
  A.seqs.origin = &origin;
  A.seqs.slot_base = &slot_base;
  A.BT = T, A.H = H, A.HV = H, A.K = K, A.V = V;
  A.q = in.q.data(), A.k = in.k.data(), A.a = in.a.data(), A.ak = in.ak.data();
  A.beta = in.beta.data(), A.v = in.v.data(), A.o = o.data(), A.ht = ht.data();
  const int64_t n_slices = V / kFwdSlice;
  AlignedFloats scratch(fwd_scratch_elems(K, n_slices));
  float* ws = scratch.p;
  const Table& tab = KDA_ISA::get();
  double best = 1e30;
  for (int rep = 0; rep < 15; ++rep) {
    const double t0 = cpu_seconds();
    for (int64_t hv = 0; hv < H; ++hv) tab.fwd_f32(A, 0, hv, 0, n_slices, 0, T, ws);
    best = std::min(best, cpu_seconds() - t0);
  }
  double check = 0;
  for (float x : o) check += x;
  const double gflops = 8.0 * K * V * H * T / best / 1e9, peak = fma_peak(strength);
  std::printf("%s T%lld s=%g: %.3f ms, %.1f GFLOP/s, %.3f ns per row and token, "
              "FMA peak %.0f GFLOP/s (%.0f%%), sum(o) %.6g\n",
              tab.isa, static_cast<long long>(T), strength, best * 1e3, gflops,
              best * 1e9 / (T * H * n_slices * K), peak, 100 * gflops / peak, check);
  return 0;
}
