// CPU backward of the fused recurrent KDA: runs the backward kernels (recompute each chunk from
// the forward's checkpoints, then the reverse recurrence of KDA_SPEC.md) over (sequence, value
// head, group of V-slices) units, sums the per-group partials in a fixed order, and chains the
// gradients through the pre-processing (l2 norm, gate, sigmoid beta).
//
// Determinism: the partition into units depends on the shapes only, never on the thread count,
// and every sum runs in a fixed order, so results are bitwise identical for any thread count.
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"

#include <ATen/Parallel.h>

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

// Sum of x[0] + x[1] + ... along dim 0, in this order.
// (x[0] + x[1]) + x[2] ... ; a single slice is returned as a view.
at::Tensor ordered_sum0(const at::Tensor& x) {
  if (x.size(0) == 1) return x.select(0, 0);
  at::Tensor acc = x.select(0, 0) + x.select(0, 1);
  for (int64_t i = 2; i < x.size(0); ++i) acc.add_(x.select(0, i));
  return acc;
}

// Sum over rows of a [R, C] tensor, rows in order (R may be large: a serial loop).
template <typename T>
void rows_sum_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t R = x.size(0), C = x.size(1);
  const T* p = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  for (int64_t c = 0; c < C; ++c) o[c] = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) o[c] += p[r * C + c];
  }
}
at::Tensor rows_sum(const at::Tensor& x2d) {
  auto x = x2d.contiguous();
  auto out = at::empty({x.size(1)}, x.options());
  if (x.scalar_type() == at::kDouble) {
    rows_sum_impl<double>(x, out);
  } else {
    rows_sum_impl<float>(x, out);
  }
  return out;
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
  const Dims d = check_inputs(in, cfg, /*check_values=*/true);
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const int64_t BT = d.B * d.T;
  const Prepared p = preprocess(in, cfg, d, /*for_backward=*/true);
  const Sequences seqs = make_sequences(in, d);
  const at::Tensor h0 = state_kv(in.initial_state, cfg, ct);
  const at::Tensor dht = state_kv(d_final_state, cfg, ct);
  const at::Tensor dout = d_o.to(ct).reshape({BT, d.HV, d.V}).contiguous();
  const at::Tensor ckpt = checkpoints.to(ct).contiguous();

  const int64_t n_slices = (d.V + kernels::kBwdSlice - 1) / kernels::kBwdSlice;
  const int64_t groups = n_groups(d, n_slices);
  at::Tensor dq_p = at::empty({groups, BT, d.HV, d.K}, opts);
  at::Tensor dk_p = at::empty({groups, BT, d.HV, d.K}, opts);
  at::Tensor dg_p = at::empty({groups, BT, d.HV, d.K}, opts);
  at::Tensor db_p = at::empty({groups, BT, d.HV}, opts);
  at::Tensor dv = at::empty({BT, d.HV, d.V}, opts);
  at::Tensor dh0 = at::empty({d.N, d.HV, d.K, d.V}, opts);
  if (ct == at::kDouble) {
    run_bwd<double>(p, d, seqs, h0, ckpt, dout, dht, dq_p, dk_p, dg_p, db_p, dv, dh0, n_slices,
                    groups);
  } else {
    run_bwd<float>(p, d, seqs, h0, ckpt, dout, dht, dq_p, dk_p, dg_p, db_p, dv, dh0, n_slices,
                   groups);
  }

  // Per-value-head gradients w.r.t. the pre-processed q (scaled), k, the log decay and beta.
  at::Tensor dqv = ordered_sum0(dq_p);  // [BT, HV, K]
  at::Tensor dkv = ordered_sum0(dk_p);
  at::Tensor dgl = ordered_sum0(dg_p);
  at::Tensor dbeta = ordered_sum0(db_p);  // [BT, HV]

  // Grouped value heads: sum over the HV / H value heads of each q/k head, in order.
  const int64_t G = d.HV / d.H;
  at::Tensor dqh = ordered_sum0(dqv.view({BT, d.H, G, d.K}).permute({2, 0, 1, 3}));
  at::Tensor dkh = ordered_sum0(dkv.view({BT, d.H, G, d.K}).permute({2, 0, 1, 3}));
  // d/d qhat = scale * d/d (scale * qhat)
  if (cfg.use_qk_l2norm_in_kernel) {
    dqh = (dqh - p.qhat * (p.qhat * dqh).sum(-1, true)) * (p.q_rnorm * cfg.scale);
    dkh = (dkh - p.k * (p.k * dkh).sum(-1, true)) * p.k_rnorm;
  } else {
    dqh = dqh * cfg.scale;
  }

  at::Tensor dg_in = dgl, dA, dbias;
  if (cfg.use_gate_in_kernel) {
    at::Tensor dz;
    if (!cfg.lower_bound) {
      const auto A = in.A_log->to(ct).reshape({1, d.HV, 1});
      dz = dgl * (-at::exp(A)) * p.gate_s;
      dA = rows_sum((dgl * p.g).sum(-1));  // [HV]
    } else {
      dz = dgl * (*cfg.lower_bound) * p.gate_s * (1.0 - p.gate_s);
      if (in.A_log) {
        dz = dz * at::exp(in.A_log->to(ct).reshape({1, d.HV, 1}));
        dA = rows_sum((dz * p.z).sum(-1));
      }
    }
    dg_in = dz;
    if (in.dt_bias) dbias = rows_sum(dz.reshape({BT, d.HV * d.K}));
  }
  if (cfg.use_beta_sigmoid_in_kernel) {
    const double c = cfg.allow_neg_eigval ? 2.0 : 1.0;
    dbeta = dbeta * p.beta * (1.0 - p.beta / c);
  }

  std::vector<at::Tensor> out(8);
  out[0] = dqh.reshape({d.B, d.T, d.H, d.K}).to(in.q.scalar_type());
  out[1] = dkh.reshape({d.B, d.T, d.H, d.K}).to(in.k.scalar_type());
  out[2] = dv.reshape({d.B, d.T, d.HV, d.V}).to(in.v.scalar_type());
  out[3] = dg_in.reshape({d.B, d.T, d.HV, d.K}).to(in.g.scalar_type());
  out[4] = dbeta.reshape({d.B, d.T, d.HV}).to(in.beta.scalar_type());
  if (in.initial_state) {
    at::Tensor s = cfg.state_v_first ? dh0.transpose(-1, -2) : dh0;
    out[5] = s.to(in.initial_state->scalar_type()).contiguous();
  } else {
    out[5] = at::empty({0}, opts);
  }
  out[6] = dA.defined() ? dA.reshape(in.A_log->sizes()).to(in.A_log->scalar_type())
                        : at::empty({0}, opts);
  out[7] = dbias.defined() ? dbias.reshape(in.dt_bias->sizes()).to(in.dt_bias->scalar_type())
                           : at::empty({0}, opts);
  return out;
}

}  // namespace detail
}  // namespace kda
