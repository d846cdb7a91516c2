// Run-time choice of the instruction set for the recurrence kernels (see cmake/KdaKernels.cmake).
#include "cpu/env_knob.h"
#include "cpu/kernels/recurrent_kernels.h"

#include <cstdlib>
#include <cstring>

#if defined(KDA_HAVE_X86_ISAS)
#include <cpuid.h>
#endif

namespace kda {
namespace kernels {

namespace {
#if defined(KDA_HAVE_X86_ISAS)
// F16C (the fp16 <-> fp32 conversions) from CPUID leaf 1: Clang's __builtin_cpu_supports does not
// know the name (Clang 14).
bool has_f16c() {
  unsigned int a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
#endif

const Table& choose() {
  // TORCH_KDA_ISA=generic|avx2|avx512 lowers the choice (for testing); never raises it.
  const char* forced = detail::env_knob("TORCH_KDA_ISA", {"generic", "avx2", "avx512"});
#if defined(KDA_HAVE_X86_ISAS)
  auto allowed = [&](const char* name) {
    return forced == nullptr || std::strcmp(forced, name) == 0;
  };
  __builtin_cpu_init();
  if (allowed("avx512") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2")) {
    return avx512::get();
  }
  if ((allowed("avx2") || allowed("avx512")) && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && has_f16c()) {
    return avx2::get();
  }
#else
  (void)forced;  // read for env_knob's check of the value; only x86-64 has a choice to make
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
