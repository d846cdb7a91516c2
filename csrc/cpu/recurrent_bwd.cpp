// CPU backward of the fused recurrent KDA: runs the backward kernels (recompute each chunk from
// the forward's checkpoints, then the reverse recurrence of docs/math.md "Backward") over (sequence, value
// head, group of V-slices) units, in the token blocks of csrc/cpu/bwd_common.cpp (run_bwd_blocked,
// which also sums the per-group partials in a fixed order and chains them through the
// pre-processing: l2 norm, gate, sigmoid beta). The kernels take per-thread scratch from here.
//
// Determinism: the partition into units and blocks depends on the shapes only, never on the
// thread count, and every sum runs in a fixed order, so results are bitwise identical for any
// thread count.
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu/output_cache.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace kda {
namespace detail {

namespace {

// Groups of V-slices per (sequence, value head): enough units to keep a few threads busy when
// there are few heads; a function of the shapes only.
int64_t n_groups(const Dims& d, int64_t n_slices) {
  const int64_t heads = std::max<int64_t>(1, d.N * d.HV);
  const int64_t want = std::max<int64_t>(1, (4 + heads - 1) / heads);
  return std::max<int64_t>(1, std::min(n_slices, want));
}

// The recurrent kernels in the backward's token blocks (run_bwd_blocked): units are (sequence,
// value head, group of V-slices), each group writing its own partial of the sums over columns.
template <typename T>
void run_recurrent_bwd(const Inputs& in, const Config& cfg, const BwdSetup& s,
                       const InputGrads& out) {
  const Dims& d = s.d;
  const int64_t HV = d.HV, K = d.K;
  const int64_t n_slices = (d.V + kernels::kBwdSlice - 1) / kernels::kBwdSlice;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t ws_stride = kernels::bwd_scratch_elems(K, n_slices);
  // One kernel scratch per thread (recomputed chunk states, state gradients).
  const at::Tensor thread_ws = empty_output({threads * ws_stride}, out.dv.options());
  advise_huge_pages(thread_ws);
  T* const ws0 = thread_ws.data_ptr<T>();
  const auto& tab = kernels::table();
  auto bwd = [&]() {
    if constexpr (std::is_same_v<T, float>) {
      return tab.bwd_f32;
    } else {
      return tab.bwd_f64;
    }
  }();
  BwdBlockKernel<T> kernel;
  kernel.groups = n_groups(d, n_slices);
  kernel.with_ak = true;
  const int64_t groups = kernel.groups, units = d.N * HV * groups;
  kernel.units = units;
  kernel.side_work = true;
  // The running state gradients between token blocks, in the kernels' layout (BwdArgs::slices).
  // Blocks run last first, so a call in several meets a block j > 0 first and makes them there; a
  // call in one block (only j = 0) keeps them in the threads' scratch instead.
  at::Tensor grads;
  kernel.run_block = [&](const kernels::BwdArgs<T>& block_args, const std::vector<int64_t>& rs,
                         const std::vector<int64_t>& re, int64_t j, const SideWork& side) {
    if (j > 0 && !grads.defined()) {
      grads = empty_output({kernels::bwd_slices_elems(d.N, HV, K, d.V)}, out.dv.options());
    }
    kernels::BwdArgs<T> A = block_args;
    A.slices = grads.defined() ? grads.data_ptr<T>() : nullptr;
    run_units_beside(units, side, [&](const auto& take) {
      T* ws = ws0 + std::min<int64_t>(at::get_thread_num(), threads - 1) * ws_stride;
      for (int64_t u; take(u);) {
        const int64_t g = u % groups;
        const int64_t hv = (u / groups) % HV;
        const int64_t n = u / (groups * HV);
        if (!block_has_work(A.seqs, rs, re, n, j)) continue;
        bwd(A, n, hv, g * n_slices / groups, (g + 1) * n_slices / groups, g, rs[n], re[n], ws);
      }
    });
  };
  run_bwd_blocked<T>(in, cfg, s, out, kernel);
}

}  // namespace

std::vector<at::Tensor> recurrent_bwd_cpu(const at::Tensor& d_o,
                                          const std::optional<at::Tensor>& d_final_state,
                                          const at::Tensor& checkpoints, const Inputs& in,
                                          const Config& cfg) {
  return run_backward(d_o, d_final_state, checkpoints, in, cfg, &run_recurrent_bwd<float>,
                      &run_recurrent_bwd<double>);
}

}  // namespace detail
}  // namespace kda
