// Internal interface between the op layer (csrc/ops.cpp, op_checks.cpp, serving_op.cpp) and the
// CPU drivers (csrc/cpu/recurrent_fwd.cpp, recurrent_bwd.cpp, chunk_bwd.cpp, bwd_common.cpp).
// Not installed.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>

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
  // by each op entry point: ops.cpp, serving_op.cpp), so a shared check never names another op.
  const char* op = "kda: ";
};

// Sizes established by check_inputs.
struct Dims {
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int64_t N = 0;         // number of sequences
  bool varlen = false;
  int64_t n_slots = 0;   // checkpoint slots: B * ceil(T / kChunk)
};

// Validates everything the kernels index with (op_checks.cpp). With check_values, also reads
// cu_seqlens (CPU kernels; the Meta kernels cannot).
Dims check_inputs(const Inputs& in, const Config& cfg, bool check_values);
// The same rules; with probe, a failed rule returns false instead of raising (no message is built).
// Fills d when it returns true.
bool check_inputs(const Inputs& in, const Config& cfg, bool check_values, bool probe, Dims& d);

// Dtype of the arithmetic and of the state: fp64 for fp64 q, else fp32.
inline at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

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

// The gate's parameters in the compute dtype ct, contiguous: exp(A_log) and A_log [HV] and
// dt_bias [HV * K]; undefined where absent or without the gate in the op.
struct GateParams {
  at::Tensor expA, A_log, bias;
};
GateParams gate_params(const Inputs& in, const Config& cfg, at::ScalarType ct);
// The pre-processing pass's arguments for outputs of token stride BT = stride: those of cfg and
// d, the inputs q, k, g and beta each read as its dtype says (T, or 16-bit widened in registers:
// storage_of; the caller converts any other dtype first) and the gate's parameters (which the
// caller keeps alive). The caller sets the outputs.
template <typename T>
kernels::PrepArgs<T> block_prep_args(const Config& cfg, const Dims& d, int64_t stride,
                                     const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& g, const at::Tensor& beta,
                                     const GateParams& gate);
// Points a kernel's pre-processed inputs at P's outputs (the token block's rows, stride P.BT) and
// sets its sizes from d; the caller sets the rest (sequences, v, states, outputs).
template <typename T>
void point_at_block_rows(kernels::RecurrenceInputs<T>& A, const kernels::PrepArgs<T>& P,
                         const Dims& d) {
  A.BT = P.BT;
  A.H = d.H;
  A.HV = d.HV;
  A.K = d.K;
  A.V = d.V;
  A.q = P.q_out;
  A.k = P.k_out;
  A.a = P.a_out;
  A.ak = P.ak_out;
  A.beta = P.beta_out;
}
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
// Runs f(n, b', e') over the rows [b, e) of a block (which may span sequences), for every run
// of rows [b', e') of one sequence n.
template <typename F>
void for_block_rows(const BlockRows& rows, int64_t b, int64_t e, const F& f) {
  const int64_t N = static_cast<int64_t>(rows.rs.size());
  int64_t n = static_cast<int64_t>(std::upper_bound(rows.loc.begin(), rows.loc.begin() + N, b) -
                                   rows.loc.begin()) - 1;
  while (b < e) {
    while (rows.loc[n + 1] <= b) ++n;
    const int64_t stop = std::min(e, rows.loc[n + 1]);
    f(n, b, stop);
    b = stop;
  }
}
// The rows per task of a pass over a block's rows (pre-processing, chain rule): a few,
// so that every thread gets some of a short block.
inline int64_t block_rows_grain(const BlockRows& rows) {
  const int64_t used = rows.loc.back();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(1, std::min<int64_t>(16, used / (4 * threads)));
}
// A pass over a block's rows as side work (SideWork): tasks 0 .. count - 1 of block_rows_grain
// rows each, task i the rows [begin(i), end(i)). Default: no rows, no tasks.
struct RowTasks {
  RowTasks() = default;
  explicit RowTasks(const BlockRows& rows)
      : used(rows.loc.back()), grain(block_rows_grain(rows)), count((used + grain - 1) / grain) {}
  int64_t begin(int64_t i) const { return i * grain; }
  int64_t end(int64_t i) const { return std::min(used, (i + 1) * grain); }
  int64_t used = 0, grain = 1, count = 0;
};
// Pre-processes the rows of a token block (kernels' prep_tokens, in parallel over rows) into P's
// outputs at the rows' local index; the inputs are read at the local index too with
// shifted_inputs (block buffers), else at the global token.
template <typename T>
void prep_block(const kernels::PrepArgs<T>& P, const BlockRows& rows, bool shifted_inputs,
                FirstBad& bad);
// prep_block's work on the block's rows [b, e) alone, on the calling thread.
template <typename T>
void prep_rows(const kernels::PrepArgs<T>& P, const BlockRows& rows, bool shifted_inputs,
               int64_t b, int64_t e, FirstBad& bad);
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

// Per-sequence lists of a call, stored inline up to 8 sequences: a decode call builds about ten of
// them, and their heap blocks were a tenth of a one-token call's time (docs/benchmarks.md "Short
// calls").
using PerSequence = c10::SmallVector<int64_t, 8>;

// Sequence layout for the kernels (owned by the caller).
struct Sequences {
  PerSequence start, end, origin, slot_base;
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
// run_block(A, prep, rs, re, j, n_blocks, side) runs block j of n_blocks (and side, the
// pre-processing of block j + 1 into a second workspace, beside it): A points at the
// block's pre-processed rows (sequence n's token t at row t - A.seqs.shift[n]; v and o at
// t - A.seqs.vo_shift[n] when those are non-null), A.ht holds each sequence's running state
// between blocks (a block with rs[n] == seqs.start[n] starts from h0 instead), and the block's
// o rows written to A.o are converted into o afterwards; `kernel` sizes the blocks and decides
// which rows they hold. An empty sequence appears in block 0 with rs == re.
// The kernel that run_fwd_blocked's blocks feed (recurrent_fwd.cpp, plan_blocks, says why the sizes):
enum class BlockKernel {
  kRecurrent,  // 2 MB of rows per thread (its results do not depend
               // on where blocks start); the rows include a * khat (A.ak), its next token's read;
               // with several threads two such workspaces (block j + 1 pre-processed beside j)
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
// Work a block's runner runs in its parallel region beside the block's units, in any order and
// on any thread, tasks 0 .. tasks - 1 through run(i): in the forward the pre-processing of block
// j + 1 (BlockKernel::kRecurrent; none for the last block and for the chunk kernel), in the
// backward the chain rule of the block before and the pre-processing of the block after.
struct SideWork {
  int64_t tasks = 0;
  std::function<void(int64_t)> run;
};
// Runs a token block's units 0 .. units - 1 and the side work in one parallel region.
// body(take) runs once per task of at::parallel_for (per-thread set-up goes there) and calls
// unit u for each u that take(u) hands out until it returns false. Without side work the units
// are split statically over the threads (at::parallel_for, grain 1). With side work, units and
// side tasks come from two shared counters, one task per thread. With kSideEvery threads or
// more and at least two units per thread, one thread in kSideEvery takes side tasks first and
// the others units, each turning to the other kind when its own runs out: the side work is
// memory-bound (the forward's pass ran at a fifth of its one-thread speed per thread with all 16
// threads on it) and its threads read memory while the others compute (16-core host: 1.1-1.3x
// for the forward at H16 / H32, the backward at H32). Otherwise every thread takes units first
// and the side work fills the tail: a side-first thread that joins the units late ends the block
// late when each thread has one or two long units (the backward at H16 with 16 threads, one
// unit each: up to 1.15x slower; B1 H4 with 2 threads: up to 1.3x on the 2-core box). Inside
// another parallel region everything runs on the calling thread, units first. Which thread runs
// a unit or a task never changes what it computes.
template <typename Body>
void run_units_beside(int64_t units, const SideWork& side, const Body& body) {
  if (side.tasks == 0) {
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      int64_t next = begin;
      body([&](int64_t& u) {
        u = next++;
        return u < end;
      });
    });
    return;
  }
  constexpr int64_t kSideEvery = 8;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const bool side_first_threads =
      threads >= kSideEvery && units >= 2 * threads && !at::in_parallel_region();
  std::atomic<int64_t> next_unit{0}, next_side{0};
  at::parallel_for(0, threads, 1, [&](int64_t task, int64_t) {
    auto side_left = [&] {
      for (int64_t i = next_side++; i < side.tasks; i = next_side++) side.run(i);
    };
    if (side_first_threads && task % kSideEvery == 0) side_left();
    body([&](int64_t& u) {
      u = next_unit++;
      return u < units;
    });
    side_left();
  });
}
template <typename T>
using BlockRunner =
    std::function<void(const kernels::FwdArgs<T>& A, const BlockPrep<T>& prep,
                       const std::vector<int64_t>& rs, const std::vector<int64_t>& re, int64_t j,
                       int64_t n_blocks, const SideWork& side)>;
template <typename T>
void run_fwd_blocked(const Inputs& in, const Config& cfg, const Dims& d, const Sequences& seqs,
                     const at::Tensor& h0, const at::Tensor& o, const at::Tensor& ht,
                     const at::Tensor& ckpt, BlockKernel kernel,
                     const BlockRunner<T>& run_block);

// CPU chunkwise forward (csrc/cpu/chunk_fwd.cpp): the contract of recurrent_fwd_cpu (the same
// outputs and checkpoints, equal to rounding), computed chunk by chunk with matrix products.
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_fwd_cpu(const Inputs& in, const Config& cfg,
                                                              bool with_checkpoints);

// The common start of both CPU backwards (csrc/cpu/bwd_common.cpp): the checked sizes, the
// sequences, and in the compute dtype the initial state and the gradient of the final state
// ([N, HV, K, V], undefined if absent) and the checkpoints [n_slots, HV, K, V]; grad_o [BT, HV, V]
// in its own dtype (contiguous; the token blocks widen their rows).
struct BwdSetup {
  Dims d;
  Sequences seqs;
  at::Tensor h0, dht, dout, ckpt;
};

// The gradients w.r.t. the op's inputs before the last step, in the compute dtype, token-major:
// dq, dk [BT, H, K], dv [BT, HV, V], dg [BT, HV, K], dbeta [BT, HV], d_initial_state dh0
// [N, HV, K, V], and the per-token rows of dA_log [BT, HV] (undefined without A_log and the gate).
struct InputGrads {
  at::Tensor dq, dk, dv, dg, dbeta, dh0, dA_rows;
};

// The frame both CPU backwards share (csrc/cpu/bwd_common.cpp): backward_setup, the outputs
// allocated once, the runner of the compute dtype filling them, then the sums over tokens (dA_log,
// dt_bias) and the outputs in the inputs' dtypes and shapes: {dq, dk, dv, dg, dbeta,
// d_initial_state, dA_log, ddt_bias}, the last three empty tensors when the input is absent or
// unused.
template <typename T>
using BackwardRunner = void (*)(const Inputs& in, const Config& cfg, const BwdSetup& s,
                                const InputGrads& out);
std::vector<at::Tensor> run_backward(const at::Tensor& d_o,
                                     const std::optional<at::Tensor>& d_final_state,
                                     const at::Tensor& checkpoints, const Inputs& in,
                                     const Config& cfg, BackwardRunner<float> run_float,
                                     BackwardRunner<double> run_double);

// The backward in token blocks, last first (csrc/cpu/bwd_common.cpp): block j holds whole
// checkpoint chunks of every sequence (tokens [rs[n], re[n])); it is pre-processed into a reused
// workspace of a few MB (the rows of kernels::BwdArgs at t - A.seqs.shift[n]; v and grad_o at
// t - A.seqs.vo_shift[n] when those are block buffers), then run_block(A, rs, re, j) runs the
// kernel's units on it: they write their partial gradients w.r.t. the pre-processed inputs at
// the block rows (`groups` partials per value head, A.group_stride apart), dv at the global
// token, and carry the gradient of the state between blocks (the recurrent kernels in their
// A.slices, the chunk kernel in A.dh0; the range that ends a sequence starts from A.dht; an empty
// sequence runs in block 0 only, see block_has_work); then
// the chain rule through the pre-processing writes the block's rows of `out`. Nothing full-size
// is allocated besides the outputs; results do not depend on where blocks start. Values outside
// the domain are reported after the last block (the smallest index: the forward's message).
template <typename T>
struct BwdBlockKernel {
  int64_t groups = 1;    // partial sums per value head (the units' column groups)
  int64_t units = 1;     // units per block (sequences x value heads x groups)
  bool with_ak = false;  // the rows include a * khat (A.ak)
  bool side_work = false;  // run_block may get the neighbour blocks' passes (run_bwd_blocked)
  std::function<void(const kernels::BwdArgs<T>& A, const std::vector<int64_t>& rs,
                     const std::vector<int64_t>& re, int64_t j, const SideWork& side)>
      run_block;  // the units through run_units_beside (side: none unless side_work)
};
template <typename T>
void run_bwd_blocked(const Inputs& in, const Config& cfg, const BwdSetup& s,
                     const InputGrads& out, const BwdBlockKernel<T>& kernel);
// Whether sequence n has units in block j: tokens there, or (block 0) no tokens at all, so that
// its initial-state gradient is dht.
inline bool block_has_work(const kernels::SeqInfo& seqs, const std::vector<int64_t>& rs,
                           const std::vector<int64_t>& re, int64_t n, int64_t j) {
  return rs[n] < re[n] || (j == 0 && seqs.seq_start[n] == seqs.seq_end[n]);
}

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
