// Pieces of the chunkwise KDA shared by the native chunk forward (csrc/cpu/chunk_fwd.cpp) and
// the chunk backward, which recomputes a chunk's forward quantities with the same functions.
// Math: docs/math.md, "Chunkwise form" (the native chunk kernel).
//
// One chunk of n <= kChunk tokens of one (sequence, value head) is processed at a time, on rows
// of the pre-processed inputs (scale * qhat, khat, a = exp(g), beta, v: the chunk's own rows,
// pre-processed just before, in the forward; detail::preprocess's arrays in the backward) and
// a per-thread workspace (ChunkWork). Matrix products go through one GEMM wrapper (chunk::gemm:
// ATen's cpublas::brgemm for float, a plain loop for double); the rest is short loops over the
// K or V channels.
//
// Decay factors. Every factor exp(G_i - G_j) (G the cumulative log-decay in the chunk, j <= i)
// is formed as the PRODUCT of the per-step decays a_{j+1} ... a_i (each <= 1), never as a
// quotient of cumulative decays and never by exponentiating a cumulative sum. A product of
// factors <= 1 cannot overflow, an underflow to 0 happens only where the true value is below
// the smallest float, an infinite decay (g = -inf, a = 0) needs no clamping, and the relative
// error is that of the recurrence itself (one rounding per step). The cumulative-sum form loses
// accuracy after strong decays (float32 spacing of G ~ 1e-4 once G reaches thousands).
//
// Off-diagonal blocks of A and M (docs/math.md): the chunk is split into sub-blocks of kSub
// tokens; for a row block I starting at token b0 and the reference token r = b0 - 1,
//   exp(G_i - G_j) = [prod_{t=b0..i} a_t] * [prod_{t=j+1..r} a_t]     (i >= b0 > r >= j)
// so A0[I, :b0] = (K_I . Rf) (K_{<b0} . Cf)^T is one GEMM with both factors <= 1. A diagonal
// block joins that GEMM with the columns k_j / Rf_j (exp(G_i - G_j) = Rf_i / Rf_j) when the
// block's total decay keeps 1 / Rf_j <= e^60 on every channel (finite, never subnormal: the
// "provably safe" case). A block with a stronger decay takes the direct form, a running product
// p = k_j . a_{j+1} ... a_i per column (vectorised across the channels; a column stops once p is
// all zero, its later products being exactly 0).
// The column factors are kept from block to block: after row block I, every column j < b1
// (the older ones and the block's own: k_j / Rf_j in the factored case, a backward running
// product in the direct one) is multiplied by the block's total decay a_b0 ... a_{b1-1} (<= 1),
// which moves its reference to b1 - 1; after the last block they are the end-decayed keys
// Kdec^T of the state update. Columns whose factors are all zero are left out of the products.
#pragma once

#include <cstdint>

#include "cpu/chunk_products.h"
#include "cpu/clones.h"
#include "cpu/kernels/recurrent_kernels.h"

namespace kda {
namespace detail {
namespace chunk {

// Chunk length (the checkpoint interval of the recurrent forward: checkpoints are shared) and
// the sub-block length of A and M.
constexpr int64_t kC = kernels::kChunk;
constexpr int64_t kSub = 16;

// Smallest product of a diagonal block's decays for which that block's own pairs take the
// factored form, in the forward and the backward alike (docs/math.md, "Chunkwise form"): the
// column factors 1 / Rf_j are then at most e^60 (float) / e^600 (double), finite with room to
// spare for sums of K products, and no factor is subnormal. Stronger blocks take the direct form.
template <typename T>
inline constexpr T kMinBlockDecay = T(8.75651076e-27);  // e^-60
template <>
inline constexpr double kMinBlockDecay<double> = 2.6503965530043108e-261;  // e^-600

// The elementwise loops of the chunk code (decay products, factors, transposes, the backward's
// pair loops) are compiled per instruction set (KDA_CLONES, csrc/cpu/clones.h); the GEMMs pick
// their own kernels.

// C[M, N] = A[M, Kd] B[Kd, N] (+ C[M, N] when add), row-major with leading dimensions (elements).
// float: ATen's cpublas::brgemm (oneDNN micro-kernels; fp32 products, fp32 accumulation);
// double: a plain loop. Deterministic: the same shapes give the same bits on any thread.
void gemm(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool add);
void gemm(int64_t M, int64_t N, int64_t Kd, const double* A, int64_t lda, const double* B,
          int64_t ldb, double* C, int64_t ldc, bool add);
// Frees the GEMM library's per-thread state (with bf16 products too the AMX tile context, see
// chunk_products.h); call at the end of each thread's work.
void gemm_release(Products products = Products::kNative);

// Sets flush-to-zero and denormals-are-zero for the calling thread while alive (x86; no-op
// elsewhere). Products of decays reach the subnormal range after strong decays, where each
// operation can cost ~100 cycles on Intel CPUs (microcode assists; the likely cause of the
// chunk forward running at 0.08x of the recurrent one on the Xeon of docs/benchmarks.md with
// strongly decaying benchmark gates, where the AMD box ran it at 0.5x). A subnormal factor is a
// full forget in float (< 1.2e-38), so flushing it to 0 changes results far below rounding.
// Put one in each thread's work.
class FlushDenormals {
 public:
  FlushDenormals();
  ~FlushDenormals();
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_ = 0;
};

// One chunk of one (sequence, value head): n tokens (1 <= n <= kC), rows of the pre-processed
// arrays (compute dtype T).
template <typename T>
struct ChunkIn {
  int64_t n = 0, K = 0, V = 0;
  const T* q = nullptr;     // [n, K] scale * qhat, row stride K
  const T* k = nullptr;     // [n, K] khat
  const T* a = nullptr;     // [n, K] per-step decay exp(g)
  const T* beta = nullptr;  // [n]
  const T* v = nullptr;     // [n, V] values, row stride ldv
  int64_t ldv = 0;
};

// Workspace of one chunk (one per thread, reused by every chunk; ~320 KB at K = V = 128 in
// float). Layouts (row-major; rows past n are not read):
//   gam   [kC, K]        Gam_i = prod_{t<=i} a_t                        (Gam_last = row n-1)
//   qg    [kC, K]        q_i . Gam_i
//   kdecT [K, kC]        (k_i . prod_{t>i} a_t)^T, the decayed keys seen from the chunk end
//   am    [kC, 2, kC]    row i of A0 at am + 2 i kC (A0_ij = sum_d k_id k_jd exp(G_id - G_jd),
//                        j < i, else 0), row i of M at am + (2 i + 1) kC (j <= i, else 0), over
//                        columns j < ceil(n / kSub) * kSub
//   na    [kC, kC]       -beta_i A0_ij (j < i): minus A of docs/math.md (with bf16 products
//                        the solve overwrites it with T = (I + A)^-1)
//   x     [kC, K + V]    after solve_wu: [-W | U]; after state_step: [-W | Vn] (the bf16
//                        forward: V part beta V from decays_and_am, Vn after state_step)
//   rhs   [kSub, K + V]  (solve) one row block of [-diag(beta) (Gam . K) | diag(beta) V], then
//                        R_I - A[I, :b0] X[:b0]; with bf16 products row 0 a row of
//                        -beta Gam . K and row 2 a row of q . Gam before rounding
//   dinv  [kC / kSub, kSub, kSub]  (I + A_II)^-1 of each diagonal block II
//   lq    [2 kSub, K]    row factors of one row block, rows k_i . Rf_i and q_i . Rf_i interleaved
//   kr    [kSub, K]      (scratch: one block's column factors before their transposition)
//   krT   [K, kC]        (scratch: the column factors with bf16 products; else kdecT holds them)
//   w     [4 K]          (scratch: running products, the block's total decay, ones)
// With bf16 state products (prod.mode, float only; set by the forward) decays_and_am writes
// q . Gam, Kdec^T and -beta Gam . K as bf16 operands into prod (qg and kdecT above then are
// scratch or unused), and beta V into x's V columns.
template <typename T>
struct ChunkWork {
  T *gam, *qg, *kdecT, *am, *na, *x, *rhs, *dinv, *lq, *kr, *krT, *w;
  ProductWork prod;
  // Takes its parts from c (carver.h).
  ChunkWork(Carver& c, int64_t K, int64_t V);
};

// The results of chunk_intra that state_step reads (gam, qg, kdecT, am, x; with bf16 products
// prod.qg, prod.kdecT, prod.nkg, prod.tinv and prod.m instead of qg, kdecT and am), kept per
// chunk so that the state-independent part of many chunks can run in parallel before their
// state steps (csrc/cpu/chunk_fwd.cpp):
// w's result parts pointed at one chunk's store, taken from `store`; carving no memory counts
// the bytes of one chunk's results.
template <typename T>
void bind_results(ChunkWork<T>& w, Carver& store, int64_t K, int64_t V, bool bf16);

// Gam, q . Gam, the transposed end-decayed keys (gam, qg, kdecT), A0 and M (am) and
// -beta A0 (na), row block by row block, with one pass over each block's rows (with bf16
// products also the solve's right-hand side, staged for its product).
template <typename T>
void decays_and_am(const ChunkIn<T>& c, ChunkWork<T>& w);

// x = (I + A)^-1 [-diag(beta) (Gam . K) | diag(beta) V] = [-W | U] by blocked forward
// substitution: per row block, a GEMM with the blocks left of the diagonal and one with the
// diagonal block's inverse (dinv). With bf16 products (w.prod.mode, chunk_products.h) instead
// T = (I + A)^-1 by forward substitution in fp32, then one bf16 product T R. Needs
// decays_and_am.
template <typename T>
void solve_wu(const ChunkIn<T>& c, ChunkWork<T>& w);

// The bf16 solve's right-hand side R (rows [0, product_cols(n)), zero past n) packed into
// w.prod.rhs from gam: before solve_wu with bf16 products (the chunk backward, whose
// decays_and_am runs with fp32 products: it reads the fp32 q . Gam).
void pack_rhs(const ChunkIn<float>& c, ChunkWork<float>& w);

// The forward's solve (after decays_and_am): solve_wu, or with bf16 products only
// T = (I + A)^-1 (prod.tinv) and M (prod.m) rounded to bf16: state_step applies T to the
// right-hand side once the state's part is in it.
template <typename T>
void forward_solve(const ChunkIn<T>& c, ChunkWork<T>& w);

// All the state-independent quantities of the chunk: decays_and_am, forward_solve.
template <typename T>
void chunk_intra(const ChunkIn<T>& c, ChunkWork<T>& w);

// With S [K, V] (row stride V) the state entering the chunk (after chunk_intra):
//   x's U part becomes Vn = U - W S (bf16 products: Vn = T (beta V - (beta Gam . K) S)), the
//   chunk's output rows o [n, V] (row stride ldo: written by the products straight into the
//   caller's output) become (Q . Gam) S + M Vn, and S becomes the state leaving the chunk,
//   Diag(Gam_last) S + Kdec^T Vn. The products run in the precision of w.prod.mode
//   (chunk_products.h); S and Vn stay in T.
template <typename T>
void state_step(const ChunkIn<T>& c, ChunkWork<T>& w, T* S, T* o, int64_t ldo);

}  // namespace chunk
}  // namespace detail
}  // namespace kda
