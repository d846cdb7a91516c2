// The AMX bf16 tile product (csrc/cpu/amx_bf16.h) against a float64 product of the same bf16
// operands, over the row / column / depth edges the chunk forward uses (rows not a multiple of 16
// or 32, one 16-column tile left over, accumulate or overwrite), and its packed layout. On a CPU
// without AMX the packing is checked, and that the chunk forward does not choose the tile products.
#include "cpu/amx_bf16.h"
#include "cpu/chunk_products.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace {

namespace amx = kda::detail::amx;
namespace chunk = kda::detail::chunk;
using at::BFloat16;

std::vector<float> random_floats(int64_t n, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& e : x) e = dist(gen);
  return x;
}

TEST(AmxBf16, PackRoundsAndInterleavesPairsOfRows) {
  std::mt19937 gen(1);
  const int64_t Kd = 64, N = 48, rows = 37, lds = 50;
  const std::vector<float> src = random_floats(rows * lds, gen);
  std::vector<BFloat16> dst(Kd * N, BFloat16(7.0f));
  amx::pack_b(Kd, N, rows, src.data(), lds, dst.data());
  for (int64_t r = 0; r < Kd; ++r) {
    for (int64_t e = 0; e < N; ++e) {
      const float want = r < rows ? static_cast<float>(BFloat16(src[r * lds + e])) : 0.0f;
      const float got = static_cast<float>(dst[(r / 2) * 2 * N + 2 * e + (r % 2)]);
      ASSERT_EQ(got, want) << "row " << r << " column " << e;
    }
  }
}

TEST(AmxBf16, ProductMatchesFloat64OfTheSameOperands) {
  if (!amx::available()) {
    // Without AMX the chunk forward never chooses the tile products.
    EXPECT_NE(chunk::choose_products(at::kBFloat16, 128, 128, "test"), chunk::Products::kAmx);
    return;
  }
  std::mt19937 gen(2);
  for (int64_t M : {1, 5, 16, 17, 32, 45, 64, 128}) {
    for (int64_t N : {16, 48, 128}) {
      for (int64_t Kd : {32, 64, 128}) {
        for (bool add : {false, true}) {
          const int64_t lda = Kd + 16, ldc = N + 8, Mr = (M + 15) / 16 * 16;
          std::vector<BFloat16> A(Mr * lda);
          for (auto& e : A) e = BFloat16(random_floats(1, gen)[0]);
          const std::vector<float> Bf = random_floats(Kd * N, gen);
          std::vector<BFloat16> B(Kd * N);
          amx::pack_b(Kd, N, Kd, Bf.data(), N, B.data());
          std::vector<float> C = random_floats(M * ldc, gen), C0 = C;
          amx::gemm(M, N, Kd, A.data(), lda, B.data(), C.data(), ldc, add);
          for (int64_t i = 0; i < M; ++i) {
            for (int64_t e = 0; e < N; ++e) {
              double want = add ? C0[i * ldc + e] : 0.0, mag = std::abs(want);
              for (int64_t d = 0; d < Kd; ++d) {
                const double t = static_cast<double>(static_cast<float>(A[i * lda + d])) *
                                 static_cast<float>(BFloat16(Bf[d * N + e]));
                want += t;
                mag += std::abs(t);
              }
              ASSERT_NEAR(C[i * ldc + e], want, 1e-6 * mag)
                  << "M " << M << " N " << N << " Kd " << Kd << " add " << add << " at " << i
                  << ", " << e;
            }
            for (int64_t e = N; e < ldc; ++e) ASSERT_EQ(C[i * ldc + e], C0[i * ldc + e]);
          }
        }
      }
    }
  }
}

}  // namespace
