// The CPU's own float -> bf16 conversion (csrc/cpu/chunk_vec.h, kBf16Convert: AVX512_BF16's
// vcvtne2ps2bf16) against the integer rounding it replaces (bf16_bits, the bits of
// at::BFloat16(float)): the same bits for every normal, zero and infinite value (round to nearest
// even, ties included), a zero of the same sign for a subnormal and a NaN for a NaN (the products
// read both alike); row tails that are not whole vectors; the VNNI row pairs. On a CPU without
// the instruction the functions are not called (round_bf16 keeps the integer path, which the
// first test then checks; the second checks that kBf16Convert says what the CPU has).
#include "cpu/chunk_vec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

namespace chunk = kda::detail::chunk;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Random floats of every exponent, with rounding ties, the extremes, zeros, infinities, NaNs and
// subnormals mixed in.
std::vector<float> values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> x(n);
  const float special[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::min(), from_bits(0x3F808000u),  // tie, even
                           from_bits(0x3F818000u),                                     // tie, odd
                           from_bits(0x7F7FFFFFu),  // rounds up to inf
                           std::numeric_limits<float>::quiet_NaN(), from_bits(0xFF800001u),
                           from_bits(0x00000001u), from_bits(0x807FFFFFu)};
  const int64_t ns = sizeof(special) / sizeof(special[0]);
  for (int64_t i = 0; i < n; ++i) x[i] = i % 7 == 3 ? special[(i / 7) % ns] : from_bits(rng());
  return x;
}

// What the products read for a bf16 value: subnormals as zero (AMX; the emulation runs under
// FlushDenormals), any NaN as a NaN.
void expect_same_operand(uint16_t got, uint32_t want, float x) {
  const float g = from_bits(uint32_t(got) << 16), w = from_bits(want << 16);
  if (std::isnan(x)) {
    EXPECT_TRUE(std::isnan(g)) << x;
  } else if (std::fpclassify(x) == FP_SUBNORMAL) {
    EXPECT_EQ(g, 0.0f) << x;
    EXPECT_EQ(std::signbit(g), std::signbit(x)) << x;
  } else {
    EXPECT_EQ(got, want) << x;
    EXPECT_FALSE(std::isnan(w));
  }
}

TEST(Bf16Convert, RoundBf16MatchesIntegerRounding) {
  for (int64_t n : {1, 8, 15, 16, 17, 31, 32, 33, 64, 100, 257}) {
    const std::vector<float> x = values(n, 17 + static_cast<uint32_t>(n));
    std::vector<at::BFloat16> y(n);
    chunk::round_bf16(x.data(), y.data(), n);  // the converter where the CPU has it, else integer
    for (int64_t e = 0; e < n; ++e) {
      uint16_t got;
      std::memcpy(&got, &y[e], sizeof(got));
      if (!chunk::kBf16Convert || n < 16) {
        EXPECT_EQ(got, chunk::bf16_bits(x[e])) << n << " " << e;  // the integer path itself
      } else {
        expect_same_operand(got, chunk::bf16_bits(x[e]), x[e]);
      }
    }
  }
}

TEST(Bf16Convert, PackPairsAsVnniWords) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  EXPECT_EQ(chunk::kBf16Convert,
            __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"));
#else
  EXPECT_FALSE(chunk::kBf16Convert);
#endif
  // Without the instruction pack_pair_convert is never called (pack_b_rows checks kBf16Convert).
  if (!chunk::kBf16Convert) return;
  for (int64_t n : {16, 20, 48, 64}) {
    const std::vector<float> x0 = values(n, 5), x1 = values(n, 6);
    std::vector<uint32_t> y(n, 0xDEADBEEFu), z(n, 0xDEADBEEFu);
    chunk::pack_pair_convert(x0.data(), x1.data(), y.data(), n);
    chunk::pack_pair_convert(x0.data(), nullptr, z.data(), n);
    for (int64_t e = 0; e < n; ++e) {
      expect_same_operand(uint16_t(y[e] & 0xFFFFu), chunk::bf16_bits(x0[e]), x0[e]);
      expect_same_operand(uint16_t(y[e] >> 16), chunk::bf16_bits(x1[e]), x1[e]);
      expect_same_operand(uint16_t(z[e] & 0xFFFFu), chunk::bf16_bits(x0[e]), x0[e]);
      EXPECT_EQ(z[e] >> 16, 0u);  // no second row: zero
    }
  }
}

}  // namespace
