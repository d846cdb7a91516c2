// The chunk kernels' bf16 products on the CPU's own hardware (csrc/cpu/chunk_products.h, gemm16
// with Products::kBf16: AMX, or AVX-512 BF16 dot products through ATen's cpublas::brgemm) against
// their emulation (kBf16Emulated: the same bf16 operands widened, the fp32 GEMM) and a float64
// product of the same rounded operands, on the shapes the chunk kernels use: M up to 64 rows, N in
// column blocks (64 with AMX, else 128) and a shorter last one, Kd = K, the chunk's columns, or
// K + V, and B packed with more rows than the product reads (lower_product's row blocks). A
// product of two bf16 numbers is exact in fp32, so the two paths differ only by the order of
// their fp32 sums.
// On a CPU without such hardware the test checks that the knob's bf16 falls back to the emulation.
#include "cpu/chunk_products.h"

#include <ATen/native/CPUBlas.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

namespace chunk = kda::detail::chunk;

struct Product {
  int64_t M, N, Kd;
  int64_t kb = 0;  // the rows B is packed with (0: Kd); the product reads the first Kd
  int64_t rows() const { return kb ? kb : Kd; }
};

// C = A B for one path (pack_b lays B out as that path reads it).
std::vector<float> run(chunk::Products mode, const Product& s, const std::vector<at::BFloat16>& a,
                       const std::vector<float>& b) {
  chunk::ProductWork p;
  p.mode = mode;
  std::vector<float> fa(s.M * s.Kd);  // the emulation's widened A rows
  p.fa = fa.data();
  std::vector<float> packed(s.rows() * s.N);  // fp32 rows (emulated) or 32-bit VNNI words
  chunk::pack_b(p, s.rows(), s.N, s.rows(), b.data(), s.N, packed.data());
  std::vector<float> c(s.M * s.N, 1.0f);
  chunk::gemm16(p, s.M, s.N, s.Kd, a.data(), s.Kd, packed.data(), c.data(), s.N, /*add=*/false,
                s.rows());
  at::native::cpublas::brgemm_release(mode == chunk::Products::kBf16);
  return c;
}

TEST(Bf16Products, HardwareMatchesEmulationAndFloat64) {
  if (!chunk::bf16_products_in_hardware()) {
    // No bf16 product hardware: the knob's bf16 must take the emulation, auto fp32 products.
    setenv("TORCH_KDA_CHUNK_PRODUCTS", "bf16", 1);
    EXPECT_EQ(chunk::choose_products(at::kBFloat16, 128, 128, "test: "),
              chunk::Products::kBf16Emulated);
    unsetenv("TORCH_KDA_CHUNK_PRODUCTS");
    EXPECT_EQ(chunk::choose_products(at::kBFloat16, 128, 128, "test: "),
              chunk::Products::kNative);
    return;
  }
  unsetenv("TORCH_KDA_CHUNK_PRODUCTS");
  EXPECT_EQ(chunk::choose_products(at::kBFloat16, 128, 128, "test: "), chunk::Products::kBf16);
  std::mt19937 gen(20261207);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const Product shapes[] = {{64, 128, 128},    {64, 256, 64},      {37, 128, 128},
                            {16, 80, 48},      {64, 64, 256},      {37, 208, 128},
                            {16, 128, 16, 32}, {16, 208, 48, 64}, {32, 256, 32, 64}};
  for (const Product& s : shapes) {
    std::vector<at::BFloat16> a(s.M * s.Kd);
    std::vector<float> b(s.rows() * s.N);
    for (auto& x : a) x = at::BFloat16(normal(gen));
    for (auto& x : b) x = static_cast<float>(at::BFloat16(normal(gen)));  // exact in bf16
    const std::vector<float> hw = run(chunk::Products::kBf16, s, a, b);
    const std::vector<float> emu = run(chunk::Products::kBf16Emulated, s, a, b);
    double err_hw = 0.0, err_emu = 0.0, norm = 0.0;
    for (int64_t i = 0; i < s.M; ++i) {
      for (int64_t j = 0; j < s.N; ++j) {
        double exact = 0.0;
        for (int64_t d = 0; d < s.Kd; ++d) {
          exact += static_cast<double>(static_cast<float>(a[i * s.Kd + d])) * b[d * s.N + j];
        }
        norm += exact * exact;
        err_hw += std::pow(hw[i * s.N + j] - exact, 2);
        err_emu += std::pow(emu[i * s.N + j] - exact, 2);
      }
    }
    // Relative RMS errors: fp32 sums of Kd exact products (~1e-7 of the result each).
    EXPECT_LT(std::sqrt(err_hw / norm), 1e-6) << s.M << "x" << s.N << "x" << s.Kd;
    EXPECT_LT(std::sqrt(err_emu / norm), 1e-6) << s.M << "x" << s.N << "x" << s.Kd;
  }
}

}  // namespace
