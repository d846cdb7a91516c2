// bf16 matrix products on Intel AMX tiles (TDPBF16PS: pairs of bf16 products summed into fp32),
// called directly instead of through ATen's cpublas::brgemm for the chunk forward's bf16 products
// (chunk_products.h). Why: at the chunk's shapes (M <= 128, N = V, Kd <= 128) each brgemm call
// costs a kernel-cache look-up and a tile configuration, and its packed B operand must be cut into
// 64-column blocks (a call and a packing call per block); here one call covers the whole product
// and the packing is one pass that also rounds to bf16.
//
// Layout of a packed B operand (the VNNI layout the tile multiply reads): B [Kd, N] as Kd / 2 rows
// of N pairs, pair (r, e) = {B[2r, e], B[2r + 1, e]}, row stride 2 N bf16.
//
// Numerics: the products of bf16 pairs are exact in fp32 and accumulated in fp32, in k-steps of 32
// (each step's 32 products summed by the hardware in a fixed order), the same on every thread and
// call: deterministic. The tile unit treats bf16 subnormals as zero and flushes subnormal results.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kda {
namespace detail {
namespace amx {

// Whether this CPU has AMX-TILE and AMX-BF16, the OS enables the tile state, and this process was
// granted the tile data (Linux asks each process to request it; requested here once). Cached.
bool available();

// dst: rows [0, rows) of the fp32 matrix src [., N] (row stride lds) rounded to bf16 as
// at::BFloat16 rounds (nearest even), rows [rows, Kd) zero, in the packed layout above
// (Kd even, N a multiple of 16; dst holds Kd * N bf16).
void pack_b(int64_t Kd, int64_t N, int64_t rows, const float* src, int64_t lds, at::BFloat16* dst);

// C[M, N] (+)= A[M, Kd] B[Kd, N]: A bf16 row-major (row stride lda; its rows up to the next
// multiple of 16 are read, the extra ones only feed results that are discarded), B from pack_b,
// C fp32 (row stride ldc; only rows [0, M) are read or written). Kd a multiple of 32, N of 16.
// Needs available(). Loads its own tile configuration on every call: callers end their thread's
// work with chunk::gemm_release, which releases the tiles (for ATen's brgemm cache too).
void gemm(int64_t M, int64_t N, int64_t Kd, const at::BFloat16* A, int64_t lda,
          const at::BFloat16* B, float* C, int64_t ldc, bool add);

}  // namespace amx
}  // namespace detail
}  // namespace kda
