// CPU forward of the fused recurrent KDA: pre-processing (ATen, once per token) and the driver
// that runs the fused kernels (csrc/cpu/kernels) over (sequence, value head, V-slice) units.
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"

#include <ATen/Parallel.h>

namespace kda {
namespace detail {

namespace {
at::Tensor rnorm(const at::Tensor& x) {
  return at::rsqrt(x.square().sum(-1, /*keepdim=*/true) + 1e-6);
}
}  // namespace

Prepared preprocess(const Inputs& in, const Config& cfg, const Dims& d) {
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const int64_t BT = d.B * d.T;
  // Head-major storage for the kernels, written through [BT, heads, ...] views.
  auto head_major = [&](int64_t heads, int64_t inner, at::Tensor& storage) {
    storage = inner ? at::empty({heads, BT, inner}, opts) : at::empty({heads, BT}, opts);
    return inner ? storage.permute({1, 0, 2}) : storage.t();
  };
  Prepared p;
  auto q = in.q.to(ct).reshape({BT, d.H, d.K});
  auto k = in.k.to(ct).reshape({BT, d.H, d.K});
  at::Tensor q_view = head_major(d.H, d.K, p.q);
  at::Tensor k_view = head_major(d.H, d.K, p.k_hm);
  if (cfg.use_qk_l2norm_in_kernel) {
    p.q_rnorm = rnorm(q);
    p.k_rnorm = rnorm(k);
    p.qhat = q * p.q_rnorm;
    at::mul_out(k_view, k, p.k_rnorm);
  } else {
    p.qhat = q;
    k_view.copy_(k);
  }
  p.k = k_view;
  at::mul_out(q_view, p.qhat, at::scalar_tensor(cfg.scale, opts));

  auto g = in.g.to(ct).reshape({BT, d.HV, d.K});
  if (cfg.use_gate_in_kernel) {
    at::Tensor z = g;
    if (in.dt_bias) z = g + in.dt_bias->to(ct).reshape({1, d.HV, d.K});
    p.z = z;
    if (!cfg.lower_bound) {
      const auto A = in.A_log->to(ct).reshape({1, d.HV, 1});
      p.gate_s = at::sigmoid(z);
      p.g = -at::exp(A) * at::softplus(z, 1.0, 20.0);
    } else {
      at::Tensor w = z;
      if (in.A_log) w = at::exp(in.A_log->to(ct).reshape({1, d.HV, 1})) * z;
      p.gate_s = at::sigmoid(w);
      p.g = *cfg.lower_bound * p.gate_s;
    }
  } else {
    p.g = g;
  }
  at::Tensor a_view = head_major(d.HV, d.K, p.a);
  at::exp_out(a_view, p.g);

  auto beta = in.beta.to(ct).reshape({BT, d.HV});
  at::Tensor b_view = head_major(d.HV, 0, p.beta_hm);
  if (cfg.use_beta_sigmoid_in_kernel) {
    at::sigmoid_out(b_view, beta);
    if (cfg.allow_neg_eigval) p.beta_hm.mul_(2.0);
  } else {
    b_view.copy_(beta);
  }
  p.beta = b_view;
  p.v = in.v.to(ct).reshape({BT, d.HV, d.V}).contiguous();
  return p;
}

Sequences make_sequences(const Inputs& in, const Dims& d) {
  Sequences s;
  s.start.resize(d.N);
  s.end.resize(d.N);
  s.origin.resize(d.N);
  s.slot_base.resize(d.N);
  const int64_t n_chunks = (d.T + kernels::kChunk - 1) / kernels::kChunk;
  if (d.varlen) {
    const auto cu = in.cu_seqlens->to(at::kLong).contiguous();
    const int64_t* c = cu.data_ptr<int64_t>();
    for (int64_t n = 0; n < d.N; ++n) {
      s.start[n] = c[n];
      s.end[n] = c[n + 1];
      s.origin[n] = 0;
      s.slot_base[n] = 0;
    }
  } else {
    for (int64_t n = 0; n < d.N; ++n) {
      s.start[n] = n * d.T;
      s.end[n] = (n + 1) * d.T;
      s.origin[n] = n * d.T;
      s.slot_base[n] = n * n_chunks;
    }
  }
  return s;
}

kernels::SeqInfo seq_info(const Sequences& s) {
  kernels::SeqInfo info;
  info.n_seq = static_cast<int64_t>(s.start.size());
  info.seq_start = s.start.data();
  info.seq_end = s.end.data();
  info.origin = s.origin.data();
  info.slot_base = s.slot_base.data();
  return info;
}

at::Tensor state_kv(const std::optional<at::Tensor>& s, const Config& cfg, at::ScalarType ct) {
  if (!s) return at::Tensor();
  auto x = s->to(ct);
  if (cfg.state_v_first) x = x.transpose(-1, -2);
  return x.contiguous();
}

namespace {
template <typename T>
void run_fwd(const Prepared& p, const Dims& d, const Sequences& seqs, const at::Tensor& h0,
             const at::Tensor& o, const at::Tensor& ht, const at::Tensor& ckpt) {
  kernels::FwdArgs<T> A;
  A.seqs = seq_info(seqs);
  A.BT = d.B * d.T;
  A.H = d.H;
  A.HV = d.HV;
  A.K = d.K;
  A.V = d.V;
  A.q = p.q.data_ptr<T>();
  A.k = p.k_hm.data_ptr<T>();
  A.a = p.a.data_ptr<T>();
  A.beta = p.beta_hm.data_ptr<T>();
  A.v = p.v.data_ptr<T>();
  A.h0 = h0.defined() ? h0.data_ptr<T>() : nullptr;
  A.o = o.data_ptr<T>();
  A.ht = ht.data_ptr<T>();
  A.ckpt = ckpt.defined() && ckpt.numel() > 0 ? ckpt.data_ptr<T>() : nullptr;
  const auto& tab = kernels::table();
  auto fn = [&]() {
    if constexpr (std::is_same_v<T, float>) {
      return tab.fwd_f32;
    } else {
      return tab.fwd_f64;
    }
  }();
  // Units: (sequence, value head, group of V-slices). Fewer groups means the q/k/decay rows of a
  // token block are reused from cache by more slices; more groups give threads work when there
  // are few heads. Each column is computed the same way whatever the grouping, so the result
  // does not depend on it (nor on the thread count).
  const int64_t n_slices = (d.V + kernels::kFwdSlice - 1) / kernels::kFwdSlice;
  const int64_t heads = std::max<int64_t>(1, d.N * d.HV);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t groups =
      std::max<int64_t>(1, std::min(n_slices, (2 * threads + heads - 1) / heads));
  const int64_t units = d.N * d.HV * groups;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t gi = u % groups;
      const int64_t hv = (u / groups) % d.HV;
      const int64_t n = u / (groups * d.HV);
      fn(A, n, hv, gi * n_slices / groups, (gi + 1) * n_slices / groups);
    }
  });
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd_cpu(const Inputs& in,
                                                                  const Config& cfg,
                                                                  bool with_checkpoints) {
  const Dims d = check_inputs(in, cfg, /*check_values=*/true);
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const Prepared p = preprocess(in, cfg, d);
  const Sequences seqs = make_sequences(in, d);
  const at::Tensor h0 = state_kv(in.initial_state, cfg, ct);

  at::Tensor o = at::empty({d.B, d.T, d.HV, d.V}, opts);
  at::Tensor ht = at::empty({d.N, d.HV, d.K, d.V}, opts);
  at::Tensor ckpt = with_checkpoints ? at::empty({d.n_slots, d.HV, d.K, d.V}, opts)
                                     : at::empty({0}, opts);
  if (ct == at::kDouble) {
    run_fwd<double>(p, d, seqs, h0, o, ht, ckpt);
  } else {
    run_fwd<float>(p, d, seqs, h0, o, ht, ckpt);
  }
  if (o.scalar_type() != in.q.scalar_type()) o = o.to(in.q.scalar_type());
  if (cfg.state_v_first) ht = ht.transpose(-1, -2).contiguous();
  return {o, ht, ckpt};
}

}  // namespace detail
}  // namespace kda
