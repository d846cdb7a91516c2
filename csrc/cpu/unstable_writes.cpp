// kda::_unstable_write: where a write step can amplify the state (beta * ||k||^2 > 2), for the
// Python warning of torch_kda._checks.warn_unstable_writes on CPU tensors. One pass over k and
// beta in one call: the same check as ATen ops costs about six dispatches, a noticeable share of
// a decode call (one token per sequence). The warning itself is raised in Python: a TORCH_WARN
// from an op called through torch.ops goes to stderr, not to Python's warnings.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "cpu/kda_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kda {
namespace detail {
namespace {

constexpr const char* kOp = "kda::_unstable_write: ";

// First flat index f of beta (in beta's own order, [B, T, HV] or head-wise [B, T, HV, V]) where
// beta'[f] * ||k[b, t, hv // (HV / H)]||^2 > 2 beyond rounding (limit below), with beta' =
// beta_mult * sigmoid(beta) when beta_sigmoid; -1 if none. NaN compares false (it propagates,
// by policy). Chunks of rows run in parallel; the smallest hit wins, so the answer does not
// depend on the thread count. k_eps: one ulp of k's own dtype.
template <typename T>
int64_t first_unstable(const at::Tensor& k, const at::Tensor& beta, bool beta_sigmoid,
                       T beta_mult, T k_eps) {
  const int64_t B = k.size(0), Tn = k.size(1), H = k.size(2), K = k.size(3);
  const int64_t G = beta.size(2) / H, C = beta.dim() == 4 ? beta.size(3) : 1;
  const T* kp = k.data_ptr<T>();
  const T* bp = beta.data_ptr<T>();
  // 2 plus rounding: keys normalised by the caller have ||k||^2 = 1 + their rounding, and beta
  // = 2 (allowed) then read "2 > 2": 32 ulp of the compute dtype, or one ulp of k's own dtype
  // (k_eps; bf16 keys normalised in bf16 land ~1e-4..1e-3 above 1).
  const T limit = T(2) * (T(1) + std::max<T>(32 * std::numeric_limits<T>::epsilon(), k_eps));
  std::atomic<int64_t> first{-1};
  at::parallel_for(0, B * Tn * H, 1024, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // r = (b * T + t) * H + h
      const int64_t seen = first.load(std::memory_order_relaxed);
      if (seen >= 0 && seen < r * G * C) return;  // an earlier hit exists: nothing below wins
      const T* row = kp + r * K;
      T acc[8] = {};  // eight independent sums (vectorisable, no add-latency chain), fixed order
      int64_t i = 0;
      for (; i + 8 <= K; i += 8) {
        for (int l = 0; l < 8; ++l) acc[l] += row[i + l] * row[i + l];
      }
      for (; i < K; ++i) acc[0] += row[i] * row[i];
      const T n2 = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
      for (int64_t f = r * G * C; f < (r + 1) * G * C; ++f) {
        T b = bp[f];
        if (beta_sigmoid) b = beta_mult / (1 + std::exp(-b));
        if (b * n2 > limit) {
          int64_t cur = first.load(std::memory_order_relaxed);
          while ((cur < 0 || f < cur) && !first.compare_exchange_weak(cur, f)) {
          }
          return;
        }
      }
    }
  });
  return first.load();
}

}  // namespace

int64_t first_unstable_write(const at::Tensor& k, const at::Tensor& beta, bool beta_sigmoid,
                             double beta_mult) {
  KDA_CHECK_VALUE(k.device().is_cpu() && beta.device().is_cpu(), kOp,
                    "k and beta must be CPU tensors, got ", k.device(), " and ", beta.device());
  KDA_CHECK_VALUE(k.dim() == 4, kOp, "k must be 4-D [B, T, H, K], got ", shape_str(k.sizes()));
  KDA_CHECK_VALUE((beta.dim() == 3 || beta.dim() == 4) && beta.size(0) == k.size(0) &&
                        beta.size(1) == k.size(1) && k.size(2) > 0 && beta.size(2) % k.size(2) == 0,
                    kOp, "beta must be [B, T, HV] or [B, T, HV, V] with B, T of k and HV a multiple "
                    "of H, got beta ", shape_str(beta.sizes()), " and k ", shape_str(k.sizes()));
  KDA_CHECK_TYPE(k.is_floating_point() && beta.is_floating_point(), kOp,
                   "k and beta must be floating point, got ", k.scalar_type(), " and ",
                   beta.scalar_type());
  if (k.numel() == 0 || beta.numel() == 0) return -1;
  // The compute dtype of the op: fp64 for fp64 k, fp32 otherwise.
  // One ulp of k's own dtype (torch.finfo(k.dtype).eps): the rounding of stored keys.
  double k_eps = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "_unstable_write",
                                  [&] { k_eps = double(std::numeric_limits<scalar_t>::epsilon()); });
  if (k.scalar_type() == at::kDouble) {
    return first_unstable<double>(k.contiguous(), beta.to(at::kDouble).contiguous(), beta_sigmoid,
                                  beta_mult, k_eps);
  }
  return first_unstable<float>(k.to(at::kFloat).contiguous(), beta.to(at::kFloat).contiguous(),
                               beta_sigmoid, static_cast<float>(beta_mult),
                               static_cast<float>(k_eps));
}

}  // namespace detail
}  // namespace kda

TORCH_LIBRARY_FRAGMENT(kda, m) {
  m.def("_unstable_write(Tensor k, Tensor beta, bool beta_sigmoid, float beta_mult) -> int",
        &kda::detail::first_unstable_write);
}
