// The recurrent backward's kernel alone (kda::kernels::<isa>::bwd_unit), without the
// pre-processing, the chain rule, the driver, ATen or Python; optionally two builds of it side by
// side in one process (an A/B of a kernel change that the shared box's noise cannot blur: the two
// builds alternate call by call on the same inputs).
//
// Inputs as benchmarks/fwd_kernel.cpp (benchmarks/kernel_inputs.h, gate strength 1/8),
// B = 1, H = 4, K = V = 128, one thread, every sequence in one range; the checkpoints come
// from the same build's forward, the cotangents (grad_o, grad of the final state) are N(0, 1).
// Prints per build the best of the calls (process CPU time): ms, GFLOP/s at 24 K V FLOPs per token
// and head (the backward's share of benchmark.Shape.flops), ns per state row and token; with two
// builds their time ratio and the largest difference of their gradients relative to the largest
// gradient (0 when the change keeps every bit; beta = 0.5 here, so a change that only moves a
// multiplication by beta keeps the bits too). Build and run from the repository root, with $BASE
// a source tree of the other build (e.g. `git archive main | tar -x -C $BASE`), e.g. (AVX2):
//
//   F="-O3 -ffp-contract=fast -std=c++17 -Wno-psabi -mavx2 -mfma -mf16c"
//   g++ $F -I$BASE/csrc -DKDA_ISA=avx2 -c $BASE/csrc/cpu/kernels/recurrent_kernels.cpp -o /tmp/a.o
//   g++ $F -Icsrc -DKDA_ISA=avx2_b -c csrc/cpu/kernels/recurrent_kernels.cpp -o /tmp/b.o
//   g++ $F -Icsrc -DKDA_ISA=avx2 -DKDA_ISA_B=avx2_b benchmarks/bwd_kernel.cpp /tmp/a.o /tmp/b.o \
//       -o /tmp/bwd_kernel && /tmp/bwd_kernel 4096 21      # tokens, calls per build
//
// Both builds must share csrc/cpu/kernels/recurrent_kernels.h (the argument structs). One build:
// leave out KDA_ISA_B and b.o. AVX-512: the flags of cmake/KdaKernels.cmake.
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu_clock.h"
#include "kernel_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

// Each build's table (a repeated declaration of the header's own is harmless).
namespace kda {
namespace kernels {
namespace KDA_ISA {
const Table& get();
}
#ifdef KDA_ISA_B
namespace KDA_ISA_B {
const Table& get();
}
#endif
}  // namespace kernels
}  // namespace kda

namespace {

using kda::kernels::BwdArgs;
using kda::kernels::FwdArgs;
using kda::kernels::Table;

constexpr int64_t H = 4, K = 128, V = 128, kSlices = V / kda::kernels::kBwdSlice;

// The gradients one build's backward writes (same shapes as BwdArgs: one partial, p = 0).
struct Grads {
  std::vector<float> dq, dk, dg, dbeta, dv, dh0;
  explicit Grads(int64_t T)
      : dq(T * H * K), dk(T * H * K), dg(T * H * K), dbeta(T * H), dv(T * H * V), dh0(H * K * V) {}
  void attach(BwdArgs<float>& B) {
    B.dq = dq.data(), B.dk = dk.data(), B.dg = dg.data(), B.dbeta = dbeta.data();
    B.dv = dv.data(), B.dh0 = dh0.data();
  }
  // Largest |this - o| over every gradient, relative to the largest |gradient|.
  double max_diff(const Grads& o) const {
    double d = 0, m = 0;
    auto scan = [&](const std::vector<float>& x, const std::vector<float>& y) {
      for (size_t i = 0; i < x.size(); ++i) {
        d = std::max(d, std::fabs(double(x[i]) - y[i]));
        m = std::max(m, std::fabs(double(x[i])));
      }
    };
    scan(dq, o.dq), scan(dk, o.dk), scan(dg, o.dg), scan(dbeta, o.dbeta), scan(dv, o.dv);
    scan(dh0, o.dh0);
    return m > 0 ? d / m : d;
  }
};

double run_once(const Table& tab, BwdArgs<float>& B, Grads& g, int64_t T, float* ws) {
  g.attach(B);
  const double t0 = cpu_seconds();
  for (int64_t hv = 0; hv < H; ++hv) tab.bwd_f32(B, 0, hv, 0, kSlices, 0, 0, T, ws);
  return cpu_seconds() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kda::kernels;
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int calls = argc > 2 ? std::atoi(argv[2]) : 15;
  KernelInputs in(H, T, K, V, 0.125f);
  std::vector<float> o(T * H * V), ht(H * K * V), dout(T * H * V), dht(H * K * V);
  for (auto* x : {&dout, &dht}) {
    for (auto& e : *x) e = in.nd(in.rng);
  }
  const int64_t slots = (T + kChunk - 1) / kChunk;
  std::vector<float> ckpt(slots * H * K * V);
  int64_t start = 0, end = T, origin = 0, slot_base = 0;
  FwdArgs<float> F;
  F.seqs.n_seq = 1;
  F.seqs.seq_start = &start, F.seqs.seq_end = &end, F.seqs.origin = &origin;
  F.seqs.slot_base = &slot_base;
  F.BT = T, F.H = H, F.HV = H, F.K = K, F.V = V;
  F.q = in.q.data(), F.k = in.k.data(), F.a = in.a.data(), F.ak = in.ak.data();
  F.beta = in.beta.data(), F.v = in.v.data(), F.o = o.data(), F.ht = ht.data(), F.ckpt = ckpt.data();
  const Table& ta = KDA_ISA::get();
  {
    AlignedFloats fs(fwd_scratch_elems(K, V / kFwdSlice));
    for (int64_t hv = 0; hv < H; ++hv) ta.fwd_f32(F, 0, hv, 0, V / kFwdSlice, 0, T, fs.p);
  }
  BwdArgs<float> B;
  static_cast<RecurrenceInputs<float>&>(B) = static_cast<const RecurrenceInputs<float>&>(F);
  B.ckpt = ckpt.data(), B.dout = dout.data(), B.dht = dht.data();
  B.group_stride = T * H * K, B.group_stride_beta = T * H;
  AlignedFloats ws(bwd_scratch_elems(K, kSlices));

  std::vector<const Table*> builds = {&ta};
#ifdef KDA_ISA_B
  builds.push_back(&KDA_ISA_B::get());
#endif
  std::vector<Grads> grads(builds.size(), Grads(T));
  std::vector<double> best(builds.size(), 1e30);
  for (int c = 0; c < calls; ++c) {
    for (size_t b = 0; b < builds.size(); ++b) {
      best[b] = std::min(best[b], run_once(*builds[b], B, grads[b], T, ws.p));
    }
  }
  for (size_t b = 0; b < builds.size(); ++b) {
    std::printf("build %c (%s) T%lld: %.3f ms, %.1f GFLOP/s, %.3f ns per row and token\n",
                static_cast<char>('A' + b), builds[b]->isa, static_cast<long long>(T),
                best[b] * 1e3, 24.0 * K * V * H * T / best[b] / 1e9,
                best[b] * 1e9 / (T * H * kSlices * K));
  }
  if (builds.size() == 2) {
    std::printf("B / A time %.3f, largest gradient difference %.3g (relative)\n",
                best[1] / best[0], grads[1].max_diff(grads[0]));
  }
  return 0;
}
