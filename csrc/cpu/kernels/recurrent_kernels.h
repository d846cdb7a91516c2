// Inner loops of the fused recurrent KDA forward and backward, on raw pointers (no torch headers).
//
// This header is included by csrc/cpu/kernels/recurrent_kernels.cpp, which is compiled once per
// instruction set (namespace kda::kernels::<isa>), and by the torch-facing drivers, which pick one
// instruction set at run time through kda::kernels::table() (csrc/cpu/isa_dispatch.cpp).
//
// All arrays are contiguous, in the compute type T (float, or double for fp64 inputs). Tokens are
// flattened over the batch: token index t in [0, B*T). A "unit" is one (sequence, value head,
// slice of V columns); units are independent, so the drivers run them in parallel.
#pragma once

#include <cstdint>

namespace kda {
namespace kernels {

// Rates exp(A_log) from this one on (A_log > 44.4; inf too) form the softplus gate in log space,
// -exp(A_log + log softplus(z)) (vec_math.h vsoftplus_gate_log_space): their product with a
// softplus(z) below float's range (z < -87.5) is not negligible. The pre-processing and the
// backward's chain rule (bwd_common.cpp) both test it.
constexpr double kLogSpaceRate = 0x1p64;

// Checkpoint interval of the forward (tokens): the backward recomputes states inside a chunk.
constexpr int64_t kChunk = 64;
// Columns of the state handled by one forward / backward unit (a K x kSlice slice stays in L1).
constexpr int64_t kFwdSlice = 32;
constexpr int64_t kBwdSlice = 32;

// Sequences: sequence n covers flattened tokens [seq_start[n], seq_end[n]); its checkpoints are
// numbered from slot_base[n], slot c holding the state before token origin[n] + c * kChunk.
struct SeqInfo {
  int64_t n_seq = 0;
  const int64_t* seq_start = nullptr;
  const int64_t* seq_end = nullptr;
  const int64_t* origin = nullptr;
  const int64_t* slot_base = nullptr;
  // The forward and the backward run in token blocks (csrc/cpu/recurrent_fwd.cpp,
  // recurrent_bwd.cpp): the pre-processed arrays (and the backward's partial gradients) hold one
  // block, sequence n's token t at local index t - shift[n]; v and o (the backward: v and
  // dout) likewise at t - vo_shift[n] when they are block buffers. Null means local == global
  // (whole arrays).
  const int64_t* shift = nullptr;
  const int64_t* vo_shift = nullptr;
  // Sequence n's token t sits at row t - row_shift(n) of the block arrays, and at
  // t - vo_row_shift(n) of v and o / dout.
  int64_t row_shift(int64_t n) const { return shift ? shift[n] : 0; }
  int64_t vo_row_shift(int64_t n) const { return vo_shift ? vo_shift[n] : 0; }
};

// The pre-processed per-token inputs are head-major ([H, BT, K]: one head's tokens contiguous),
// so a unit streams contiguous memory; v, o and the gradients keep the [BT, HV, ...] layout.
// Shared by the forward and the backward (which recomputes the states from the same inputs).
template <typename T>
struct RecurrenceInputs {
  SeqInfo seqs;
  int64_t BT = 0, H = 0, HV = 0, K = 0, V = 0;
  const T* q = nullptr;     // [H, BT, K]   scale * l2norm(q) (already pre-processed)
  const T* k = nullptr;     // [H, BT, K]   l2norm(k)
  const T* a = nullptr;     // [HV, BT, K]  per-channel decay exp(g)
  const T* ak = nullptr;    // [HV, BT, K]  a * khat (khat of the value head's key head)
  const T* beta = nullptr;  // [HV, BT]
  const T* v = nullptr;     // [BT, HV, V]
  const T* h0 = nullptr;    // [N, HV, K, V] or null (zeros)
};

template <typename T>
struct FwdArgs : RecurrenceInputs<T> {
  T* o = nullptr;           // [BT, HV, V]
  // [N, HV, K, V]: the final state (the recurrent kernels write it at the range that ends a
  // sequence; the chunk forward keeps its running state there between token ranges too).
  T* ht = nullptr;
  T* ckpt = nullptr;        // [slots, HV, K, V] or null (no checkpoints)
  // The recurrent kernels' running state between token ranges, in their own layout:
  // [N, HV, ceil(V / kFwdSlice)] slices of K x kFwdSlice, fwd_slice_stride apart (a range that
  // starts a sequence fills them from h0 or zeros; fwd_slices_elems). Kept in place from range
  // to range: reloading it from ht and storing it back at every token block took 2.3% of a call
  // at H16 with 256-token blocks (perf), and blocks of 64 tokens are four times as many. Null
  // only when every sequence runs in one range (a call in one token block): the thread's scratch
  // then holds the state, with no extra state-sized buffer to write back.
  T* slices = nullptr;
};

// The backward: BT (of RecurrenceInputs) is the token stride of the pre-processed block arrays
// and of the partials; dv is a whole array indexed by the global token, and so are v and dout
// unless seqs.vo_shift is set (block rows: 16-bit v and grad_o widened block by block).
template <typename T>
struct BwdArgs : RecurrenceInputs<T> {
  const T* ckpt = nullptr;  // [slots, HV, K, V] written by the forward
  const T* dout = nullptr;  // [B*T, HV, V] (or block rows, see above)
  const T* dht = nullptr;   // [N, HV, K, V] or null
  // Sums over V columns: unit (n, hv, group p) writes partial p: [P, BT, HV, K] and [P, BT, HV].
  T* dq = nullptr;          // gradient w.r.t. the pre-processed q (scale included)
  T* dk = nullptr;          // gradient w.r.t. the pre-processed k
  T* dg = nullptr;          // gradient w.r.t. the log decay g
  T* dbeta = nullptr;
  int64_t group_stride = 0; // BT * HV * K  (elements between partials of dq, dk, dg)
  int64_t group_stride_beta = 0;  // BT * HV
  T* dv = nullptr;          // [B*T, HV, V]
  // [N, HV, K, V]: the gradient w.r.t. the initial state. The chunk backward also keeps the
  // running gradient of the state there between token ranges (the range that ends a sequence
  // reads dht, any earlier range dh0).
  T* dh0 = nullptr;
  // The gradient w.r.t. the state after the range of sequence n that ends at token t1 (null:
  // zero), as the rule above says.
  const T* state_grad_after(int64_t n, int64_t t1) const {
    return t1 == this->seqs.seq_end[n] ? dht : dh0;
  }
  // The recurrent kernels' running gradient of the state between token ranges, in their own
  // (transposed) layout: [N, HV, ceil(V / kBwdSlice)] slices of bwd_slice_elems(K) elements (the
  // range that ends a sequence fills them from dht or zeros, the range that starts it stores them
  // to dh0; bwd_slices_elems). Kept in place from range to range: a transposed reload from dh0
  // (missing the caches) and a store back at every token block (every chunk at H16, one thread)
  // took about 5% of the backward there (perf, Zen 3). Null only when every sequence runs in one
  // range: the thread's scratch then holds them.
  T* slices = nullptr;
};

// Per-token pre-processing (docs/math.md "Gates"): l2 norm and
// scale of q/k, gate and decay, sigmoid beta, fused in one pass over the tokens.
enum class GateMode : int { kNone = 0, kSoftplus = 1, kBounded = 2 };
// How an input array is stored: in the compute type T, or as 16-bit floats that the pass widens
// to float as it reads them (half the bytes of a converted copy, and no separate pass).
enum class Storage : int { kCompute = 0, kBf16 = 1, kF16 = 2 };

template <typename T>
struct PrepArgs {
  int64_t BT = 0, H = 0, HV = 0, K = 0;
  const T* q = nullptr;        // [BT, H, K] raw
  const T* k = nullptr;        // [BT, H, K] raw
  const T* g = nullptr;        // [BT, HV, K] log decay, or raw gate input
  const T* beta = nullptr;     // [BT, HV] strength or logits
  // 16-bit inputs (T = float only): with a Storage other than kCompute the array is read from
  // the 16-bit pointer instead (q and k share q_store).
  Storage q_store = Storage::kCompute, g_store = Storage::kCompute,
          beta_store = Storage::kCompute, v_store = Storage::kCompute;
  const uint16_t *q16 = nullptr, *k16 = nullptr, *g16 = nullptr, *beta16 = nullptr;
  // v widened into v_out [BT, HV * V] at the output row (forward token blocks, 16-bit v), or
  // v16 == null: no v in this pass.
  const uint16_t* v16 = nullptr;
  T* v_out = nullptr;
  int64_t VW = 0;              // HV * V
  const T* expA = nullptr;     // [HV] exp(A_log), or null (bounded gate without A_log)
  const T* A_log = nullptr;    // [HV] A_log where expA is set (rates >= kLogSpaceRate use it)
  const T* dt_bias = nullptr;  // [HV * K] or null
  // Token t is read at row t - in_shift of q, k, g, beta and written at t - out_shift of the
  // outputs (token blocks of the forward; 0 for whole arrays). BT is the outputs' token stride.
  int64_t in_shift = 0, out_shift = 0;
  // The inputs' token strides (elements) of q and k, g, beta and v16; 0: packed (H * K, HV * K,
  // HV, VW). A view of one head (H = HV = 1, the input pointers at that head, VW = V) keeps the
  // whole arrays' strides here: the chunk forward pre-processes one chunk of one head at a time
  // (its PrepReport then numbers tokens and channels as for HV = 1).
  int64_t q_ld = 0, g_ld = 0, beta_ld = 0, v_ld = 0;
  T scale = 1;
  bool l2norm = false;
  GateMode gate = GateMode::kNone;
  T lower_bound = 0;
  bool beta_sigmoid = false;
  T beta_mult = 1;             // 2 with allow_neg_eigval
  T* q_out = nullptr;          // [H, BT, K]  scale * qhat
  T* k_out = nullptr;          // [H, BT, K]  khat
  T* a_out = nullptr;          // [HV, BT, K] exp(g)
  T* ak_out = nullptr;         // [HV, BT, K] exp(g) * khat (null: not made)
  T* beta_out = nullptr;       // [HV, BT]
  // For the backward (may be null): 1/||.|| of q and k [BT, H], log decay [BT, HV, K], and the
  // slopes of the gate's and beta's nonlinearities at their arguments: softplus'(z) = sigmoid(z)
  // [BT, HV, K] (under a rate >= kLogSpaceRate, the log-space gate's whole derivative in z:
  // vec_math.h vsoftplus_gate_log_space); sigmoid'(x) = sigmoid(x) sigmoid(-x) [BT, HV, K] and
  // beta_mult times it [HV, BT]. sigmoid(-x) is computed, not taken as 1 - sigmoid(x), which
  // rounds to 0 in float32 once x > ~17 while the slope (~exp(-x)) is still representable.
  T* q_rnorm = nullptr;
  T* k_rnorm = nullptr;
  T* g_out = nullptr;
  T* gate_slope_out = nullptr;
  T* beta_slope_out = nullptr;
};

// FwdArgs::slices: one slice's state (K x kFwdSlice) and a gap of kSliceGap elements after it,
// so that a core streaming through its slice does not prefetch into the next one, which another
// core is updating at every token. Elements of the compute type; multiples of 16.
constexpr int64_t kSliceGap = 1024;
constexpr int64_t fwd_slice_stride(int64_t K) { return K * kFwdSlice + kSliceGap; }

// Scratch of one forward call (elements of the compute type): per slice the kFwdSlice-wide read
// (kFwdSlice is a multiple of every vector width), then K zeros, then (used without
// FwdArgs::slices) per slice a state, fwd_slice_stride apart; multiples of 16 elements, so
// every part stays 64-byte aligned.
constexpr int64_t fwd_scratch_elems(int64_t K, int64_t n_slices) {
  return n_slices * kFwdSlice + (K + 15) / 16 * 16 + n_slices * fwd_slice_stride(K);
}

constexpr int64_t fwd_slices_elems(int64_t N, int64_t HV, int64_t K, int64_t V) {
  return N * HV * ((V + kFwdSlice - 1) / kFwdSlice) * fwd_slice_stride(K);
}

// Scratch of one backward call (elements of the compute type). The backward keeps its slices
// transposed (kBwdSlice columns of Kp elements, Kp = K rounded up to 16; see bwd_chunk): the
// recomputed states of a chunk (kChunk slices), their reads (kChunk x kBwdSlice), the running state
// gradient of every slice, one vector (at most 64 bytes) per column for the column sums;
// multiples of 16 elements (64-byte aligned parts).
constexpr int64_t bwd_slice_elems(int64_t K) { return kBwdSlice * ((K + 15) / 16 * 16); }

constexpr int64_t bwd_scratch_elems(int64_t K, int64_t n_slices) {
  return (kChunk + n_slices) * bwd_slice_elems(K) + kChunk * kBwdSlice + kBwdSlice * 16;
}

constexpr int64_t bwd_slices_elems(int64_t N, int64_t HV, int64_t K, int64_t V) {
  return N * HV * ((V + kBwdSlice - 1) / kBwdSlice) * bwd_slice_elems(K);
}

// What the pre-processing pass found outside the domain where the recurrence is defined
// (docs/math.md "Domain of the inputs"); found for free while the values pass through registers.
// Each field is the FIRST offending index in the pass's token range (global token numbering t,
// not the shifted rows), or -1.
struct PrepReport {
  int64_t bad_g = -1;      // t * HV * K + hv * K + i: a log-decay > 0 (only without the in-op gate)
  int64_t bad_beta = -1;   // t * HV + hv: a precomputed beta outside [0, 2] (no in-op sigmoid)
};

struct Table {
  const char* isa;
  // Pre-processing of tokens [t0, t1).
  PrepReport (*prep_f32)(const PrepArgs<float>&, int64_t t0, int64_t t1);
  PrepReport (*prep_f64)(const PrepArgs<double>&, int64_t t0, int64_t t1);
  // Forward of tokens [t0, t1) of sequence n (a range inside it; t0 == seq_start reads h0, else
  // the state A.slices holds), slices [s_begin, s_end) (kFwdSlice columns each) of value head
  // hv; the state stays in A.slices (or the scratch, see FwdArgs::slices), and goes to ht at the
  // range that ends the sequence.
  // ws: the calling thread's scratch, fwd_scratch_elems(K, s_end - s_begin) elements, 64-byte
  // aligned (owned by the driver and reused by every call of the thread: no allocation here).
  void (*fwd_f32)(const FwdArgs<float>&, int64_t n, int64_t hv, int64_t s_begin, int64_t s_end,
                  int64_t t0, int64_t t1, float* ws);
  void (*fwd_f64)(const FwdArgs<double>&, int64_t n, int64_t hv, int64_t s_begin, int64_t s_end,
                  int64_t t0, int64_t t1, double* ws);
  // Backward of tokens [t0, t1) of sequence n (whole kChunk chunks of it, except at its ends;
  // t1 == seq_end reads dht, else the running gradient A.slices holds), slices [s_begin, s_end)
  // (kBwdSlice columns each) of value head hv, writing partial p; the state gradient goes to dh0
  // at the range that starts the sequence. ws: the calling thread's scratch,
  // bwd_scratch_elems(K, s_end - s_begin) elements, 64-byte aligned.
  void (*bwd_f32)(const BwdArgs<float>&, int64_t n, int64_t hv, int64_t s_begin, int64_t s_end,
                  int64_t p, int64_t t0, int64_t t1, float* ws);
  void (*bwd_f64)(const BwdArgs<double>&, int64_t n, int64_t hv, int64_t s_begin, int64_t s_end,
                  int64_t p, int64_t t0, int64_t t1, double* ws);
};

// The best kernels this CPU supports (chosen once).
const Table& table();

#define KDA_DECLARE_ISA(isa) \
  namespace isa { const Table& get(); }
KDA_DECLARE_ISA(avx512)
KDA_DECLARE_ISA(avx2)
KDA_DECLARE_ISA(generic)
#undef KDA_DECLARE_ISA

}  // namespace kernels
}  // namespace kda
