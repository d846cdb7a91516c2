// The kda ops but serving: schemas, CPU / Meta kernels, the C++ autograd, the functional API's
// one-call path from Python (kda::_fused_recurrent_fast) and the public C++ API (kda/kda.h). Their
// argument checks are in op_checks.cpp, the serving op (a state pool) in serving_op.cpp.
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
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "cpu/env_knob.h"
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu/output_cache.h"
#include "cpu/serving.h"
#include "op_checks.h"

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
              "[B * ceil(T / 64), HV, K, V] (from fused_recurrent_fwd or chunk_fwd)");
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
  check_same_device(op, q, {{"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta},
                           {"initial_state", defined_ptr(initial_state)},
                           {"cu_seqlens", defined_ptr(cu_seqlens)}, {"A_log", defined_ptr(A_log)},
                           {"dt_bias", defined_ptr(dt_bias)}});
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
  // v's sizes give the outputs' before the op runs: its two rules first, in the op's words.
  KDA_CHECK_TYPE(v.defined(), "kda::fused_recurrent: q, k, v, g and beta must be defined tensors");
  KDA_CHECK_VALUE(v.dim() == 4, "kda::fused_recurrent: v must be 4-D [B, T, HV, V], got shape ",
                  detail::shape_str(v.sizes()));
  // From the output cache, as the Python entry's outputs (no page faults per call).
  const at::Tensor out = o.out ? *o.out : detail::empty_output(v.sizes(), q.options());
  std::optional<at::Tensor> final_state;
  if (!o.inplace_final_state) {
    // N from cu_seqlens only where it has the shape the op checks (1-D, at least one offset):
    // else the op's cu_seqlens check raises, with its words, before it reads final_state's shape.
    const bool packed = o.cu_seqlens && o.cu_seqlens->defined();
    const bool cu_1d = packed && o.cu_seqlens->dim() == 1 && o.cu_seqlens->size(0) >= 1;
    const int64_t N = !packed ? q.size(0) : cu_1d ? o.cu_seqlens->size(0) - 1 : 0;
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

// The serving ops are registered in csrc/serving_op.cpp, the output cache's in
// csrc/cpu/output_cache.cpp (TORCH_LIBRARY_FRAGMENT).
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
  m.def("fused_recurrent_fwd(" KDA_SCHEMA_ARGS
        ") -> (Tensor o, Tensor final_state, Tensor checkpoints)");
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
  m.impl("chunk", &kda::detail::chunk_cpu);
  m.impl("chunk_fwd", &kda::detail::chunk_fwd_cpu_op);
}

TORCH_LIBRARY_IMPL(kda, Meta, m) {
  m.impl("fused_recurrent", &kda::detail::fused_recurrent_meta);
  m.impl("fused_recurrent_fwd", &kda::detail::fwd_meta);
  m.impl("fused_recurrent_bwd", &kda::detail::bwd_meta);
  m.impl("chunk_bwd", &kda::detail::chunk_bwd_meta);
  m.impl("chunk", &kda::detail::chunk_meta);
  m.impl("chunk_fwd", &kda::detail::chunk_fwd_meta);
}

TORCH_LIBRARY_IMPL(kda, CompositeImplicitAutograd, m) {
  m.impl("_fused_recurrent_checked", &kda::detail::fused_recurrent_checked);
  m.impl("_fused_recurrent_fast", &kda::detail::fused_recurrent_fast);
}

TORCH_LIBRARY_IMPL(kda, Autograd, m) {
  m.impl("fused_recurrent", &kda::detail::fused_recurrent_autograd);
  m.impl("fused_recurrent_bwd", &kda::detail::bwd_autograd);
  m.impl("chunk", &kda::detail::chunk_autograd);
  m.impl("chunk_bwd", &kda::detail::chunk_bwd_autograd);
}
