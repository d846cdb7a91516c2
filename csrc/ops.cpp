// The kda ops: schemas, argument checks (one place), CPU / Meta kernels and the C++ autograd.
//
//   kda::fused_recurrent      public op: (o, final_state). Autograd kernel below; CPU and Meta
//                             kernels for calls without autograd (inference, fake tensors).
//   kda::fused_recurrent_fwd  (o, final_state, checkpoints): the forward that keeps the state
//                             every kChunk tokens for the backward.
//   kda::fused_recurrent_bwd  the analytic backward (first order); its Autograd kernel makes a
//                             second-order gradient an error that names backend="reference".
// Tracing (torch.compile / AOTAutograd) sees fused_recurrent_fwd and fused_recurrent_bwd, both
// with Meta kernels.
#include <kda/kda.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"

namespace kda {
namespace detail {

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor, at::Tensor>;

namespace {

Grads to_grads(const std::vector<at::Tensor>& r) {
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]};
}

constexpr const char* kOp = "kda::fused_recurrent: ";

bool is_float_dtype(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(is_float_dtype(t.scalar_type()), kOp, name,
              " must be a floating tensor (float64, float32, bfloat16 or float16), got dtype ",
              t.scalar_type());
}

void check_device(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.device() == q.device(), kOp, name, " must be on the device of q (", q.device(),
              "), got ", t.device());
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected,
                 const char* what) {
  TORCH_CHECK(t.sizes() == expected, kOp, name, " must have shape ", expected, " ", what,
              ", got ", t.sizes());
}

}  // namespace

Dims check_inputs(const Inputs& in, const Config& cfg, bool check_values) {
  const at::Tensor& q = in.q;
  TORCH_CHECK(q.defined() && in.k.defined() && in.v.defined() && in.g.defined() &&
                  in.beta.defined(),
              kOp, "q, k, v, g and beta must be defined tensors");
  TORCH_CHECK(q.dim() == 4, kOp, "q must be 4-D [B, T, H, K], got shape ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kDouble || q.scalar_type() == at::kFloat ||
                  q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              kOp, "q must be float64, float32, bfloat16 or float16, got dtype ", q.scalar_type());
  TORCH_CHECK(in.k.scalar_type() == q.scalar_type(), kOp, "k must have the dtype of q (",
              q.scalar_type(), "), got ", in.k.scalar_type());
  TORCH_CHECK(in.v.scalar_type() == q.scalar_type(), kOp, "v must have the dtype of q (",
              q.scalar_type(), "), got ", in.v.scalar_type());
  check_float(in.g, "g");
  check_float(in.beta, "beta");

  Dims d;
  d.B = q.size(0);
  d.T = q.size(1);
  d.H = q.size(2);
  d.K = q.size(3);
  TORCH_CHECK(d.H > 0, kOp, "q must have at least one head (H = q.size(2) > 0), got H = ", d.H);
  TORCH_CHECK(d.K > 0, kOp, "the key dimension K = q.size(3) must be > 0, got ", d.K);
  check_shape(in.k, "k", q.sizes(), "(the shape of q, [B, T, H, K])");
  TORCH_CHECK(in.v.dim() == 4, kOp, "v must be 4-D [B, T, HV, V], got shape ", in.v.sizes());
  TORCH_CHECK(in.v.size(0) == d.B && in.v.size(1) == d.T, kOp,
              "v must have shape [B, T, HV, V] with B = ", d.B, " and T = ", d.T,
              " (from q), got ", in.v.sizes());
  d.HV = in.v.size(2);
  d.V = in.v.size(3);
  TORCH_CHECK(d.HV > 0 && d.HV % d.H == 0, kOp,
              "the number of value heads HV = v.size(2) must be a positive multiple of the "
              "number of q/k heads H = ",
              d.H, ", got HV = ", d.HV);
  TORCH_CHECK(d.V > 0, kOp, "the value dimension V = v.size(3) must be > 0, got ", d.V);
  check_shape(in.g, "g", {d.B, d.T, d.HV, d.K}, "[B, T, HV, K]");
  check_shape(in.beta, "beta", {d.B, d.T, d.HV}, "[B, T, HV]");
  check_device(in.k, "k", q);
  check_device(in.v, "v", q);
  check_device(in.g, "g", q);
  check_device(in.beta, "beta", q);

  TORCH_CHECK(std::isfinite(cfg.scale), kOp, "scale must be finite, got ", cfg.scale);
  TORCH_CHECK(!cfg.allow_neg_eigval || cfg.use_beta_sigmoid_in_kernel, kOp,
              "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True");
  TORCH_CHECK(cfg.use_gate_in_kernel || (!in.A_log && !in.dt_bias), kOp,
              "A_log and dt_bias are only used with use_gate_in_kernel=True, got "
              "use_gate_in_kernel=False with A_log ", in.A_log ? "set" : "None", " and dt_bias ",
              in.dt_bias ? "set" : "None");
  if (cfg.use_gate_in_kernel) {
    if (cfg.lower_bound) {
      TORCH_CHECK(std::isfinite(*cfg.lower_bound) && *cfg.lower_bound < 0.0, kOp,
                  "lower_bound must be a finite negative number, got ", *cfg.lower_bound);
    } else {
      TORCH_CHECK(in.A_log.has_value(), kOp,
                  "use_gate_in_kernel=True without lower_bound (softplus gate) requires A_log, "
                  "got None");
    }
  }
  if (in.A_log) {
    check_float(*in.A_log, "A_log");
    check_device(*in.A_log, "A_log", q);
    TORCH_CHECK(in.A_log->dim() == 1 && in.A_log->size(0) == d.HV, kOp,
                "A_log must have shape [HV] = [", d.HV, "], got ", in.A_log->sizes());
  }
  if (in.dt_bias) {
    check_float(*in.dt_bias, "dt_bias");
    check_device(*in.dt_bias, "dt_bias", q);
    const auto& b = *in.dt_bias;
    TORCH_CHECK((b.dim() == 1 && b.size(0) == d.HV * d.K) ||
                    (b.dim() == 2 && b.size(0) == d.HV && b.size(1) == d.K),
                kOp, "dt_bias must have shape [HV * K] = [", d.HV * d.K, "] or [HV, K] = [", d.HV,
                ", ", d.K, "], got ", b.sizes());
  }

  if (in.cu_seqlens) {
    const auto& cu = *in.cu_seqlens;
    TORCH_CHECK(cu.scalar_type() == at::kLong || cu.scalar_type() == at::kInt, kOp,
                "cu_seqlens must be int64 or int32, got dtype ", cu.scalar_type());
    TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, kOp,
                "cu_seqlens must be 1-D [N + 1] with N >= 0, got shape ", cu.sizes());
    TORCH_CHECK(d.B == 1, kOp, "with cu_seqlens the batch size must be 1, got B = ", d.B);
    d.varlen = true;
    d.N = cu.size(0) - 1;
    if (check_values) {
      TORCH_CHECK(cu.device().is_cpu(), kOp, "cu_seqlens must be a CPU tensor, got ",
                  cu.device());
      const auto c = cu.to(at::kLong).contiguous();
      const int64_t* p = c.data_ptr<int64_t>();
      TORCH_CHECK(p[0] == 0, kOp, "cu_seqlens[0] must be 0, got ", p[0]);
      for (int64_t i = 0; i < d.N; ++i) {
        TORCH_CHECK(p[i + 1] >= p[i], kOp, "cu_seqlens must be non-decreasing, got cu_seqlens[",
                    i, "] = ", p[i], " > cu_seqlens[", i + 1, "] = ", p[i + 1]);
      }
      TORCH_CHECK(p[d.N] == d.T, kOp, "cu_seqlens[-1] must equal T = ", d.T, ", got ", p[d.N]);
    }
  } else {
    d.N = d.B;
  }
  if (in.initial_state) {
    const auto& s = *in.initial_state;
    check_float(s, "initial_state");
    check_device(s, "initial_state", q);
    if (cfg.state_v_first) {
      check_shape(s, "initial_state", {d.N, d.HV, d.V, d.K}, "[N, HV, V, K] (state_v_first)");
    } else {
      check_shape(s, "initial_state", {d.N, d.HV, d.K, d.V}, "[N, HV, K, V]");
    }
  }
  d.n_slots = d.B * ((d.T + kernels::kChunk - 1) / kernels::kChunk);
  return d;
}

namespace {

Inputs make_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta,
                   const std::optional<at::Tensor>& initial_state,
                   const std::optional<at::Tensor>& cu_seqlens,
                   const std::optional<at::Tensor>& A_log,
                   const std::optional<at::Tensor>& dt_bias) {
  Inputs in{q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias};
  // An undefined tensor passed for an optional argument (e.g. from the autograd context) is None.
  for (auto* o : {&in.initial_state, &in.cu_seqlens, &in.A_log, &in.dt_bias}) {
    if (o->has_value() && !(*o)->defined()) o->reset();
  }
  return in;
}

Config make_config(double scale, bool l2, bool gate, bool sig, bool neg,
                   std::optional<double> lower_bound, bool state_v_first) {
  Config c;
  c.scale = scale;
  c.use_qk_l2norm_in_kernel = l2;
  c.use_gate_in_kernel = gate;
  c.use_beta_sigmoid_in_kernel = sig;
  c.allow_neg_eigval = neg;
  c.lower_bound = lower_bound;
  c.state_v_first = state_v_first;
  return c;
}

void check_cpu(const Inputs& in) {
  TORCH_CHECK(in.q.device().is_cpu(), kOp, "the native kernels run on CPU tensors, got q on ",
              in.q.device());
}

#define KDA_OP_ARGS                                                                         \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &g,      \
      const at::Tensor &beta, double scale, const std::optional<at::Tensor>&initial_state, \
      bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel,                               \
      bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval,                              \
      std::optional<double> lower_bound, bool state_v_first,                               \
      const std::optional<at::Tensor>&cu_seqlens, const std::optional<at::Tensor>&A_log,   \
      const std::optional<at::Tensor>&dt_bias
#define KDA_OP_INPUTS make_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
#define KDA_OP_CONFIG                                                                    \
  make_config(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,                       \
              use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first)
#define KDA_OP_FORWARD                                                                  \
  q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,  \
      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,         \
      cu_seqlens, A_log, dt_bias

// ---- CPU kernels ----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cpu(KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  check_cpu(in);
  return recurrent_fwd_cpu(in, KDA_OP_CONFIG, /*with_checkpoints=*/true);
}

std::tuple<at::Tensor, at::Tensor> fused_recurrent_cpu(KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  check_cpu(in);
  auto r = recurrent_fwd_cpu(in, KDA_OP_CONFIG, /*with_checkpoints=*/false);
  return {std::get<0>(r), std::get<1>(r)};
}

Grads bwd_cpu(const at::Tensor& grad_o,
                                const std::optional<at::Tensor>& grad_final_state,
                                const at::Tensor& checkpoints, KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  check_cpu(in);
  const Config cfg = KDA_OP_CONFIG;
  const Dims d = check_inputs(in, cfg, /*check_values=*/true);
  TORCH_CHECK(grad_o.sizes() == at::IntArrayRef({d.B, d.T, d.HV, d.V}), kOp,
              "grad_o must have shape [B, T, HV, V] = ", at::IntArrayRef({d.B, d.T, d.HV, d.V}),
              ", got ", grad_o.sizes());
  check_float(grad_o, "grad_o");
  check_device(grad_o, "grad_o", q);
  std::optional<at::Tensor> gfs = grad_final_state;
  if (gfs && !gfs->defined()) gfs.reset();
  if (gfs) {
    check_float(*gfs, "grad_final_state");
    check_device(*gfs, "grad_final_state", q);
    if (cfg.state_v_first) {
      check_shape(*gfs, "grad_final_state", {d.N, d.HV, d.V, d.K}, "[N, HV, V, K]");
    } else {
      check_shape(*gfs, "grad_final_state", {d.N, d.HV, d.K, d.V}, "[N, HV, K, V]");
    }
  }
  check_float(checkpoints, "checkpoints");
  check_device(checkpoints, "checkpoints", q);
  check_shape(checkpoints, "checkpoints", {d.n_slots, d.HV, d.K, d.V},
              "[B * ceil(T / 64), HV, K, V] (from fused_recurrent_fwd)");
  return to_grads(recurrent_bwd_cpu(grad_o, gfs, checkpoints, in, cfg));
}

// ---- Meta kernels (shapes and dtypes only; symbolic sizes) ----------------------------------

// Checks that need no sizes: every tensor defined and on q's device (a tensor on another device
// can route the call to this kernel).
void check_defined_same_device(KDA_OP_ARGS) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined() && g.defined() && beta.defined(), kOp,
              "q, k, v, g and beta must be defined tensors");
  check_device(k, "k", q);
  check_device(v, "v", q);
  check_device(g, "g", q);
  check_device(beta, "beta", q);
  if (initial_state && initial_state->defined()) check_device(*initial_state, "initial_state", q);
  if (cu_seqlens && cu_seqlens->defined()) check_device(*cu_seqlens, "cu_seqlens", q);
  if (A_log && A_log->defined()) check_device(*A_log, "A_log", q);
  if (dt_bias && dt_bias->defined()) check_device(*dt_bias, "dt_bias", q);
}

at::ScalarType state_dtype(const at::Tensor& q) { return compute_dtype(q); }

std::vector<c10::SymInt> state_shape_meta(const at::Tensor& q, const at::Tensor& v,
                                          const std::optional<at::Tensor>& cu_seqlens,
                                          bool state_v_first) {
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4, kOp, "q and v must be 4-D");
  c10::SymInt N = (cu_seqlens && cu_seqlens->defined()) ? cu_seqlens->sym_size(0) - 1
                                                         : q.sym_size(0);
  if (state_v_first) return {N, v.sym_size(2), v.sym_size(3), q.sym_size(3)};
  return {N, v.sym_size(2), q.sym_size(3), v.sym_size(3)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_meta(KDA_OP_ARGS) {
  check_defined_same_device(KDA_OP_FORWARD);
  const auto ct = state_dtype(q);
  auto opts = q.options().dtype(ct);
  auto o = at::empty_symint({q.sym_size(0), q.sym_size(1), v.sym_size(2), v.sym_size(3)},
                            q.options());
  auto ht = at::empty_symint(state_shape_meta(q, v, cu_seqlens, state_v_first), opts);
  const c10::SymInt chunks = (q.sym_size(1) + (kernels::kChunk - 1)) / kernels::kChunk;
  auto ck = at::empty_symint({q.sym_size(0) * chunks, v.sym_size(2), q.sym_size(3), v.sym_size(3)},
                             opts);
  return {o, ht, ck};
}

std::tuple<at::Tensor, at::Tensor> fused_recurrent_meta(KDA_OP_ARGS) {
  auto r = fwd_meta(KDA_OP_FORWARD);
  return {std::get<0>(r), std::get<1>(r)};
}

Grads bwd_meta(const at::Tensor& grad_o,
                                 const std::optional<at::Tensor>& grad_final_state,
                                 const at::Tensor& checkpoints, KDA_OP_ARGS) {
  check_defined_same_device(KDA_OP_FORWARD);
  check_device(grad_o, "grad_o", q);
  check_device(checkpoints, "checkpoints", q);
  const auto ct = state_dtype(q);
  auto empty_like_meta = [](const at::Tensor& t) {
    return at::empty_symint(t.sym_sizes(), t.options());
  };
  std::vector<at::Tensor> out(8);
  out[0] = empty_like_meta(q);
  out[1] = empty_like_meta(k);
  out[2] = empty_like_meta(v);
  out[3] = empty_like_meta(g);
  out[4] = empty_like_meta(beta);
  auto none = [&]() { return at::empty({0}, q.options().dtype(ct)); };
  out[5] = (initial_state && initial_state->defined()) ? empty_like_meta(*initial_state) : none();
  const bool gate_a = use_gate_in_kernel && A_log && A_log->defined();
  const bool gate_b = use_gate_in_kernel && dt_bias && dt_bias->defined();
  out[6] = gate_a ? empty_like_meta(*A_log) : none();
  out[7] = gate_b ? empty_like_meta(*dt_bias) : none();
  return to_grads(out);
}

// ---- Autograd -------------------------------------------------------------------------------

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_fwd(KDA_OP_ARGS) {
  static auto op = op_handle("kda::fused_recurrent_fwd")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(KDA_OP_ARGS)>();
  return op.call(KDA_OP_FORWARD);
}

Grads call_bwd(const at::Tensor& grad_o,
                                 const std::optional<at::Tensor>& grad_final_state,
                                 const at::Tensor& checkpoints, KDA_OP_ARGS) {
  static auto op =
      op_handle("kda::fused_recurrent_bwd")
          .typed<Grads(const at::Tensor&, const std::optional<at::Tensor>&,
                                         const at::Tensor&, KDA_OP_ARGS)>();
  return op.call(grad_o, grad_final_state, checkpoints, KDA_OP_FORWARD);
}

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The analytic backward as a differentiable function whose own backward refuses.
class FusedRecurrentBackward : public torch::autograd::Function<FusedRecurrentBackward> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_o,
                               const std::optional<at::Tensor>& grad_final_state,
                               const at::Tensor& checkpoints, KDA_OP_ARGS) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto r = call_bwd(grad_o, grad_final_state, checkpoints, KDA_OP_FORWARD);
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r),
            std::get<4>(r), std::get<5>(r), std::get<6>(r), std::get<7>(r)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(false,
                "kda::fused_recurrent: the native backward is first order only; for "
                "higher-order gradients (e.g. create_graph=True followed by another backward) use "
                "backend=\"reference\"");
    return {};
  }
};

class FusedRecurrentFunction : public torch::autograd::Function<FusedRecurrentFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, KDA_OP_ARGS) {
    at::Tensor o, ht, ckpt;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(o, ht, ckpt) = call_fwd(KDA_OP_FORWARD);
    }
    auto val = [](const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); };
    ctx->save_for_backward({q, k, v, g, beta, val(initial_state), val(cu_seqlens), val(A_log),
                            val(dt_bias), ckpt});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["l2"] = use_qk_l2norm_in_kernel;
    ctx->saved_data["gate"] = use_gate_in_kernel;
    ctx->saved_data["sig"] = use_beta_sigmoid_in_kernel;
    ctx->saved_data["neg"] = allow_neg_eigval;
    ctx->saved_data["has_lb"] = lower_bound.has_value();
    ctx->saved_data["lb"] = lower_bound.value_or(0.0);
    ctx->saved_data["vfirst"] = state_v_first;
    return {o, ht};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &g = s[3], &beta = s[4];
    const auto initial_state = opt(s[5]), cu_seqlens = opt(s[6]), A_log = opt(s[7]),
               dt_bias = opt(s[8]);
    const at::Tensor& ckpt = s[9];
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool use_qk_l2norm_in_kernel = ctx->saved_data["l2"].toBool();
    const bool use_gate_in_kernel = ctx->saved_data["gate"].toBool();
    const bool use_beta_sigmoid_in_kernel = ctx->saved_data["sig"].toBool();
    const bool allow_neg_eigval = ctx->saved_data["neg"].toBool();
    const std::optional<double> lower_bound =
        ctx->saved_data["has_lb"].toBool()
            ? std::optional<double>(ctx->saved_data["lb"].toDouble())
            : std::nullopt;
    const bool state_v_first = ctx->saved_data["vfirst"].toBool();

    at::Tensor grad_o = grads[0];
    if (!grad_o.defined()) {
      grad_o = at::zeros_symint({v.sym_size(0), v.sym_size(1), v.sym_size(2), v.sym_size(3)},
                                q.options());
    }
    const auto r = FusedRecurrentBackward::apply(grad_o, opt(grads[1]), ckpt, KDA_OP_FORWARD);
    variable_list out(16);
    out[0] = r[0];
    out[1] = r[1];
    out[2] = r[2];
    out[3] = r[3];
    out[4] = r[4];
    if (initial_state) out[6] = r[5];
    if (use_gate_in_kernel && A_log) out[14] = r[6];
    if (use_gate_in_kernel && dt_bias) out[15] = r[7];
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> fused_recurrent_autograd(KDA_OP_ARGS) {
  check_defined_same_device(KDA_OP_FORWARD);
  auto req = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
  const bool needs_grad =
      at::GradMode::is_enabled() &&
      (q.requires_grad() || k.requires_grad() || v.requires_grad() || g.requires_grad() ||
       beta.requires_grad() || req(initial_state) || req(A_log) || req(dt_bias));
  if (!needs_grad) {
    // Nothing to differentiate: the kernel below autograd, without checkpoints.
    static auto op = op_handle("kda::fused_recurrent")
                         .typed<std::tuple<at::Tensor, at::Tensor>(KDA_OP_ARGS)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(KDA_OP_FORWARD);
  }
  auto r = FusedRecurrentFunction::apply(KDA_OP_FORWARD);
  return {r[0], r[1]};
}

Grads bwd_autograd(const at::Tensor& grad_o,
                                     const std::optional<at::Tensor>& grad_final_state,
                                     const at::Tensor& checkpoints, KDA_OP_ARGS) {
  return to_grads(
      FusedRecurrentBackward::apply(grad_o, grad_final_state, checkpoints, KDA_OP_FORWARD));
}

}  // namespace
}  // namespace detail

// ---- public C++ API ---------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> fused_recurrent(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& g,
                                                   const at::Tensor& beta,
                                                   const FusedRecurrentOptions& o) {
  TORCH_CHECK(q.defined(), "kda::fused_recurrent: q must be a defined tensor");
  TORCH_CHECK(q.dim() == 4, "kda::fused_recurrent: q must be 4-D [B, T, H, K], got shape ",
              q.sizes());
  const double scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kda::fused_recurrent", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, double,
                           const std::optional<at::Tensor>&, bool, bool, bool, bool,
                           std::optional<double>, bool, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  return op.call(q, k, v, g, beta, scale, o.initial_state, o.use_qk_l2norm_in_kernel,
                 o.use_gate_in_kernel, o.use_beta_sigmoid_in_kernel, o.allow_neg_eigval,
                 o.lower_bound, o.state_v_first, o.cu_seqlens, o.A_log, o.dt_bias);
}

const char* cpu_kernel_isa() { return kernels::table().isa; }

}  // namespace kda

// ---- registration -------------------------------------------------------------------------------

#define KDA_SCHEMA_ARGS                                                                     \
  "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "                      \
  "Tensor? initial_state=None, bool use_qk_l2norm_in_kernel=False, "                        \
  "bool use_gate_in_kernel=False, bool use_beta_sigmoid_in_kernel=False, "                  \
  "bool allow_neg_eigval=False, float? lower_bound=None, bool state_v_first=False, "        \
  "Tensor? cu_seqlens=None, Tensor? A_log=None, Tensor? dt_bias=None"

TORCH_LIBRARY(kda, m) {
  m.def("fused_recurrent(" KDA_SCHEMA_ARGS ") -> (Tensor o, Tensor final_state)");
  m.def("fused_recurrent_fwd(" KDA_SCHEMA_ARGS
        ") -> (Tensor o, Tensor final_state, Tensor checkpoints)");
  m.def("fused_recurrent_bwd(Tensor grad_o, Tensor? grad_final_state, Tensor checkpoints, "
        KDA_SCHEMA_ARGS
        ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, "
        "Tensor d_initial_state, Tensor dA_log, Tensor ddt_bias)");
}

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("fused_recurrent", &kda::detail::fused_recurrent_cpu);
  m.impl("fused_recurrent_fwd", &kda::detail::fwd_cpu);
  m.impl("fused_recurrent_bwd", &kda::detail::bwd_cpu);
}

TORCH_LIBRARY_IMPL(kda, Meta, m) {
  m.impl("fused_recurrent", &kda::detail::fused_recurrent_meta);
  m.impl("fused_recurrent_fwd", &kda::detail::fwd_meta);
  m.impl("fused_recurrent_bwd", &kda::detail::bwd_meta);
}

TORCH_LIBRARY_IMPL(kda, Autograd, m) {
  m.impl("fused_recurrent", &kda::detail::fused_recurrent_autograd);
  m.impl("fused_recurrent_bwd", &kda::detail::bwd_autograd);
}
