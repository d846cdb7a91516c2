// kda::detail::message (csrc/cpu/error_message.h) builds the native ops' error messages without
// iostreams (streaming a number crashed the process on one torch / compiler pairing,
// docs/benchmarks.md "Known problem: shape errors crash on the device"). Its text must be the one
// c10::str (what TORCH_CHECK would have printed) makes, so tests and users see the same words:
// here c10::str is safe, so the two are compared part type by part type.
#include "cpu/error_message.h"

#include <c10/util/StringUtil.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>

namespace {

using kda::detail::message;
using kda::detail::shape_str;

TEST(ErrorMessage, IntegersAsC10Str) {
  std::mt19937_64 rng(1234);
  for (int i = 0; i < 200; ++i) {
    const int64_t x = static_cast<int64_t>(rng());
    const int32_t y = static_cast<int32_t>(rng());
    const uint32_t z = static_cast<uint32_t>(rng());
    EXPECT_EQ(message("a ", x, ", ", y, ", ", z), c10::str("a ", x, ", ", y, ", ", z));
  }
  EXPECT_EQ(message(std::numeric_limits<int64_t>::min()), c10::str(std::numeric_limits<int64_t>::min()));
}

TEST(ErrorMessage, FloatsAsC10Str) {
  std::mt19937_64 rng(99);
  std::uniform_real_distribution<double> mant(-10.0, 10.0);
  std::uniform_int_distribution<int> ex(-40, 40);
  for (int i = 0; i < 500; ++i) {
    const double x = std::ldexp(mant(rng), ex(rng));
    const float f = static_cast<float>(x);
    EXPECT_EQ(message("v = ", x, "; f = ", f), c10::str("v = ", x, "; f = ", f)) << x;
  }
  for (double x : {0.0, -0.0, 1.0, 2.5, 1e-7, 123456789.0, std::numeric_limits<double>::infinity(),
                   -std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(message(x), c10::str(x)) << x;
  }
}

TEST(ErrorMessage, OtherPartsAsC10Str) {
  const std::string name = "initial_state";
  EXPECT_EQ(message(name, " must be ", at::kFloat, " on ", c10::Device(c10::kCPU), ", got ",
                    at::kBFloat16, '!', true, false),
            c10::str(name, " must be ", at::kFloat, " on ", c10::Device(c10::kCPU), ", got ",
                     at::kBFloat16, '!', true, false));
  const std::vector<int64_t> sizes = {2, 6, 0, 128};
  EXPECT_EQ(shape_str(sizes), c10::str(c10::IntArrayRef(sizes)));
  EXPECT_EQ(shape_str({}), c10::str(c10::IntArrayRef()));
}

}  // namespace
