// Error and warning messages of the native ops, formatted without iostreams.
//
// Why: on the H200 machine's host (torch 2.11.0+cu130, g++ 13.3) a message that streamed an
// integer or a float through std::ostream (c10::str, which TORCH_CHECK uses) ended the process
// with SIGSEGV, while messages made only of strings raised normally; a tiny extension built there
// crashed on c10::str(t.sizes()) alone (benchmarks/device_error_probe.py --probe,
// docs/benchmarks.md "Known problem: shape errors crash on the device"). So every message is
// built here as one std::string (numbers through snprintf, never a stream) and TORCH_CHECK only
// receives that string. The text is the one c10::str would have made: integers in decimal,
// floating-point numbers as "%g" (an ostream's default), bool as 1 / 0, ScalarType and Device
// by their names; sizes go through shape_str.
//
// Use KDA_CHECK / KDA_CHECK_VALUE / KDA_CHECK_TYPE / KDA_WARN instead of the TORCH_ macros; as
// with those, the message is only formatted when the check fails.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace kda {
namespace detail {

// "[2, 6, 2, 4]".
inline std::string shape_str(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

inline void append_part(std::string& s, const std::string& x) { s += x; }
inline void append_part(std::string& s, const char* x) { s += x; }
inline void append_part(std::string& s, char x) { s += x; }  // a character, not its code
inline void append_part(std::string& s, c10::ScalarType x) { s += c10::toString(x); }
inline void append_part(std::string& s, const c10::Device& x) { s += x.str(); }
template <typename N, typename = std::enable_if_t<std::is_arithmetic_v<N>>>
void append_part(std::string& s, N x) {
  if constexpr (std::is_floating_point_v<N>) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(x));
    s += buf;
  } else {
    s += std::to_string(x);
  }
}

// The parts concatenated (types other than the ones above fail to compile, on purpose: add an
// overload rather than a stream).
template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (append_part(s, parts), ...);
  return s;
}

}  // namespace detail
}  // namespace kda

#define KDA_CHECK(cond, ...) TORCH_CHECK(cond, ::kda::detail::message(__VA_ARGS__))
#define KDA_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::kda::detail::message(__VA_ARGS__))
#define KDA_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::kda::detail::message(__VA_ARGS__))
#define KDA_WARN(...) TORCH_WARN(::kda::detail::message(__VA_ARGS__))
