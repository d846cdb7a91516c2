// torch-kda: public C++ API of the native Kimi Delta Attention operator.
//
// Link the CMake target TorchKDA::kda (find_package(TorchKDA)). Loading the library registers the
// ops torch.ops.kda.fused_recurrent and torch.ops.kda.chunk (+ the internal _fwd / _bwd ops) with
// CPU, Meta and Autograd kernels; kda::fused_recurrent() and kda::chunk() below call the
// registered ops, so gradients flow through them in a pure C++ program (tensor.backward()).
//
// Math: docs/math.md in the repository. Per sequence and value head, t = 1..T:
//   S'_t = Diag(exp(g_t)) S_{t-1};  u_t = beta_t (v_t - S'_t^T k_t);  S_t = S'_t + k_t u_t^T;
//   o_t = S_t^T (scale * q_t)
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace kda {

// Options of fused_recurrent (and of chunk, without the serving fields); the defaults give the
// plain recurrence.
struct FusedRecurrentOptions {
  // Multiplies q; default K ** -0.5.
  std::optional<double> scale;
  // S_0: [N, HV, K, V] (or [N, HV, V, K] with state_v_first), any floating dtype; zeros if unset.
  std::optional<at::Tensor> initial_state;
  // Packed variable-length sequences: [N + 1] int64 or int32, 0 = c_0 <= c_1 <= ... <= c_N = T,
  // with B == 1. Unset: N = B and each batch row is one sequence.
  std::optional<at::Tensor> cu_seqlens;
  // q, k <- x / sqrt(sum x^2 + 1e-6) over K before use.
  bool use_qk_l2norm_in_kernel = false;
  // g is the raw gate input: with lower_bound unset, g <- -exp(A_log) * softplus(g + dt_bias)
  // (A_log required); with lower_bound (< 0), g <- lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
  // (A_log optional: without it, lower_bound * sigmoid(g + dt_bias)).
  bool use_gate_in_kernel = false;
  std::optional<double> lower_bound;
  std::optional<at::Tensor> A_log;    // [HV]
  std::optional<at::Tensor> dt_bias;  // [HV * K] or [HV, K]
  // beta is a logit: beta <- sigmoid(beta) (times 2 with allow_neg_eigval, which requires it).
  bool use_beta_sigmoid_in_kernel = false;
  bool allow_neg_eigval = false;
  // Layout of initial_state and of the returned final state: [.., V, K] instead of [.., K, V].
  bool state_v_first = false;

  // ---- serving (docs/serving.md; FLA's fused_recurrent_kda_fwd names). Inference only. ----
  // Slot indices into initial_state, which is then a state pool [num_slots, HV, K, V] (or
  // [num_slots, HV, V, K]) of float32 or bfloat16: [N] int64/int32 (sequence n starts from slot
  // indices[n]; in place, its final state is written there) or [N, T_max] (speculative decoding,
  // needs inplace_final_state: starts from slot indices[n, num_accepted_tokens[n] - 1], the state
  // after its token t is written to slot indices[n, t]).
  std::optional<at::Tensor> ssm_state_indices;
  std::optional<at::Tensor> num_accepted_tokens;  // [N], values in [1, T_n]; default all 1
  // Write the final states into initial_state in place (returned as the final state); slots not
  // named are left bitwise unchanged.
  bool inplace_final_state = false;
  // Preallocated o [B, T, HV, V] (q's dtype), written and returned.
  std::optional<at::Tensor> out;
  // An index equal to it marks a pad sequence: zero output, nothing read or written.
  int64_t pad_slot_id = -1;
  // beta may also be head-wise [B, T, HV, V] (serving path, forward only).
};

// Fused recurrent KDA on CPU tensors.
//   q, k:  [B, T, H, K]      v: [B, T, HV, V] (HV % H == 0; value head hv reads q/k head
//          hv / (HV / H)), q/k/v of one dtype in {float64, float32, bfloat16, float16}
//   g:     [B, T, HV, K]     log decay (<= 0), or the raw gate input with use_gate_in_kernel
//   beta:  [B, T, HV]        write strength, or logits with use_beta_sigmoid_in_kernel
// Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] (or [N, HV, V, K]) in float32,
// float64 when q is float64). Arithmetic in float32 (float64 for float64 q). Inputs may be
// non-contiguous and are never modified; T = 0 and empty sequences are valid (the state passes
// through). Gradients (first order) flow to q, k, v, g, beta, initial_state, A_log, dt_bias and
// from both outputs; a second-order gradient throws. Results are bitwise identical for any
// number of threads (at::set_num_threads).
// Errors: any inconsistent size, dtype, device or cu_seqlens value throws c10::Error naming the
// argument, the expected and the actual value.
std::tuple<at::Tensor, at::Tensor> fused_recurrent(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& g,
                                                   const at::Tensor& beta,
                                                   const FusedRecurrentOptions& options = {});

// Chunkwise KDA on CPU tensors: the same recurrence, arguments, results, gradients and errors as
// fused_recurrent() above (equal to rounding, not bitwise), computed in the chunkwise form of
// docs/math.md ("Chunkwise form"): chunks of 64 tokens, each a few small matrix products (the
// intra-chunk triangular solve, then one state update per chunk) instead of one rank-1 update per
// token; faster for long sequences, while fused_recurrent() is the one for decode (T of 1).
// Shapes and dtypes: as fused_recurrent(); T need not be a multiple of 64 (the last chunk of each
// sequence is shorter). Its backward is the chunkwise backward (kda::chunk_bwd). Bitwise identical
// for any number of threads. For bf16 / fp16 inputs on CPUs with AMX the state products take
// bf16 operands with fp32 accumulation (environment TORCH_KDA_CHUNK_PRODUCTS=auto|fp32|bf16, read
// at each call; docs/math.md "Chunkwise form").
// Errors: those of fused_recurrent(); an unknown TORCH_KDA_CHUNK_PRODUCTS value; the serving fields of FusedRecurrentOptions
// (ssm_state_indices, num_accepted_tokens, inplace_final_state, out, pad_slot_id != -1) and a
// head-wise beta [B, T, HV, V] throw c10::ValueError (the serving path is fused_recurrent's).
std::tuple<at::Tensor, at::Tensor> chunk(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& g,
                                         const at::Tensor& beta,
                                         const FusedRecurrentOptions& options = {});

// Name of the instruction set the CPU kernels use on this machine ("avx512", "avx2", "generic").
const char* cpu_kernel_isa();

}  // namespace kda
