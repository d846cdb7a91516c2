// Precision of the chunk forward's state products (csrc/cpu/chunk_common.h, state_step):
//   Vn = U - W S,   o = (Q . Gam) S + M Vn,   S <- Diag(Gam_last) S + Kdec^T Vn,
// and of its W/U solve (solve_wu): [-W | U] = T R with T = (I + A)^-1 (computed in fp32) and
// R = [-diag(beta) (Gam . K) | diag(beta) V].
// For bf16 / fp16 INPUTS these may run with bf16 operands and fp32 accumulation (the matrix
// engines of server CPUs: AMX tiles, or AVX-512 BF16 dot products, through ATen's
// cpublas::brgemm (oneDNN) on VNNI-packed B operands). The forward then applies T to the
// state's part of the right-hand side instead (state_step_bf16):
// Vn = T (beta V - (beta Gam . K) S), the same Vn with one product less. The running state,
// beta V and the outputs stay fp32; S, Vn, R', T, M and R are rounded to bf16 only as product
// operands (FLA's chunk kernels do the same).
// fp32 / fp64 inputs always keep fp32 / fp64 products. The chunk backward (chunk_bwd.cpp) has
// bf16 products of the same kind, chosen by the same rule.
//
// One knob, the environment variable TORCH_KDA_CHUNK_PRODUCTS, read at each call:
//   auto (default)  bf16 products for bf16 inputs where the CPU has bf16 product hardware that
//                   the GEMM library drives (bf16_products_in_hardware: AMX, or AVX-512 BF16);
//                   fp32 products elsewhere, where bf16 products would run ATen's slow fallback
//                   or oneDNN's software emulation, and for fp16 inputs (rounding their
//                   operands to bf16 would lose fp16's 3 extra mantissa bits);
//   fp32            fp32 products always;
//   bf16            bf16 products for 16-bit inputs everywhere: the real ones where the CPU has
//                   them (as auto), else an emulation with the same numerics (operands rounded to bf16, their
//                   products exact in fp32, fp32 accumulation through the fp32 GEMM) so the code
//                   path and its accuracy are testable on any CPU.
// bf16 products need K and V multiples of 16 (the packed layout's column blocks of 16..64 and
// the pairs of rows of VNNI); other head sizes keep fp32 products.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "cpu/carver.h"

namespace kda {
namespace detail {
namespace chunk {

enum class Products {
  kNative,        // the compute dtype's products (fp32 for 16-bit inputs)
  kBf16,          // bf16 operands, fp32 accumulation, ATen's cpublas::brgemm (packed B; AMX or
                  // AVX-512 BF16)
  kBf16Emulated,  // the same numerics through the fp32 GEMM
};

// Whether this CPU has AMX tiles for bf16 products (ATen packs bf16 operands itself:
// cpublas::could_pack).
bool amx_tiles();

// The shapes of the chunk forward's products: with AMX, where each product call costs more
// set-up (tile configurations), chunks of 64 tokens and one product per lower triangular factor;
// elsewhere chunks of 32 tokens and the triangular products in row blocks (chunk_fwd.cpp,
// lower_product in chunk_common.cpp). Reads TORCH_KDA_CHUNK_SHAPES at each call: auto (default:
// by amx_tiles()), amx or blocked (either shapes on any CPU, the same results to rounding: for
// tests of the other CPUs' path); an unknown value raises c10::Error naming it (`op` prefixes
// it).
bool amx_shapes(const char* op);

// Whether ATen's cpublas::brgemm runs bf16 products on this CPU's own bf16 hardware for B
// operands laid out by pack_b: AMX, or AVX-512 BF16 dot products (probed once per process), with
// oneDNN enabled (chunk_products.cpp).
bool bf16_products_in_hardware();

// The products of a chunk forward or backward with inputs of dtype `input` and head sizes K, V
// (reads TORCH_KDA_CHUNK_PRODUCTS; an unknown value raises c10::Error naming it; `op` prefixes
// it). The backward takes the forward's choice: with the forward's bf16 products the gradient of
// A_log (a sum with cancellation over all tokens and channels) already carries their error (up
// to 1.5e-2 relative to float64 on a small GVA / V-first problem), the backward's add little to
// it (1.9e-2) and make it ~15% faster on the 16-core AMX host; FLA's own kernels measured
// 1.2-2x our gradient errors on the same inputs (docs/benchmarks.md "Accuracy of the bf16
// products").
Products choose_products(at::ScalarType input, int64_t K, int64_t V, const char* op);

// Operands of the bf16 products. A operands (bf16, row-major, zero past the chunk's
// rows/columns where a product reads them); those of the forward's state step are per chunk
// (chunk::bind_results points them into the forward's store of chunk results):
//   qg    [kC, K]   (q_i . Gam_i), written by decays_and_am
//   kdecT [K, kC]   end-decayed keys, transposed, written by decays_and_am
//   nkg   [kC, K]   -beta_i Gam_i . k_i (the K part of the solve's right-hand side R), written
//                   by decays_and_am
//   m     [kC, kC]  M, rounded by forward_solve
//   tinv  [kC, kC]  (I + A)^-1 (per chunk in the forward; a part of the thread's workspace for
//                   the backward's W/U solve)
// B operands, parts of a thread's workspace (carver.h): S, Vn (or R') and the backward's solve
// right-hand side R [kC, K + V], rounded to bf16, laid out by pack_b:
//   s, vn, rhs      packed (kBf16) or rounded fp32 (kBf16Emulated)
//   fa              [max(K, kC), max(K, kC)] fp32 (emulation: an A operand widened)
struct ProductWork {
  Products mode = Products::kNative;
  bool whole = amx_tiles();  // one product per lower triangular factor (amx_shapes)
  at::BFloat16 *qg = nullptr, *kdecT = nullptr, *nkg = nullptr, *m = nullptr, *tinv = nullptr;
  void *s = nullptr, *vn = nullptr, *rhs = nullptr;
  float* fa = nullptr;
  // Takes its parts from c.
  ProductWork(Products mode, Carver& c, int64_t K, int64_t V);
  ProductWork() = default;
};

// The columns of the A operands / rows of the B operands of the products over a chunk's n tokens:
// n rounded up to the k-step of the products (16 = kSub: the VNNI pairs and the packed layout);
// the operands are zero past n.
inline int64_t product_cols(int64_t n) { return (n + 15) / 16 * 16; }

// Rows [r0, r1) of the B operand [Kd, N] of gemm16 (r0 even, r1 <= Kd; Kd and N multiples of
// 16), rounded to bf16 from the fp32 rows src + (r - r0) lds for r < have, zero for r >= have,
// written in the packed layout (kBf16: blocks of at most 64 columns with AMX, else 128, each
// [Kd / 2, width, 2], pairs of rows as 32-bit words: the VNNI layout ATen's cpublas::pack makes
// for brgemm, written in the rounding pass instead of rounding, then packing) or as rounded fp32
// rows (kBf16Emulated). A whole operand is pack_b; a row pair at a time suits rows made one by
// one.
void pack_b_rows(const ProductWork& p, int64_t Kd, int64_t N, int64_t r0, int64_t r1,
                 int64_t have, const float* src, int64_t lds, void* dst);
inline void pack_b(const ProductWork& p, int64_t Kd, int64_t N, int64_t rows, const float* src,
                   int64_t lds, void* dst) {
  pack_b_rows(p, Kd, N, 0, Kd, rows, src, lds, dst);
}

// pack_b of all Kd rows of src (Kd and N multiples of 16) into dst, and src's row r multiplied by
// scale[r] in place in the same pass (the state step's S packed, then Diag(Gam_last) S).
void pack_b_scaled(const ProductWork& p, int64_t Kd, int64_t N, float* src, int64_t lds,
                   const float* scale, void* dst);

// C[M, N] (+)= A[M, Kd] B[Kd, N]: A bf16 row-major (stride lda), B from pack_b, fp32 C. B may
// have been packed with more rows, kb (a multiple of 16, >= Kd): its first Kd rows are used.
void gemm16(const ProductWork& p, int64_t M, int64_t N, int64_t Kd, const at::BFloat16* A,
            int64_t lda, const void* B, float* C, int64_t ldc, bool add, int64_t kb = 0);

}  // namespace chunk
}  // namespace detail
}  // namespace kda
