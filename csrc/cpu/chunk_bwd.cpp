// CPU chunkwise backward of KDA (docs/math.md "Chunkwise backward").
//
// Units are (sequence, value head). A unit runs its chunks (the kChunk-token chunks of the
// forward's checkpoints) from last to first: it recomputes the chunk's forward quantities from the
// checkpoint with the pieces of csrc/cpu/chunk_common.h (Gam, A0, M, (I + A)^-1 [.. | ..], Vn),
// then applies the backward of the chunk formulas, which gives the gradients of the chunk's
// tokens w.r.t. the pre-processed inputs and the gradient of the state entering the chunk (passed
// on to the previous chunk). Matrix products go through chunk::gemm; the rest is short loops over
// K or V channels in a per-thread workspace. The units run in the token blocks of
// csrc/cpu/bwd_common.cpp (run_bwd_blocked, shared with the recurrent backward), which also
// pre-processes each block's rows and runs the chain rule through the pre-processing (l2 norm,
// gates, sigmoid beta, grouped heads) over them.
//
// The channel loops carry KDA_IVDEP (chunk_vec.h): their rows are distinct, but GCC cannot prove
// it through the workspace struct and left them scalar (measured: the diagonal-block pair loop,
// the per-token rows and the factor rows ran as vmulss / vmovss, ~1/3 of the backward's loops).
//
// Determinism: units and chunk boundaries depend on the shapes only; a unit runs on one thread
// and every sum in it runs in a fixed order, so results are bitwise identical for any thread
// count.
#include "cpu/chunk_common.h"
#include "cpu/chunk_vec.h"
#include "cpu/kda_cpu.h"
#include "cpu/output_cache.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace kda {
namespace detail {

namespace {

using chunk::kC;
using chunk::kSub;

using chunk::any_nonzero;
using chunk::kMinBlockDecay;

// sum_d x_d y_d, d < n, in 16 partial sums and then a fixed tree: the same bits on any thread, and
// the loop vectorizes (a single running sum keeps it scalar without -ffast-math).
template <typename T>
inline T dot(const T* __restrict x, const T* __restrict y, int64_t n) {
  T acc[16] = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int l = 0; l < 16; ++l) acc[l] += x[d + l] * y[d + l];
  }
  for (int l = 0; d < n; ++d, ++l) acc[l] += x[d] * y[d];
  for (int w = 8; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// The backward's part of a thread's workspace (row-major; ld = K + V). Names follow
// docs/math.md "Chunkwise backward"; NW = -W (chunk_common keeps W negated).
template <typename T>
struct BwdWork {
  const T* S;  // [K, V]   state entering the chunk (the checkpoint, h0 or zero)
  T* zero;     // [K, V]   zeros (the state entering a sequence without h0)
  T* ST;     // [V, K]
  T* dS;     // [K, V]     gradient w.r.t. the state leaving the chunk (then entering it)
  T* dST;    // [V, K]
  T* dSnew;  // [K, V]
  const T* xu;  // [kC, ld] [NW | U]: the solve's result in the ChunkWork
  T* xuT;    // [ld, kC]
  T* vn;     // [kC, V]    Vn = U - W S
  T* vnT;    // [V, kC]
  T* X;      // [2 kC, V]  rows 0..n: dO, rows n..2n: dVn
  T* Y;      // [2 kC, K]  X S^T: rows 0..n: d(Q . Gam), rows n..2n: dNW = dVn S^T
  T* mT;     // [kC, kC]   M^T
  T* naT;    // [kC, kC]   (-A)^T
  T* kdec;   // [kC, K]    Kdec_i = k_i exp(G_last - G_i)
  T* edec;   // [kC, K]    exp(G_last - G_i)
  T* dkdec;  // [kC, K]
  T* qwT;    // [K, 2 kC]  [(Q . Gam)^T | NW^T]
  T* dR;     // [kC, ld]   gradient w.r.t. the right-hand sides [-B (Gam . K) | B V]
  T* dam;    // [2 kC, kC] row 2i: dA0_i (j < i), row 2i + 1: dM_i (j <= i)
  T* damT;   // [kC, 2 kSub]
  T* lq;     // [2 kSub, K] interleaved row factors k_i Rf_i, q_i Rf_i of one row block
  T* dlq;    // [2 kSub, K]
  T* dlq2;   // [2 kSub, K]
  T* rf;     // [kSub, K]  Rf_i = exp(G_i - G_r)
  T* cf;     // [kC, K]    Cf_j = exp(G_r - G_j)
  T* kr;     // [kC, K]    k_j Cf_j
  T* dkr;    // [kC, K]
  T* dq;     // [kC, K]
  T* dk;     // [kC, K]
  T* run;    // [K]
  T* run2;   // [K] scratch: running products, Gam_i . k_i, the dg row before its select
  T* ybuf;   // [kSub, K]  pair terms of one column of a diagonal block
  T* dgd;    // [kSub, K]  the diagonal block's dg
  // The gradient w.r.t. g, in double (see "G = cumsum(g)" in chunk_backward): dG [kC, K] w.r.t.
  // the cumulative log decay G (summed in reverse into dg), dgx [kC, K] added to dg directly,
  // acc [2 K].
  double *dG, *dgx, *acc;

  // Takes its parts from c (carver.h).
  BwdWork(Carver& c, int64_t K, int64_t V) {
    const int64_t ld = K + V;
    zero = c.take<T>(K * V);
    ST = c.take<T>(K * V);
    dS = c.take<T>(K * V);
    dST = c.take<T>(K * V);
    dSnew = c.take<T>(K * V);
    xuT = c.take<T>(kC * ld);
    dR = c.take<T>(kC * ld);
    vn = c.take<T>(kC * V);
    vnT = c.take<T>(kC * V);
    X = c.take<T>(2 * kC * V);
    Y = c.take<T>(2 * kC * K);
    mT = c.take<T>(kC * kC);
    naT = c.take<T>(kC * kC);
    kdec = c.take<T>(kC * K);
    edec = c.take<T>(kC * K);
    dkdec = c.take<T>(kC * K);
    qwT = c.take<T>(K * 2 * kC);
    dam = c.take<T>(2 * kC * kC);
    damT = c.take<T>(kC * 2 * kSub);
    lq = c.take<T>(2 * kSub * K);
    dlq = c.take<T>(2 * kSub * K);
    dlq2 = c.take<T>(2 * kSub * K);
    rf = c.take<T>(kSub * K);
    cf = c.take<T>(kC * K);
    kr = c.take<T>(kC * K);
    dkr = c.take<T>(kC * K);
    dq = c.take<T>(kC * K);
    dk = c.take<T>(kC * K);
    run = c.take<T>(K);
    run2 = c.take<T>(K);
    ybuf = c.take<T>(kSub * K);
    dgd = c.take<T>(kSub * K);
    dG = c.take<double>(kC * K);
    dgx = c.take<double>(kC * K);
    acc = c.take<double>(2 * K);
  }
};

// Operands of the backward's bf16 products (bf16 / fp16 inputs, chunk_products.h), float only.
// A operands are bf16 row-major; B operands are laid out by pack_b (packed bf16, or rounded fp32
// in the emulation) in three slots reused along the chunk (sizes for the emulation's fp32).
struct BwdProducts {
  chunk::ProductWork p;  // the solve's parts (chunk_common's solve_wu, pack_rhs)
  at::BFloat16* x;       // [2 kC, V]   [dO; dVn]
  at::BFloat16* nw;      // [kC, K]     NW
  at::BFloat16* dr;      // [kC, ld]    dR
  at::BFloat16* qgT;     // [K, kC]     (Q . Gam)^T, zero past n
  at::BFloat16* nwT;     // [K, kC]     NW^T, zero past n
  at::BFloat16* mT;      // [kC, kC]    M^T, zero past n
  at::BFloat16* tT;      // [kC, kC]    T^T = (I + A)^-T, zero past n
  void* slot[3];         // packed B operands

  BwdProducts(chunk::Products mode, Carver& c, int64_t K, int64_t V) : p(mode, c, K, V) {
    const int64_t ld = K + V;
    // The backward's A operands reach [2 kC, K + V] elements: a larger widening buffer for the
    // emulation than the forward's.
    p.fa = c.take<float>(2 * kC * ld);
    x = c.take<at::BFloat16>(2 * kC * V);
    nw = c.take<at::BFloat16>(kC * K);
    dr = c.take<at::BFloat16>(kC * ld);
    qgT = c.take<at::BFloat16>(K * kC);
    nwT = c.take<at::BFloat16>(K * kC);
    mT = c.take<at::BFloat16>(kC * kC);
    tT = c.take<at::BFloat16>(kC * kC);
    for (void*& s : slot) s = c.take<float>(std::max(K * V, kC * ld));
  }
};

// Where one chunk's rows are: its first token, and the rows of that token in the block arrays
// (the pre-processed inputs and the partials) and in v and grad_o (run_bwd_blocked's rows).
struct ChunkAt {
  int64_t token = 0, row = 0, vo_row = 0;
};

// The pairs j <= i of the diagonal block [b0, b1) in the direct form: exp(G_i - G_j) is the
// running product a_{j+1}..a_i. Adds to dq and dk (with kWithQK) and to dgx: pair (i, j) reaches
// dg_t for j < t <= i, so for each column j the suffix sums over i of its pair terms y_ij give
// dg_t directly: only terms that involve g_t are summed (no cancellation; reversing dG instead
// would form dg_t as a difference of larger sums, and give a token after the loss's last one a
// gradient of pure rounding instead of exactly 0).
template <typename T, bool kWithQK>
inline void direct_diagonal_block(const chunk::ChunkIn<T>& c, int64_t b0, int64_t b1,
                                  BwdWork<T>& bw) {
  const int64_t K = c.K;
  T* __restrict p = bw.run2;
  T* __restrict dgd = bw.dgd;  // [kSub, K]: the block's dg_t, t = b0 + row
  std::fill(dgd, dgd + (b1 - b0) * K, T(0));
  for (int64_t j = b0; j < b1; ++j) {
    const T* __restrict kj = c.k + j * K;
    const T* __restrict qj = c.q + j * K;
    T* __restrict dkj = bw.dk + j * K;
    {
      const T tm = bw.dam[(2 * j + 1) * kC + j];
      T* __restrict dqj = bw.dq + j * K;
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) {
        if (kWithQK) {
          dqj[d] += tm * kj[d];
          dkj[d] += tm * qj[d];
        }
        p[d] = T(1);
      }
    }
    int64_t last = b1;  // pairs (i >= last, j) are exactly 0
    for (int64_t i = j + 1; i < b1; ++i) {
      // Strong decays: once the running product is 0 on every channel (flushed to zero), the
      // pairs (i' >= i, j) contribute exactly nothing.
      if (i > j + 1 && !any_nonzero(p, K)) {
        last = i;
        break;
      }
      const T ta = bw.dam[2 * i * kC + j], tm = bw.dam[(2 * i + 1) * kC + j];
      const T* __restrict ai = c.a + i * K;
      const T* __restrict ki = c.k + i * K;
      const T* __restrict qi = c.q + i * K;
      T* __restrict dki = bw.dk + i * K;
      T* __restrict dqi = bw.dq + i * K;
      T* __restrict y = bw.ybuf + (i - b0) * K;
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) {
        p[d] *= ai[d];
        const T x = (ta * ki[d] + tm * qi[d]) * p[d];
        if (kWithQK) {
          const T kje = kj[d] * p[d];
          dki[d] += ta * kje;
          dqi[d] += tm * kje;
          dkj[d] += x;
        }
        y[d] = x * kj[d];
      }
    }
    // dg_t += sum_{t <= i < last} y_ij for t in (j, last)
    T* __restrict sum = p;
    for (int64_t d = 0; d < K; ++d) sum[d] = T(0);
    for (int64_t i = last - 1; i > j; --i) {
      const T* __restrict y = bw.ybuf + (i - b0) * K;
      T* __restrict dg = dgd + (i - b0) * K;
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) {
        sum[d] += y[d];
        dg[d] += sum[d];
      }
    }
  }
  for (int64_t t = b0 + 1; t < b1; ++t) {
    const T* __restrict dg = dgd + (t - b0) * K;
    double* __restrict dgx = bw.dgx + t * K;
    KDA_IVDEP
    for (int64_t d = 0; d < K; ++d) dgx[d] += static_cast<double>(dg[d]);
  }
}

// The products of the chunk backward in the compute dtype's precision, up to the per-token rows
// (bw.xu, bw.kdec and dO in bw.X's first n rows on entry): Vn; dVn (bw.X's rows n..2n);
// [d(Q . Gam); dNW] (bw.Y); dKdec; dSnew without its Diag(Gam_last) dS_next term; dR; dA0 (before
// its sign and beta) and dM (bw.dam).
template <typename T>
KDA_ALWAYS_INLINE void state_products(const chunk::ChunkIn<T>& c, chunk::ChunkWork<T>& cw,
                                      BwdWork<T>& bw) {
  const int64_t n = c.n, K = c.K, V = c.V, ld = K + V;
  const int64_t nb = (n + kSub - 1) / kSub;
  // Vn = U + NW S
  for (int64_t i = 0; i < n; ++i) std::memcpy(bw.vn + i * V, bw.xu + i * ld + K, sizeof(T) * V);
  chunk::gemm(n, V, K, bw.xu, ld, bw.S, V, bw.vn, V, /*add=*/true);
  // ---- O = (Q . Gam) S + M Vn,  S_next = Diag(Gam_last) S + Kdec^T Vn ----
  T* dVn = bw.X + n * V;
  // dVn = M^T dO + Kdec dS_next
  chunk::transpose(cw.am + kC, n, n, 2 * kC, bw.mT, kC);
  chunk::gemm(n, V, n, bw.mT, kC, bw.X, V, dVn, V, /*add=*/false);
  chunk::gemm(n, V, K, bw.kdec, K, bw.dS, V, dVn, V, /*add=*/true);
  // [d(Q . Gam); dNW] = [dO; dVn] S^T   (Vn = U + NW S gives dNW = dVn S^T)
  chunk::transpose(bw.S, K, V, V, bw.ST, K);
  chunk::gemm(2 * n, K, V, bw.X, V, bw.ST, K, bw.Y, K, /*add=*/false);
  // dKdec = Vn dS_next^T
  chunk::transpose(bw.dS, K, V, V, bw.dST, K);
  chunk::gemm(n, K, V, bw.vn, V, bw.dST, K, bw.dkdec, K, /*add=*/false);
  // dS = (Q . Gam)^T dO + NW^T dVn (+ Diag(Gam_last) dS_next, added by the caller)
  chunk::transpose(cw.qg, n, K, K, bw.qwT, 2 * kC);
  chunk::transpose(bw.xu, n, K, ld, bw.qwT + n, 2 * kC);
  chunk::gemm(K, V, 2 * n, bw.qwT, 2 * kC, bw.X, V, bw.dSnew, V, /*add=*/false);

  // ---- through the solve: [NW | U] = (I + A)^-1 R,  R = [-B (Gam . K) | B V] ----
  // dR = (I + A)^-T [dNW | dVn], by backward substitution, row block by row block from the last.
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(bw.dR + i * ld, bw.Y + (n + i) * K, sizeof(T) * K);
    std::memcpy(bw.dR + i * ld + K, dVn + i * V, sizeof(T) * V);
  }
  // (only the strictly lower part of na is read below)
  chunk::transpose(cw.na, n, n, kC, bw.naT, kC);
  for (int64_t I = nb - 1; I >= 0; --I) {
    const int64_t b0 = I * kSub, b1 = std::min(n, b0 + kSub);
    // dR_i += sum_{m >= b1} na_mi dR_m   (na = -A)
    if (b1 < n) {
      chunk::gemm(b1 - b0, ld, n - b1, bw.naT + b0 * kC + b1, kC, bw.dR + b1 * ld, ld,
                  bw.dR + b0 * ld, ld, /*add=*/true);
    }
    for (int64_t i = b1 - 2; i >= b0; --i) {
      T* __restrict ri = bw.dR + i * ld;
      for (int64_t m = i + 1; m < b1; ++m) {
        const T s = cw.na[m * kC + i];
        const T* __restrict rm = bw.dR + m * ld;
        for (int64_t e = 0; e < ld; ++e) ri[e] += s * rm[e];
      }
    }
  }
  // dA = -strict_tril(dR [NW | U]^T);  dM = tril(dO Vn^T)
  chunk::transpose(bw.xu, n, ld, ld, bw.xuT, kC);
  chunk::gemm(n, n, ld, bw.dR, ld, bw.xuT, kC, bw.dam, 2 * kC, /*add=*/false);
  chunk::transpose(bw.vn, n, V, V, bw.vnT, kC);
  chunk::gemm(n, n, V, bw.X, V, bw.vnT, kC, bw.dam + kC, 2 * kC, /*add=*/false);
}

// state_products with bf16 operands and fp32 accumulation (bf16 / fp16 inputs, chunk_products.h:
// the operands rounded to bf16 only as operands, every result fp32, as the forward's products),
// except the two products with dS_next, the gradient w.r.t. the state leaving the chunk: through
// Kdec dS_next and Vn dS_next^T the gradient of every later token reaches this chunk's, and with
// those rounded to bf16 too the gradients of beta, v and A_log of a small problem (K = 16, V = 32,
// T = 150, tests/test_chunk_products.py) went from 0.002-0.005 to 0.007-0.0081 relative RMS
// against float64, at FLA's bar of 0.008; they stay fp32 (4 of the chunk's ~19 MFLOP in
// products). The solve ran in its bf16 form, which leaves T = (I + A)^-1 in cw.na:
// dR = T^T [dNW | dVn] is one product instead of the substitution (T rounded to bf16 as the
// forward's X = T R had it). Products over the chunk's tokens run over product_cols(n) columns
// with zeros past n.
KDA_ALWAYS_INLINE void state_products_bf16(const chunk::ChunkIn<float>& c,
                                           chunk::ChunkWork<float>& cw, BwdWork<float>& bw,
                                           BwdProducts& bp) {
  using chunk::gemm16;
  using chunk::pack_b;
  using chunk::round_bf16;
  using chunk::transpose;
  using chunk::zero_cols;
  const int64_t n = c.n, K = c.K, V = c.V, ld = K + V;
  const int64_t ncol = chunk::product_cols(n);
  const chunk::ProductWork& p = bp.p;
  // Vn = U + NW S (the forward's product, the same bits)
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(bw.vn + i * V, bw.xu + i * ld + K, sizeof(float) * V);
    round_bf16(bw.xu + i * ld, bp.nw + i * K, K);
  }
  pack_b(p, K, V, K, bw.S, V, bp.slot[0]);
  gemm16(p, n, V, K, bp.nw, K, bp.slot[0], bw.vn, V, /*add=*/true);
  // dVn = M^T dO + Kdec dS_next (dO packed in slot 1 until dS)
  float* dVn = bw.X + n * V;
  transpose(cw.am + kC, n, n, 2 * kC, bp.mT, kC);
  zero_cols(bp.mT, n, kC, n, ncol);
  pack_b(p, ncol, V, n, bw.X, V, bp.slot[1]);
  gemm16(p, n, V, ncol, bp.mT, kC, bp.slot[1], dVn, V, /*add=*/false);
  chunk::gemm(n, V, K, bw.kdec, K, bw.dS, V, dVn, V, /*add=*/true);
  // [d(Q . Gam); dNW] = [dO; dVn] S^T
  round_bf16(bw.X, bp.x, 2 * n * V);
  transpose(bw.S, K, V, V, bw.ST, K);
  pack_b(p, V, K, V, bw.ST, K, bp.slot[0]);
  gemm16(p, 2 * n, K, V, bp.x, V, bp.slot[0], bw.Y, K, /*add=*/false);
  // dKdec = Vn dS_next^T
  transpose(bw.dS, K, V, V, bw.dST, K);
  chunk::gemm(n, K, V, bw.vn, V, bw.dST, K, bw.dkdec, K, /*add=*/false);
  // dS = (Q . Gam)^T dO + NW^T dVn (+ Diag(Gam_last) dS_next, added by the caller)
  transpose(cw.qg, n, K, K, bp.qgT, kC);
  zero_cols(bp.qgT, K, kC, n, ncol);
  transpose(bw.xu, n, K, ld, bp.nwT, kC);
  zero_cols(bp.nwT, K, kC, n, ncol);
  pack_b(p, ncol, V, n, dVn, V, bp.slot[0]);
  gemm16(p, K, V, ncol, bp.qgT, kC, bp.slot[1], bw.dSnew, V, /*add=*/false);
  gemm16(p, K, V, ncol, bp.nwT, kC, bp.slot[0], bw.dSnew, V, /*add=*/true);
  // dR = T^T [dNW | dVn]
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(bw.dR + i * ld, bw.Y + (n + i) * K, sizeof(float) * K);
    std::memcpy(bw.dR + i * ld + K, dVn + i * V, sizeof(float) * V);
  }
  pack_b(p, ncol, ld, n, bw.dR, ld, bp.slot[2]);
  transpose(cw.na, n, n, kC, bp.tT, kC);
  zero_cols(bp.tT, n, kC, n, ncol);
  gemm16(p, n, ld, ncol, bp.tT, kC, bp.slot[2], bw.dR, ld, /*add=*/false);
  // dA = -strict_tril(dR [NW | U]^T);  dM = tril(dO Vn^T)  (columns up to ncol; those past n
  // are not read)
  round_bf16(bw.dR, bp.dr, n * ld);
  transpose(bw.xu, n, ld, ld, bw.xuT, kC);
  zero_cols(bw.xuT, ld, kC, n, ncol);
  pack_b(p, ld, ncol, ld, bw.xuT, kC, bp.slot[2]);
  gemm16(p, n, ncol, ld, bp.dr, ld, bp.slot[2], bw.dam, 2 * kC, /*add=*/false);
  transpose(bw.vn, n, V, V, bw.vnT, kC);
  zero_cols(bw.vnT, V, kC, n, ncol);
  pack_b(p, V, ncol, V, bw.vnT, kC, bp.slot[2]);
  gemm16(p, n, ncol, V, bp.x, V, bp.slot[2], bw.dam + kC, 2 * kC, /*add=*/false);
}

// The backward of one chunk (docs/math.md "Chunkwise backward"), tokens [place.token,
// place.token + c.n) of value head hv: S0 the state entering the chunk (null: zeros), bw.dS the gradient w.r.t. the state
// leaving it on entry and w.r.t. the state entering it on return. bp: the bf16 products' parts
// (null: the compute dtype's products).
template <typename T>
KDA_CLONES void chunk_backward(const kernels::BwdArgs<T>& A, const chunk::ChunkIn<T>& c,
                               const ChunkAt& place, int64_t hv, const T* S0,
                               chunk::ChunkWork<T>& cw, BwdWork<T>& bw, BwdProducts* bp) {
  const int64_t n = c.n, K = c.K, V = c.V, ld = K + V, HV = A.HV;
  const int64_t nb = (n + kSub - 1) / kSub;
  if (!S0) {
    std::fill(bw.zero, bw.zero + K * V, T(0));
    S0 = bw.zero;
  }
  bw.S = S0;

  // ---- forward quantities of the chunk (chunk_common) ----
  // gam, qg, kdecT, am (A0 / M), then the solve: x = [NW | U], na = -A (with bf16 products na =
  // T = (I + A)^-1: the forward's bf16 solve; Gam, A0 and M stay in T as the forward's).
  chunk::decays_and_am(c, cw);
  if constexpr (std::is_same_v<T, float>) {
    if (bp) {
      // Only the solve in bf16: cw keeps fp32 products for decays_and_am, whose fp32 q . Gam
      // the per-token rows read.
      chunk::ChunkWork<T> solve = cw;
      solve.prod = bp->p;
      chunk::pack_rhs(c, solve);
      chunk::solve_wu(c, solve);
    } else {
      chunk::solve_wu(c, cw);
    }
  } else {
    chunk::solve_wu(c, cw);
  }
  bw.xu = cw.x;
  // exp(G_last - G_i) and Kdec_i = k_i exp(G_last - G_i) (the running product of chunk_common's
  // kdecT, formed here token-major instead of transposing kdecT back).
  {
    T* __restrict run = bw.run;
    for (int64_t d = 0; d < K; ++d) run[d] = T(1);
    for (int64_t i = n - 1; i >= 0; --i) {
      const T* __restrict ai = c.a + i * K;
      const T* __restrict ki = c.k + i * K;
      T* __restrict ed = bw.edec + i * K;
      T* __restrict kd = bw.kdec + i * K;
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) {
        ed[d] = run[d];
        kd[d] = ki[d] * run[d];
        run[d] *= ai[d];
      }
    }
  }
  const T* dO = A.dout + (place.vo_row * HV + hv) * V;
  for (int64_t i = 0; i < n; ++i) std::memcpy(bw.X + i * V, dO + i * HV * V, sizeof(T) * V);
  if constexpr (std::is_same_v<T, float>) {
    if (bp) {
      state_products_bf16(c, cw, bw, *bp);
    } else {
      state_products(c, cw, bw);
    }
  } else {
    state_products(c, cw, bw);
  }
  const T* gl = cw.gam + (n - 1) * K;
  for (int64_t d = 0; d < K; ++d) {
    const T* s = bw.S + d * V;
    const T* ds = bw.dS + d * V;
    T* __restrict dsn = bw.dSnew + d * V;
    const T f = gl[d];
    KDA_IVDEP
    for (int64_t e = 0; e < V; ++e) dsn[e] += f * ds[e];
    // dG_last += Gam_last . rowsum(S . dS_next) (a fixed-order dot: one running sum kept the
    // whole loop scalar)
    bw.acc[d] = static_cast<double>(f * dot(s, ds, V));
    bw.acc[K + d] = 0.0;
  }

  // ---- per token: beta, v, Gam, Kdec ----
  for (int64_t i = 0; i < n; ++i) {
    const T b = c.beta[i];
    const T* __restrict a0 = cw.am + 2 * i * kC;
    T* __restrict da = bw.dam + 2 * i * kC;
    T* __restrict dm = bw.dam + (2 * i + 1) * kC;
    T db = 0;
    for (int64_t j = 0; j < i; ++j) {
      const T dA = -da[j];
      db += dA * a0[j];
      da[j] = b * dA;  // A_ij = beta_i A0_ij
    }
    for (int64_t j = i; j < n; ++j) da[j] = T(0);
    for (int64_t j = i + 1; j < n; ++j) dm[j] = T(0);
    const T* __restrict dnr = bw.dR + i * ld;  // w.r.t. -beta_i Gam_i k_i
    const T* __restrict dbv = dnr + K;           // w.r.t. beta_i v_i
    const T* __restrict vi = c.v + i * c.ldv;
    const T* __restrict ki = c.k + i * K;
    const T* __restrict gi = cw.gam + i * K;
    const T* __restrict qgi = cw.qg + i * K;
    const T* __restrict dqg = bw.Y + i * K;
    const T* __restrict ed = bw.edec + i * K;
    const T* __restrict kd = bw.kdec + i * K;
    const T* __restrict dkd = bw.dkdec + i * K;
    T* __restrict dq = bw.dq + i * K;
    T* __restrict dk = bw.dk + i * K;
    double* __restrict dG = bw.dG + i * K;
    double* __restrict dgx = bw.dgx + i * K;
    T* __restrict dv = A.dv + ((place.token + i) * HV + hv) * V;
    T* __restrict gk = bw.run2;  // Gam_i . k_i
    double* __restrict kacc = bw.acc + K;
    for (int64_t e = 0; e < V; ++e) dv[e] = b * dbv[e];
    KDA_IVDEP
    for (int64_t d = 0; d < K; ++d) {
      gk[d] = gi[d] * ki[d];
      dq[d] = gi[d] * dqg[d];
      dk[d] = -b * gi[d] * dnr[d] + ed[d] * dkd[d];
      dG[d] = static_cast<double>(-b * gk[d] * dnr[d] + qgi[d] * dqg[d]);
      // Kdec_i = k_i exp(G_last - G_i) depends on g_t for i < t <= last: dg_t gets the sum of
      // Kdec_i . dKdec_i over i < t (an exclusive prefix sum, in acc[K:]).
      dgx[d] = kacc[d];
      kacc[d] += static_cast<double>(kd[d] * dkd[d]);
    }
    A.dbeta[(place.row + i) * HV + hv] = db + dot(dbv, vi, V) - dot(dnr, gk, K);
  }
  for (int64_t d = 0; d < K; ++d) bw.dG[(n - 1) * K + d] += bw.acc[d];

  // ---- through A0 and M: P_ij = sum_d X_id k_jd exp(G_id - G_jd), X = k (A0) or q (M) ----
  // Row block I = [b0, b1): the pairs (i in I, j < b0) in the factored form with the reference
  // token r = b0 - 1 (row factors Rf_i = a_b0..a_i, column factors Cf_j = a_{j+1}..a_r, both
  // <= 1; G_r cancels); the block's own pairs (j <= i in I) join the same products with column
  // factors 1 / Rf_j where the block's total decay keeps them <= e^60 (as the forward does),
  // else take the direct form (running products a_{j+1}..a_i).
  T* __restrict p = bw.run;
  for (int64_t I = 0; I < nb; ++I) {
    const int64_t b0 = I * kSub, b1 = std::min(n, b0 + kSub), rows = b1 - b0;
    for (int64_t d = 0; d < K; ++d) p[d] = T(1);
    for (int64_t i = b0; i < b1; ++i) {
      const T* __restrict ai = c.a + i * K;
      const T* __restrict ki = c.k + i * K;
      const T* __restrict qi = c.q + i * K;
      T* __restrict rf = bw.rf + (i - b0) * K;
      T* __restrict lk = bw.lq + 2 * (i - b0) * K;
      T* __restrict lqq = lk + K;
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) {
        p[d] *= ai[d];
        rf[d] = p[d];
        lk[d] = ki[d] * p[d];
        lqq[d] = qi[d] * p[d];
      }
    }
    T least = T(1);
    for (int64_t d = 0; d < K; ++d) least = std::min(least, p[d]);
    const bool factored = least >= kMinBlockDecay<T>;
    if (factored) {
      for (int64_t j = b0; j < b1; ++j) {
        const T* __restrict rf = bw.rf + (j - b0) * K;
        const T* __restrict kj = c.k + j * K;
        T* __restrict cf = bw.cf + j * K;
        T* __restrict kr = bw.kr + j * K;
        KDA_IVDEP
        for (int64_t d = 0; d < K; ++d) {
          cf[d] = T(1) / rf[d];
          kr[d] = kj[d] * cf[d];
        }
      }
      direct_diagonal_block<T, false>(c, b0, b1, bw);  // their dg only
    } else {
      direct_diagonal_block<T, true>(c, b0, b1, bw);
    }
    // Columns before the block, from r = b0 - 1 down; Cf_j only shrinks as j decreases, so once
    // it is 0 on every channel (strong decays, flushed to zero) the columns j < j0 contribute
    // exactly nothing and the products below skip them.
    for (int64_t d = 0; d < K; ++d) p[d] = T(1);
    int64_t j0 = 0;
    for (int64_t j = b0 - 1; j >= 0; --j) {
      const T* __restrict aj = c.a + j * K;
      const T* __restrict kj = c.k + j * K;
      T* __restrict cf = bw.cf + j * K;
      T* __restrict kr = bw.kr + j * K;
      if (!any_nonzero(p, K)) {
        j0 = j + 1;
        break;
      }
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) {
        cf[d] = p[d];
        kr[d] = kj[d] * p[d];
        p[d] *= aj[d];
      }
    }
    const int64_t cols = factored ? b1 : b0;
    if (cols == j0) continue;
    // [dRow_k; dRow_q] (rows interleaved) = [dA0; dM][I, :cols] Col, the columns before the block
    // (dlq) and the block's own (dlq2) apart; dCol = [dA0; dM][I, :cols]^T [Row_k; Row_q]
    // (dA0 and dM are zero above their diagonal).
    if (b0 > j0) {
      chunk::gemm(2 * rows, K, b0 - j0, bw.dam + 2 * b0 * kC + j0, kC, bw.kr + j0 * K, K, bw.dlq,
                  K, /*add=*/false);
    } else {
      std::fill(bw.dlq, bw.dlq + 2 * rows * K, T(0));
    }
    if (factored) {
      chunk::gemm(2 * rows, K, rows, bw.dam + 2 * b0 * kC + b0, kC, bw.kr + b0 * K, K, bw.dlq2,
                  K, /*add=*/false);
    }
    chunk::transpose(bw.dam + 2 * b0 * kC + j0, 2 * rows, cols - j0, kC, bw.damT + j0 * 2 * kSub,
                     2 * kSub);
    chunk::gemm(cols - j0, K, 2 * rows, bw.damT + j0 * 2 * kSub, 2 * kSub, bw.lq, K,
                bw.dkr + j0 * K, K, /*add=*/false);
    // dg_t collects the pairs (i in I, j < b0) with j < t <= i, formed directly (a reverse sum of
    // dG would form them as differences of larger sums): for t in [1, b0] the column sums
    // C_j = dCol_j . Col_j over j < t, for t in (b0, b1) the row sums R_i = dRow_i . Row_i over
    // i >= t. (The block's own pairs went to dgx above.)
    // (acc through a local pointer: read through bw, GCC reloads it after every store)
    double* __restrict cs = bw.acc;
    for (int64_t d = 0; d < K; ++d) cs[d] = 0.0;
    for (int64_t i = b1 - 1; i >= b0; --i) {
      const T* __restrict rf = bw.rf + (i - b0) * K;
      const T* __restrict lk = bw.lq + 2 * (i - b0) * K;
      const T* __restrict lqq = lk + K;
      const T* __restrict dlk = bw.dlq + 2 * (i - b0) * K;
      const T* __restrict dlqq = dlk + K;
      const T* __restrict dlk2 = bw.dlq2 + 2 * (i - b0) * K;
      const T* __restrict dlqq2 = dlk2 + K;
      T* __restrict dki = bw.dk + i * K;
      T* __restrict dqi = bw.dq + i * K;
      double* __restrict dgi = bw.dgx + i * K;
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) {
        cs[d] += static_cast<double>(dlk[d] * lk[d] + dlqq[d] * lqq[d]);
        if (i > b0) dgi[d] += cs[d];
        const T rk = factored ? dlk[d] + dlk2[d] : dlk[d];
        const T rq = factored ? dlqq[d] + dlqq2[d] : dlqq[d];
        dki[d] += rk * rf[d];
        dqi[d] += rq * rf[d];
      }
    }
    if (factored) {
      for (int64_t j = b0; j < b1; ++j) {
        const T* __restrict cf = bw.cf + j * K;
        const T* __restrict dkr = bw.dkr + j * K;
        T* __restrict dkj = bw.dk + j * K;
        KDA_IVDEP
        for (int64_t d = 0; d < K; ++d) dkj[d] += dkr[d] * cf[d];
      }
    }
    for (int64_t d = 0; d < K; ++d) cs[d] = 0.0;
    for (int64_t j = j0; j < b0; ++j) {
      const T* __restrict cf = bw.cf + j * K;
      const T* __restrict kr = bw.kr + j * K;
      const T* __restrict dkr = bw.dkr + j * K;
      T* __restrict dkj = bw.dk + j * K;
      double* __restrict dgn = bw.dgx + (j + 1) * K;  // t = j + 1
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) {
        dkj[d] += dkr[d] * cf[d];
        cs[d] += static_cast<double>(dkr[d] * kr[d]);
        dgn[d] += cs[d];
      }
    }
  }

  // ---- G = cumsum(g): dg_t = sum_{i >= t} dG_i + dgx_t, summed in double; a step with
  // a = exp(g) = 0 (an infinite or underflowed decay) has dg = a dL/da = 0 (docs/math.md
  // "Saturation") ----
  double* __restrict acc = bw.acc;
  for (int64_t d = 0; d < K; ++d) acc[d] = 0.0;
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t row = ((place.row + i) * HV + hv) * K;
    const T* __restrict ai = c.a + i * K;
    const double* __restrict dG = bw.dG + i * K;
    const double* __restrict dgx = bw.dgx + i * K;
    T* __restrict dg = A.dg + row;
    // Two loops, one in double and one in T: mixing them with the select kept it scalar.
    T* __restrict sum = bw.run2;
    KDA_IVDEP
    for (int64_t d = 0; d < K; ++d) {
      acc[d] += dG[d];
      sum[d] = static_cast<T>(acc[d] + dgx[d]);
    }
    KDA_IVDEP
    for (int64_t d = 0; d < K; ++d) dg[d] = ai[d] == T(0) ? T(0) : sum[d];
    std::memcpy(A.dq + row, bw.dq + i * K, sizeof(T) * K);
    std::memcpy(A.dk + row, bw.dk + i * K, sizeof(T) * K);
  }
  std::swap(bw.dS, bw.dSnew);  // dS w.r.t. the state entering the chunk, for the chunk before
}

// The chunks of tokens [t0, t1) (whole chunks but at the sequence's ends) of value head hv of
// sequence n, last first. The gradient w.r.t. the state comes from dht (the range that ends the
// sequence; zero without it) or dh0 (a later range ran before) and goes back to dh0.
template <typename T>
void bwd_unit(const kernels::BwdArgs<T>& A, int64_t n, int64_t hv, int64_t t0, int64_t t1,
              chunk::ChunkWork<T>& cw, BwdWork<T>& bw, BwdProducts* bp) {
  const int64_t K = A.K, V = A.V, HV = A.HV, BT = A.BT;
  const int64_t h = hv / (HV / A.H);
  const int64_t ts = A.seqs.seq_start[n];
  const int64_t origin = A.seqs.origin[n], slot_base = A.seqs.slot_base[n];
  const int64_t shift = A.seqs.row_shift(n), vo_shift = A.seqs.vo_row_shift(n);
  const int64_t state_off = (n * HV + hv) * K * V;
  const T* src = A.state_grad_after(n, t1);
  if (src) {
    std::memcpy(bw.dS, src + state_off, sizeof(T) * K * V);
  } else {
    std::fill(bw.dS, bw.dS + K * V, T(0));
  }
  if (t0 < t1) {
    const int64_t c_first = (t0 - origin) / kC, c_last = (t1 - 1 - origin) / kC;
    for (int64_t ci = c_last; ci >= c_first; --ci) {
      const int64_t s0 = std::max(t0, origin + ci * kC);
      const int64_t e = std::min(t1, origin + (ci + 1) * kC);
      // The state entering the chunk: the initial state at the sequence start (its checkpoint
      // slot may belong to another sequence with cu_seqlens), else the checkpoint.
      const T* S0 = s0 == ts ? (A.h0 ? A.h0 + state_off : nullptr)
                             : A.ckpt + ((slot_base + ci) * HV + hv) * K * V;
      const ChunkAt place{s0, s0 - shift, s0 - vo_shift};
      chunk::ChunkIn<T> c;
      c.n = e - s0;
      c.K = K;
      c.V = V;
      c.q = A.q + (h * BT + place.row) * K;
      c.k = A.k + (h * BT + place.row) * K;
      c.a = A.a + (hv * BT + place.row) * K;
      c.beta = A.beta + hv * BT + place.row;
      c.v = A.v + (place.vo_row * HV + hv) * V;
      c.ldv = HV * V;
      chunk_backward(A, c, place, hv, S0, cw, bw, bp);
    }
  }
  std::memcpy(A.dh0 + state_off, bw.dS, sizeof(T) * K * V);
}

// The chunk kernels in the backward's token blocks (run_bwd_blocked): units are (sequence, value
// head), one partial (a unit owns all columns of its head).
template <typename T>
void run_chunk_bwd(const Inputs& in, const Config& cfg, const BwdSetup& s,
                   const InputGrads& out) {
  const Dims& d = s.d;
  const chunk::Products products = std::is_same_v<T, float>
      ? chunk::choose_products(in.q.scalar_type(), d.K, d.V, cfg.op)
      : chunk::Products::kNative;
  // One workspace per thread (forward pieces, then the backward's), reused by all its units.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const bool bf16 = products != chunk::Products::kNative;
  Carver sizer(nullptr);  // carves no memory: only the sizes count
  chunk::ChunkWork<T>(sizer, d.K, d.V);
  BwdWork<T>(sizer, d.K, d.V);
  if (bf16) BwdProducts(products, sizer, d.K, d.V);
  const int64_t stride = sizer.bytes();
  const at::Tensor ws = empty_output({threads * stride + 64}, out.dv.options().dtype(at::kByte));
  advise_huge_pages(ws);  // ~1.6 MB per thread at K = V = 128 in float: fresh pages every call
  char* const ws0 = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(ws.data_ptr()) + 63) / 64 * 64);
  BwdBlockKernel<T> kernel;
  kernel.groups = 1;
  kernel.units = d.N * d.HV;
  // No side work: beside the neighbour blocks' passes its units (oneDNN products, one per
  // thread at H16 with 16 threads) ran 0.91-1.20x the time of the separate regions (median 1.06,
  // 7 pairs, B1 T8K bf16, 16-core host, session 17), where the recurrent backward gained.
  kernel.side_work = false;
  kernel.run_block = [&](const kernels::BwdArgs<T>& A, const std::vector<int64_t>& rs,
                         const std::vector<int64_t>& re, int64_t j, const SideWork& side) {
    run_units_beside(d.N * d.HV, side, [&](const auto& take) {
      chunk::FlushDenormals ftz;  // subnormal decay products: full forgets, slow on Intel CPUs
      Carver c(ws0 + std::min<int64_t>(at::get_thread_num(), threads - 1) * stride);
      chunk::ChunkWork<T> cw(c, d.K, d.V);
      BwdWork<T> bw(c, d.K, d.V);
      std::optional<BwdProducts> bp;
      if (bf16) bp.emplace(products, c, d.K, d.V);
      for (int64_t u; take(u);) {
        const int64_t n = u / d.HV;
        if (!block_has_work(A.seqs, rs, re, n, j)) continue;
        bwd_unit<T>(A, n, u % d.HV, rs[n], re[n], cw, bw, bp ? &*bp : nullptr);
      }
      chunk::gemm_release(products);
    });
  };
  run_bwd_blocked<T>(in, cfg, s, out, kernel);
}

}  // namespace

std::vector<at::Tensor> chunk_bwd_cpu(const at::Tensor& d_o,
                                      const std::optional<at::Tensor>& d_final_state,
                                      const at::Tensor& checkpoints, const Inputs& in,
                                      const Config& cfg) {
  return run_backward(d_o, d_final_state, checkpoints, in, cfg, &run_chunk_bwd<float>,
                      &run_chunk_bwd<double>);
}

}  // namespace detail
}  // namespace kda
