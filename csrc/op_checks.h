// The argument checks and argument lists every kda op shares: the plain, chunkwise and backward
// ops (csrc/ops.cpp) and the serving op (csrc/serving_op.cpp). One set of rules, with the words
// of the Python checks (src/torch_kda/_checks.py; docs/bad_inputs.md). Not installed.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "cpu/error_message.h"
#include "cpu/kda_cpu.h"

namespace kda {
namespace detail {

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

bool is_float_dtype(at::ScalarType t);

// Each returns true when its rule holds; else raises with the op's words, or returns false when
// probing.
bool check_float(const char* op, const at::Tensor& t, const char* name, bool probe = false);
bool check_device(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q,
                  bool probe = false);
bool check_shape(const char* op, const at::Tensor& t, const char* name, at::IntArrayRef expected,
                 const char* what, bool probe = false);

// An op's tensor argument with its name, for the messages; null for an absent optional one.
struct NamedTensor {
  const char* name;
  const at::Tensor* tensor;
};

// A defined tensor's address, else null: for lists of the optional arguments.
inline const at::Tensor* defined_ptr(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? &*t : nullptr;
}

// Raises unless every tensor of `others` (null entries skipped) is on q's device, naming the
// first that is not. The Meta kernels' check: one meta tensor among CPU tensors sends a call to
// them (Meta has the higher dispatch priority).
void check_same_device(const char* op, const at::Tensor& q,
                       std::initializer_list<NamedTensor> others);

// Whether x stays finite in the compute dtype of the inputs q (compute_dtype: float64 for
// float64, float32 for the others): a scale of 1e300 is a finite double but infinite in float32,
// where it made every output NaN.
bool finite_in_compute(double x, const at::Tensor& q);

// The op's tensors (an undefined tensor given for an optional argument, e.g. from the autograd
// context, becomes None) and flags.
Inputs make_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta,
                   const std::optional<at::Tensor>& initial_state,
                   const std::optional<at::Tensor>& cu_seqlens,
                   const std::optional<at::Tensor>& A_log,
                   const std::optional<at::Tensor>& dt_bias);
Config make_config(const char* op, double scale, bool l2, bool gate, bool sig, bool neg,
                   std::optional<double> lower_bound, bool state_v_first);

// Whether an input carries a forward-mode tangent (torch.autograd.forward_ad, torch.func.jvp),
// and the error that refuses one (no op has a forward-mode formula).
bool any_tangent(const Inputs& in);
void reject_tangents(const char* op, const Inputs& in);

// The entry of every CPU kernel (forward, backward, serving ops): CPU tensors, no tangents.
void check_cpu(const char* op, const Inputs& in);

// The status of kda::_fused_recurrent_fast and kda::_fused_recurrent_serving_fast when their probe
// of the arguments failed: nothing ran, and the Python checks then raise with their words.
constexpr int64_t kRefused = -2;

// The Python checks' rules beyond the ops' (check_kda_inputs, check_cu_seqlens): a lower_bound
// is a finite negative number even without the in-op gate (where it is only a promise, see
// fused_recurrent_kda), and cu_seqlens names at least one sequence.
bool python_only_rules(std::optional<double> lower_bound, const at::Tensor& q,
                       const std::optional<at::Tensor>& cu_seqlens);

// scale=None: K ** -0.5 as Python computes it (float pow), so that both paths run one scale.
double python_default_scale(int64_t K);

// The plain ops' arguments (kda::fused_recurrent's schema, KDA_SCHEMA_ARGS in ops.cpp), as
// parameters, as Inputs / Config, and passed on.
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

// The serving op's arguments (kda::fused_recurrent_serving's schema, serving_op.cpp).
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

}  // namespace detail
}  // namespace kda
