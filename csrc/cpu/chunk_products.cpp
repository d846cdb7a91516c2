// bf16 state products of the chunk forward (see chunk_products.h).
#include "cpu/chunk_products.h"

#include "cpu/chunk_common.h"
#include "cpu/chunk_vec.h"
#include "cpu/error_message.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kda {
namespace detail {
namespace chunk {

namespace {

// Column blocks of a packed B operand: the packing routine's output row length must be 16, 32,
// 48 or 64 (oneDNN's transform ukernel), so N is cut into blocks of 64 (the last one shorter,
// a multiple of 16), each packed as its own [Kd, width] matrix, one after the other.
constexpr int64_t kBlockN = 64;

}  // namespace

Products choose_products(at::ScalarType input, int64_t K, int64_t V, const char* op) {
  const char* env = std::getenv("TORCH_KDA_CHUNK_PRODUCTS");
  const std::string knob = env && *env ? env : "auto";
  KDA_CHECK(knob == "auto" || knob == "fp32" || knob == "bf16", op,
              "TORCH_KDA_CHUNK_PRODUCTS must be auto, fp32 or bf16, got '", knob, "'");
  const bool half = input == at::kBFloat16 || input == at::kHalf;
  if (!half || knob == "fp32" || K % 16 != 0 || V % 16 != 0) return Products::kNative;
  if (at::native::cpublas::could_pack(at::kBFloat16)) return Products::kBf16;
  return knob == "bf16" ? Products::kBf16Emulated : Products::kNative;
}

ProductWork::ProductWork(Products mode_, Carver& c, int64_t K, int64_t V) : mode(mode_) {
  const int64_t R = std::max(K, kC);
  nw = c.take<at::BFloat16>(kC * K);
  m = c.take<at::BFloat16>(kC * kC);
  tinv = c.take<at::BFloat16>(kC * kC);
  round = c.take<at::BFloat16>(std::max(R * V, kC * (K + V)));
  s = c.take<float>(K * V);  // packed bf16 needs half of this; the emulation's fp32 all of it
  vn = c.take<float>(kC * V);
  rhs = c.take<float>(kC * (K + V));
  fa = c.take<float>(R * R);
}

KDA_CLONES void pack_b(const ProductWork& p, int64_t Kd, int64_t N, int64_t rows,
                       const float* src, int64_t lds, void* dst) {
  for (int64_t r = 0; r < rows; ++r) stage_b_row(p, r, N, src + r * lds, dst);
  finish_b(p, Kd, N, rows, dst);
}

void finish_b(const ProductWork& p, int64_t Kd, int64_t N, int64_t rows, void* dst) {
  if (p.mode == Products::kBf16Emulated) {
    float* d = static_cast<float*>(dst);
    std::fill(d + rows * N, d + Kd * N, 0.0f);
    return;
  }
  at::BFloat16* b = p.round;
  std::fill(b + rows * N, b + Kd * N, at::BFloat16(0.0f));
  at::BFloat16* d = static_cast<at::BFloat16*>(dst);
  for (int64_t e0 = 0; e0 < N; e0 += kBlockN) {
    const int64_t width = std::min(kBlockN, N - e0);
    at::native::cpublas::pack(Kd, width, N, width, at::kBFloat16, at::kBFloat16, b + e0,
                              d + e0 * Kd);
  }
}

void gemm16(const ProductWork& p, int64_t M, int64_t N, int64_t Kd, const at::BFloat16* A,
            int64_t lda, const void* B, float* C, int64_t ldc, bool add) {
  if (M <= 0 || N <= 0) return;
  if (p.mode == Products::kBf16Emulated) {
    // bf16 x bf16 products are exact in fp32 (8 + 8 significant bits), so widening the operands
    // and running the fp32 GEMM gives the numerics of bf16 products with fp32 accumulation.
    for (int64_t i = 0; i < M; ++i) {
      const at::BFloat16* __restrict a = A + i * lda;
      float* __restrict f = p.fa + i * Kd;
      for (int64_t d = 0; d < Kd; ++d) f[d] = static_cast<float>(a[d]);
    }
    at::native::cpublas::brgemm(M, N, Kd, Kd, N, ldc, add, p.fa, static_cast<const float*>(B),
                                C, /*is_vnni=*/false);
    return;
  }
  const at::BFloat16* b = static_cast<const at::BFloat16*>(B);
  for (int64_t e0 = 0; e0 < N; e0 += kBlockN) {
    const int64_t width = std::min(kBlockN, N - e0);
    at::native::cpublas::brgemm(M, width, Kd, lda, width, ldc, add, A, b + e0 * Kd, C + e0,
                                /*is_vnni=*/true);
  }
}

}  // namespace chunk
}  // namespace detail
}  // namespace kda
