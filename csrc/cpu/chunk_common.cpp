// Shared pieces of the chunkwise KDA (see chunk_common.h; math: docs/math.md "Chunkwise form").
#include "cpu/chunk_common.h"
#include "cpu/chunk_vec.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define KDA_HAVE_MXCSR 1
#endif

namespace kda {
namespace detail {
namespace chunk {

void gemm(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool add) {
  if (M <= 0 || N <= 0) return;
  if (Kd <= 0) {
    if (!add) {
      for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * N);
    }
    return;
  }
  at::native::cpublas::brgemm(M, N, Kd, lda, ldb, ldc, add, A, B, C, /*is_vnni=*/false);
}

void gemm(int64_t M, int64_t N, int64_t Kd, const double* A, int64_t lda, const double* B,
          int64_t ldb, double* C, int64_t ldc, bool add) {
  // float64 is the checking dtype (gradcheck, oracles): plain loops, speed does not matter.
  for (int64_t i = 0; i < M; ++i) {
    double* c = C + i * ldc;
    if (!add) std::fill(c, c + N, 0.0);
    for (int64_t p = 0; p < Kd; ++p) {
      const double s = A[i * lda + p];
      const double* b = B + p * ldb;
      for (int64_t j = 0; j < N; ++j) c[j] += s * b[j];
    }
  }
}

FlushDenormals::FlushDenormals() {
#if defined(KDA_HAVE_MXCSR)
  saved_ = _mm_getcsr();
  _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
#endif
}

FlushDenormals::~FlushDenormals() {
#if defined(KDA_HAVE_MXCSR)
  _mm_setcsr(saved_);
#endif
}

void gemm_release(Products products) {
  at::native::cpublas::brgemm_release(/*is_vnni=*/products == Products::kBf16);
}

namespace {

#if defined(KDA_HAVE_VEC16)
using vec_detail::v16sf;
using vec_detail::v16si;
using vec_detail::hsum16;
using vec_detail::any16;
#endif

// x . y and z . y over n channels, in a fixed order (8 partial sums, then a fixed tree): the
// same bits whatever the thread. Written so the compiler can keep the partial sums in vectors.
template <typename T>
inline void dot2(const T* __restrict x, const T* __restrict z, const T* __restrict y, int64_t n,
                 T& rx, T& rz) {
  T ax[8] = {0, 0, 0, 0, 0, 0, 0, 0}, az[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) {
      ax[l] += x[d + l] * y[d + l];
      az[l] += z[d + l] * y[d + l];
    }
  }
  for (int l = 0; d < n; ++d, ++l) {
    ax[l] += x[d] * y[d];
    az[l] += z[d] * y[d];
  }
  for (int w = 4; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) {
      ax[l] += ax[l + w];
      az[l] += az[l + w];
    }
  }
  rx = ax[0];
  rz = az[0];
}

}  // namespace

template <typename T>
ChunkWork<T>::ChunkWork(Carver& c, int64_t K, int64_t V) {
  gam = c.take<T>(kC * K);
  qg = c.take<T>(kC * K);
  kdecT = c.take<T>(K * kC);
  krT = c.take<T>(K * kC);
  am = c.take<T>(kC * 2 * kC);
  na = c.take<T>(kC * kC);
  x = c.take<T>(kC * (K + V));
  rhs = c.take<T>(kSub * (K + V));
  dinv = c.take<T>(kC * kSub);
  lq = c.take<T>(2 * kSub * K);
  kr = c.take<T>(kSub * K);
  w = c.take<T>(4 * K);
}

template <typename T>
void bind_results(ChunkWork<T>& w, Carver& store, int64_t K, int64_t V, bool bf16) {
  w.gam = store.take<T>(kC * K);
  w.x = store.take<T>(kC * (K + V));
  if (bf16) {
    w.prod.qg = store.take<at::BFloat16>(kC * K);
    w.prod.kdecT = store.take<at::BFloat16>(K * kC);
    w.prod.nkg = store.take<at::BFloat16>(kC * K);
    w.prod.tinv = store.take<at::BFloat16>(kC * kC);
    w.prod.m = store.take<at::BFloat16>(kC * kC);
  } else {
    w.am = store.take<T>(kC * 2 * kC);
    w.qg = store.take<T>(kC * K);
    w.kdecT = store.take<T>(K * kC);
  }
}

namespace {

#if defined(KDA_HAVE_VEC16)
// direct_block for float and K a multiple of 32 (at most kDirectMaxK): p in 16-lane vectors,
// two partial sums per product, reduced by a fixed tree. A column stops once p is all zero (its
// later products are exactly 0; decays_and_am zeroed the rows): after strong decays most do within a
// few tokens.
constexpr int64_t kDirectMaxK = 256;
KDA_ALWAYS_INLINE void direct_block_vec(const ChunkIn<float>& c, ChunkWork<float>& w, int64_t lo,
                                        int64_t hi) {
  const int64_t nv = c.K / 16;
  const v16sf* k = reinterpret_cast<const v16sf*>(c.k);  // rows of nv vectors (unaligned loads
  const v16sf* q = reinterpret_cast<const v16sf*>(c.q);  // through the may_alias type)
  const v16sf* a = reinterpret_cast<const v16sf*>(c.a);
  v16sf p[kDirectMaxK / 16];
  for (int64_t j = lo; j < hi; ++j) {
    v16sf m0 = {}, m1 = {};
    for (int64_t v = 0; v < nv; ++v) {
      p[v] = k[j * nv + v];
      if (v & 1) {
        m1 += q[j * nv + v] * p[v];
      } else {
        m0 += q[j * nv + v] * p[v];
      }
    }
    w.am[(2 * j + 1) * kC + j] = hsum16(m0 + m1);
    for (int64_t i = j + 1; i < hi; ++i) {
      v16sf s0 = {}, s1 = {}, t0 = {}, t1 = {};
      v16si live = {};
      for (int64_t v = 0; v < nv; v += 2) {
        p[v] *= a[i * nv + v];
        p[v + 1] *= a[i * nv + v + 1];
        // Magnitude bits (integer operations: exactly p != 0, a NaN counting as live).
        live |= ((v16si)p[v] | (v16si)p[v + 1]) & 0x7FFFFFFF;
        s0 += k[i * nv + v] * p[v];
        s1 += k[i * nv + v + 1] * p[v + 1];
        t0 += q[i * nv + v] * p[v];
        t1 += q[i * nv + v + 1] * p[v + 1];
      }
      w.am[2 * i * kC + j] = hsum16(s0 + s1);
      w.am[(2 * i + 1) * kC + j] = hsum16(t0 + t1);
      if (!any16(live)) break;
    }
  }
}
#endif

// Direct form of the pairs inside [lo, hi): for each column token j a running product over the
// tokens after it, p = k_j . a_{j+1} ... a_i, gives A0_ij = k_i . p and M_ij = q_i . p.
template <typename T>
KDA_ALWAYS_INLINE void direct_block(const ChunkIn<T>& c, ChunkWork<T>& w, int64_t lo, int64_t hi) {
  const int64_t K = c.K;
#if defined(KDA_HAVE_VEC16)
  if constexpr (std::is_same_v<T, float>) {
    if (K % 32 == 0 && K <= kDirectMaxK) {
      direct_block_vec(c, w, lo, hi);
      return;
    }
  }
#endif
  T* __restrict p = w.w;
  for (int64_t j = lo; j < hi; ++j) {
    const T* kj = c.k + j * K;
    for (int64_t d = 0; d < K; ++d) p[d] = kj[d];
    T unused, mjj;
    dot2(c.q + j * K, c.q + j * K, p, K, mjj, unused);
    w.am[(2 * j + 1) * kC + j] = mjj;
    for (int64_t i = j + 1; i < hi; ++i) {
      const T* __restrict ai = c.a + i * K;
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) p[d] *= ai[d];
      T aij, mij;
      dot2(c.k + i * K, c.q + i * K, p, K, aij, mij);
      w.am[2 * i * kC + j] = aij;
      w.am[(2 * i + 1) * kC + j] = mij;
    }
  }
}

}  // namespace

namespace {

// Row i of the solve's right-hand side R = [-beta_i Gam_i . k_i | beta_i v_i]: its K part into
// rk [K], its V part into rv [V].
template <typename T>
KDA_ALWAYS_INLINE void rhs_row(const ChunkIn<T>& c, const ChunkWork<T>& w, int64_t i,
                               T* __restrict rk, T* __restrict rv) {
  const int64_t K = c.K, V = c.V;
  const T b = c.beta[i];
  const T* __restrict g = w.gam + i * K;
  const T* __restrict k = c.k + i * K;
  const T* __restrict v = c.v + i * c.ldv;
  KDA_IVDEP
  for (int64_t d = 0; d < K; ++d) rk[d] = -b * (g[d] * k[d]);
  KDA_IVDEP
  for (int64_t e = 0; e < V; ++e) rv[e] = b * v[e];
}

// tot = a_lo ... a_{hi-1} per channel (the block's total decay); whether its least entry keeps
// the factored form safe (kMinBlockDecay: 1 / Rf_j <= e^60 for every j of the block).
template <typename T>
KDA_ALWAYS_INLINE bool block_decay(const ChunkIn<T>& c, int64_t lo, int64_t hi,
                                   T* __restrict tot) {
  const int64_t K = c.K;
  for (int64_t d = 0; d < K; ++d) tot[d] = T(1);
  for (int64_t i = lo; i < hi; ++i) {
    const T* __restrict a = c.a + i * K;
    KDA_IVDEP
    for (int64_t d = 0; d < K; ++d) tot[d] *= a[d];
  }
  // Whether every entry passes (an OR of comparison results vectorises; a float min does not
  // without -ffast-math). A NaN fails.
  int weak = 0;
  for (int64_t d = 0; d < K; ++d) weak |= !(tot[d] >= kMinBlockDecay<T>);
  return weak == 0;
}

// One pass over the rows [b0, b1) of row block I (the only pass that reads the chunk's q, k, a,
// v rows; every operand is written once, in the layout its product reads):
//   gam_i = gam_{i-1} . a_i and q_i . gam_i (qg: fp32, or rounded into prod.qg);
//   the row factors Rf_i = a_b0 ... a_i: k_i . Rf_i, q_i . Rf_i interleaved in lq;
//   factored: the block's own column factors k_i / Rf_i in kr (row i - b0);
//   bf16 products: the right-hand side row [-beta_i gam_i . k_i | beta_i v_i] of the solve,
//   the K part rounded to bf16 (prod.nkg), the V part in fp32 (x's V columns).
template <typename T>
KDA_ALWAYS_INLINE void block_rows(const ChunkIn<T>& c, ChunkWork<T>& w, int64_t b0, int64_t b1,
                                  bool factored) {
  const int64_t K = c.K;
  [[maybe_unused]] const int64_t V = c.V;
  T* __restrict rf = w.w + 2 * K;
  const T* __restrict one = w.w + 3 * K;
  for (int64_t d = 0; d < K; ++d) rf[d] = T(1);
  [[maybe_unused]] const bool bf16 = w.prod.mode != Products::kNative;
  for (int64_t i = b0; i < b1; ++i) {
    const T* __restrict a = c.a + i * K;
    const T* __restrict k = c.k + i * K;
    const T* __restrict q = c.q + i * K;
    const T* __restrict gp = i > 0 ? w.gam + (i - 1) * K : one;
    T* __restrict g = w.gam + i * K;
    // With bf16 products q . gam goes through a scratch row (rhs row 2) into prod.qg.
    T* __restrict qg = bf16 ? w.rhs + 2 * (K + V) : w.qg + i * K;
    T* __restrict lk = w.lq + 2 * (i - b0) * K;
    T* __restrict lqq = lk + K;
    KDA_IVDEP
    for (int64_t d = 0; d < K; ++d) {
      const T gi = gp[d] * a[d];
      g[d] = gi;
      qg[d] = q[d] * gi;
      rf[d] *= a[d];
      lk[d] = k[d] * rf[d];
      lqq[d] = q[d] * rf[d];
    }
    if (factored) {
      T* __restrict kr = w.kr + (i - b0) * K;
      KDA_IVDEP
      for (int64_t d = 0; d < K; ++d) kr[d] = k[d] / rf[d];
    }
    if constexpr (std::is_same_v<T, float>) {
      if (bf16) {
        round_bf16(qg, w.prod.qg + i * K, K);
        // Row i of R: -beta_i gam_i . k_i through a scratch row (rhs row 0), rounded into
        // prod.nkg; beta_i v_i in fp32 into x's V columns (state_step_bf16's R').
        rhs_row(c, w, i, w.rhs, w.x + i * (K + V) + K);
        round_bf16(w.rhs, w.prod.nkg + i * K, K);
      }
    }
  }
}

// Columns [from, to) of the column factors colf [K, kC] times tot (per channel row); returns
// the first of them with a nonzero entry (to if none; magnitude bits, so a NaN counts).
template <typename T>
KDA_ALWAYS_INLINE int64_t scale_columns(T* __restrict colf, int64_t K, int64_t from, int64_t to,
                                        const T* __restrict tot) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr U kMag = ~(U(1) << (8 * sizeof(T) - 1));
  U live[kC] = {};
  for (int64_t d = 0; d < K; ++d) {
    const T s = tot[d];
    T* __restrict row = colf + d * kC;
    KDA_IVDEP
    for (int64_t j = from; j < to; ++j) {
      const T x = row[j] * s;
      row[j] = x;
      U u;
      std::memcpy(&u, &x, sizeof(u));
      live[j] |= u & kMag;
    }
  }
  for (int64_t j = from; j < to; ++j) {
    if (live[j]) return j;
  }
  return to;
}

}  // namespace

template <typename T>
KDA_CLONES void decays_and_am(const ChunkIn<T>& c, ChunkWork<T>& w) {
  const int64_t n = c.n, K = c.K;
  const int64_t nb = (n + kSub - 1) / kSub;
  const int64_t ncol = nb * kSub;  // columns the later products read (zero past n)
  const bool bf16 = w.prod.mode != Products::kNative;
  for (int64_t i = 0; i < n; ++i) {
    std::fill(w.am + 2 * i * kC, w.am + 2 * i * kC + ncol, T(0));
    std::fill(w.am + (2 * i + 1) * kC, w.am + (2 * i + 1) * kC + ncol, T(0));
  }
  T* __restrict tot = w.w + K;
  std::fill(w.w + 3 * K, w.w + 4 * K, T(1));
  // The column factors [K, kC], kept against the reference token of the next row block: before
  // row block I (reference b0 - 1) column j < b0 holds k_j . a_{j+1} ... a_{b0-1}, so after the
  // last block the end-decayed keys Kdec^T. Each block appends its own columns and scales the
  // older ones by its total decay (one pass, no recomputed running products). Columns [0, c1)
  // are exactly zero (after strong decays all but the last few): the products skip them and
  // they are not kept up to date.
  T* const colf = bf16 ? w.krT : w.kdecT;
  int64_t c1 = 0;
  for (int64_t I = 0; I < nb; ++I) {
    const int64_t b0 = I * kSub, b1 = std::min(n, b0 + kSub), rows = b1 - b0;
    T* const am = w.am + 2 * b0 * kC;
    const bool factored = block_decay(c, b0, b1, tot);
    block_rows(c, w, b0, b1, factored);
    if (factored) {
      // The columns before the block and its own pairs in one GEMM (exp(G_i - G_j) =
      // Rf_i / Rf_j inside the block), then only the causal part kept: A0 strictly lower, M lower.
      transpose(w.kr, rows, K, K, colf + b0, kC);
      gemm(2 * rows, b1 - c1, K, w.lq, K, colf + c1, kC, am + c1, kC, false);
      for (int64_t i = b0; i < b1; ++i) {
        std::fill(w.am + 2 * i * kC + i, w.am + 2 * i * kC + b1, T(0));
        std::fill(w.am + (2 * i + 1) * kC + i + 1, w.am + (2 * i + 1) * kC + b1, T(0));
      }
      c1 = scale_columns(colf, K, c1, b1, tot);
    } else {
      if (b0 > c1) gemm(2 * rows, b0 - c1, K, w.lq, K, colf + c1, kC, am + c1, kC, false);
      direct_block(c, w, b0, b1);
      c1 = scale_columns(colf, K, c1, b0, tot);
      // The block's own columns against its last token: k_j . a_{j+1} ... a_{b1-1}, a running
      // product walked backwards (every factor <= 1).
      T* __restrict run = w.w;
      for (int64_t d = 0; d < K; ++d) run[d] = T(1);
      int64_t first = b1;
      for (int64_t j = b1 - 1; j >= b0; --j) {
        const T* __restrict k = c.k + j * K;
        const T* __restrict a = c.a + j * K;
        T* __restrict kr = w.kr + (j - b0) * K;
        KDA_IVDEP
        for (int64_t d = 0; d < K; ++d) {
          kr[d] = k[d] * run[d];
          run[d] *= a[d];
        }
        if (any_nonzero(kr, K)) first = j;
      }
      transpose(w.kr, rows, K, K, colf + b0, kC);
      if (c1 == b0) c1 = first;
    }
  }
  // Kdec^T: columns [0, c1) zero, [c1, n) from colf; the bf16 operand is zero up to ncol.
  for (int64_t d = 0; d < K; ++d) {
    if constexpr (std::is_same_v<T, float>) {
      if (bf16) {
        at::BFloat16* r = w.prod.kdecT + d * kC;
        std::fill(r, r + c1, at::BFloat16(0.0f));
        round_bf16(colf + d * kC + c1, r + c1, n - c1);
        std::fill(r + n, r + product_cols(n), at::BFloat16(0.0f));
        continue;
      }
    }
    std::fill(colf + d * kC, colf + d * kC + c1, T(0));
  }
  // na = -beta_i A0_ij (strictly lower).
  for (int64_t i = 0; i < n; ++i) {
    const T nb_i = -c.beta[i];
    const T* a0 = w.am + 2 * i * kC;
    T* r = w.na + i * kC;
    for (int64_t j = 0; j < i; ++j) r[j] = nb_i * a0[j];
  }
}

namespace {


// C[n, N] (+)= L[n, ncol] B[ncol, N] for L lower triangular (T or M: row i zero past column i)
// and B packed with ncol rows: in row blocks of kSub, each over the columns up to its last
// row only (at n = 64, 5/8 of one product over all columns; 4 us less per chunk on a Zen 4 core).
// With AMX (p.whole, amx_shapes) one product over all columns: there the extra calls cost more
// than the zeros they skip (the op 3-10% slower on the 16-core Xeon host, docs/benchmarks.md
// session 27).
KDA_ALWAYS_INLINE void lower_product(const ProductWork& p, int64_t n, int64_t N, int64_t ncol,
                                     const at::BFloat16* L, int64_t ldl, const void* B, float* C,
                                     int64_t ldc, bool add) {
  if (p.whole) {
    gemm16(p, n, N, ncol, L, ldl, B, C, ldc, add);
    return;
  }
  for (int64_t r0 = 0; r0 < n; r0 += kSub) {
    const int64_t r1 = std::min(n, r0 + kSub);
    gemm16(p, r1 - r0, N, product_cols(r1), L + r0 * ldl, ldl, B, C + r0 * ldc, ldc, add, ncol);
  }
}

// T = (I + A)^-1 (unit lower triangular, rows [0, n)) in fp32 by forward substitution, rounded to
// bf16 into w.prod.tinv over product_cols(n) columns (zero past each row's diagonal).
KDA_ALWAYS_INLINE void inverse_bf16(const ChunkIn<float>& c, ChunkWork<float>& w) {
  const int64_t n = c.n;
  const ProductWork& p = w.prod;
  const int64_t ncol = product_cols(n);
  // T row by row, T_i = e_i + sum_{j<i} na_ij T_j (na = -A), rows of kC columns (T_j is zero
  // past column j), written over na: row i of na is read before row i of T replaces it. Two
  // partial sums (even and odd j) halve the chain of dependent additions. Row i is computed over
  // the vectors up to its column i and zeroed past them, up to ncol.
  float* t = w.na;
  for (int64_t i = 0; i < n; ++i) {
    float* __restrict ti = t + i * kC;
#if defined(KDA_HAVE_VEC16)
    constexpr int64_t nv = kC / 16;
    const int64_t live = i / 16 + 1, zero = ncol / 16;
    v16sf a[nv] = {}, b[nv] = {};
    int64_t j = 0;
    for (; j + 1 < i; j += 2) {
      const float s0 = ti[j], s1 = ti[j + 1];
      const v16sf* t0 = reinterpret_cast<const v16sf*>(t + j * kC);
      const v16sf* t1 = reinterpret_cast<const v16sf*>(t + (j + 1) * kC);
      for (int64_t v = 0; v < nv; ++v) {
        if (v < live) {
          a[v] += s0 * t0[v];
          b[v] += s1 * t1[v];
        }
      }
    }
    if (j < i) {
      const float s0 = ti[j];
      const v16sf* t0 = reinterpret_cast<const v16sf*>(t + j * kC);
      for (int64_t v = 0; v < nv; ++v) {
        if (v < live) a[v] += s0 * t0[v];
      }
    }
    v16sf* out = reinterpret_cast<v16sf*>(ti);
    for (int64_t v = 0; v < nv; ++v) {
      if (v < live) {
        out[v] = a[v] + b[v];
      } else if (v < zero) {
        out[v] = v16sf{};
      }
    }
#else
    float a[kC] = {};
    for (int64_t j = 0; j < i; ++j) {
      const float s0 = ti[j];
      const float* __restrict tj = t + j * kC;
      for (int64_t e = 0; e < kC; ++e) a[e] += s0 * tj[e];
    }
    std::copy(a, a + kC, ti);
#endif
    ti[i] = 1.0f;
    round_bf16(ti, p.tinv + i * kC, ncol);
  }
}

// solve_wu with bf16 products (w.prod.mode, float only): T = (I + A)^-1 in fp32, then
// X = T R as one bf16 product (T and R rounded to bf16, as FLA's chunk kernels do for 16-bit
// inputs) instead of two fp32 GEMMs per row block: the products are the calls that cost, not
// their arithmetic. R was packed by pack_rhs.
KDA_ALWAYS_INLINE void solve_wu_bf16(const ChunkIn<float>& c, ChunkWork<float>& w) {
  inverse_bf16(c, w);
  lower_product(w.prod, c.n, c.K + c.V, product_cols(c.n), w.prod.tinv, kC, w.prod.rhs, w.x,
                c.K + c.V, /*add=*/false);
}

}  // namespace

template <typename T>
KDA_CLONES void solve_wu(const ChunkIn<T>& c, ChunkWork<T>& w) {
  if constexpr (std::is_same_v<T, float>) {
    if (w.prod.mode != Products::kNative) {
      solve_wu_bf16(c, w);
      return;
    }
  }
  const int64_t n = c.n, K = c.K, V = c.V, ld = K + V;
  // (I + A) X = R with R = [-beta_i Gam_i . k_i | beta_i v_i], row block by row block:
  //   X_I = (I + A_II)^-1 (R_I - A[I, :b0] X[:b0])
  // the first product with na (= -A), the second with the block's inverse dinv (16 x 16, by
  // forward substitution on the identity), both GEMMs; R_I is built in rhs block by block.
  const int64_t nb = (n + kSub - 1) / kSub;
  for (int64_t I = 0; I < nb; ++I) {
    const int64_t b0 = I * kSub, b1 = std::min(n, b0 + kSub), rows = b1 - b0;
    for (int64_t i = b0; i < b1; ++i) {
      rhs_row(c, w, i, w.rhs + (i - b0) * ld, w.rhs + (i - b0) * ld + K);
    }
    if (b0 > 0) gemm(rows, ld, b0, w.na + b0 * kC, kC, w.x, ld, w.rhs, ld, /*add=*/true);
    T* di = w.dinv + I * kSub * kSub;
    for (int64_t i = 0; i < rows; ++i) {
      T* __restrict row = di + i * kSub;
      std::fill(row, row + kSub, T(0));
      row[i] = T(1);
      for (int64_t j = 0; j < i; ++j) {
        const T s = w.na[(b0 + i) * kC + b0 + j];
        const T* __restrict rj = di + j * kSub;
        for (int64_t e = 0; e <= j; ++e) row[e] += s * rj[e];
      }
    }
    gemm(rows, ld, rows, di, kSub, w.rhs, ld, w.x + b0 * ld, ld, /*add=*/false);
  }
}

template <typename T>
KDA_CLONES void forward_solve(const ChunkIn<T>& c, ChunkWork<T>& w) {
  if constexpr (std::is_same_v<T, float>) {
    if (w.prod.mode != Products::kNative) {
      inverse_bf16(c, w);
      // M's rows as the state step's operand (decays_and_am zeroed its columns past n up to
      // product_cols(n))
      const int64_t ncol = product_cols(c.n);
      for (int64_t i = 0; i < c.n; ++i) {
        round_bf16(w.am + (2 * i + 1) * kC, w.prod.m + i * kC, ncol);
      }
      return;
    }
  }
  solve_wu(c, w);
}

template <typename T>
void chunk_intra(const ChunkIn<T>& c, ChunkWork<T>& w) {
  decays_and_am(c, w);
  forward_solve(c, w);
}

KDA_CLONES void pack_rhs(const ChunkIn<float>& c, ChunkWork<float>& w) {
  const int64_t n = c.n, ld = c.K + c.V;
  // x, the solve's result (not yet written), stages R's rows.
  for (int64_t i = 0; i < n; ++i) rhs_row(c, w, i, w.x + i * ld, w.x + i * ld + c.K);
  pack_b(w.prod, product_cols(n), ld, n, w.x, ld, w.prod.rhs);
}

namespace {

// state_step with bf16 products (chunk_products.h), in the order that applies T = (I + A)^-1
// once, to a right-hand side that already holds the state's part (docs/math.md, "Chunkwise
// form"): R' = beta V - (beta Gam . K) S, then Vn = T R' (the same Vn as U - W S with
// [-W | U] = T R; one [n, n] x [n, V] product instead of the solve's [n, n] x [n, K + V] and the
// [n, K] x [K, V] product with W). S is packed once for the two products that read it, R' and
// Vn once each; -beta Gam . K, q . Gam, T, M and Kdec^T are already bf16 (forward_solve,
// decays_and_am). Columns and rows past n up to a multiple of the products' k-step
// (product_cols) are zero in both operands of the products over the chunk's tokens.
KDA_CLONES void state_step_bf16(const ChunkIn<float>& c, ChunkWork<float>& w, float* S,
                                float* o, int64_t ldo) {
  const int64_t n = c.n, K = c.K, V = c.V, ld = K + V;
  const ProductWork& p = w.prod;
  const int64_t ncol = product_cols(n);
  float* r = w.x + K;  // beta V (decays_and_am), then R', then Vn
  // S packed, and S <- Diag(Gam_last) S in the same pass (the products read the packed S)
  pack_b_scaled(p, K, V, S, V, w.gam + (n - 1) * K, p.s);
  // R' = beta V + (-beta Gam . K) S;  o = (Q . Gam) S
  gemm16(p, n, V, K, p.nkg, K, p.s, r, ld, /*add=*/true);
  gemm16(p, n, V, K, p.qg, K, p.s, o, ldo, /*add=*/false);
  // Vn = T R' (R' packed first, so that Vn can replace it)
  pack_b(p, ncol, V, n, r, ld, p.vn);
  lower_product(p, n, V, ncol, p.tinv, kC, p.vn, r, ld, /*add=*/false);
  pack_b(p, ncol, V, n, r, ld, p.vn);
  // o += M Vn
  lower_product(p, n, V, ncol, p.m, kC, p.vn, o, ldo, /*add=*/true);
  // S <- (Diag(Gam_last) S, above) + Kdec^T Vn
  gemm16(p, K, V, ncol, p.kdecT, kC, p.vn, S, V, /*add=*/true);
}

}  // namespace

template <typename T>
KDA_CLONES void state_step(const ChunkIn<T>& c, ChunkWork<T>& w, T* S, T* o, int64_t ldo) {
  if constexpr (std::is_same_v<T, float>) {
    if (w.prod.mode != Products::kNative) {
      state_step_bf16(c, w, S, o, ldo);
      return;
    }
  }
  const int64_t n = c.n, K = c.K, V = c.V, ld = K + V;
  T* vn = w.x + K;
  // Vn = U + (-W) S
  gemm(n, V, K, w.x, ld, S, V, vn, ld, /*add=*/true);
  // o = (Q . Gam) S + M Vn; M is lower triangular: row block I reads columns [0, b1).
  gemm(n, V, K, w.qg, K, S, V, o, ldo, /*add=*/false);
  const int64_t nb = (n + kSub - 1) / kSub;
  for (int64_t I = 0; I < nb; ++I) {
    const int64_t b0 = I * kSub, b1 = std::min(n, b0 + kSub);
    gemm(b1 - b0, V, b1, w.am + (2 * b0 + 1) * kC, 2 * kC, vn, ld, o + b0 * ldo, ldo, true);
  }
  // S <- Diag(Gam_last) S + Kdec^T Vn
  const T* gl = w.gam + (n - 1) * K;
  for (int64_t d = 0; d < K; ++d) {
    const T f = gl[d];
    T* __restrict s = S + d * V;
    KDA_IVDEP
    for (int64_t e = 0; e < V; ++e) s[e] *= f;
  }
  gemm(K, V, n, w.kdecT, kC, vn, ld, S, V, /*add=*/true);
}

#define KDA_CHUNK_INSTANTIATE(T)                                         \
  template struct ChunkWork<T>;                                          \
  template void bind_results<T>(ChunkWork<T>&, Carver&, int64_t, int64_t, bool);  \
  template void decays_and_am<T>(const ChunkIn<T>&, ChunkWork<T>&);      \
  template void solve_wu<T>(const ChunkIn<T>&, ChunkWork<T>&);           \
  template void forward_solve<T>(const ChunkIn<T>&, ChunkWork<T>&);      \
  template void chunk_intra<T>(const ChunkIn<T>&, ChunkWork<T>&);        \
  template void state_step<T>(const ChunkIn<T>&, ChunkWork<T>&, T*, T*, int64_t);
KDA_CHUNK_INSTANTIATE(float)
KDA_CHUNK_INSTANTIATE(double)
#undef KDA_CHUNK_INSTANTIATE

}  // namespace chunk
}  // namespace detail
}  // namespace kda
