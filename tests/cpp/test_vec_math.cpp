// The pre-processing's float math (csrc/cpu/kernels/vec_math.h) on every instruction set this CPU
// runs (tests/cpp/vec_math_cases.cpp evaluates it per ISA), against double-precision libm: the
// gate's softplus, its sigmoid and the decay's exp within a few units in the last place over wide
// and near-zero inputs, the overflow and underflow edges, infinities, and NaN propagated; and the
// fp16 widening (half_to_float) exact for every one of the 65,536 fp16 bit patterns.
#include "cpu/kernels/recurrent_kernels.h"
#include "vec_math_cases.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using kda::kernels::kVecMathBlock;
using EvalFn = void (*)(const float*, int64_t, float*, float*, float*, float*);
using HalfFn = void (*)(const uint16_t*, int64_t, float*);

struct Isa {
  std::string name;
  EvalFn eval;
  HalfFn half;
};

// The ISAs this CPU runs: the one the library's dispatch chose (csrc/cpu/isa_dispatch.cpp, which
// TORCH_KDA_ISA may lower) and every narrower one.
std::vector<Isa> isas() {
  std::vector<Isa> all;
#if defined(KDA_HAVE_X86_ISAS)
  all.push_back({"avx512", &kda::kernels::avx512::vec_math_eval, &kda::kernels::avx512::half_eval});
  all.push_back({"avx2", &kda::kernels::avx2::vec_math_eval, &kda::kernels::avx2::half_eval});
#endif
  all.push_back({"generic", &kda::kernels::generic::vec_math_eval,
                 &kda::kernels::generic::half_eval});
  const std::string chosen = kda::kernels::table().isa;
  std::size_t first = 0;
  while (first < all.size() && all[first].name != chosen) ++first;
  return std::vector<Isa>(all.begin() + first, all.end());
}

// |got - ref| in units of the last place of ref rounded to float. Results below the smallest
// normal float count as exact when both are (the functions flush there, as documented).
double ulps(float got, double ref) {
  if (std::isnan(ref)) return std::isnan(got) ? 0 : 1e30;
  if (std::isinf(ref)) return got == static_cast<float>(ref) ? 0 : 1e30;
  const float r = static_cast<float>(ref);
  if (std::isinf(r)) return got == r ? 0 : 1e30;  // ref beyond the largest float
  const float tiny = std::numeric_limits<float>::min();
  if (std::fabs(r) < tiny) return std::fabs(got) < tiny ? 0 : 1e30;
  const double ulp = std::nextafter(std::fabs(r), INFINITY) - std::fabs(r);
  return std::fabs(got - ref) / ulp;
}

// Uniform over [-60, 60], normal around 0, the edges, infinities; one NaN at the end, then padding.
std::vector<float> inputs(uint32_t seed, int64_t* n_checked) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> wide(-60.0f, 60.0f);
  std::normal_distribution<float> around0(0.0f, 3.0f);
  std::vector<float> x;
  for (int i = 0; i < 200000; ++i) x.push_back(wide(rng));
  for (int i = 0; i < 200000; ++i) x.push_back(around0(rng));
  const float inf = std::numeric_limits<float>::infinity();
  for (float e : {0.0f, -0.0f, 1e-30f, -1e-30f, 19.9999f, 20.0f, 20.0001f, -87.0f, -87.5f, -88.0f,
                  -100.0f, 88.0f, 88.37f, 88.38f, 88.5f, 88.7f, 88.7228317f, 88.7228394f,
                  88.75f, 88.76f, 89.0f, 1e30f, -1e30f, inf, -inf}) {
    x.push_back(e);
  }
  *n_checked = static_cast<int64_t>(x.size());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  while (x.size() % kVecMathBlock != 0) x.push_back(0.5f);
  return x;
}

TEST(VecMath, SoftplusSigmoidExpWithinAFewUlpOnEveryIsaThisCpuRuns) {
  const std::vector<Isa> runnable = isas();
  ASSERT_FALSE(runnable.empty()) << "the dispatch chose an ISA this test does not know";
  for (const Isa& isa : runnable) {
    for (uint32_t seed : {1u, 2u}) {
      SCOPED_TRACE(isa.name + " seed " + std::to_string(seed));
      int64_t n_checked = 0;
      const std::vector<float> x = inputs(seed, &n_checked);
      const int64_t n = static_cast<int64_t>(x.size());
      std::vector<float> sp(n), sp2(n), sig(n), ex(n);
      isa.eval(x.data(), n, sp.data(), sp2.data(), sig.data(), ex.data());
      double sp_ulp = 0, sig_ulp = 0, ex_ulp = 0;
      int64_t forms_differ = 0;
      for (int64_t i = 0; i < n_checked; ++i) {
        const double z = x[i];
        // softplus keeps z above 20, as torch.nn.functional.softplus does
        sp_ulp = std::fmax(sp_ulp, ulps(sp[i], z > 20.0 ? z : std::log1p(std::exp(z))));
        sig_ulp = std::fmax(sig_ulp, ulps(sig[i], 1.0 / (1.0 + std::exp(-z))));
        // up to the largest float (88.7228317), then inf
        ex_ulp = std::fmax(ex_ulp, ulps(ex[i], std::exp(z)));
        forms_differ += sp2[i] != sp[i];
      }
      EXPECT_LE(ex_ulp, 1.5);   // a degree-6 polynomial after Cephes' range reduction
      EXPECT_LE(sp_ulp, 3.0);   // log1p through atanh's series, on the exp above
      EXPECT_LE(sig_ulp, 3.0);  // from the same exp and one division
      EXPECT_EQ(forms_differ, 0) << "vsoftplus_n and vsoftplus_sigmoid_n disagree";
      const int64_t nan_at = n_checked;
      EXPECT_TRUE(std::isnan(sp[nan_at]) && std::isnan(sp2[nan_at]) && std::isnan(sig[nan_at]) &&
                  std::isnan(ex[nan_at]));
    }
  }
}

// The fp16 value of bits h from its definition (sign, 5-bit exponent biased by 15, 10-bit
// mantissa with a hidden 1 for normal numbers), in double: the oracle of half_to_float.
double half_value(uint16_t h) {
  const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0x1F) {
    return mantissa ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  }
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

TEST(VecMath, HalfToFloatIsExactForEveryFp16OnEveryIsaThisCpuRuns) {
  std::vector<uint16_t> bits(1 << 16);
  for (int i = 0; i < (1 << 16); ++i) bits[i] = static_cast<uint16_t>(i);
  for (const Isa& isa : isas()) {
    SCOPED_TRACE(isa.name);
    std::vector<float> got(bits.size());
    isa.half(bits.data(), static_cast<int64_t>(bits.size()), got.data());
    int64_t wrong = 0;
    for (size_t i = 0; i < bits.size(); ++i) {
      const double want = half_value(bits[i]);
      const bool ok = std::isnan(want)
                          ? std::isnan(got[i]) && std::signbit(got[i]) == bool(bits[i] & 0x8000)
                          : static_cast<double>(got[i]) == want &&
                                std::signbit(got[i]) == std::signbit(want);
      if (!ok && wrong++ < 5) {
        ADD_FAILURE() << "fp16 bits 0x" << std::hex << bits[i] << ": got " << got[i];
      }
    }
    EXPECT_EQ(wrong, 0);
  }
}

}  // namespace
