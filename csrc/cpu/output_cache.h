// Large output buffers of the CPU ops, recycled between calls (csrc/cpu/output_cache.cpp).
//
// A prefill call returns o ([B, T, HV, V]: 32 MB at T = 4K, H = 16 fp32) and a final state, and a
// training forward keeps checkpoints; made fresh each call, every page of them is faulted in on
// first touch (glibc maps blocks >= 32 MB anew and unmaps them on free; without transparent huge
// pages that is one fault per 4 KB: 8K faults per 32 MB, 15-25% of the call in the kernel). The
// blocks of these tensors come instead from a bounded per-process cache: when the tensor is freed
// its block goes back to a free list, and the next call's output of about that size reuses it
// (already mapped: no faults). The tensors are ordinary resizable CPU tensors; only their storage's
// allocator differs.
//
// Limit: the bytes held by the free list (blocks not in use), default min(2 GB, RAM / 8),
// environment variable TORCH_KDA_OUTPUT_CACHE_MB (read once; 0 disables the cache). Blocks under
// 128 KB are not cached (glibc's heap serves those; larger ones it trimmed away and faulted in
// again call after call). The ops' per-call work buffers come from it too. Thread-safe: a tensor
// may be freed on any thread.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kda {
namespace detail {

// An uninitialised contiguous CPU tensor of `sizes` with `opts`' dtype, its block taken from the
// output cache when it is large enough (and the cache is on), else at::empty. The contents are
// unspecified, as with at::empty: the caller writes every element.
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& opts);

// empty_output with the sizes and options of t (contiguous).
at::Tensor empty_output_like(const at::Tensor& t);

// t in `dtype`, contiguous: t itself when it already is (as t.to(dtype).contiguous() returns),
// else a copy (copy_: the conversion of .to(), the same bits) into an empty_output block. For the
// conversions of a call's large inputs and outputs (a 16-bit grad_o to fp32, the fp32 gradients
// to the inputs' 16-bit dtypes): fresh at::empty copies faulted in 10-26K pages per backward.
at::Tensor to_output(const at::Tensor& t, at::ScalarType dtype);

// What the cache holds and did since the process started (tests, benchmarks).
struct OutputCacheStats {
  int64_t limit = 0;       // bytes the free list may hold (0: cache off)
  int64_t held = 0;        // bytes in the free list now
  int64_t in_use = 0;      // bytes of cached-allocator blocks owned by live tensors
  int64_t hits = 0;        // allocations served from the free list
  int64_t misses = 0;      // allocations that mapped a new block
  int64_t released = 0;    // blocks returned to the system (over the limit, or on a new limit)
};
OutputCacheStats output_cache_stats();

// Sets the limit in bytes (0: off; the free list is trimmed to it at once) and returns the
// previous one; a negative limit throws c10::Error and changes nothing.
int64_t set_output_cache_limit(int64_t bytes);

}  // namespace detail
}  // namespace kda
