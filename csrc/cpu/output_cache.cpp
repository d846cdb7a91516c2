// The output cache (csrc/cpu/output_cache.h): a c10::Allocator whose blocks go back to a bounded,
// size-keyed free list when their tensor is freed, so a call's large outputs reuse the pages of
// the previous call's instead of faulting fresh ones in.
//
// Process-wide by design (the team's code otherwise avoids global state): the point is reuse
// ACROSS calls, and a tensor may outlive any object a call could own. The one instance is never
// destroyed, so a tensor freed during interpreter shutdown still finds it.
#include "cpu/output_cache.h"
#include "cpu/error_message.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace kda {
namespace detail {

namespace {

// Blocks under this size come from the ordinary allocator. glibc serves them from its heap but
// hands the heap's top back to the system when it trims it, so buffers of a few hundred KB
// made and freed every call faulted in again call after call: the forward's block workspaces at
// T = 1K, H = 4 with 2 threads, 620-970 faults per call and a quarter of its time (docs/benchmarks.md,
// "Page faults under 1 MB"). 128 KB is glibc's default threshold for a mapping of its own.
constexpr size_t kMinBytes = size_t(128) << 10;
// Block capacities are multiples of this (so outputs of nearby sizes can share blocks).
constexpr size_t kGrain = size_t(64) << 10;
// A free block serves a request of n bytes (capacity cap: n rounded up to the grain) if its
// capacity is at least cap and at most cap + cap / kSlackDiv (best fit among those): a much larger
// block would tie up memory another call could use.
constexpr size_t kSlackDiv = 8;
constexpr size_t kHuge = size_t(2) << 20;

// min(2 GB, RAM / 8): a training step (forward + backward) frees all its blocks at its end, and
// the next step reuses them only if the free list can hold them all: 0.9-1.2 GB at B1 T8K H16
// with 16-bit inputs (widened inputs and grad_o, fp32 gradients and their 16-bit copies, the chunk
// backward's full-size pre-processing). With 512 MB the oldest were unmapped every step and mapped
// again (huge-page faults: 27-51% of the step in the kernel; docs/benchmarks.md "Prefill without
// page faults").
int64_t default_limit() {
  int64_t limit = int64_t(2048) << 20;
#if defined(__linux__)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) limit = std::min<int64_t>(limit, int64_t(pages) * page / 8);
#endif
  if (const char* env = std::getenv("TORCH_KDA_OUTPUT_CACHE_MB")) {
    // A whole number of megabytes, 0 turning the cache off. Anything else ("1e3", "-5", "64MB")
    // warns and keeps the default instead of being read as its leading digits.
    int64_t mb = -1;
    size_t used = 0;
    try {
      mb = std::stoll(env, &used);
    } catch (const std::exception&) {
      mb = -1;
    }
    if (mb >= 0 && env[used] == '\0' && mb <= (std::numeric_limits<int64_t>::max() >> 20)) {
      limit = mb << 20;
    } else {
      KDA_WARN("TORCH_KDA_OUTPUT_CACHE_MB=", env, " is not a whole number of megabytes >= 0; "
                 "using the default (", limit >> 20, " MB)");
    }
  }
  return limit;
}

struct Block {
  void* ptr = nullptr;
  size_t cap = 0;
#if defined(__linux__)
  bool mapped = false;  // from mmap (else c10::alloc_cpu)
#endif
};

// A new block of cap bytes. On Linux an anonymous mapping aligned to 2 MB, with the huge-page
// advice (so transparent huge pages in "madvise" mode can back it whole); elsewhere the CPU
// allocator's aligned block.
std::unique_ptr<Block> map_block(size_t cap) {
  auto b = std::make_unique<Block>();
  b->cap = cap;
#if defined(__linux__)
  void* raw = mmap(nullptr, cap + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw != MAP_FAILED) {
    const uintptr_t r = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t a = (r + kHuge - 1) & ~(kHuge - 1);
    if (a > r) munmap(raw, a - r);
    const uintptr_t tail = a + cap, end = r + cap + kHuge;
    if (end > tail) munmap(reinterpret_cast<void*>(tail), end - tail);
#if defined(MADV_HUGEPAGE)
    if (cap >= kHuge) madvise(reinterpret_cast<void*>(a), cap / kHuge * kHuge, MADV_HUGEPAGE);
#endif
    b->ptr = reinterpret_cast<void*>(a);
    b->mapped = true;
    return b;
  }
#endif
  b->ptr = c10::alloc_cpu(cap);  // raises c10::OutOfMemoryError on failure
  return b;
}

void unmap_block(Block* b) {
#if defined(__linux__)
  if (b->mapped) {
    munmap(b->ptr, b->cap);
    return;
  }
#endif
  c10::free_cpu(b->ptr);
}

void release_block(void* ctx);

class OutputCache final : public c10::Allocator {
 public:
  OutputCache() : limit_(default_limit()) {}

  c10::DataPtr allocate(size_t n) override {
    // Small blocks (and everything while the cache is off) from the CPU allocator: a resize of
    // a cached tensor to a small size lands here too.
    if (n < kMinBytes || limit() == 0) return c10::GetCPUAllocator()->allocate(n);
    const size_t cap = (n + kGrain - 1) / kGrain * kGrain;
    std::unique_ptr<Block> b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        const size_t c = (*it)->cap;
        // Against the request's own capacity: a block made for this size (rounded up to the
        // grain) always fits it again, even where the grain exceeds the slack (n < 512 KB).
        if (c >= cap && c <= cap + cap / kSlackDiv && (best == free_.end() || c < (*best)->cap)) {
          best = it;
        }
      }
      if (best != free_.end()) {
        b.reset(*best);
        free_.erase(best);
        held_ -= b->cap;
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (!b) b = map_block(cap);
    void* p = b->ptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_ += b->cap;
    }
    return {p, b.release(), &release_block, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // The deleter of every block this allocator handed out (any thread).
  void release(Block* b) {
    std::vector<Block*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_ -= b->cap;
      if (static_cast<int64_t>(b->cap) <= limit_) {
        free_.push_front(b);  // most recently freed first: trimming drops the oldest
        held_ += b->cap;
      } else {
        drop.push_back(b);
      }
      trim_locked(drop);
    }
    unmap_all(drop);
  }

  int64_t set_limit(int64_t bytes) {
    std::vector<Block*> drop;
    int64_t old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      old = limit_;
      limit_ = std::max<int64_t>(0, bytes);
      trim_locked(drop);
    }
    unmap_all(drop);
    return old;
  }

  int64_t limit() {
    std::lock_guard<std::mutex> lock(mu_);
    return limit_;
  }

  OutputCacheStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {limit_, held_, in_use_, hits_, misses_, released_};
  }

 private:
  // Drops the oldest free blocks until the free list is within the limit (called with mu_ held;
  // the blocks are unmapped after the lock is released).
  void trim_locked(std::vector<Block*>& drop) {
    while (held_ > limit_ && !free_.empty()) {
      Block* b = free_.back();
      free_.pop_back();
      held_ -= b->cap;
      drop.push_back(b);
    }
    released_ += static_cast<int64_t>(drop.size());
  }

  static void unmap_all(std::vector<Block*>& drop) {
    for (Block* b : drop) {
      unmap_block(b);
      delete b;  // owned since allocate() released it into the DataPtr's context
    }
  }

  std::mutex mu_;
  std::list<Block*> free_;
  int64_t limit_ = 0, held_ = 0, in_use_ = 0, hits_ = 0, misses_ = 0, released_ = 0;
};

OutputCache& cache() {
  // Never destroyed: tensors holding its blocks may be freed after static destruction starts.
  static OutputCache* c = new OutputCache();
  return *c;
}

void release_block(void* ctx) { cache().release(static_cast<Block*>(ctx)); }

}  // namespace

at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(opts.dtype().toScalarType());
  if (opts.device().type() != c10::DeviceType::CPU || nbytes < kMinBytes || cache().limit() == 0) {
    return at::empty(sizes, opts);
  }
  return at::detail::empty_generic(sizes, &cache(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   opts.dtype().toScalarType(), c10::MemoryFormat::Contiguous);
}

at::Tensor empty_output_like(const at::Tensor& t) { return empty_output(t.sizes(), t.options()); }

at::Tensor to_output(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype && t.is_contiguous()) return t;
  at::Tensor out = empty_output(t.sizes(), t.options().dtype(dtype));
  out.copy_(t);
  return out;
}

OutputCacheStats output_cache_stats() { return cache().stats(); }

int64_t set_output_cache_limit(int64_t bytes) {
  // a negative limit is a mistake (it used to turn the cache off silently), not a request for 0
  TORCH_CHECK(bytes >= 0, "kda._output_cache_set_limit: bytes must be >= 0 (0 turns the cache off), "
              "got ", bytes);
  return cache().set_limit(bytes);
}

namespace {
std::vector<int64_t> stats_op() {
  const OutputCacheStats s = output_cache_stats();
  return {s.limit, s.held, s.in_use, s.hits, s.misses, s.released};
}
}  // namespace

}  // namespace detail
}  // namespace kda

// For tests and benchmarks: [limit, held, in_use, hits, misses, released] (bytes / counts), and
// a new limit in bytes (returns the previous one).
TORCH_LIBRARY_FRAGMENT(kda, m) {
  m.def("_output_cache_stats() -> int[]", &kda::detail::stats_op);
  m.def("_output_cache_set_limit(int bytes) -> int", &kda::detail::set_output_cache_limit);
}
