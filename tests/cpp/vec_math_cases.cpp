// The float math of the pre-processing (csrc/cpu/kernels/vec_math.h: vexp_n, vsoftplus_n,
// vsoftplus_sigmoid_n, half_to_float) for one instruction set, evaluated on the inputs
// test_vec_math.cpp makes.
// Compiled once per ISA with the kernels' flags (CMakeLists.txt, KDA_ISA = avx512 | avx2 |
// generic), like the kernels themselves, so each build runs its own code paths (AVX-512's
// vrndscaleps and vscalefps, AVX2's vroundps, the generic vectors). As in the kernel files, no
// std:: template is instantiated here: a weak instance compiled with -mavx512f could be the one
// the linker keeps for every caller (the first version of this file drew its random inputs here
// and died of SIGILL on an AVX2 CPU).
#include "cpu/kernels/vec_math.h"
#include "vec_math_cases.h"

#include <cstring>

namespace kda {
namespace kernels {
namespace KDA_ISA {

void vec_math_eval(const float* x, int64_t n, float* softplus, float* softplus_with_sig,
                   float* sigmoid, float* exp) {
  typedef float VF __attribute__((vector_size(KDA_VEC_BYTES)));
  constexpr int64_t kLanes = KDA_VEC_BYTES / 4;
  constexpr int kGroup = 8;  // vectors per call, as the pre-processing pass runs them
  static_assert(kVecMathBlock % (kGroup * kLanes) == 0, "blocks of whole groups");
  for (int64_t i = 0; i < n; i += kGroup * kLanes) {
    VF sp[kGroup], sp2[kGroup], sig[kGroup], ex[kGroup];
    for (int c = 0; c < kGroup; ++c) {
      std::memcpy(&sp[c], x + i + c * kLanes, sizeof(VF));
      sp2[c] = ex[c] = sp[c];
    }
    vsoftplus_n<kGroup>(sp);
    vsoftplus_sigmoid_n<kGroup>(sp2, sig);
    vexp_n<kGroup>(ex);
    for (int c = 0; c < kGroup; ++c) {
      std::memcpy(softplus + i + c * kLanes, &sp[c], sizeof(VF));
      std::memcpy(softplus_with_sig + i + c * kLanes, &sp2[c], sizeof(VF));
      std::memcpy(sigmoid + i + c * kLanes, &sig[c], sizeof(VF));
      std::memcpy(exp + i + c * kLanes, &ex[c], sizeof(VF));
    }
  }
}

// half_to_float of each of n fp16 bit patterns.
void half_eval(const uint16_t* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(h[i]);
}

}  // namespace KDA_ISA
}  // namespace kernels
}  // namespace kda
