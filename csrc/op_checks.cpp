// The argument checks of the kda ops (csrc/op_checks.h).
#include "op_checks.h"

#include <cmath>
#include <limits>

namespace kda {
namespace detail {

bool is_float_dtype(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

bool check_float(const char* op, const at::Tensor& t, const char* name, bool probe) {
  KDA_RULE(TYPE, is_float_dtype(t.scalar_type()), op, name,
           " must be a floating tensor (float64, float32, bfloat16 or float16), got dtype ",
           t.scalar_type());
  return true;
}

bool check_device(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q,
                  bool probe) {
  KDA_RULE(VALUE, t.device() == q.device(), op, name, " must be on the device of q (", q.device(),
           "), got ", t.device());
  return true;
}

bool check_shape(const char* op, const at::Tensor& t, const char* name, at::IntArrayRef expected,
                 const char* what, bool probe) {
  KDA_RULE(VALUE, t.sizes() == expected, op, name, " must have shape ", shape_str(expected), " ",
           what, ", got ", shape_str(t.sizes()));
  return true;
}

void check_same_device(const char* op, const at::Tensor& q,
                       std::initializer_list<NamedTensor> others) {
  for (const auto& [name, t] : others) {
    if (t != nullptr) check_device(op, *t, name, q);
  }
}

bool finite_in_compute(double x, const at::Tensor& q) {
  if (!std::isfinite(x)) return false;
  return compute_dtype(q) == at::kDouble ||
         std::abs(x) <= static_cast<double>(std::numeric_limits<float>::max());
}

bool check_inputs(const Inputs& in, const Config& cfg, bool check_values, bool probe, Dims& d) {
  const at::Tensor& q = in.q;
  const char* op = cfg.op;
  KDA_RULE(TYPE, q.defined() && in.k.defined() && in.v.defined() && in.g.defined() &&
                     in.beta.defined(),
           op, "q, k, v, g and beta must be defined tensors");
  KDA_RULE(VALUE, q.dim() == 4, op, "q must be 4-D [B, T, H, K], got shape ", shape_str(q.sizes()));
  KDA_RULE(TYPE, is_float_dtype(q.scalar_type()), op,
           "q must be float64, float32, bfloat16 or float16, got dtype ", q.scalar_type());
  KDA_RULE(TYPE, in.k.scalar_type() == q.scalar_type(), op, "k must have the dtype of q (",
           q.scalar_type(), "), got ", in.k.scalar_type());
  KDA_RULE(TYPE, in.v.scalar_type() == q.scalar_type(), op, "v must have the dtype of q (",
           q.scalar_type(), "), got ", in.v.scalar_type());
  if (!check_float(op, in.g, "g", probe) || !check_float(op, in.beta, "beta", probe)) return false;

  d = Dims();
  d.B = q.size(0);
  d.T = q.size(1);
  d.H = q.size(2);
  d.K = q.size(3);
  KDA_RULE(VALUE, d.H > 0, op, "q must have at least one head (H = q.size(2) > 0), got H = ", d.H);
  KDA_RULE(VALUE, d.K > 0, op, "the key dimension K = q.size(3) must be > 0, got ", d.K);
  if (!check_shape(op, in.k, "k", q.sizes(), "(the shape of q, [B, T, H, K])", probe)) return false;
  KDA_RULE(VALUE, in.v.dim() == 4, op, "v must be 4-D [B, T, HV, V], got shape ",
           shape_str(in.v.sizes()));
  KDA_RULE(VALUE, in.v.size(0) == d.B && in.v.size(1) == d.T, op,
           "v must have shape [B, T, HV, V] with B = ", d.B, " and T = ", d.T, " (from q), got ",
           shape_str(in.v.sizes()));
  d.HV = in.v.size(2);
  d.V = in.v.size(3);
  KDA_RULE(VALUE, d.HV > 0 && d.HV % d.H == 0, op,
           "the number of value heads HV = v.size(2) must be a positive multiple of the "
           "number of q/k heads H = ",
           d.H, ", got HV = ", d.HV);
  KDA_RULE(VALUE, d.V > 0, op, "the value dimension V = v.size(3) must be > 0, got ", d.V);
  if (!check_shape(op, in.g, "g", {d.B, d.T, d.HV, d.K}, "[B, T, HV, K]", probe) ||
      !check_shape(op, in.beta, "beta", {d.B, d.T, d.HV}, "[B, T, HV]", probe) ||
      !check_device(op, in.k, "k", q, probe) || !check_device(op, in.v, "v", q, probe) ||
      !check_device(op, in.g, "g", q, probe) || !check_device(op, in.beta, "beta", q, probe)) {
    return false;
  }

  KDA_RULE(VALUE, finite_in_compute(cfg.scale, q), op,
           "scale must be finite (in the compute dtype: float32 unless q is float64), got ",
           cfg.scale);
  KDA_RULE(VALUE, !cfg.allow_neg_eigval || cfg.use_beta_sigmoid_in_kernel, op,
           "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True");
  KDA_RULE(VALUE, cfg.use_gate_in_kernel || (!in.A_log && !in.dt_bias), op,
           "A_log and dt_bias are only used with use_gate_in_kernel=True, got "
           "use_gate_in_kernel=False with A_log ", in.A_log ? "set" : "None", " and dt_bias ",
           in.dt_bias ? "set" : "None");
  if (cfg.use_gate_in_kernel) {
    if (cfg.lower_bound) {
      KDA_RULE(VALUE, finite_in_compute(*cfg.lower_bound, q) &&
                          *cfg.lower_bound < 0.0,
               op, "lower_bound must be a finite negative number (finite in the compute dtype: "
               "float32 unless q is float64), got ", *cfg.lower_bound);
    } else {
      KDA_RULE(VALUE, in.A_log.has_value(), op,
               "use_gate_in_kernel=True without lower_bound (softplus gate) requires A_log, "
               "got None");
    }
  }
  if (in.A_log) {
    if (!check_float(op, *in.A_log, "A_log", probe) ||
        !check_device(op, *in.A_log, "A_log", q, probe)) {
      return false;
    }
    KDA_RULE(VALUE, in.A_log->dim() == 1 && in.A_log->size(0) == d.HV, op,
             "A_log must have shape [HV] = [", d.HV, "], got ", shape_str(in.A_log->sizes()));
  }
  if (in.dt_bias) {
    const auto& b = *in.dt_bias;
    if (!check_float(op, b, "dt_bias", probe) || !check_device(op, b, "dt_bias", q, probe)) {
      return false;
    }
    KDA_RULE(VALUE, (b.dim() == 1 && b.size(0) == d.HV * d.K) ||
                        (b.dim() == 2 && b.size(0) == d.HV && b.size(1) == d.K),
             op, "dt_bias must have shape [HV * K] = [", d.HV * d.K, "] or [HV, K] = [", d.HV,
             ", ", d.K, "], got ", shape_str(b.sizes()));
  }

  if (in.cu_seqlens) {
    const auto& cu = *in.cu_seqlens;
    KDA_RULE(TYPE, cu.scalar_type() == at::kLong || cu.scalar_type() == at::kInt, op,
             "cu_seqlens must be int64 or int32, got dtype ", cu.scalar_type());
    KDA_RULE(VALUE, cu.dim() == 1 && cu.size(0) >= 1, op,
             "cu_seqlens must be 1-D [N + 1] with N >= 0, got shape ", shape_str(cu.sizes()));
    KDA_RULE(VALUE, d.B == 1, op, "with cu_seqlens the batch size must be 1, got B = ", d.B);
    d.varlen = true;
    d.N = cu.size(0) - 1;
    if (check_values) {
      KDA_RULE(VALUE, cu.device().is_cpu(), op, "cu_seqlens must be a CPU tensor, got ",
               cu.device());
      const auto c = cu.to(at::kLong).contiguous();
      const int64_t* p = c.data_ptr<int64_t>();
      KDA_RULE(VALUE, p[0] == 0, op, "cu_seqlens[0] must be 0, got ", p[0]);
      for (int64_t i = 0; i < d.N; ++i) {
        KDA_RULE(VALUE, p[i + 1] >= p[i], op, "cu_seqlens must be non-decreasing, got cu_seqlens[",
                 i, "] = ", p[i], " > cu_seqlens[", i + 1, "] = ", p[i + 1]);
      }
      KDA_RULE(VALUE, p[d.N] == d.T, op, "cu_seqlens[-1] must equal T = ", d.T, ", got ", p[d.N]);
    }
  } else {
    d.N = d.B;
  }
  if (in.initial_state) {
    const auto& s = *in.initial_state;
    if (!check_float(op, s, "initial_state", probe) ||
        !check_device(op, s, "initial_state", q, probe)) {
      return false;
    }
    const bool shape_ok =
        cfg.state_v_first
            ? check_shape(op, s, "initial_state", {d.N, d.HV, d.V, d.K}, "[N, HV, V, K] (state_v_first)", probe)
            : check_shape(op, s, "initial_state", {d.N, d.HV, d.K, d.V}, "[N, HV, K, V]", probe);
    if (!shape_ok) return false;
  }
  d.n_slots = d.B * ((d.T + kernels::kChunk - 1) / kernels::kChunk);
  return true;
}

Dims check_inputs(const Inputs& in, const Config& cfg, bool check_values) {
  Dims d;
  check_inputs(in, cfg, check_values, /*probe=*/false, d);
  return d;
}

Inputs make_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta,
                   const std::optional<at::Tensor>& initial_state,
                   const std::optional<at::Tensor>& cu_seqlens,
                   const std::optional<at::Tensor>& A_log,
                   const std::optional<at::Tensor>& dt_bias) {
  Inputs in{q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias};
  for (auto* o : {&in.initial_state, &in.cu_seqlens, &in.A_log, &in.dt_bias}) {
    if (o->has_value() && !(*o)->defined()) o->reset();
  }
  return in;
}

Config make_config(const char* op, double scale, bool l2, bool gate, bool sig, bool neg,
                   std::optional<double> lower_bound, bool state_v_first) {
  Config c;
  c.op = op;
  c.scale = scale;
  c.use_qk_l2norm_in_kernel = l2;
  c.use_gate_in_kernel = gate;
  c.use_beta_sigmoid_in_kernel = sig;
  c.allow_neg_eigval = neg;
  c.lower_bound = lower_bound;
  c.state_v_first = state_v_first;
  return c;
}

namespace {
// Whether t carries a forward-mode tangent (level 0, the first dual level).
bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
bool has_tangent(const std::optional<at::Tensor>& t) { return t && has_tangent(*t); }
}  // namespace

bool any_tangent(const Inputs& in) {
  return has_tangent(in.q) || has_tangent(in.k) || has_tangent(in.v) || has_tangent(in.g) ||
         has_tangent(in.beta) || has_tangent(in.initial_state) || has_tangent(in.A_log) ||
         has_tangent(in.dt_bias);
}

// No op has a forward-mode formula: a tangent would be dropped without a word (the outputs carry
// none, and torch.func.jvp reads that as zero). Called at every CPU kernel (tangents of
// torch.autograd.forward_ad) and in the autograd kernels: under torch.func.jvp / jacfwd the
// tangents sit on functorch's wrappers, which the autograd kernels receive and the CPU kernels
// get unwrapped.
void reject_tangents(const char* op, const Inputs& in) {
  TORCH_CHECK_NOT_IMPLEMENTED(!any_tangent(in), op,
                              "forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not "
                              "implemented by the native operator; use the reference (torch_kda's "
                              "backend='reference', or 'auto', which picks it for inputs with "
                              "tangents)");
}

void check_cpu(const char* op, const Inputs& in) {
  KDA_CHECK_VALUE(in.q.device().is_cpu(), op, "the native kernels run on CPU tensors, got q on ",
              in.q.device());
  reject_tangents(op, in);
}

bool python_only_rules(std::optional<double> lower_bound, const at::Tensor& q,
                       const std::optional<at::Tensor>& cu_seqlens) {
  if (lower_bound && !(finite_in_compute(*lower_bound, q) && *lower_bound < 0.0)) return false;
  return !(cu_seqlens && cu_seqlens->defined() && cu_seqlens->numel() < 2);
}

double python_default_scale(int64_t K) { return std::pow(static_cast<double>(K), -0.5); }

}  // namespace detail
}  // namespace kda
