// Internal interface between the op layer (csrc/ops.cpp: schemas, checks, Meta, autograd) and the
// CPU drivers (csrc/cpu/recurrent_fwd.cpp, recurrent_bwd.cpp, chunk_bwd.cpp, bwd_common.cpp).
// Not installed.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu/error_message.h"
#include "cpu/kernels/recurrent_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kda {
namespace detail {

// The inputs of kda::fused_recurrent / fused_recurrent_fwd / fused_recurrent_bwd, as passed.
struct Inputs {
  at::Tensor q, k, v, g, beta;
  std::optional<at::Tensor> initial_state, cu_seqlens, A_log, dt_bias;
};

struct Config {
  double scale = 1.0;
  bool use_qk_l2norm_in_kernel = false;
  bool use_gate_in_kernel = false;
  bool use_beta_sigmoid_in_kernel = false;
  bool allow_neg_eigval = false;
  std::optional<double> lower_bound;
  bool state_v_first = false;
  // The prefix of every error message, naming the op that was called ("kda::chunk: ", ...; set
  // by each op entry point in ops.cpp), so a shared check never names another op.
  const char* op = "kda: ";
};

// Sizes established by check_inputs.
struct Dims {
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int64_t N = 0;         // number of sequences
  bool varlen = false;
  int64_t n_slots = 0;   // checkpoint slots: B * ceil(T / kChunk)
};

// Validates everything the kernels index with (ops.cpp). With check_values, also reads
// cu_seqlens (CPU kernels; the Meta kernels cannot).
Dims check_inputs(const Inputs& in, const Config& cfg, bool check_values);
// The same rules; with probe, a failed rule returns false instead of raising (no message is built).
// Fills d when it returns true.
bool check_inputs(const Inputs& in, const Config& cfg, bool check_values, bool probe, Dims& d);

// Dtype of the arithmetic and of the state: fp64 for fp64 q, else fp32.
inline at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Per-token pre-processing (l2 norm, scale, gate, decay, sigmoid beta) into contiguous buffers of
// the compute dtype. Shared by the forward and the backward (which recomputes it).
struct Prepared {
  // Kernel inputs, head-major and contiguous:
  at::Tensor q;       // [H, BT, K]   scale * qhat
  at::Tensor k_hm;    // [H, BT, K]   khat
  at::Tensor a;       // [HV, BT, K]  exp(g)
  at::Tensor beta_hm; // [HV, BT]     write strength
  at::Tensor v;       // [BT, HV, V]
  // For the backward's chain rule (csrc/cpu/recurrent_bwd.cpp, chain_rule_tokens), token-major:
  at::Tensor q_in;    // [B, T, H, K]  raw q in the compute dtype (contiguous)
  at::Tensor q_rnorm; // [BT, H, 1]   1 / sqrt(sum q^2 + 1e-6)   (only with l2 norm)
  at::Tensor k;       // [BT, H, K]   khat (a view of k_hm)
  at::Tensor k_rnorm; // [BT, H, 1]
  at::Tensor g_in;    // [B, T, HV, K] raw gate input / log decay in the compute dtype (contiguous)
  at::Tensor g;       // [BT, HV, K]  log decay (the gate's output with the gate in the op)
  at::Tensor gate_s;  // [BT, HV, K]  sigmoid used by the gate (gate in op)
  at::Tensor beta;    // [BT, HV]     write strength (a view of beta_hm)
};
// (csrc/cpu/kernels prep_tokens, one parallel pass.) Without for_backward only the kernel inputs
// are made; with it also the values the chain rule needs (qhat, rnorms, g, gate_s, z).
Prepared preprocess(const Inputs& in, const Config& cfg, const Dims& d, bool for_backward);

// The first offending indices of the pre-processing pass reported by any thread (-1: none): the
// smallest wins, so the message does not depend on the thread count.
struct FirstBad {
  std::atomic<int64_t> g{-1}, beta{-1};
  static void keep(std::atomic<int64_t>& first, int64_t idx) {
    if (idx < 0) return;
    int64_t cur = first.load();
    while ((cur < 0 || idx < cur) && !first.compare_exchange_weak(cur, idx)) {
    }
  }
  void add(const kernels::PrepReport& r) {
    keep(g, r.bad_g);
    keep(beta, r.bad_beta);
  }
};
// Raises what the pre-processing pass found (docs/bad_inputs.md, "Values outside the domain"),
// with the value read from the caller's tensor.
// cfg.op names the op in the message.
void report_domain(const FirstBad& bad, const Inputs& in, const Config& cfg, const Dims& d);

// The first flat index f of beta ([B, T, HV] or head-wise [B, T, HV, V], CPU) where
// beta'[f] * ||k[b, t, hv // (HV / H)]||^2 > 2 (beta' = beta_mult * sigmoid(beta) with
// beta_sigmoid), or -1: the place of the warning of docs/bad_inputs.md row 48
// (csrc/cpu/unstable_writes.cpp, the op kda::_unstable_write).
int64_t first_unstable_write(const at::Tensor& k, const at::Tensor& beta, bool beta_sigmoid,
                             double beta_mult);

// The pre-processing arguments that depend on cfg and d only (float and double); BT = stride,
// the token stride of the outputs. The caller sets the pointers.
template <typename T>
kernels::PrepArgs<T> make_prep_args(const Config& cfg, const Dims& d, int64_t stride);
// Points P's q, k, g and beta at the given inputs through the pointer their storage in P names:
// T (kCompute) or 16-bit; set P's storages first.
template <typename T>
void set_prep_inputs(kernels::PrepArgs<T>& P, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& g, const at::Tensor& beta);
// How the pre-processing pass reads an input of dtype st in compute dtype ct: as it is
// (kCompute), bf16 / fp16 widened in registers (ct = float), or nullopt (converted first).
std::optional<kernels::Storage> storage_of(at::ScalarType st, at::ScalarType ct);

// The rows of one token block of every sequence (forward and backward token blocks): sequence n's
// tokens [rs[n], rs[n] + loc[n + 1] - loc[n]) sit at rows [loc[n], loc[n + 1]) of the block
// buffers, token t at row t - shift[n].
struct BlockRows {
  explicit BlockRows(int64_t n) : rs(n), loc(n + 1), shift(n) {}
  std::vector<int64_t> rs, loc, shift;
};
// Copies the block's rows of every sequence from src [B*T, ...] (any dtype) into dst [rows, ...]
// (copy_: a conversion into the block buffer's dtype).
void copy_block_rows(const at::Tensor& dst, const at::Tensor& src, const BlockRows& rows);
// Runs f(n, b, e) over the used rows of a block in parallel, for every run of rows [b, e) of one
// sequence n; a few rows per task, so that every thread gets some of a short block.
template <typename F>
void parallel_block_rows(const BlockRows& rows, const F& f) {
  const int64_t N = static_cast<int64_t>(rows.rs.size());
  const int64_t used = rows.loc[N];
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(16, used / (4 * threads)));
  at::parallel_for(0, used, grain, [&](int64_t b, int64_t e) {
    int64_t n = static_cast<int64_t>(std::upper_bound(rows.loc.begin(), rows.loc.begin() + N, b) -
                                     rows.loc.begin()) - 1;
    while (b < e) {
      while (rows.loc[n + 1] <= b) ++n;
      const int64_t stop = std::min(e, rows.loc[n + 1]);
      f(n, b, stop);
      b = stop;
    }
  });
}
// Pre-processes the rows of a token block (kernels' prep_tokens, in parallel over rows) into P's
// outputs at the rows' local index; the inputs are read at the local index too with
// shifted_inputs (block buffers), else at the global token.
template <typename T>
void prep_block(const kernels::PrepArgs<T>& P, const BlockRows& rows, bool shifted_inputs,
                FirstBad& bad);
// The pre-processing kernel (prep_tokens) of compute type T for this CPU (kernels::table()).
template <typename T>
auto prep_kernel() {
  if constexpr (std::is_same_v<T, float>) {
    return kernels::table().prep_f32;
  } else {
    return kernels::table().prep_f64;
  }
}

// Large buffers written once per call (outputs, checkpoints, gradient partials): on Linux, asks
// for 2 MB pages (transparent huge pages "madvise" mode), ~500x fewer page faults than 4 KB pages.
// Advice only; call before the first touch.
void advise_huge_pages(const at::Tensor& t);

// Sequence layout for the kernels (int64 vectors owned by the caller).
struct Sequences {
  std::vector<int64_t> start, end, origin, slot_base;
};
Sequences make_sequences(const Inputs& in, const Dims& d);
kernels::SeqInfo seq_info(const Sequences& s);

// Initial state in [N, HV, K, V] layout and compute dtype (undefined if none).
at::Tensor state_kv(const std::optional<at::Tensor>& s, const Config& cfg, at::ScalarType ct);

// CPU forward: (o [B,T,HV,V] in q's dtype, final_state (compute dtype, caller's layout),
// checkpoints [n_slots, HV, K, V] compute dtype, or an empty tensor without with_checkpoints).
std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd_cpu(const Inputs& in,
                                                                  const Config& cfg,
                                                                  bool with_checkpoints);

// The frame both CPU forwards share (csrc/cpu/recurrent_fwd.cpp): checks, outputs allocated once
// (2 MB page advice), the runner of the compute dtype filling o, the final state ht
// ([N, HV, K, V]) and the checkpoints, then the caller's state layout.
template <typename T>
using ForwardRunner = void (*)(const Inputs& in, const Config& cfg, const Dims& d,
                               const Sequences& seqs, const at::Tensor& h0, const at::Tensor& o,
                               const at::Tensor& ht, const at::Tensor& ckpt);
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_forward(const Inputs& in, const Config& cfg,
                                                           bool with_checkpoints,
                                                           ForwardRunner<float> run_float,
                                                           ForwardRunner<double> run_double);

// The forward in token blocks (csrc/cpu/recurrent_fwd.cpp): block j of every sequence
// (tokens [rs[n], re[n])) is converted and pre-processed into a small reused workspace (no
// full-size pre-processed arrays; BlockKernel::kChunk pre-processes its own rows instead), then
// run_block(A, prep, rs, re, j) runs the block: A points at the
// block's pre-processed rows (sequence n's token t at row t - A.seqs.shift[n]; v and o at
// t - A.seqs.vo_shift[n] when those are non-null), A.ht holds each sequence's running state
// between blocks (a block with rs[n] == seqs.start[n] starts from h0 instead), and the block's
// o rows written to A.o are converted into o afterwards; `kernel` sizes the blocks and decides
// which rows they hold. An empty sequence appears in block 0 with rs == re.
// The kernel that run_fwd_blocked's blocks feed (recurrent_fwd.cpp, plan_blocks, says why the sizes):
enum class BlockKernel {
  kRecurrent,  // 8 MB of rows, 2 MB more per thread beyond 4 threads (its results do not depend
               // on where blocks start); the rows include a * khat (A.ak), its next token's read
  kChunk,      // 2 MB of rows, at least 4 chunks of each sequence: the shapes only (the chunk
               // forward's last bits depend on where blocks cut packed sequences); the kernel
               // pre-processes its own rows (BlockPrep): A.q, A.k, A.a, A.ak, A.beta are null,
               // and so is A.v when the kernel widens 16-bit v itself (prep.P.v16 set)
};
// The pre-processing pass's arguments for a kernel that pre-processes its own rows
// (BlockKernel::kChunk): P reads the inputs (the block's converted rows, token t at row
// t - shift[n], when shifted_inputs; else the whole arrays at t) and has P.v16 set when the
// kernel is to widen 16-bit v; its outputs and shifts are the kernel's to set. Values outside
// the domain are the kernel's to report (report_domain) before the block's runner returns.
template <typename T>
struct BlockPrep {
  kernels::PrepArgs<T> P;
  bool shifted_inputs = false;
};
template <typename T>
using BlockRunner =
    std::function<void(const kernels::FwdArgs<T>& A, const BlockPrep<T>& prep,
                       const std::vector<int64_t>& rs, const std::vector<int64_t>& re, int64_t j)>;
template <typename T>
void run_fwd_blocked(const Inputs& in, const Config& cfg, const Dims& d, const Sequences& seqs,
                     const at::Tensor& h0, const at::Tensor& o, const at::Tensor& ht,
                     const at::Tensor& ckpt, BlockKernel kernel,
                     const BlockRunner<T>& run_block);

// CPU chunkwise forward (csrc/cpu/chunk_fwd.cpp): the contract of recurrent_fwd_cpu (the same
// outputs and checkpoints, equal to rounding), computed chunk by chunk with matrix products.
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_fwd_cpu(const Inputs& in, const Config& cfg,
                                                              bool with_checkpoints);

// Arguments of the chain rule (csrc/cpu/bwd_common.cpp, chain_rule_tokens).
template <typename T>
struct ChainArgs {
  int64_t BT = 0, H = 0, HV = 0, K = 0, groups = 1;
  const T *dq_p = nullptr, *dk_p = nullptr, *dg_p = nullptr, *db_p = nullptr;  // [P, BT, HV, *]
  const T* q = nullptr;       // [BT, H, K] raw q (compute dtype)
  const T* q_rnorm = nullptr; // [BT, H] or null (no l2 norm)
  const T* k_hm = nullptr;    // [H, BT, K] khat
  const T* k_rnorm = nullptr; // [BT, H] or null
  const T* g = nullptr;       // [BT, HV, K] log decay (softplus gate) or raw gate input (bounded)
  const T* gate_s = nullptr;  // [BT, HV, K] sigmoid of the gate, or null (no gate in the op)
  const T* expA = nullptr;    // [HV] exp(A_log) or null
  const T* bias = nullptr;    // [HV * K] dt_bias or null
  const T* beta = nullptr;    // [HV, BT] write strength (after the sigmoid)
  bool softplus = false, beta_sigmoid = false;
  T scale = 1, lower_bound = 0, beta_c = 1;
  T *dq = nullptr, *dk = nullptr, *dg = nullptr, *dbeta = nullptr, *dA_rows = nullptr;
};

// The common start of both CPU backwards (csrc/cpu/bwd_common.cpp): the checked sizes, the
// recomputed pre-processing (for_backward), the sequences, and in the compute dtype the initial
// state and the gradient of the final state ([N, HV, K, V], undefined if absent), grad_o
// [BT, HV, V] and the checkpoints [n_slots, HV, K, V] (all contiguous).
struct BwdSetup {
  Dims d;
  Prepared p;
  Sequences seqs;
  at::Tensor h0, dht, dout, ckpt;
};
// Without with_prepared (the recurrent backward, which works block by block), p stays empty and
// grad_o keeps its dtype (contiguous; the blocks widen their rows).
BwdSetup backward_setup(const at::Tensor& d_o, const std::optional<at::Tensor>& d_final_state,
                        const at::Tensor& checkpoints, const Inputs& in, const Config& cfg,
                        bool with_prepared = true);

// What a backward kernel produces (compute dtype): gradients w.r.t. the pre-processed q
// (scale * qhat), khat, the log decay g and beta per VALUE head as `groups` partial sums
// ([groups, BT, HV, K] / [groups, BT, HV], summed in order p = 0, 1, ...), and the final dv
// [BT, HV, V] and d_initial_state [N, HV, K, V].
struct KernelGrads {
  int64_t groups = 1;
  at::Tensor dq, dk, dg, dbeta, dv, dh0;
};
// The chain rule through the pre-processing (l2 norm, scale, grouped heads, gates with their
// saturation limits, sigmoid beta; docs/math.md "Backward") and the op's outputs in the
// inputs' dtypes and shapes, as recurrent_bwd_cpu returns them.
std::vector<at::Tensor> backward_finish(const BwdSetup& s, const KernelGrads& kg,
                                        const Inputs& in, const Config& cfg);

// The gradients w.r.t. the op's inputs before the last step, in the compute dtype, token-major:
// dq, dk [BT, H, K], dv [BT, HV, V], dg [BT, HV, K], dbeta [BT, HV], d_initial_state dh0
// [N, HV, K, V], and the per-token rows of dA_log [BT, HV] (undefined without A_log and the gate).
struct InputGrads {
  at::Tensor dq, dk, dv, dg, dbeta, dh0, dA_rows;
};
// Fresh (uninitialised) InputGrads, 2 MB page advice on the large ones.
InputGrads empty_input_grads(const Dims& d, const Inputs& in, const Config& cfg);
// The sums over tokens (dA_log, dt_bias, in token order) and the op's outputs in the inputs'
// dtypes and shapes, as recurrent_bwd_cpu returns them.
std::vector<at::Tensor> backward_outputs(const InputGrads& g, const Dims& d, const Inputs& in,
                                         const Config& cfg);

// The chain rule (csrc/cpu/bwd_common.cpp chain_rule_tokens) over the rows of one token block of
// the recurrent backward: C's block arrays (partials, rnorms, khat, gate values, beta; BT = the
// block's row stride) are read at the row, G's arrays at the global token (row + shift[n]); q
// or g at the row too when q_in_block / g_in_block (block buffers of widened 16-bit inputs).
template <typename T>
struct ChainGlobals {
  const T* q = nullptr;  // [B*T, H, K] raw q (compute dtype), or null (no l2 norm)
  const T* g = nullptr;  // [B*T, HV, K] raw gate input (bounded gate), or null: C.g is used
  bool q_in_block = false, g_in_block = false;
  T *dq = nullptr, *dk = nullptr, *dg = nullptr, *dbeta = nullptr, *dA_rows = nullptr;
};
template <typename T>
void chain_rule_rows(const ChainArgs<T>& C, const BlockRows& rows, const ChainGlobals<T>& G);

// CPU backward: {dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias}, each in its input's
// dtype and shape; the last three are empty tensors when the input is absent / unused.
std::vector<at::Tensor> recurrent_bwd_cpu(const at::Tensor& d_o,
                                          const std::optional<at::Tensor>& d_final_state,
                                          const at::Tensor& checkpoints, const Inputs& in,
                                          const Config& cfg);

// CPU chunkwise backward (csrc/cpu/chunk_bwd.cpp, docs/math.md "Chunkwise backward"): the
// contract of recurrent_bwd_cpu (same arguments, checkpoints and outputs, equal to rounding).
std::vector<at::Tensor> chunk_bwd_cpu(const at::Tensor& d_o,
                                      const std::optional<at::Tensor>& d_final_state,
                                      const at::Tensor& checkpoints, const Inputs& in,
                                      const Config& cfg);

}  // namespace detail
}  // namespace kda
