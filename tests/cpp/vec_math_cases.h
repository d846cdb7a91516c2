// The per-ISA entry of tests/cpp/vec_math_cases.cpp (see there and test_vec_math.cpp).
#pragma once

#include <cstdint>

namespace kda {
namespace kernels {

// Inputs a multiple of kVecMathBlock floats.
constexpr int64_t kVecMathBlock = 8 * 16;

#define KDA_DECLARE_VEC_MATH_CASES(isa)                                                   \
  namespace isa {                                                                         \
  void vec_math_eval(const float* x, int64_t n, float* softplus, float* softplus_with_sig, \
                     float* sigmoid, float* exp);                                         \
  void half_eval(const uint16_t* h, int64_t n, float* out);                               \
  }
KDA_DECLARE_VEC_MATH_CASES(avx512)
KDA_DECLARE_VEC_MATH_CASES(avx2)
KDA_DECLARE_VEC_MATH_CASES(generic)
#undef KDA_DECLARE_VEC_MATH_CASES

}  // namespace kernels
}  // namespace kda
