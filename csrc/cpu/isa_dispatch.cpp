// Run-time choice of the instruction set for the recurrence kernels (see cmake/KdaKernels.cmake).
#include "cpu/env_knob.h"
#include "cpu/kernels/recurrent_kernels.h"

#include <cstdlib>
#include <cstring>

namespace kda {
namespace kernels {

namespace {
const Table& choose() {
  // TORCH_KDA_ISA=generic|avx2|avx512 lowers the choice (for testing); never raises it.
  const char* forced = detail::env_knob("TORCH_KDA_ISA", {"generic", "avx2", "avx512"});
  auto allowed = [&](const char* name) { return forced == nullptr || std::strcmp(forced, name) == 0; };
#if defined(KDA_HAVE_X86_ISAS)
  __builtin_cpu_init();
  if (allowed("avx512") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2")) {
    return avx512::get();
  }
  if ((allowed("avx2") || allowed("avx512")) && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return avx2::get();
  }
#endif
  return generic::get();
}
}  // namespace

const Table& table() {
  static const Table& t = choose();
  return t;
}

}  // namespace kernels
}  // namespace kda

#if !defined(KDA_HAVE_X86_ISAS)
// Only the generic kernels are compiled: give the other names a definition that is never chosen.
namespace kda { namespace kernels {
namespace avx512 { const Table& get() { return generic::get(); } }
namespace avx2 { const Table& get() { return generic::get(); } }
}}
#endif
