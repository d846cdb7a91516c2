// CPU backward of the fused recurrent KDA: runs the backward kernels (recompute each chunk from
// the forward's checkpoints, then the reverse recurrence of docs/math.md "Backward") over (sequence, value
// head, group of V-slices) units; the per-group partials are summed in a fixed order and chained
// through the pre-processing (l2 norm, gate, sigmoid beta) by csrc/cpu/bwd_common.cpp.
//
// Determinism: the partition into units depends on the shapes only, never on the thread count,
// and every sum runs in a fixed order, so results are bitwise identical for any thread count.
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"

#include <ATen/Parallel.h>

#include <vector>

namespace kda {
namespace detail {

namespace {

// Groups of V-slices per (sequence, value head): enough units to keep a few threads busy when
// there are few heads; a function of the shapes only.
int64_t n_groups(const Dims& d, int64_t n_slices) {
  const int64_t heads = std::max<int64_t>(1, d.N * d.HV);
  const int64_t want = std::max<int64_t>(1, (4 + heads - 1) / heads);
  return std::max<int64_t>(1, std::min(n_slices, want));
}

template <typename T>
void run_bwd(const Prepared& p, const Dims& d, const Sequences& seqs, const at::Tensor& h0,
             const at::Tensor& ckpt, const at::Tensor& dout, const at::Tensor& dht,
             const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dg,
             const at::Tensor& dbeta, const at::Tensor& dv, const at::Tensor& dh0,
             int64_t n_slices, int64_t groups) {
  kernels::BwdArgs<T> A;
  fill_recurrence_inputs<T>(A, p, d, seqs, h0);
  A.ckpt = ckpt.numel() > 0 ? ckpt.data_ptr<T>() : nullptr;
  A.dout = dout.data_ptr<T>();
  A.dht = dht.defined() ? dht.data_ptr<T>() : nullptr;
  A.dq = dq.data_ptr<T>();
  A.dk = dk.data_ptr<T>();
  A.dg = dg.data_ptr<T>();
  A.dbeta = dbeta.data_ptr<T>();
  A.group_stride = d.B * d.T * d.HV * d.K;
  A.group_stride_beta = d.B * d.T * d.HV;
  A.dv = dv.data_ptr<T>();
  A.dh0 = dh0.data_ptr<T>();
  const auto& tab = kernels::table();
  auto fn = [&]() {
    if constexpr (std::is_same_v<T, float>) {
      return tab.bwd_f32;
    } else {
      return tab.bwd_f64;
    }
  }();
  const int64_t units = d.N * d.HV * groups;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u % groups;
      const int64_t hv = (u / groups) % d.HV;
      const int64_t n = u / (groups * d.HV);
      fn(A, n, hv, g * n_slices / groups, (g + 1) * n_slices / groups, g);
    }
  });
}

}  // namespace

std::vector<at::Tensor> recurrent_bwd_cpu(const at::Tensor& d_o,
                                          const std::optional<at::Tensor>& d_final_state,
                                          const at::Tensor& checkpoints, const Inputs& in,
                                          const Config& cfg) {
  const BwdSetup s = backward_setup(d_o, d_final_state, checkpoints, in, cfg);
  const Dims& d = s.d;
  const auto opts = in.q.options().dtype(compute_dtype(in.q));
  const int64_t BT = d.B * d.T;

  const int64_t n_slices = (d.V + kernels::kBwdSlice - 1) / kernels::kBwdSlice;
  KernelGrads kg;
  kg.groups = n_groups(d, n_slices);
  kg.dq = at::empty({kg.groups, BT, d.HV, d.K}, opts);
  kg.dk = at::empty({kg.groups, BT, d.HV, d.K}, opts);
  kg.dg = at::empty({kg.groups, BT, d.HV, d.K}, opts);
  kg.dbeta = at::empty({kg.groups, BT, d.HV}, opts);
  kg.dv = at::empty({BT, d.HV, d.V}, opts);
  kg.dh0 = at::empty({d.N, d.HV, d.K, d.V}, opts);
  for (const at::Tensor* t : {&kg.dq, &kg.dk, &kg.dg, &kg.dv}) advise_huge_pages(*t);
  if (opts.dtype() == at::kDouble) {
    run_bwd<double>(s.p, d, s.seqs, s.h0, s.ckpt, s.dout, s.dht, kg.dq, kg.dk, kg.dg, kg.dbeta,
                    kg.dv, kg.dh0, n_slices, kg.groups);
  } else {
    run_bwd<float>(s.p, d, s.seqs, s.h0, s.ckpt, s.dout, s.dht, kg.dq, kg.dk, kg.dg, kg.dbeta,
                   kg.dv, kg.dh0, n_slices, kg.groups);
  }
  // The chain rule through the pre-processing (csrc/cpu/bwd_common.cpp).
  return backward_finish(s, kg, in, cfg);
}

}  // namespace detail
}  // namespace kda
