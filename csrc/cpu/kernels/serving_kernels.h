// Inner loops of the serving / decode path of KDA (csrc/cpu/serving.cpp drives them): a state pool
// read and written in place by slot, per-token snapshots, both state layouts, fp32/bf16 storage.
//
// Compiled once per instruction set like recurrent_kernels.cpp (cmake/KdaKernels.cmake); no torch
// headers. A unit is one (sequence n, value head hv, columns [c0, c1) of V): it pre-processes its
// tokens itself (l2 norm, gate, decay, beta: a few K-vectors per token), reads its state slice once
// and writes it once, so the kernel moves each state byte twice and allocates nothing for T_n = 1.
#pragma once

#include <cstdint>

#include "cpu/kernels/recurrent_kernels.h"

namespace kda {
namespace kernels {

// Storage type of a state tensor (the pool, the initial state or the fresh final state).
enum class StateType : int { kF32 = 0, kF64 = 1, kBF16 = 2 };

template <typename T>
struct ServingArgs {
  int64_t H = 0, HV = 0, K = 0, V = 0;
  bool v_first = false;        // states are [.., V, K] (a value column's row contiguous over K)
  // Pre-processing (docs/math.md "Gates").
  T scale = 1;
  bool l2norm = false;
  GateMode gate = GateMode::kNone;
  T lower_bound = 0;
  bool beta_sigmoid = false;
  T beta_mult = 1;
  bool beta_headwise = false;  // beta [BT, HV, V] instead of [BT, HV]
  // Token-major inputs in the compute type, contiguous.
  const T* q = nullptr;        // [BT, H, K]
  const T* k = nullptr;        // [BT, H, K]
  const T* v = nullptr;        // [BT, HV, V]
  const T* g = nullptr;        // [BT, HV, K]
  const T* beta = nullptr;     // [BT, HV] or [BT, HV, V]
  const T* expA = nullptr;     // [HV] exp(A_log) or null
  const T* A_log = nullptr;    // [HV] A_log where expA is set (rates >= kLogSpaceRate use it)
  const T* dt_bias = nullptr;  // [HV * K] or null
  T* o = nullptr;              // [BT, HV, V]
  // Sequence n covers flattened tokens [seq_start[n], seq_end[n]).
  const int64_t* seq_start = nullptr;
  const int64_t* seq_end = nullptr;
  // The plan, per sequence (built and checked by the op): the row of `src` it starts from (-1:
  // zeros), whether it is a pad sequence (zero output, nothing written), the row of `dst` that
  // receives its final state (-1: none), and with snapshots the row of `src` that receives the
  // state after its token t: snap[n * snap_ld + t] (-1: none).
  const int64_t* src_row = nullptr;
  const uint8_t* pad = nullptr;
  const int64_t* dst_row = nullptr;
  const int64_t* snap = nullptr;
  int64_t snap_ld = 0;
  // State tensors: rows of HV * K * V elements, `stride` elements apart. `src` is also written
  // (snapshots; and it is `dst` for in-place calls).
  void* src = nullptr;
  StateType src_type = StateType::kF32;
  int64_t src_stride = 0;
  void* dst = nullptr;
  StateType dst_type = StateType::kF32;
  int64_t dst_stride = 0;
  // Decode (one token per sequence): write the fp32 final state `dst` with non-temporal stores
  // (no read of the destination lines first). The driver sets it for a fresh final state whose
  // read + write bytes exceed the last-level cache (at most 48 MB), 64-byte aligned with rows of a
  // multiple of 16 elements (csrc/cpu/serving.cpp, stream_final_state).
  bool stream_dst = false;
  // Decode with a V-first state: read the rows of a head's columns (up to 128 of them) before
  // writing any, instead of writing each vector-length block of rows right after reading it. The
  // driver sets it on AMD CPUs for a fresh final state with plain stores whose read + written bytes
  // exceed a third of the last-level cache (csrc/cpu/serving.cpp, vfirst_two_pass, which says where
  // it was measured). The values written are the same either way.
  bool vfirst_two_pass = false;
};

struct ServingTable {
  const char* isa;
  // Sequence n, value head hv, value columns [c0, c1). next_head: the calling thread runs head
  // hv + 1 of sequence n next (its whole columns), so a decode unit prefetches that head's state.
  void (*unit_f32)(const ServingArgs<float>&, int64_t n, int64_t hv, int64_t c0, int64_t c1,
                   bool next_head);
  void (*unit_f64)(const ServingArgs<double>&, int64_t n, int64_t hv, int64_t c0, int64_t c1,
                   bool next_head);
};

// The serving kernels of the instruction set kernels::table() chose.
const ServingTable& serving_table();

namespace avx512 { const ServingTable& serving(); }
namespace avx2 { const ServingTable& serving(); }
namespace generic { const ServingTable& serving(); }

}  // namespace kernels
}  // namespace kda
