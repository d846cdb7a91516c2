// CPU forward of the fused recurrent KDA: pre-processing (ATen, once per token) and the driver
// that runs the fused kernels (csrc/cpu/kernels) over (sequence, value head, V-slice) units.
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"

#include <ATen/Parallel.h>

namespace kda {
namespace detail {

namespace {
template <typename T>
void run_prep(const kernels::PrepArgs<T>& P) {
  const auto& tab = kernels::table();
  auto fn = [&]() {
    if constexpr (std::is_same_v<T, float>) {
      return tab.prep_f32;
    } else {
      return tab.prep_f64;
    }
  }();
  at::parallel_for(0, P.BT, 16, [&](int64_t b, int64_t e) { fn(P, b, e); });
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

template <typename T>
void fill_prep(kernels::PrepArgs<T>& P, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& g, const at::Tensor& beta, const at::Tensor& expA,
               const at::Tensor& bias, Prepared& p) {
  P.q = q.data_ptr<T>();
  P.k = k.data_ptr<T>();
  P.g = g.data_ptr<T>();
  P.beta = beta.data_ptr<T>();
  P.expA = ptr_or_null<T>(expA);
  P.dt_bias = ptr_or_null<T>(bias);
  P.q_out = p.q.data_ptr<T>();
  P.k_out = p.k_hm.data_ptr<T>();
  P.a_out = p.a.data_ptr<T>();
  P.ak_out = p.ak.data_ptr<T>();
  P.beta_out = p.beta_hm.data_ptr<T>();
  P.q_rnorm = ptr_or_null<T>(p.q_rnorm);
  P.k_rnorm = ptr_or_null<T>(p.k_rnorm);
  P.g_out = ptr_or_null<T>(p.g);
  P.s_out = ptr_or_null<T>(p.gate_s);
}
}  // namespace

Prepared preprocess(const Inputs& in, const Config& cfg, const Dims& d, bool for_backward) {
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const int64_t BT = d.B * d.T;
  const at::Tensor q = in.q.to(ct).contiguous();
  const at::Tensor k = in.k.to(ct).contiguous();
  const at::Tensor g = in.g.to(ct).contiguous();
  const at::Tensor beta = in.beta.to(ct).contiguous();
  at::Tensor expA, bias;
  if (cfg.use_gate_in_kernel && in.A_log) expA = at::exp(in.A_log->to(ct)).contiguous();
  if (cfg.use_gate_in_kernel && in.dt_bias) bias = in.dt_bias->to(ct).contiguous().reshape({-1});

  Prepared p;
  p.q = at::empty({d.H, BT, d.K}, opts);
  p.k_hm = at::empty({d.H, BT, d.K}, opts);
  p.a = at::empty({d.HV, BT, d.K}, opts);
  p.ak = at::empty({d.HV, BT, d.K}, opts);
  p.beta_hm = at::empty({d.HV, BT}, opts);
  if (for_backward) {
    if (cfg.use_qk_l2norm_in_kernel) {
      p.q_rnorm = at::empty({BT, d.H}, opts);
      p.k_rnorm = at::empty({BT, d.H}, opts);
    }
    if (cfg.use_gate_in_kernel) {
      p.g = at::empty({BT, d.HV, d.K}, opts);
      p.gate_s = at::empty({BT, d.HV, d.K}, opts);
    }
  }
  auto set_common = [&](auto& P) {
    P.BT = BT;
    P.H = d.H;
    P.HV = d.HV;
    P.K = d.K;
    P.scale = cfg.scale;
    P.l2norm = cfg.use_qk_l2norm_in_kernel;
    P.gate = !cfg.use_gate_in_kernel ? kernels::GateMode::kNone
             : cfg.lower_bound       ? kernels::GateMode::kBounded
                                     : kernels::GateMode::kSoftplus;
    P.lower_bound = cfg.lower_bound.value_or(0.0);
    P.beta_sigmoid = cfg.use_beta_sigmoid_in_kernel;
    P.beta_mult = cfg.allow_neg_eigval ? 2.0 : 1.0;
  };
  if (ct == at::kDouble) {
    kernels::PrepArgs<double> P;
    set_common(P);
    fill_prep<double>(P, q, k, g, beta, expA, bias, p);
    run_prep<double>(P);
  } else {
    kernels::PrepArgs<float> P;
    set_common(P);
    fill_prep<float>(P, q, k, g, beta, expA, bias, p);
    run_prep<float>(P);
  }

  // Token-major views and values for the backward's chain rule.
  p.k = p.k_hm.permute({1, 0, 2});
  p.beta = p.beta_hm.t();
  if (for_backward) {
    const at::Tensor q3 = q.reshape({BT, d.H, d.K});
    if (cfg.use_qk_l2norm_in_kernel) {
      p.q_rnorm = p.q_rnorm.unsqueeze(-1);
      p.k_rnorm = p.k_rnorm.unsqueeze(-1);
      p.qhat = q3 * p.q_rnorm;
    } else {
      p.qhat = q3;
    }
    if (!cfg.use_gate_in_kernel) {
      p.g = g.reshape({BT, d.HV, d.K});
    } else if (cfg.lower_bound && in.A_log) {
      p.z = g.reshape({BT, d.HV, d.K});
      if (bias.defined()) p.z = p.z + bias.reshape({1, d.HV, d.K});
    }
  }
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
  fill_recurrence_inputs<T>(A, p, d, seqs, h0);
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
  const Prepared p = preprocess(in, cfg, d, /*for_backward=*/false);
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
