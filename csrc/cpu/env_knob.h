// The environment knobs that choose among code paths for tests and benchmarks (TORCH_KDA_ISA,
// TORCH_KDA_DECODE_KERNEL, TORCH_KDA_DECODE_STREAM): read where they are used, each time, so a
// benchmark can switch them within one process.
#pragma once

#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "cpu/error_message.h"

namespace kda {
namespace detail {

// The value of the environment variable `name` when it is one of `allowed`; null when it is unset
// or empty. Any other value (a typo, another case) warns, naming the accepted ones, and counts as
// unset: it must not silently pick a slower path (Python shows such a warning once per place).
inline const char* env_knob(const char* name, std::initializer_list<const char*> allowed) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return nullptr;
  std::string names;
  for (const char* a : allowed) {
    if (std::strcmp(value, a) == 0) return value;
    names += names.empty() ? a : std::string(", ") + a;
  }
  KDA_WARN(name, "=", value, " is not one of ", names, "; ignored");
  return nullptr;
}

}  // namespace detail
}  // namespace kda
