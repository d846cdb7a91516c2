// The kda ops: schemas, argument checks (one place), CPU / Meta kernels and the C++ autograd.
//
//   kda::fused_recurrent      public op: (o, final_state). Autograd kernel below; CPU and Meta
//                             kernels for calls without autograd (inference, fake tensors).
//   kda::fused_recurrent_fwd  (o, final_state, checkpoints): the forward that keeps the state
//                             every kChunk tokens for the backward.
//   kda::fused_recurrent_bwd  the analytic backward (first order); its Autograd kernel makes a
//                             second-order gradient an error that names backend="reference".
//   kda::chunk, chunk_fwd     the chunkwise forward (csrc/cpu/chunk_fwd.cpp) with the schemas,
//                             checks, Meta kernels and autograd of fused_recurrent /
//                             fused_recurrent_fwd; its backward is kda::chunk_bwd.
//   kda::chunk_bwd            the backward in the chunkwise form (csrc/cpu/chunk_bwd.cpp): schema,
//                             checks, Meta kernel, Autograd kernel and checkpoints of
//                             fused_recurrent_bwd (either backward reads either forward's).
// Tracing (torch.compile / AOTAutograd) sees the _fwd and _bwd ops, all with Meta kernels.
#include <kda/kda.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu/env_knob.h"
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu/output_cache.h"
#include "cpu/serving.h"

namespace kda {
namespace detail {

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor, at::Tensor>;

namespace {

Grads to_grads(const std::vector<at::Tensor>& r) {
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]};
}

// The message prefixes: every error names the op that was called (Config::op carries it into
// the shared checks and the pre-processing pass).
constexpr const char* kRec = "kda::fused_recurrent: ";
constexpr const char* kRecFwd = "kda::fused_recurrent_fwd: ";
constexpr const char* kRecBwd = "kda::fused_recurrent_bwd: ";
constexpr const char* kChunk = "kda::chunk: ";
constexpr const char* kChunkFwd = "kda::chunk_fwd: ";
constexpr const char* kChunkBwd = "kda::chunk_bwd: ";

bool is_float_dtype(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// The argument checks run in one of two modes. Raising (probe = false, every op): a failed rule
// throws the c10 error with the op's words. Probing (probe = true, kda::_fused_recurrent_fast, the
// functional API's one-call path): a failed rule makes the check return false, with no message
// built and nothing thrown; the Python checks then run and raise with their own words
// (docs/bad_inputs.md). One set of rules for both. Used inside functions returning bool with a
// `probe` in scope.
#define KDA_RULE(KIND, cond, ...)            \
  do {                                       \
    if (C10_UNLIKELY(!(cond))) {             \
      if (probe) return false;               \
      KDA_CHECK_##KIND(false, __VA_ARGS__);  \
    }                                        \
  } while (0)

bool check_float(const char* op, const at::Tensor& t, const char* name, bool probe = false) {
  KDA_RULE(TYPE, is_float_dtype(t.scalar_type()), op, name,
           " must be a floating tensor (float64, float32, bfloat16 or float16), got dtype ",
           t.scalar_type());
  return true;
}

bool check_device(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q,
                  bool probe = false) {
  KDA_RULE(VALUE, t.device() == q.device(), op, name, " must be on the device of q (", q.device(),
           "), got ", t.device());
  return true;
}

bool check_shape(const char* op, const at::Tensor& t, const char* name, at::IntArrayRef expected,
                 const char* what, bool probe = false) {
  KDA_RULE(VALUE, t.sizes() == expected, op, name, " must have shape ", shape_str(expected), " ",
           what, ", got ", shape_str(t.sizes()));
  return true;
}

// Whether x stays finite in the compute dtype of the inputs q (compute_dtype: float64 for
// float64, float32 for the others): a scale of 1e300 is a finite double but infinite in float32,
// where it made every output NaN.
bool finite_in_compute(double x, const at::Tensor& q) {
  if (!std::isfinite(x)) return false;
  return compute_dtype(q) == at::kDouble ||
         std::abs(x) <= static_cast<double>(std::numeric_limits<float>::max());
}

}  // namespace

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

// Whether t carries a forward-mode tangent (torch.autograd.forward_ad, torch.func.jvp; level 0,
// the first dual level).
bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
bool has_tangent(const std::optional<at::Tensor>& t) { return t && has_tangent(*t); }
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

// The entry of every CPU kernel (forward, backward, serving ops).
void check_cpu(const char* op, const Inputs& in) {
  KDA_CHECK_VALUE(in.q.device().is_cpu(), op, "the native kernels run on CPU tensors, got q on ",
              in.q.device());
  reject_tangents(op, in);
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
#define KDA_OP_CONFIG(op)                                                                \
  make_config(op, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,                   \
              use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first)
#define KDA_OP_FORWARD                                                                  \
  q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,  \
      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,         \
      cu_seqlens, A_log, dt_bias

// ---- CPU kernels ----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cpu(KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  check_cpu(kRecFwd, in);
  return recurrent_fwd_cpu(in, KDA_OP_CONFIG(kRecFwd), /*with_checkpoints=*/true);
}

std::tuple<at::Tensor, at::Tensor> fused_recurrent_cpu(KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  check_cpu(kRec, in);
  {
    // Decode and small short prefills (is_short_call, serving.h): the serving kernels read each
    // state slice once and write the fresh final state once, in either layout, without
    // transposed copies, and skip the general path's fixed costs.
    const Config cfg = KDA_OP_CONFIG(kRec);
    const Dims d = check_inputs(in, cfg, /*check_values=*/true);
    // TORCH_KDA_DECODE_KERNEL=recurrent keeps these calls on the general recurrent kernels
    // (benchmarks compare the two paths side by side; tests check they agree).
    const bool general = env_knob("TORCH_KDA_DECODE_KERNEL", {"recurrent"}) != nullptr;
    if (!general && is_short_call(in, d)) {
      check_domain(in, cfg, d);  // the serving kernels pre-process inside their units
      // o and the fresh final state reuse freed blocks of earlier calls (csrc/cpu/output_cache.h):
      // a decode loop's final state (128 MB at B64 H32) is then not faulted in anew every call.
      const auto ct = compute_dtype(q);
      at::Tensor o = empty_output({d.B, d.T, d.HV, d.V}, q.options());
      at::Tensor ht = cfg.state_v_first ? empty_output({d.N, d.HV, d.V, d.K}, q.options().dtype(ct))
                                        : empty_output({d.N, d.HV, d.K, d.V}, q.options().dtype(ct));
      serving_cpu(in, cfg, d, plain_plan(in, d),
                  in.initial_state ? *in.initial_state : at::Tensor(), ht, o);
      return {o, ht};
    }
  }
  auto r = recurrent_fwd_cpu(in, KDA_OP_CONFIG(kRec), /*with_checkpoints=*/false);
  return {std::get<0>(r), std::get<1>(r)};
}

// The chunkwise forward (csrc/cpu/chunk_fwd.cpp): the contract of the two kernels above, equal
// to rounding; its checkpoints feed either backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_fwd_cpu_op(KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  check_cpu(kChunkFwd, in);
  return chunk_fwd_cpu(in, KDA_OP_CONFIG(kChunkFwd), /*with_checkpoints=*/true);
}

std::tuple<at::Tensor, at::Tensor> chunk_cpu(KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  check_cpu(kChunk, in);
  auto r = chunk_fwd_cpu(in, KDA_OP_CONFIG(kChunk), /*with_checkpoints=*/false);
  return {std::get<0>(r), std::get<1>(r)};
}

// Checks of a backward call beyond those of the forward's inputs (grad_o, grad_final_state,
// checkpoints); returns grad_final_state, absent when undefined. Shared by both backwards.
std::optional<at::Tensor> check_bwd_call(const at::Tensor& grad_o,
                                         const std::optional<at::Tensor>& grad_final_state,
                                         const at::Tensor& checkpoints, const Inputs& in,
                                         const Config& cfg) {
  const at::Tensor& q = in.q;
  const char* op = cfg.op;
  check_cpu(op, in);
  const Dims d = check_inputs(in, cfg, /*check_values=*/true);
  KDA_CHECK_VALUE(grad_o.sizes() == at::IntArrayRef({d.B, d.T, d.HV, d.V}), op,
              "grad_o must have shape [B, T, HV, V] = ", shape_str({d.B, d.T, d.HV, d.V}),
              ", got ", shape_str(grad_o.sizes()));
  check_float(op, grad_o, "grad_o");
  check_device(op, grad_o, "grad_o", q);
  std::optional<at::Tensor> gfs = grad_final_state;
  if (gfs && !gfs->defined()) gfs.reset();
  if (gfs) {
    check_float(op, *gfs, "grad_final_state");
    check_device(op, *gfs, "grad_final_state", q);
    if (cfg.state_v_first) {
      check_shape(op, *gfs, "grad_final_state", {d.N, d.HV, d.V, d.K}, "[N, HV, V, K]");
    } else {
      check_shape(op, *gfs, "grad_final_state", {d.N, d.HV, d.K, d.V}, "[N, HV, K, V]");
    }
  }
  check_float(op, checkpoints, "checkpoints");
  check_device(op, checkpoints, "checkpoints", q);
  check_shape(op, checkpoints, "checkpoints", {d.n_slots, d.HV, d.K, d.V},
              "[B * ceil(T / 64), HV, K, V] (from fused_recurrent_fwd)");
  return gfs;
}

Grads bwd_cpu(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state,
              const at::Tensor& checkpoints, KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  const Config cfg = KDA_OP_CONFIG(kRecBwd);
  const auto gfs = check_bwd_call(grad_o, grad_final_state, checkpoints, in, cfg);
  return to_grads(recurrent_bwd_cpu(grad_o, gfs, checkpoints, in, cfg));
}

// The chunkwise backward (csrc/cpu/chunk_bwd.cpp): the contract of bwd_cpu, equal to rounding.
Grads chunk_bwd_cpu_op(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state,
                       const at::Tensor& checkpoints, KDA_OP_ARGS) {
  const Inputs in = KDA_OP_INPUTS;
  const Config cfg = KDA_OP_CONFIG(kChunkBwd);
  const auto gfs = check_bwd_call(grad_o, grad_final_state, checkpoints, in, cfg);
  return to_grads(chunk_bwd_cpu(grad_o, gfs, checkpoints, in, cfg));
}

// ---- Meta kernels (shapes and dtypes only; symbolic sizes) ----------------------------------

// Checks that need no sizes: every tensor defined and on q's device (a tensor on another device
// can route the call to this kernel).
void check_defined_same_device(const char* op, KDA_OP_ARGS) {
  KDA_CHECK_TYPE(q.defined() && k.defined() && v.defined() && g.defined() && beta.defined(), op,
              "q, k, v, g and beta must be defined tensors");
  check_device(op, k, "k", q);
  check_device(op, v, "v", q);
  check_device(op, g, "g", q);
  check_device(op, beta, "beta", q);
  if (initial_state && initial_state->defined()) {
    check_device(op, *initial_state, "initial_state", q);
  }
  if (cu_seqlens && cu_seqlens->defined()) check_device(op, *cu_seqlens, "cu_seqlens", q);
  if (A_log && A_log->defined()) check_device(op, *A_log, "A_log", q);
  if (dt_bias && dt_bias->defined()) check_device(op, *dt_bias, "dt_bias", q);
}

at::ScalarType state_dtype(const at::Tensor& q) { return compute_dtype(q); }

std::vector<c10::SymInt> state_shape_meta(const char* op, const at::Tensor& q,
                                          const at::Tensor& v,
                                          const std::optional<at::Tensor>& cu_seqlens,
                                          bool state_v_first) {
  KDA_CHECK_VALUE(q.dim() == 4 && v.dim() == 4, op, "q and v must be 4-D");
  c10::SymInt N = (cu_seqlens && cu_seqlens->defined()) ? cu_seqlens->sym_size(0) - 1
                                                         : q.sym_size(0);
  if (state_v_first) return {N, v.sym_size(2), v.sym_size(3), q.sym_size(3)};
  return {N, v.sym_size(2), q.sym_size(3), v.sym_size(3)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_meta_impl(const char* op, KDA_OP_ARGS) {
  check_defined_same_device(op, KDA_OP_FORWARD);
  const auto ct = state_dtype(q);
  auto opts = q.options().dtype(ct);
  auto o = at::empty_symint({q.sym_size(0), q.sym_size(1), v.sym_size(2), v.sym_size(3)},
                            q.options());
  auto ht = at::empty_symint(state_shape_meta(op, q, v, cu_seqlens, state_v_first), opts);
  const c10::SymInt chunks = (q.sym_size(1) + (kernels::kChunk - 1)) / kernels::kChunk;
  auto ck = at::empty_symint({q.sym_size(0) * chunks, v.sym_size(2), q.sym_size(3), v.sym_size(3)},
                             opts);
  return {o, ht, ck};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_meta(KDA_OP_ARGS) {
  return fwd_meta_impl(kRecFwd, KDA_OP_FORWARD);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_fwd_meta(KDA_OP_ARGS) {
  return fwd_meta_impl(kChunkFwd, KDA_OP_FORWARD);
}

std::tuple<at::Tensor, at::Tensor> fused_recurrent_meta(KDA_OP_ARGS) {
  auto r = fwd_meta_impl(kRec, KDA_OP_FORWARD);
  return {std::get<0>(r), std::get<1>(r)};
}

std::tuple<at::Tensor, at::Tensor> chunk_meta(KDA_OP_ARGS) {
  auto r = fwd_meta_impl(kChunk, KDA_OP_FORWARD);
  return {std::get<0>(r), std::get<1>(r)};
}

Grads bwd_meta_impl(const char* op, const at::Tensor& grad_o,
                    const std::optional<at::Tensor>& grad_final_state,
                    const at::Tensor& checkpoints, KDA_OP_ARGS) {
  check_defined_same_device(op, KDA_OP_FORWARD);
  check_device(op, grad_o, "grad_o", q);
  check_device(op, checkpoints, "checkpoints", q);
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

Grads bwd_meta(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state,
               const at::Tensor& checkpoints, KDA_OP_ARGS) {
  return bwd_meta_impl(kRecBwd, grad_o, grad_final_state, checkpoints, KDA_OP_FORWARD);
}

Grads chunk_bwd_meta(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state,
                     const at::Tensor& checkpoints, KDA_OP_ARGS) {
  return bwd_meta_impl(kChunkBwd, grad_o, grad_final_state, checkpoints, KDA_OP_FORWARD);
}

// ---- Autograd -------------------------------------------------------------------------------

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The forward of the autograd function: kda::chunk_fwd (chunk) or kda::fused_recurrent_fwd.
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_fwd(bool chunk, KDA_OP_ARGS) {
  using Fwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(KDA_OP_ARGS);
  static auto rec = op_handle("kda::fused_recurrent_fwd").typed<Fwd>();
  static auto chk = op_handle("kda::chunk_fwd").typed<Fwd>();
  return (chunk ? chk : rec).call(KDA_OP_FORWARD);
}

// The backward: kda::chunk_bwd for the chunk op, kda::fused_recurrent_bwd for the recurrent one
// (both consume the same checkpoints, so either pairing is valid).
Grads call_bwd(bool chunk, const at::Tensor& grad_o,
               const std::optional<at::Tensor>& grad_final_state, const at::Tensor& checkpoints,
               KDA_OP_ARGS) {
  using Bwd = Grads(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                    KDA_OP_ARGS);
  static auto rec = op_handle("kda::fused_recurrent_bwd").typed<Bwd>();
  static auto chk = op_handle("kda::chunk_bwd").typed<Bwd>();
  return (chunk ? chk : rec).call(grad_o, grad_final_state, checkpoints, KDA_OP_FORWARD);
}

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The analytic backward as a differentiable function whose own backward refuses.
class FusedRecurrentBackward : public torch::autograd::Function<FusedRecurrentBackward> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad_o,
                               const std::optional<at::Tensor>& grad_final_state,
                               const at::Tensor& checkpoints, KDA_OP_ARGS, bool chunk) {
    ctx->saved_data["chunk"] = chunk;
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto r = call_bwd(chunk, grad_o, grad_final_state, checkpoints, KDA_OP_FORWARD);
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r),
            std::get<4>(r), std::get<5>(r), std::get<6>(r), std::get<7>(r)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    KDA_CHECK(false, ctx->saved_data["chunk"].toBool() ? kChunkBwd : kRecBwd,
                "the native backward is first order only; for "
                "higher-order gradients (e.g. create_graph=True followed by another backward) use "
                "backend=\"reference\"");
    return {};
  }
};

class FusedRecurrentFunction : public torch::autograd::Function<FusedRecurrentFunction> {
 public:
  // chunk: kda::chunk (chunkwise forward) instead of kda::fused_recurrent.
  static variable_list forward(AutogradContext* ctx, KDA_OP_ARGS, bool chunk) {
    at::Tensor o, ht, ckpt;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(o, ht, ckpt) = call_fwd(chunk, KDA_OP_FORWARD);
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
    ctx->saved_data["chunk"] = chunk;
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
    const bool chunk = ctx->saved_data["chunk"].toBool();

    at::Tensor grad_o = grads[0];
    if (!grad_o.defined()) {
      grad_o = at::zeros_symint({v.sym_size(0), v.sym_size(1), v.sym_size(2), v.sym_size(3)},
                                q.options());
    }
    const auto r =
        FusedRecurrentBackward::apply(grad_o, opt(grads[1]), ckpt, KDA_OP_FORWARD, chunk);
    variable_list out(17);
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

// kda::fused_recurrent and (chunk) kda::chunk under autograd.
std::tuple<at::Tensor, at::Tensor> autograd_impl(bool chunk, KDA_OP_ARGS) {
  check_defined_same_device(chunk ? kChunk : kRec, KDA_OP_FORWARD);
  reject_tangents(chunk ? kChunk : kRec, KDA_OP_INPUTS);
  auto req = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
  const bool needs_grad =
      at::GradMode::is_enabled() &&
      (q.requires_grad() || k.requires_grad() || v.requires_grad() || g.requires_grad() ||
       beta.requires_grad() || req(initial_state) || req(A_log) || req(dt_bias));
  if (!needs_grad) {
    // Nothing to differentiate: the kernel below autograd, without checkpoints.
    using Op = std::tuple<at::Tensor, at::Tensor>(KDA_OP_ARGS);
    static auto rec = op_handle("kda::fused_recurrent").typed<Op>();
    static auto chk = op_handle("kda::chunk").typed<Op>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return (chunk ? chk : rec).call(KDA_OP_FORWARD);
  }
  auto r = FusedRecurrentFunction::apply(KDA_OP_FORWARD, chunk);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor> fused_recurrent_autograd(KDA_OP_ARGS) {
  return autograd_impl(/*chunk=*/false, KDA_OP_FORWARD);
}

std::tuple<at::Tensor, at::Tensor> chunk_autograd(KDA_OP_ARGS) {
  return autograd_impl(/*chunk=*/true, KDA_OP_FORWARD);
}

// kda::_fused_recurrent_checked: kda::fused_recurrent plus the place of the unstable-write
// warning (first_unstable_write, csrc/cpu/unstable_writes.cpp; -1 for none, and not computed with
// the in-op l2 norm, which rules it out), in one call from Python: the functional API's native
// path makes one Python -> C++ call instead of two, several microseconds of a decode step
// (docs/benchmarks.md "Decode: the Python layer, fourth round"). CompositeImplicitAutograd:
// kda::fused_recurrent is called through the dispatcher, so its checks, autograd and kernels are
// exactly that op's; the warning is raised by Python (a TORCH_WARN from torch.ops reaches stderr).
std::tuple<at::Tensor, at::Tensor, int64_t> fused_recurrent_checked(KDA_OP_ARGS) {
  using Op = std::tuple<at::Tensor, at::Tensor>(KDA_OP_ARGS);
  static auto rec = op_handle("kda::fused_recurrent").typed<Op>();
  auto r = rec.call(KDA_OP_FORWARD);
  int64_t first = -1;
  if (!use_qk_l2norm_in_kernel) {
    at::NoGradGuard no_grad;  // reads k and beta; nothing to differentiate
    first = first_unstable_write(k, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval ? 2.0 : 1.0);
  }
  return {std::get<0>(r), std::get<1>(r), first};
}

// kda::_fused_recurrent_fast: the functional API's plain call (torch_kda.fused_recurrent_kda with
// no serving argument, CPU tensors) in one Python -> C++ call: the checks of check_kda_inputs
// (src/torch_kda/_checks.py), probed here without raising, then kda::_fused_recurrent_checked.
// `scale` None means K ** -0.5, computed as Python computes it (pow). Returns (o, final_state,
// status): status kRefused when a rule failed (undefined tensors; nothing ran, and the Python
// checks then raise with their words), else the place of the unstable-write warning (-1: none).
// A decode step's Python layer shrinks to a few attribute tests (docs/benchmarks.md "Decode: the
// Python layer, fifth round").
constexpr int64_t kRefused = -2;

// The Python checks' rules beyond the ops' (check_kda_inputs, check_cu_seqlens): a lower_bound
// is a finite negative number even without the in-op gate (where it is only a promise, see
// fused_recurrent_kda), and cu_seqlens names at least one sequence.
bool python_only_rules(std::optional<double> lower_bound, const at::Tensor& q,
                       const std::optional<at::Tensor>& cu_seqlens) {
  if (lower_bound && !(finite_in_compute(*lower_bound, q) && *lower_bound < 0.0)) return false;
  return !(cu_seqlens && cu_seqlens->defined() && cu_seqlens->numel() < 2);
}

// scale=None: K ** -0.5 as Python computes it (float pow), so that both paths run one scale.
double python_default_scale(int64_t K) { return std::pow(static_cast<double>(K), -0.5); }

std::tuple<at::Tensor, at::Tensor, int64_t> fused_recurrent_fast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, std::optional<double> scale,
    const std::optional<at::Tensor>& initial_state, bool use_qk_l2norm_in_kernel,
    bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval,
    std::optional<double> lower_bound, bool state_v_first,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& A_log,
    const std::optional<at::Tensor>& dt_bias) {
  const std::tuple<at::Tensor, at::Tensor, int64_t> refused{at::Tensor(), at::Tensor(), kRefused};
  const Inputs in = make_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias);
  const Config cfg = make_config(kRec, scale.value_or(1.0), use_qk_l2norm_in_kernel,
                                 use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                 lower_bound, state_v_first);
  Dims d;
  if (!q.is_cpu() || !check_inputs(in, cfg, /*check_values=*/true, /*probe=*/true, d) ||
      !python_only_rules(lower_bound, q, cu_seqlens)) {
    return refused;
  }
  const double s = scale ? *scale : python_default_scale(d.K);
  return fused_recurrent_checked(q, k, v, g, beta, s, initial_state, use_qk_l2norm_in_kernel,
                                 use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                 lower_bound, state_v_first, cu_seqlens, A_log, dt_bias);
}

Grads bwd_autograd(const at::Tensor& grad_o,
                                     const std::optional<at::Tensor>& grad_final_state,
                                     const at::Tensor& checkpoints, KDA_OP_ARGS) {
  return to_grads(FusedRecurrentBackward::apply(grad_o, grad_final_state, checkpoints,
                                                KDA_OP_FORWARD, /*chunk=*/false));
}

Grads chunk_bwd_autograd(const at::Tensor& grad_o,
                         const std::optional<at::Tensor>& grad_final_state,
                         const at::Tensor& checkpoints, KDA_OP_ARGS) {
  return to_grads(FusedRecurrentBackward::apply(grad_o, grad_final_state, checkpoints,
                                                KDA_OP_FORWARD, /*chunk=*/true));
}

}  // namespace

// ---- serving: a state pool addressed by slot indices (docs/serving.md) ----------------------

namespace {

constexpr const char* kSrv = "kda::fused_recurrent_serving: ";

#define KDA_SERVING_ARGS                                                                       \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &g,         \
      const at::Tensor &beta, double scale, const std::optional<at::Tensor>&initial_state,    \
      const std::optional<at::Tensor>&ssm_state_indices,                                       \
      const std::optional<at::Tensor>&num_accepted_tokens, const at::Tensor &out,             \
      const std::optional<at::Tensor>&final_state, int64_t pad_slot_id,                        \
      bool inplace_final_state, bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel,        \
      bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, std::optional<double> lower_bound, \
      bool state_v_first, const std::optional<at::Tensor>&cu_seqlens,                          \
      const std::optional<at::Tensor>&A_log, const std::optional<at::Tensor>&dt_bias
#define KDA_SERVING_FORWARD                                                                    \
  q, k, v, g, beta, scale, initial_state, ssm_state_indices, num_accepted_tokens, out,        \
      final_state, pad_slot_id, inplace_final_state, use_qk_l2norm_in_kernel,                 \
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,           \
      state_v_first, cu_seqlens, A_log, dt_bias

std::optional<at::Tensor> defined_or_none(const std::optional<at::Tensor>& t) {
  return (t && t->defined()) ? t : std::nullopt;
}

// Whether two elements of t may share memory (a stride 0, or slots that overlap). Sufficient test
// for separate elements: sorted by stride, each stride exceeds the largest offset the smaller ones
// reach; every view made by slicing, permuting and (non-zero) striding a fresh tensor passes it.
bool may_self_overlap(const at::Tensor& t) {
  c10::SmallVector<std::pair<int64_t, int64_t>, 8> dims;  // (stride, size)
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += (size - 1) * stride;
  }
  return false;
}

// The byte range [first, end) spanned by t's elements; empty ({0, 0}) when t has none.
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t last = 0;
  for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

// A tensor a serving call writes or reads, with its argument's name for the messages. Pointers,
// not copies: these lists are built at every call, decode's included (a list of (std::string,
// Tensor) pairs took 15% of a one-token call from C++; docs/benchmarks.md "Short calls").
struct NamedTensor {
  const char* name;
  const at::Tensor* tensor;
};
using NamedTensors = c10::SmallVector<NamedTensor, 16>;

// PyTorch refuses to bump the version of an inference tensor outside inference mode, which a
// serving call does after writing: refused here instead, before anything is written (the rule
// and the words of torch_kda._checks.check_serving_inputs).
bool check_writable(const NamedTensors& written, bool probe) {
  for (const auto& [name, t] : written) {
    KDA_RULE(VALUE, !t->is_inference() || c10::InferenceMode::is_enabled(), kSrv, name,
             " was made under inference mode and is written in place here, outside it; call "
             "under torch.inference_mode() / c10::InferenceMode, or make ", name,
             " outside inference mode");
  }
  return true;
}

// Memory a serving call writes in place (out, the pool with inplace_final_state, a caller's
// final_state) must not alias itself, another output or an input: the kernels write while other
// threads still read (out = q returned wrong values; an expanded pool wrote two sequences' states
// into one place). The rule and the words of torch_kda._checks.check_no_aliasing.
bool check_no_aliasing(const NamedTensors& written, const NamedTensors& read, bool probe) {
  for (const auto& [name, t] : written) {
    if (!may_self_overlap(*t)) continue;
    if (probe) return false;
    const std::string layout = "(shape " + shape_str(t->sizes()) + ", strides " +
                               shape_str(t->strides()) + "; an expanded tensor?)";
    if (std::strcmp(name, "initial_state") == 0) {
      KDA_CHECK_VALUE(false, kSrv, "the slots of the state pool (initial_state) overlap in memory ",
                        layout, ", so two slot indices could name one state that "
                        "inplace_final_state=True writes; pass a pool whose slots are separate "
                        "(e.g. initial_state.contiguous())");
    }
    KDA_CHECK_VALUE(false, kSrv, name, " has elements that share memory ", layout,
                      ", and it is written in place; pass a tensor of separate elements (e.g. "
                      "torch.empty)");
  }
  NamedTensors all(written);
  all.append(read.begin(), read.end());
  c10::SmallVector<std::pair<uintptr_t, uintptr_t>, 16> spans;
  for (const auto& named : all) spans.push_back(byte_span(*named.tensor));
  for (size_t i = 0; i < written.size(); ++i) {
    for (size_t j = i + 1; j < all.size(); ++j) {
      const bool disjoint = spans[i].first >= spans[i].second ||
                            spans[j].first >= spans[j].second ||
                            spans[i].first >= spans[j].second || spans[j].first >= spans[i].second;
      KDA_RULE(VALUE, disjoint, kSrv, all[i].name, " shares memory with ", all[j].name,
               ": it is written in place while the call reads ", all[j].name,
               ", which would corrupt the result; pass a separate tensor as ", all[i].name);
    }
  }
  return true;
}

// Every check of a serving call, and the plan it resolves to (raising, or probing: see KDA_RULE).
// Nothing is written before this returns, so a rejected call leaves the pool (and out) untouched.
// An undefined `out` (probing only: kda::_fused_recurrent_serving_fast allocates it afterwards)
// is skipped, as an undefined final_state is.
bool check_serving(KDA_SERVING_ARGS, bool probe, Inputs& in, Config& cfg, Dims& d,
                   ServingPlan& plan) {
  const auto pool = defined_or_none(initial_state);
  const auto idx = defined_or_none(ssm_state_indices);
  const auto nat = defined_or_none(num_accepted_tokens);
  const auto fresh = defined_or_none(final_state);
  KDA_RULE(TYPE, beta.defined(), kSrv, "beta must be a defined tensor");
  KDA_RULE(TYPE, out.defined() || probe, kSrv, "out must be a defined tensor");
  const bool headwise = beta.dim() == 4;
  KDA_RULE(VALUE, !headwise || beta.size(3) > 0, kSrv, "head-wise beta [B, T, HV, V] needs V = "
           "v.shape[3] > 0 columns, got shape ", shape_str(beta.sizes()));
  // The plain checks, with the pool and a head-wise beta replaced by what they check.
  in = make_inputs(q, k, v, g, headwise ? beta.select(3, 0) : beta, idx ? std::nullopt : pool,
                   cu_seqlens, A_log, dt_bias);
  cfg = make_config(kSrv, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first);
  if (probe) {
    if (!q.is_cpu() || any_tangent(in) ||
        !check_inputs(in, cfg, /*check_values=*/true, /*probe=*/true, d)) {
      return false;
    }
  } else {
    check_cpu(kSrv, in);
    d = check_inputs(in, cfg, /*check_values=*/true);
  }
  in.beta = beta;
  in.initial_state = pool;
  if (headwise &&
      !check_shape(kSrv, beta, "beta", {d.B, d.T, d.HV, d.V}, "[B, T, HV, V] (head-wise)", probe)) {
    return false;
  }
  const auto ct = compute_dtype(q);
  const std::vector<int64_t> per_slot = state_v_first ? std::vector<int64_t>{d.HV, d.V, d.K}
                                                      : std::vector<int64_t>{d.HV, d.K, d.V};
  const char* layout = state_v_first ? "[num_slots, HV, V, K] (state_v_first)" : "[num_slots, HV, K, V]";
  int64_t num_slots = 0;
  if (idx || inplace_final_state) {
    KDA_RULE(VALUE, pool.has_value(), kSrv, idx ? "ssm_state_indices" : "inplace_final_state=True",
             " needs the state pool as initial_state ", layout, ", got None");
    const auto& p = *pool;
    if (!check_device(kSrv, p, "initial_state", q, probe)) return false;
    KDA_RULE(VALUE, p.dim() == 4 && p.size(1) == per_slot[0] && p.size(2) == per_slot[1] &&
                        p.size(3) == per_slot[2],
             kSrv, "initial_state (the state pool) must have shape ", layout,
             " with [HV, ., .] = ", shape_str(per_slot), ", got ", shape_str(p.sizes()));
    KDA_RULE(TYPE, p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16 ||
                       (p.scalar_type() == at::kDouble && ct == at::kDouble),
             kSrv, "the state pool (initial_state) must be float32 or bfloat16 (or float64 "
             "with float64 inputs), got ", p.scalar_type());
    num_slots = p.size(0);
  }
  if (inplace_final_state) {
    const auto& p = *pool;
    KDA_RULE(VALUE, p.stride(3) == 1 && p.stride(2) == p.size(3) &&
                        p.stride(1) == p.size(2) * p.size(3),
             kSrv, "inplace_final_state=True needs each slot of the pool contiguous, got "
             "strides ", shape_str(p.strides()));
    KDA_RULE(VALUE, !fresh, kSrv, "final_state must be None with inplace_final_state=True "
             "(the pool receives the states)");
  }
  if (out.defined()) {
    if (!check_device(kSrv, out, "out", q, probe) ||
        !check_shape(kSrv, out, "out", {d.B, d.T, d.HV, d.V}, "[B, T, HV, V]", probe)) {
      return false;
    }
    KDA_RULE(TYPE, out.scalar_type() == q.scalar_type(), kSrv, "out must have the dtype of q (",
             q.scalar_type(), "), got ", out.scalar_type());
  }
  if (fresh) {
    if (!check_device(kSrv, *fresh, "final_state", q, probe)) return false;
    const bool shape_ok =
        state_v_first
            ? check_shape(kSrv, *fresh, "final_state", {d.N, d.HV, d.V, d.K}, "[N, HV, V, K]", probe)
            : check_shape(kSrv, *fresh, "final_state", {d.N, d.HV, d.K, d.V}, "[N, HV, K, V]", probe);
    if (!shape_ok) return false;
    KDA_RULE(TYPE, fresh->scalar_type() == ct && fresh->is_contiguous(), kSrv,
             "final_state must be a contiguous ", ct, " tensor, got a ",
             fresh->is_contiguous() ? "contiguous " : "non-contiguous ", fresh->scalar_type(),
             " tensor");
  }

  {
    NamedTensors written;
    if (out.defined()) written.push_back({"out", &out});
    if (inplace_final_state) written.push_back({"initial_state", &*pool});
    if (fresh) written.push_back({"final_state", &*fresh});
    NamedTensors read{{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}};
    const std::pair<const char*, const std::optional<at::Tensor>*> optional_reads[] = {
        {"initial_state", inplace_final_state ? nullptr : &pool}, {"A_log", &A_log},
        {"dt_bias", &dt_bias}, {"cu_seqlens", &cu_seqlens}, {"ssm_state_indices", &idx},
        {"num_accepted_tokens", &nat}};
    for (const auto& [name, t] : optional_reads) {
      if (t && *t && (*t)->defined()) read.push_back({name, &**t});
    }
    if (!check_writable(written, probe) || !check_no_aliasing(written, read, probe)) return false;
  }

  plan = ServingPlan();
  const Sequences seqs = make_sequences(in, d);
  plan.seq_start = seqs.start;
  plan.seq_end = seqs.end;
  plan.src_row.assign(d.N, -1);
  plan.dst_row.assign(d.N, -1);
  plan.pad.assign(d.N, 0);
  std::vector<int64_t> accepted;
  if (nat) {
    KDA_RULE(VALUE, idx && idx->dim() == 2, kSrv, "num_accepted_tokens (speculative decoding) "
             "needs 2-D ssm_state_indices [N, T_max]");
    KDA_RULE(TYPE, nat->scalar_type() == at::kLong || nat->scalar_type() == at::kInt, kSrv,
             "num_accepted_tokens must be int64 or int32, got ", nat->scalar_type());
    if (!check_device(kSrv, *nat, "num_accepted_tokens", q, probe) ||
        !check_shape(kSrv, *nat, "num_accepted_tokens", {d.N}, "[N]", probe)) {
      return false;
    }
    const auto a = nat->to(at::kLong).contiguous();
    accepted.assign(a.data_ptr<int64_t>(), a.data_ptr<int64_t>() + d.N);
  }
  if (!idx) {
    for (int64_t n = 0; n < d.N; ++n) {
      plan.src_row[n] = pool ? n : -1;
      plan.dst_row[n] = inplace_final_state || fresh ? n : -1;
    }
    return true;
  }
  KDA_RULE(TYPE, idx->scalar_type() == at::kLong || idx->scalar_type() == at::kInt, kSrv,
           "ssm_state_indices must be int64 or int32, got ", idx->scalar_type());
  if (!check_device(kSrv, *idx, "ssm_state_indices", q, probe)) return false;
  KDA_RULE(VALUE, (idx->dim() == 1 || idx->dim() == 2) && idx->size(0) == d.N, kSrv,
           "ssm_state_indices must have shape [N] or [N, T_max] with N = ", d.N,
           ", got ", shape_str(idx->sizes()));
  KDA_RULE(VALUE, idx->dim() == 1 || inplace_final_state, kSrv,
           "2-D ssm_state_indices write per-token snapshots into the pool and need "
           "inplace_final_state=True");
  const auto iv = idx->to(at::kLong).contiguous();
  const int64_t* ix = iv.data_ptr<int64_t>();
  const int64_t cols = idx->dim() == 2 ? idx->size(1) : 1;
  constexpr int64_t kBad = -2;  // a slot out of range (probing; raising throws instead)
  auto slot = [&](int64_t n, int64_t t) -> int64_t {  // -1: pad
    const int64_t s = ix[n * cols + t];
    if (s == pad_slot_id) return -1;
    if (s >= 0 && s < num_slots) return s;
    KDA_CHECK_VALUE(probe, kSrv, "ssm_state_indices[", n,
                      idx->dim() == 2 ? ", " + std::to_string(t) : std::string(), "] = ", s,
                      " is out of range: expected a slot in [0, ", num_slots,
                      ") (num_slots = initial_state.shape[0]) or pad_slot_id = ", pad_slot_id);
    return kBad;
  };
  // The writer of each slot: its sequence and token (column of 2-D indices; 0 for 1-D ones).
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> writer;
  auto claim = [&](int64_t s, int64_t n, int64_t t) -> bool {
    if (s < 0) return true;
    const auto [n0, t0] = writer.emplace(s, std::make_pair(n, t)).first->second;
    KDA_RULE(VALUE, n0 == n, kSrv, "two sequences write slot ", s, " in one call (sequences ",
             n0, " and ", n, "); each slot may be written by one sequence only");
    // Two snapshots of one row in one slot: the later one would silently replace the state that
    // num_accepted_tokens may name on the next call.
    KDA_RULE(VALUE, t0 == t, kSrv, "sequence ", n, " writes slot ", s,
             " twice (at ssm_state_indices[", n, ", ", t0, "] and [", n, ", ", t,
             "]); each token's snapshot needs its own slot");
    return true;
  };
  if (idx->dim() == 1) {
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t s = slot(n, 0);
      if (s == kBad) return false;
      plan.pad[n] = s < 0;
      plan.src_row[n] = s;
      if (inplace_final_state) {
        plan.dst_row[n] = s;
        if (!claim(s, n, 0)) return false;
      } else if (fresh) {
        plan.dst_row[n] = n;
      }
    }
  } else {
    plan.snap_ld = cols;
    plan.snap.assign(d.N * cols, -1);
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t Tn = plan.seq_end[n] - plan.seq_start[n];
      KDA_RULE(VALUE, Tn <= cols, kSrv, "sequence ", n, " has ", Tn,
               " tokens but ssm_state_indices has T_max = ", cols, " columns");
      if (Tn == 0) {
        plan.pad[n] = 1;
        continue;
      }
      const int64_t a = nat ? accepted[n] : 1;
      KDA_RULE(VALUE, a >= 1 && a <= Tn, kSrv, "num_accepted_tokens[", n,
               "] must be in [1, T_n] = [1, ", Tn, "], got ", a);
      std::vector<int64_t> row(Tn);
      for (int64_t t = 0; t < Tn; ++t) {
        row[t] = slot(n, t);
        if (row[t] == kBad) return false;
      }
      plan.src_row[n] = row[a - 1];
      plan.pad[n] = row[a - 1] < 0;
      if (plan.pad[n]) continue;
      for (int64_t t = 0; t < Tn; ++t) {
        plan.snap[n * cols + t] = row[t];
        if (!claim(row[t], n, t)) return false;
      }
    }
  }
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t s = plan.src_row[n];
    if (s < 0) continue;
    const auto it = writer.find(s);
    KDA_RULE(VALUE, it == writer.end() || it->second.first == n, kSrv, "slot ", s,
             " is read by sequence ", n, " and written by sequence ", it->second.first,
             " in the same call; give each sequence its own slots");
  }
  return true;
}

ServingPlan check_serving(KDA_SERVING_ARGS, Inputs& in, Config& cfg, Dims& d) {
  ServingPlan plan;
  check_serving(KDA_SERVING_FORWARD, /*probe=*/false, in, cfg, d, plan);
  return plan;
}

// A checked serving call: the values (g, beta), then the kernels. dst: the pool (in place), a
// fresh final_state, or undefined.
void run_serving(const Inputs& in, const Config& cfg, const Dims& d, const ServingPlan& plan,
                 const at::Tensor& dst, bool fresh_dst, const at::Tensor& out) {
  check_domain(in, cfg, d);  // the values last, as in Python; still before any write
  // A fresh final state is first touched by the kernels: 2 MB pages make that hundreds of times
  // fewer page faults (B = 64, H = 32: 128 MB).
  if (fresh_dst) advise_huge_pages(dst);
  serving_cpu(in, cfg, d, plan, in.initial_state ? *in.initial_state : at::Tensor(), dst, out);
}

void fused_recurrent_serving_cpu(KDA_SERVING_ARGS) {
  Inputs in;
  Config cfg;
  Dims d;
  const ServingPlan plan = check_serving(KDA_SERVING_FORWARD, in, cfg, d);
  const auto fresh = defined_or_none(final_state);
  const at::Tensor dst = inplace_final_state ? *in.initial_state : fresh ? *fresh : at::Tensor();
  run_serving(in, cfg, d, plan, dst, !inplace_final_state && fresh, out);
}

void fused_recurrent_serving_meta(KDA_SERVING_ARGS) {}  // outputs are the caller's tensors

// The serving ops write out, the pool (in place) and a caller's final_state below autograd's
// ADInplaceOrView kernel, which is where PyTorch's in-place ops bump a tensor's version: bumped
// here, so a graph that saved one of them raises at backward ("modified by an inplace
// operation") instead of computing with the new values. As for PyTorch's own in-place ops, an
// inference tensor written outside InferenceMode raises.
void bump_written_versions(const at::Tensor& out, const std::optional<at::Tensor>& initial_state,
                           bool inplace_final_state, const std::optional<at::Tensor>& final_state) {
  if (out.defined()) torch::autograd::impl::bump_version(out);
  if (inplace_final_state && initial_state && initial_state->defined()) {
    torch::autograd::impl::bump_version(*initial_state);
  }
  if (final_state && final_state->defined()) torch::autograd::impl::bump_version(*final_state);
}

// Serving is inference only: the pool and out are written in place, which autograd cannot follow.
void fused_recurrent_serving_autograd(KDA_SERVING_ARGS) {
  reject_tangents(kSrv, make_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias));
  if (at::GradMode::is_enabled()) {
    auto req = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
    const char* name = q.requires_grad() ? "q" : k.requires_grad() ? "k" : v.requires_grad() ? "v"
                       : g.requires_grad() ? "g" : beta.requires_grad() ? "beta"
                       : req(initial_state) ? "initial_state" : req(A_log) ? "A_log"
                       : req(dt_bias) ? "dt_bias" : out.requires_grad() ? "out" : nullptr;
    KDA_CHECK_VALUE(name == nullptr, kSrv, "serving calls are inference only (the pool and out "
                      "are written in place), but ", name, " requires grad; run under "
                      "torch::NoGradGuard / torch.no_grad(), or use backend=\"reference\" for "
                      "gradients");
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kda::fused_recurrent_serving", "")
                       .typed<void(KDA_SERVING_ARGS)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(KDA_SERVING_FORWARD);
  }
  bump_written_versions(out, initial_state, inplace_final_state, final_state);
}

// kda::_fused_recurrent_serving_fast: fused_recurrent_kda's serving call (a state pool through
// ssm_state_indices, in-place final states, out=, head-wise beta, per-token snapshots) on CPU
// tensors in one Python -> C++ call, as kda::_fused_recurrent_fast is for the plain call:
// check_serving probed (the rules of torch_kda._checks.check_serving_inputs), refused too under
// grad mode when a tensor requires grad (serving is inference only: Python raises), then the
// serving kernels and the place of the unstable-write warning. Allocates o when `out` is None and
// the final state with output_final_state (not in place). Returns (o, or undefined when `out` was
// given; the fresh final state or undefined; status as kda::_fused_recurrent_fast's).
std::tuple<at::Tensor, at::Tensor, int64_t> fused_recurrent_serving_fast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, std::optional<double> scale,
    const std::optional<at::Tensor>& initial_state,
    const std::optional<at::Tensor>& ssm_state_indices,
    const std::optional<at::Tensor>& num_accepted_tokens, const std::optional<at::Tensor>& out,
    bool output_final_state, int64_t pad_slot_id, bool inplace_final_state,
    bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel,
    bool allow_neg_eigval, std::optional<double> lower_bound, bool state_v_first,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& A_log,
    const std::optional<at::Tensor>& dt_bias) {
  const std::tuple<at::Tensor, at::Tensor, int64_t> refused{at::Tensor(), at::Tensor(), kRefused};
  if (at::GradMode::is_enabled()) {
    auto req = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
    if (req(q) || req(k) || req(v) || req(g) || req(beta) || req(initial_state) || req(A_log) ||
        req(dt_bias) || req(out)) {
      return refused;
    }
  }
  if (!python_only_rules(lower_bound, q, cu_seqlens)) return refused;
  const at::Tensor out_given = out && out->defined() ? *out : at::Tensor();
  Inputs in;
  Config cfg;
  Dims d;
  ServingPlan plan;
  if (!check_serving(q, k, v, g, beta, scale.value_or(1.0), initial_state, ssm_state_indices,
                     num_accepted_tokens, out_given, std::nullopt, pad_slot_id,
                     inplace_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                     use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                     cu_seqlens, A_log, dt_bias, /*probe=*/true, in, cfg, d, plan)) {
    return refused;
  }
  if (!scale) cfg.scale = python_default_scale(d.K);
  // As the plain decode path: o and a fresh final state from the output cache (output_cache.h).
  const at::Tensor o =
      out_given.defined() ? out_given : empty_output({d.B, d.T, d.HV, d.V}, q.options());
  at::Tensor fresh;
  if (output_final_state && !inplace_final_state) {
    const auto opts = q.options().dtype(compute_dtype(q));
    fresh = state_v_first ? empty_output({d.N, d.HV, d.V, d.K}, opts)
                          : empty_output({d.N, d.HV, d.K, d.V}, opts);
    // as check_serving plans it for a caller's final_state (1-D or no indices: not in place)
    std::iota(plan.dst_row.begin(), plan.dst_row.end(), int64_t(0));
  }
  run_serving(in, cfg, d, plan, inplace_final_state ? *in.initial_state : fresh, fresh.defined(), o);
  bump_written_versions(out_given, initial_state, inplace_final_state, std::nullopt);
  int64_t first = -1;
  if (!use_qk_l2norm_in_kernel) {
    first = first_unstable_write(k, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval ? 2.0 : 1.0);
  }
  return {out_given.defined() ? at::Tensor() : o, fresh, first};
}

}  // namespace
}  // namespace detail

// ---- public C++ API ---------------------------------------------------------------------------

namespace {

// scale's default, K ** -0.5 (q's last dimension), after the checks that reading K needs;
// computed as the Python API computes it (1 / sqrt(K) differs from it in the last bit for about
// a fifth of the K, e.g. 8 and 32), so both APIs give the same bits.
double default_scale(const at::Tensor& q, const FusedRecurrentOptions& o, const char* who) {
  KDA_CHECK_TYPE(q.defined(), who, "q must be a defined tensor");
  KDA_CHECK_VALUE(q.dim() == 4, who, "q must be 4-D [B, T, H, K], got shape ", detail::shape_str(q.sizes()));
  return o.scale ? *o.scale : detail::python_default_scale(q.size(3));
}

// Whether the options (or a head-wise beta) ask for the serving path (docs/serving.md).
bool is_serving_call(const at::Tensor& beta, const FusedRecurrentOptions& o) {
  return o.ssm_state_indices || o.num_accepted_tokens || o.inplace_final_state || o.out ||
         (beta.defined() && beta.dim() == 4);
}

using PlainOp = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    double, const std::optional<at::Tensor>&, bool, bool, bool, bool, std::optional<double>, bool,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&);

c10::TypedOperatorHandle<PlainOp> plain_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<PlainOp>();
}

// kda::fused_recurrent or kda::chunk (one schema) through the dispatcher, so that autograd,
// Meta and any other registered kernel apply as they do from Python.
std::tuple<at::Tensor, at::Tensor> call_plain_op(const c10::TypedOperatorHandle<PlainOp>& op,
                                                 const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const at::Tensor& g,
                                                 const at::Tensor& beta, double scale,
                                                 const FusedRecurrentOptions& o) {
  return op.call(q, k, v, g, beta, scale, o.initial_state, o.use_qk_l2norm_in_kernel,
                 o.use_gate_in_kernel, o.use_beta_sigmoid_in_kernel, o.allow_neg_eigval,
                 o.lower_bound, o.state_v_first, o.cu_seqlens, o.A_log, o.dt_bias);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_recurrent(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& g,
                                                   const at::Tensor& beta,
                                                   const FusedRecurrentOptions& o) {
  const double scale = default_scale(q, o, "kda::fused_recurrent: ");
  if (!is_serving_call(beta, o)) {
    static const auto op = plain_op("kda::fused_recurrent");
    return call_plain_op(op, q, k, v, g, beta, scale, o);
  }
  // Serving call: the outputs are allocated here (the op writes into them) and the op checks
  // everything before writing.
  KDA_CHECK(v.defined() && v.dim() == 4, "kda::fused_recurrent: v must be 4-D [B, T, HV, V]");
  // From the output cache, as the Python entry's outputs (no page faults per call).
  const at::Tensor out = o.out ? *o.out : detail::empty_output(v.sizes(), q.options());
  std::optional<at::Tensor> final_state;
  if (!o.inplace_final_state) {
    const int64_t N = o.cu_seqlens ? o.cu_seqlens->size(0) - 1 : q.size(0);
    const auto opts = q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
    const int64_t HV = v.size(2), K = q.size(3), V = v.size(3);
    const std::vector<int64_t> shape = o.state_v_first ? std::vector<int64_t>{N, HV, V, K}
                                                       : std::vector<int64_t>{N, HV, K, V};
    final_state = detail::empty_output(shape, opts);
  }
  static auto sop = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("kda::fused_recurrent_serving", "")
                        .typed<void(KDA_SERVING_ARGS)>();
  sop.call(q, k, v, g, beta, scale, o.initial_state, o.ssm_state_indices, o.num_accepted_tokens,
           out, final_state, o.pad_slot_id, o.inplace_final_state, o.use_qk_l2norm_in_kernel,
           o.use_gate_in_kernel, o.use_beta_sigmoid_in_kernel, o.allow_neg_eigval, o.lower_bound,
           o.state_v_first, o.cu_seqlens, o.A_log, o.dt_bias);
  return {out, o.inplace_final_state ? *o.initial_state : *final_state};
}

std::tuple<at::Tensor, at::Tensor> chunk(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& g,
                                         const at::Tensor& beta, const FusedRecurrentOptions& o) {
  const double scale = default_scale(q, o, "kda::chunk: ");
  // The chunkwise kernels have no state pool: a serving option would otherwise be dropped silently.
  KDA_CHECK_VALUE(!is_serving_call(beta, o), "kda::chunk: the serving options "
                    "(ssm_state_indices, num_accepted_tokens, inplace_final_state, out, a "
                    "head-wise beta [B, T, HV, V]) are not supported by the chunkwise form; use "
                    "kda::fused_recurrent for serving calls (docs/serving.md)");
  KDA_CHECK_VALUE(o.pad_slot_id == -1, "kda::chunk: pad_slot_id is a serving option (it marks "
                    "pad entries of ssm_state_indices) and must stay -1, got ", o.pad_slot_id);
  static const auto op = plain_op("kda::chunk");
  return call_plain_op(op, q, k, v, g, beta, scale, o);
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
  m.def("_fused_recurrent_checked(" KDA_SCHEMA_ARGS
        ") -> (Tensor o, Tensor final_state, int first_unstable)");
  m.def("_fused_recurrent_fast(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "float? scale, Tensor? initial_state=None, bool use_qk_l2norm_in_kernel=False, "
        "bool use_gate_in_kernel=False, bool use_beta_sigmoid_in_kernel=False, "
        "bool allow_neg_eigval=False, float? lower_bound=None, bool state_v_first=False, "
        "Tensor? cu_seqlens=None, Tensor? A_log=None, Tensor? dt_bias=None) "
        "-> (Tensor o, Tensor final_state, int status)");
  m.def("_fused_recurrent_serving_fast(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "float? scale, Tensor(a!)? initial_state, Tensor? ssm_state_indices, "
        "Tensor? num_accepted_tokens, Tensor(b!)? out, bool output_final_state, int pad_slot_id, "
        "bool inplace_final_state, bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, "
        "bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, float? lower_bound, "
        "bool state_v_first, Tensor? cu_seqlens, Tensor? A_log, Tensor? dt_bias) "
        "-> (Tensor o, Tensor final_state, int status)");
  m.def("fused_recurrent_fwd(" KDA_SCHEMA_ARGS
        ") -> (Tensor o, Tensor final_state, Tensor checkpoints)");
  // Serving (docs/serving.md): writes o into `out`, final states into the pool (in place) or into
  // `final_state`, and returns nothing; inference only.
  m.def("fused_recurrent_serving(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
        "Tensor(a!)? initial_state, Tensor? ssm_state_indices, Tensor? num_accepted_tokens, "
        "Tensor(b!) out, Tensor(c!)? final_state, int pad_slot_id=-1, "
        "bool inplace_final_state=False, bool use_qk_l2norm_in_kernel=False, "
        "bool use_gate_in_kernel=False, bool use_beta_sigmoid_in_kernel=False, "
        "bool allow_neg_eigval=False, float? lower_bound=None, bool state_v_first=False, "
        "Tensor? cu_seqlens=None, Tensor? A_log=None, Tensor? dt_bias=None) -> ()");
  // The chunkwise form (csrc/cpu/chunk_fwd.cpp): the same schemas and results (to rounding); the
  // checkpoints are those of fused_recurrent_fwd.
  m.def("chunk(" KDA_SCHEMA_ARGS ") -> (Tensor o, Tensor final_state)");
  m.def("chunk_fwd(" KDA_SCHEMA_ARGS ") -> (Tensor o, Tensor final_state, Tensor checkpoints)");
  m.def("fused_recurrent_bwd(Tensor grad_o, Tensor? grad_final_state, Tensor checkpoints, "
        KDA_SCHEMA_ARGS
        ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, "
        "Tensor d_initial_state, Tensor dA_log, Tensor ddt_bias)");
  // The chunkwise backward (csrc/cpu/chunk_bwd.cpp): the schema and results (to rounding) of
  // fused_recurrent_bwd, from the same checkpoints.
  m.def("chunk_bwd(Tensor grad_o, Tensor? grad_final_state, Tensor checkpoints, "
        KDA_SCHEMA_ARGS
        ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, "
        "Tensor d_initial_state, Tensor dA_log, Tensor ddt_bias)");
}

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("fused_recurrent", &kda::detail::fused_recurrent_cpu);
  m.impl("fused_recurrent_fwd", &kda::detail::fwd_cpu);
  m.impl("fused_recurrent_bwd", &kda::detail::bwd_cpu);
  m.impl("chunk_bwd", &kda::detail::chunk_bwd_cpu_op);
  m.impl("fused_recurrent_serving", &kda::detail::fused_recurrent_serving_cpu);
  m.impl("chunk", &kda::detail::chunk_cpu);
  m.impl("chunk_fwd", &kda::detail::chunk_fwd_cpu_op);
}

TORCH_LIBRARY_IMPL(kda, Meta, m) {
  m.impl("fused_recurrent", &kda::detail::fused_recurrent_meta);
  m.impl("fused_recurrent_fwd", &kda::detail::fwd_meta);
  m.impl("fused_recurrent_bwd", &kda::detail::bwd_meta);
  m.impl("chunk_bwd", &kda::detail::chunk_bwd_meta);
  m.impl("fused_recurrent_serving", &kda::detail::fused_recurrent_serving_meta);
  m.impl("chunk", &kda::detail::chunk_meta);
  m.impl("chunk_fwd", &kda::detail::chunk_fwd_meta);
}

TORCH_LIBRARY_IMPL(kda, CompositeImplicitAutograd, m) {
  m.impl("_fused_recurrent_checked", &kda::detail::fused_recurrent_checked);
  m.impl("_fused_recurrent_fast", &kda::detail::fused_recurrent_fast);
  m.impl("_fused_recurrent_serving_fast", &kda::detail::fused_recurrent_serving_fast);
}

TORCH_LIBRARY_IMPL(kda, Autograd, m) {
  m.impl("fused_recurrent", &kda::detail::fused_recurrent_autograd);
  m.impl("fused_recurrent_bwd", &kda::detail::bwd_autograd);
  m.impl("fused_recurrent_serving", &kda::detail::fused_recurrent_serving_autograd);
  m.impl("chunk", &kda::detail::chunk_autograd);
  m.impl("chunk_bwd", &kda::detail::chunk_bwd_autograd);
}
