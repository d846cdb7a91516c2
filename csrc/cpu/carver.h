// One workspace buffer cut into consecutive parts, each starting on a 64-byte line (if the base
// does). Carving no memory (a null base) hands out null pointers and only counts, so a
// workspace's size comes from the very code that carves it: no second list of part sizes to
// keep in step with the first.
#pragma once

#include <cstdint>

namespace kda {
namespace detail {

class Carver {
 public:
  static constexpr int64_t kLine = 64;

  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}

  // The next part: n elements of U (null when carving no memory).
  template <typename U>
  U* take(int64_t n) {
    char* part = base_ ? base_ + used_ : nullptr;
    used_ += (n * static_cast<int64_t>(sizeof(U)) + kLine - 1) / kLine * kLine;
    return reinterpret_cast<U*>(part);
  }

  // Bytes taken so far (whole lines).
  int64_t bytes() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

}  // namespace detail
}  // namespace kda
