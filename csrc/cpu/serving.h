// Internal interface between the serving op (csrc/serving_op.cpp: its checks build a plan) and the
// serving / decode driver (csrc/cpu/serving.cpp). Not installed.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/kda_cpu.h"

namespace kda {
namespace detail {

// What every sequence reads and writes, resolved and validated by the op before anything runs.
struct ServingPlan {
  PerSequence seq_start, seq_end;           // flattened token range of sequence n
  PerSequence src_row;                      // row of the source state tensor, -1: zeros
  c10::SmallVector<uint8_t, 8> pad;         // pad sequence: zero output, nothing written
  PerSequence dst_row;                      // row of the destination tensor, -1: none
  std::vector<int64_t> snap;                // [N, snap_ld]: pool row for the state after token t
  int64_t snap_ld = 0;
};

// Runs the plan. `beta` of `in` may be [B, T, HV] or head-wise [B, T, HV, V]; `src` is the state
// the sequences start from (the pool, an initial state, or undefined), `dst` receives final states
// (the pool itself for in-place calls, a fresh [N, ...] tensor, or undefined), `out` receives o.
// Everything was checked by the caller (serving_op.cpp; ops.cpp for a plain call's plain_plan);
// in-place targets are fp32 / bf16 (or fp64 with fp64 inputs) with contiguous slots.
void serving_cpu(const Inputs& in, const Config& cfg, const Dims& d, const ServingPlan& plan,
                 const at::Tensor& src, const at::Tensor& dst, const at::Tensor& out);

// A plan for a plain call (no pool): sequence n starts from initial_state[n] (or zeros) and its
// final state goes to row n of a fresh tensor.
ServingPlan plain_plan(const Inputs& in, const Dims& d);

// Plain fused_recurrent calls that run on the serving kernels: decode (one token per sequence),
// and short calls whose work, all tokens x HV x K x V state elements, is at most kShortCallWork.
// The serving kernels skip the general kernels' fixed costs (pre-processing pass, token blocks,
// workspaces: their smallest calls took 4.6-8 us on a Zen 4 core, 11-17 us on a 16-core Xeon
// host's) but cost more per token past the first (the slice goes through a local copy from token
// to token), so they win only on small calls. The general kernels' time over theirs
// (benchmarks/short_calls.cpp, B = 1, one thread, K = V = 16-128, 1-32 heads, T = 2-64;
// docs/benchmarks.md "Short calls"): inside the bound 1.07-3.1 on the Zen 4 box and 1.24-3.1 on
// the Xeon host, but for one head of 128 at T = 2 (1.32 / 0.98); at twice the bound 0.84-0.94 on
// the Xeon (32 heads of 32 at T = 2, one head of 128 at T = 4, four at T = 2, one head of 32 at
// T = 64). No bound on the tokens themselves: one head of 16 wins up to T = 64 on both.
constexpr int64_t kShortCallWork = 32768;

// True when a plain call runs on the serving kernels (the rule above); at least one token.
bool is_short_call(const Inputs& in, const Dims& d);

// The domain checks of the decode and serving paths (docs/bad_inputs.md rows 46-47: g <= 0
// without the in-op gate, beta in [0, 2] without the in-op sigmoid, head-wise beta too): their
// kernels pre-process inside the units, so nothing else finds these. One scan of g and beta,
// called before anything is written (a rejected serving call leaves the pool unchanged); raises
// with report_domain's words and the first offending place.
void check_domain(const Inputs& in, const Config& cfg, const Dims& d);

// Bytes of a cache size as Linux's sysfs writes it ("32768K", "1M", "512"; K = 1024 bytes), or
// -1 when `text` is not one (for the decode's last-level cache bound, serving.cpp).
int64_t parse_cache_size(const std::string& text);

}  // namespace detail
}  // namespace kda
