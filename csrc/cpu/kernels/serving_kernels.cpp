// Serving / decode kernels of KDA (see serving_kernels.h). Compiled once per instruction set
// (KDA_ISA); GCC/Clang vector extensions of the register width (KDA_SRV_VEC_BYTES: 64 bytes with
// AVX-512, 32 with AVX2, where wider vectors would spill through the stack).
//
// Per token of a unit (sequence n, value head hv, columns [c0, c1)), with a = exp(g), the
// recurrence of docs/math.md in one read of the state S and one write:
//   K-first S [K, V]: pass 1 reads the rows,  kS = sum_k (a k)_k S_k,  qS = sum_k (a q)_k S_k;
//                     u = beta (v - kS);  o = qS + (q . k) u;
//                     pass 2 re-reads the rows (from L1/L2) and writes  a_k S_k + k_k u.
//   V-first S [V, K]: per value column c, the row S_c is contiguous: two dot products
//                     (a k) . S_c and (a q) . S_c, then the row  a * S_c + u_c k  is written
//                     (right after each block's read, or after a head's whole read when the
//                     state comes from memory: vfirst_block).
// o = q^T S_new = q^T (Diag(a) S) + (q . k) u, so the output needs no third pass. Sums run in a
// fixed order independent of the split into units: results do not depend on the thread count.
#include "cpu/kernels/serving_kernels.h"
#include "cpu/kernels/vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef KDA_ISA
#error "KDA_ISA must name the instruction set this file is compiled for"
#endif

#if defined(__AVX512F__)
#define KDA_SRV_VEC_BYTES 64
constexpr int kMaxNV = 8;  // K-first pass: 2 x 8 zmm accumulators (128 fp32 columns)
#elif defined(__AVX2__)
#define KDA_SRV_VEC_BYTES 32
constexpr int kMaxNV = 4;  // 16 ymm registers: 2 x 4 accumulators (32 fp32 columns) + operands
#else
#define KDA_SRV_VEC_BYTES 16
constexpr int kMaxNV = 4;
#endif
// V-first: value columns per pass. Measured on the AVX2 box (B1 / B8 H32, 1 thread, CPU time):
// 2 columns ran 0.85-0.94x / 0.79-0.84x the time of K-first, 1 column 1.2x / 0.7x, 4 columns
// 1.0x / 1.3x, one column with 3 loads per 2 FMAs (before) 1.4x / 0.8x.
constexpr int kColBlock = 2;
#define KDA_SSTR2(x) #x
#define KDA_SSTR(x) KDA_SSTR2(x)

namespace kda {
namespace kernels {
namespace KDA_ISA {
namespace {

// Internal linkage only, no std:: templates (see recurrent_kernels.cpp: one object per ISA).
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  typedef float type __attribute__((vector_size(KDA_SRV_VEC_BYTES)));
  typedef int32_t itype __attribute__((vector_size(KDA_SRV_VEC_BYTES)));
};
template <>
struct Vec<double> {
  typedef double type __attribute__((vector_size(KDA_SRV_VEC_BYTES)));
  typedef int64_t itype __attribute__((vector_size(KDA_SRV_VEC_BYTES)));
};
template <typename T>
using vec = typename Vec<T>::type;
template <typename T>
constexpr int64_t kL = KDA_SRV_VEC_BYTES / static_cast<int64_t>(sizeof(T));

// bf16 <-> fp32 lanes of one float vector.
typedef uint16_t u16x16 __attribute__((vector_size(KDA_SRV_VEC_BYTES / 2)));
typedef uint32_t u32x16 __attribute__((vector_size(KDA_SRV_VEC_BYTES)));

struct bf16 {
  uint16_t bits;
};

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename T>
inline vec<T> splat(T x) {
  return x - vec<T>{};
}

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  if (f != f) return static_cast<uint16_t>((w >> 16) | 0x40);
  return static_cast<uint16_t>((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 bf16 <-> fp32 of 8 lanes with intrinsics: the generic vector code costs about twice the
// instructions (GCC splits the widening load and masks before packing), and a bf16 pool is
// compute-bound on these conversions.
inline vec<float> bf16x8_load(const bf16* p) {
  const __m256i w = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<vec<float>>(_mm256_castsi256_ps(w));
}
inline void bf16x8_store(bf16* p, vec<float> x) {
  const __m256 f = reinterpret_cast<__m256>(x);
  const __m256i u = _mm256_castps_si256(f);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#define KDA_SRV_BF16_INTRINSICS 1
#endif

// ---- loads and stores of m (<= lanes; may be <= 0) elements, converting to/from T ---------------
template <typename T, typename S>
inline vec<T> vload(const S* p, int64_t m) {
  vec<T> r{};
  if constexpr (std::is_same<S, T>::value) {
    if (m >= kL<T>) {
      std::memcpy(&r, p, sizeof(r));
    } else {
      for (int64_t l = 0; l < m; ++l) r[l] = p[l];
    }
  } else if constexpr (std::is_same<S, bf16>::value && std::is_same<T, float>::value) {
    if (m >= kL<float>) {
#if defined(KDA_SRV_BF16_INTRINSICS)
      return bf16x8_load(p);
#endif
      u16x16 h;
      std::memcpy(&h, p, sizeof(h));
      const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
      std::memcpy(&r, &w, sizeof(r));
    } else {
      for (int64_t l = 0; l < m; ++l) r[l] = bf16_to_float(p[l].bits);
    }
  } else {
    for (int64_t l = 0; l < m && l < kL<T>; ++l) {
      if constexpr (std::is_same<S, bf16>::value) {
        r[l] = static_cast<T>(bf16_to_float(p[l].bits));
      } else {
        r[l] = static_cast<T>(p[l]);
      }
    }
  }
  return r;
}

template <typename T, typename S>
inline void vstore(S* p, const vec<T>& x, int64_t m) {
  if constexpr (std::is_same<S, T>::value) {
    if (m >= kL<T>) {
      std::memcpy(p, &x, sizeof(x));
    } else {
      for (int64_t l = 0; l < m; ++l) p[l] = x[l];
    }
  } else if constexpr (std::is_same<S, bf16>::value && std::is_same<T, float>::value) {
    if (m >= kL<float>) {
#if defined(KDA_SRV_BF16_INTRINSICS)
      bf16x8_store(p, x);
      return;
#endif
      u32x16 w;
      std::memcpy(&w, &x, sizeof(w));
      const u32x16 rounded = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
      const auto is_nan = x != x;  // all ones where NaN
      u32x16 nan;
      std::memcpy(&nan, &is_nan, sizeof(nan));
      const u32x16 quiet = (w >> 16) | 0x40u;
      const u32x16 r = (quiet & nan) | (rounded & ~nan);
      const u16x16 h = __builtin_convertvector(r, u16x16);
      std::memcpy(p, &h, sizeof(h));
    } else {
      for (int64_t l = 0; l < m; ++l) p[l].bits = float_to_bf16(x[l]);
    }
  } else {
    for (int64_t l = 0; l < m && l < kL<T>; ++l) {
      if constexpr (std::is_same<S, bf16>::value) {
        p[l].bits = float_to_bf16(static_cast<float>(x[l]));
      } else {
        p[l] = static_cast<S>(x[l]);
      }
    }
  }
}

// A whole vector of the final state: NT (fp32 state, aligned by the driver) stores it non-temporally,
// without first reading the destination line (read-for-ownership), for final states larger than
// the last-level cache (ServingArgs::stream_dst). Same values either way.
template <bool NT, typename T, typename Dst>
inline void vput(Dst* p, const vec<T>& x, int64_t m) {
#if defined(__AVX2__)
  if constexpr (NT && std::is_same<T, float>::value && std::is_same<Dst, float>::value) {
#if defined(__AVX512F__)
    _mm512_stream_ps(p, (__m512)x);
#else
    _mm256_stream_ps(p, (__m256)x);
#endif
    return;
  }
#endif
  vstore<T, Dst>(p, x, m);
}

// Fixed-order lane sums (hsum, lane_sums), shared with recurrent_kernels.cpp: they expect vec_t and
// kLanes.
template <typename T>
using vec_t = vec<T>;
template <typename T>
constexpr int64_t kLanes = kL<T>;
#include "cpu/kernels/lane_reduce.h"

// Elementwise math of the pre-processing: vec_math.h (shared with recurrent_kernels.cpp).

// Software prefetch of the state block a thread reads next (the following head's), a few lines for
// every row of this head that is read: a state that comes from memory (a decode batch larger
// than the caches) then streams in while this head's arithmetic runs, instead of after it. Into
// L2 (prefetcht1): the next block (64 KB at K = V = 128) would push this head's rows out of L1.
struct Ahead {
  uintptr_t p = 0, end = 0;  // addresses: the cursor may step past the end (prefetches never fault)
  // The next `bytes` (a constant at every call: the loop unrolls).
  __attribute__((always_inline)) inline void fetch(uintptr_t bytes) {
    if (p >= end) return;
    for (uintptr_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(p + b), 0, 2);
    }
    p += bytes;
  }
};

// ---- per-token pre-processing of one (token, value head) ---------------------------------------
template <typename T>
struct Prep {
  T* q;   // [K] scale * qhat * a   (reads the decayed state)
  T* k;   // [K] khat
  T* a;   // [K] exp(g)
  T* ak;  // [K] a * khat
  T qk;   // qhat . khat * scale
  T beta; // scalar beta (unused when head-wise)
  mutable Ahead next{};  // the block to prefetch while this one is read (decode only)
  bool two_pass = false;  // V-first: ServingArgs::vfirst_two_pass, decode only (vfirst_block)
};

template <typename T>
inline T l2_rnorm(const T* x, int64_t K) {
  vec<T> acc{};
  for (int64_t i = 0; i < K; i += kL<T>) {
    const vec<T> t = vload<T, T>(x + i, K - i);
    acc += t * t;
  }
  return static_cast<T>(1) / __builtin_sqrt(static_cast<double>(hsum<T>(acc)) + 1e-6);
}

template <typename T>
void prep_token(const ServingArgs<T>& A, int64_t tok, int64_t hv, Prep<T>& P) {
  const int64_t K = A.K, h = hv / (A.HV / A.H);
  const T* q = A.q + (tok * A.H + h) * K;
  const T* k = A.k + (tok * A.H + h) * K;
  const T* g = A.g + (tok * A.HV + hv) * K;
  const T qs = A.l2norm ? l2_rnorm<T>(q, K) * A.scale : A.scale;
  const T ks = A.l2norm ? l2_rnorm<T>(k, K) : static_cast<T>(1);
  // As the prefill's pass (recurrent_kernels.cpp): a rate >= kLogSpaceRate forms the softplus
  // gate in log space, an overflowed one (docs/math.md "Saturation") makes the bounded gate its
  // step (inf * 0 would be NaN); the others through rate_times (vec_math.h).
  const GateRate<T> rate = gate_rate(A.expA, hv);
  const bool rate_inf = __builtin_isinf(rate.rate);
  vec<T> qk{};
  for (int64_t i = 0; i < K; i += kL<T>) {
    const int64_t m = K - i;
    vec<T> z = vload<T, T>(g + i, m);
    vec<T> lg;
    if (A.gate == GateMode::kNone) {
      lg = z;
    } else {
      if (A.dt_bias) z += vload<T, T>(A.dt_bias + hv * K + i, m);
      if (A.gate == GateMode::kSoftplus) {
        vec<T> slope_unused;
        lg = rate.log_space ? vsoftplus_gate_log_space(z, A.A_log[hv], slope_unused)
                            : -rate_times(rate, vsoftplus(z));
      } else if (rate_inf) {
        lg = A.lower_bound * vsigmoid_step(z);
      } else {
        lg = A.lower_bound * vsigmoid(rate_times(rate, z));
      }
    }
    const vec<T> a = vexp(lg);
    const vec<T> qv = vload<T, T>(q + i, m) * qs;
    const vec<T> kv = vload<T, T>(k + i, m) * ks;
    qk += qv * kv;
    vstore<T, T>(P.q + i, qv * a, m);
    vstore<T, T>(P.k + i, kv, m);
    vstore<T, T>(P.a + i, a, m);
    vstore<T, T>(P.ak + i, a * kv, m);
  }
  P.qk = hsum<T>(qk);
  if (!A.beta_headwise) {
    T b = A.beta[tok * A.HV + hv];
    if (A.beta_sigmoid) b = vsigmoid(splat<T>(b))[0] * A.beta_mult;
    P.beta = b;
  }
}

// Head-wise beta of columns [c0, c0 + w) of (tok, hv), after the optional sigmoid.
template <typename T>
inline vec<T> beta_cols(const ServingArgs<T>& A, int64_t tok, int64_t hv, int64_t c, int64_t m) {
  vec<T> b = vload<T, T>(A.beta + (tok * A.HV + hv) * A.V + c, m);
  if (A.beta_sigmoid) b = vsigmoid(b) * A.beta_mult;
  return b;
}

// What the products of x [K] (the decayed key or query) with a zero state give: +0, or NaN where
// x holds a NaN or an infinity (x - x is +0 for every finite x, and a sum of +0s is +0). A unit
// that starts from a zero state skips those products; this stands in for them, so a NaN spreads
// as it does in the general kernels and the reference (docs/bad_inputs.md: NaN propagates to its
// own sequence), and a finite input keeps its bits. Only a sequence's first token from zeros
// comes here (each column block recomputes it: K subtractions against the block's K x 16 writes).
template <typename T>
inline T zero_state_product(const T* x, int64_t K) {
  vec<T> acc{};
  for (int64_t i = 0; i < K; i += kL<T>) {
    const vec<T> t = vload<T, T>(x + i, K - i);  // (lanes past K: zeros)
    acc += t - t;
  }
  return hsum<T>(acc);
}

// ---- one token on a K-first slice: columns [c, c + w), w <= NV * lanes --------------------------
// src/dst point at S[0][c] with row strides sld/dld; src == nullptr: a zero state; dst == nullptr:
// the state is not kept. Full: w == NV * lanes, so every load is one full vector (the hot path:
// the accumulators then stay in registers; the partial path is only for a ragged last slice).
template <typename T, int NV, bool Full, bool NT, typename Src, typename Dst>
void step_kfirst(const ServingArgs<T>& A, const Prep<T>& P, int64_t tok, int64_t hv, int64_t c,
                 int64_t w, const Src* src, int64_t sld, Dst* dst, int64_t dld) {
  constexpr int64_t L = kL<T>;
  const int64_t K = A.K;
  auto cnt = [&](int j) -> int64_t { return Full ? L : w - j * L; };
  vec<T> accK[NV], accQ[NV];
  for (int j = 0; j < NV; ++j) accK[j] = accQ[j] = vec<T>{};
  if (src == nullptr) {
    const vec<T> zk = splat(zero_state_product(P.ak, K)), zq = splat(zero_state_product(P.q, K));
    for (int j = 0; j < NV; ++j) {
      accK[j] = zk;
      accQ[j] = zq;
    }
  } else {
    for (int64_t r = 0; r < K; ++r) {
      const vec<T> ak = splat(P.ak[r]), qa = splat(P.q[r]);
      const Src* row = src + r * sld;
      if constexpr (Full) P.next.fetch(NV * L * sizeof(Src));
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        const vec<T> s = vload<T, Src>(row + j * L, cnt(j));
        accK[j] += ak * s;
        accQ[j] += qa * s;
      }
    }
  }
  vec<T> u[NV];
  const int64_t ob = (tok * A.HV + hv) * A.V + c;
  for (int j = 0; j < NV; ++j) {
    const int64_t m = cnt(j);
    const vec<T> b = A.beta_headwise ? beta_cols(A, tok, hv, c + j * L, m) : splat(P.beta);
    u[j] = b * (vload<T, T>(A.v + ob + j * L, m) - accK[j]);
    vstore<T, T>(A.o + ob + j * L, accQ[j] + P.qk * u[j], m);
  }
  if (dst == nullptr) return;
  if (src == nullptr) {
    for (int64_t r = 0; r < K; ++r) {
      const vec<T> kk = splat(P.k[r]);
      for (int j = 0; j < NV; ++j) vstore<T, Dst>(dst + r * dld + j * L, kk * u[j], cnt(j));
    }
    return;
  }
  for (int64_t r = 0; r < K; ++r) {
    const vec<T> a = splat(P.a[r]), kk = splat(P.k[r]);
    const Src* row = src + r * sld;
    Dst* out = dst + r * dld;
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      const vec<T> s = vload<T, Src>(row + j * L, cnt(j));
      vput<NT, T, Dst>(out + j * L, a * s + kk * u[j], cnt(j));
    }
  }
}

// ---- one token on a V-first slice: value columns [c, c + w), rows of K elements -----------------
// u_j = beta_j (v_j - dk_j) and o_j = dq_j + (q . k) u_j of the n <= kL<T> value columns from c,
// with dk_j = (a k) . S_j and dq_j = (a q) . S_j in lane j of dk and dq (lane by lane: the same
// bits for any n); u is returned broadcast for the rows' write.
template <typename T>
inline void vfirst_outputs(const ServingArgs<T>& A, const Prep<T>& P, int64_t tok, int64_t hv,
                           int64_t c, int n, const vec<T>& dk, const vec<T>& dq, vec<T>* u) {
  const int64_t ob = (tok * A.HV + hv) * A.V + c;
  const vec<T> b = A.beta_headwise ? beta_cols(A, tok, hv, c, n) : splat(P.beta);
  const vec<T> uv = b * (vload<T, T>(A.v + ob, n) - dk);
  vstore<T, T>(A.o + ob, dq + P.qk * uv, n);
  T us[kL<T>];
  std::memcpy(us, &uv, sizeof(us));
  for (int j = 0; j < n; ++j) u[j] = splat(us[j]);
}

// Columns are taken kColBlock at a time: the vectors of (a k) and (a q) loaded once serve the
// rows of every column of the block (two loads of (a k), (a q) per block instead of per column),
// and the block's rows are re-read for the write while still in L1.
// Each dot product is one accumulator per column summed over i in order, then a fixed lane tree
// (hsum): the same sums whatever the block a column falls in, so results do not depend on the
// split into units or on the thread count. Full: K is a multiple of the vector length, so every
// load is a whole vector (the hot path; the compiler keeps the accumulators in registers).
template <typename T, int CB, bool Full, bool NT, typename Src, typename Dst>
inline void vfirst_cols(const ServingArgs<T>& A, const Prep<T>& P, int64_t tok, int64_t hv,
                        int64_t c, const Src* src, int64_t sld, Dst* dst, int64_t dld) {
  constexpr int64_t L = kL<T>;
  const int64_t K = A.K;
  const T* pak = P.ak;
  const T* pq = P.q;
  static_assert(CB <= kL<T>, "vfirst_outputs takes the block's columns in one vector");
  T dk[CB] = {}, dq[CB] = {};
  if (src == nullptr) {
    std::fill(dk, dk + CB, zero_state_product(pak, K));
    std::fill(dq, dq + CB, zero_state_product(pq, K));
  } else {
    vec<T> ka[CB], qa[CB];
    for (int j = 0; j < CB; ++j) ka[j] = qa[j] = vec<T>{};
    for (int64_t i = 0; i < K; i += L) {
      const int64_t m = Full ? L : K - i;
      const vec<T> ak = vload<T, T>(pak + i, m), q = vload<T, T>(pq + i, m);
      if constexpr (Full) P.next.fetch(CB * L * sizeof(Src));
#pragma GCC unroll 8
      for (int j = 0; j < CB; ++j) {
        const vec<T> s = vload<T, Src>(src + j * sld + i, m);
        ka[j] += ak * s;
        qa[j] += q * s;
      }
    }
    for (int j = 0; j < CB; ++j) {
      dk[j] = hsum<T>(ka[j]);
      dq[j] = hsum<T>(qa[j]);
    }
  }
  vec<T> u[CB];
  vfirst_outputs<T>(A, P, tok, hv, c, CB, vload<T, T>(dk, CB), vload<T, T>(dq, CB), u);
  if (dst == nullptr) return;
  const T* pa = P.a;
  const T* pk = P.k;
  if (src == nullptr) {
    for (int64_t i = 0; i < K; i += L) {
      const int64_t m = Full ? L : K - i;
      const vec<T> kk = vload<T, T>(pk + i, m);
      for (int j = 0; j < CB; ++j) vstore<T, Dst>(dst + j * dld + i, u[j] * kk, m);
    }
    return;
  }
  for (int64_t i = 0; i < K; i += L) {
    const int64_t m = Full ? L : K - i;
    const vec<T> a = vload<T, T>(pa + i, m), kk = vload<T, T>(pk + i, m);
#pragma GCC unroll 8
    for (int j = 0; j < CB; ++j) {
      const vec<T> s = vload<T, Src>(src + j * sld + i, m);
      vput<NT, T, Dst>(dst + j * dld + i, a * s + u[j] * kk, m);
    }
  }
}

// f(std::integral_constant<int, n>{}) for n in [1, 8] (a count of vectors as a template
// argument); false, and nothing run, for any other n.
template <typename F>
inline bool with_vectors(int64_t n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 5: f(std::integral_constant<int, 5>{}); return true;
    case 6: f(std::integral_constant<int, 6>{}); return true;
    case 7: f(std::integral_constant<int, 7>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

// The write of vfirst_lanes' L rows, S'_j = a . S_j + u_j k, in pieces of CV vectors of K: a and
// k of a piece stay in 2 CV registers across the rows, so each output vector costs one load (the
// row's) instead of three. AVX-512: the whole row (K = CV vectors, CV <= 8: 16 of its 32
// registers), row by row as the general loop below; AVX2: pieces of 4 vectors (8 of its 16
// registers), the rows' pieces one after the other.
template <int CV, typename T, bool NT, typename Src, typename Dst>
inline void vfirst_write_rows(const Prep<T>& P, const vec<T>* u, const Src* src, int64_t sld,
                              Dst* dst, int64_t dld, int64_t K) {
  constexpr int64_t L = kL<T>;
  for (int64_t i0 = 0; i0 < K; i0 += CV * L) {
    vec<T> a[CV], kk[CV];
    for (int i = 0; i < CV; ++i) {
      a[i] = vload<T, T>(P.a + i0 + i * L, L);
      kk[i] = vload<T, T>(P.k + i0 + i * L, L);
    }
    for (int j = 0; j < L; ++j) {
      const Src* row = src + j * sld + i0;
      Dst* out = dst + j * dld + i0;
#pragma GCC unroll 8
      for (int i = 0; i < CV; ++i) {
        const vec<T> s = vload<T, Src>(row + i * L, L);
        vput<NT, T, Dst>(out + i * L, a[i] * s + u[j] * kk[i], L);
      }
    }
  }
}

// The dot products of vfirst_lanes_dots with K = NV vectors: (a k) and (a q) stay in 2 NV
// registers across the L rows, taken 2 at a time (each row one contiguous read), so each row
// vector costs one load instead of 1.5. Each accumulator sums over i in order, as below.
template <int NV, typename T, typename Src>
inline void vfirst_dot_rows(const Prep<T>& P, const Src* src, int64_t sld, vec<T>* zk,
                            vec<T>* zq) {
  constexpr int64_t L = kL<T>;
  vec<T> ak[NV], q[NV];
  for (int i = 0; i < NV; ++i) {
    ak[i] = vload<T, T>(P.ak + i * L, L);
    q[i] = vload<T, T>(P.q + i * L, L);
  }
  for (int64_t j = 0; j < L; j += 2) {
    const Src* r0 = src + j * sld;
    const Src* r1 = r0 + sld;
    vec<T> k0{}, q0{}, k1{}, q1{};
    P.next.fetch(2 * NV * L * sizeof(Src));
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const vec<T> s0 = vload<T, Src>(r0 + i * L, L), s1 = vload<T, Src>(r1 + i * L, L);
      k0 += ak[i] * s0;
      q0 += q[i] * s0;
      k1 += ak[i] * s1;
      q1 += q[i] * s1;
    }
    zk[j] = k0;
    zq[j] = q0;
    zk[j + 1] = k1;
    zq[j + 1] = q1;
  }
}

// V-first, kL<T> value columns at once when K is a multiple of the vector length (the hot path:
// 16 columns under AVX-512): the dot products of columns [c, c + L) and their outputs; u gets the
// columns' u_j broadcast for the write (vfirst_lanes_write). The dot products accumulate per row
// exactly as in vfirst_cols, 4 rows per sweep over K (2 rows with (a k), (a q) held in registers
// where AVX-512 holds them: vfirst_dot_rows), and the 2 x kL<T> lane sums come out of two
// transposing reductions (lane_sums_vec) instead of one horizontal sum each: the same bits
// (lane_reduce.h), ~3 shuffles per row instead of ~8 plus a round trip through the stack. Where
// the state stays in cache (B1 on the 16-core host) the horizontal sums had made V-first 1.1-1.4x
// slower than K-first.
template <typename T, typename Src>
inline void vfirst_lanes_dots(const ServingArgs<T>& A, const Prep<T>& P, int64_t tok, int64_t hv,
                              int64_t c, const Src* src, int64_t sld, vec<T>* u) {
  constexpr int64_t L = kL<T>;
  // Rows per sweep over K (2 G accumulators in registers): 4, or all L when a vector holds fewer
  // (fp64 in the 16-byte generic kernels: L = 2), so j0 + j stays below L (zk / zq have L rows).
  constexpr int G = L < 4 ? static_cast<int>(L) : 4;
  static_assert(L % G == 0, "the sweeps must tile the L columns");
  const int64_t K = A.K;
  vec<T> dk{}, dq{};
  if (src == nullptr) {
    dk = splat(zero_state_product(P.ak, K));
    dq = splat(zero_state_product(P.q, K));
  } else {
    vec<T> zk[L], zq[L];
    bool done = false;
#if defined(__AVX512F__)
    // K of 1-8 whole vectors: (a k) and (a q) in at most 16 of the 32 registers (it was 4 and 8
    // only). With the loop below, V-first decode at K = 32 / 48 took 1.1x / 1.4x this time (B1
    // and B8, H32, the state in cache, one Zen 4 core).
    if (K % L == 0) {
      done = with_vectors(K / L, [&](auto nv) {
        vfirst_dot_rows<decltype(nv)::value, T, Src>(P, src, sld, zk, zq);
      });
    }
#endif
    for (int64_t j0 = 0; !done && j0 < L; j0 += G) {
      vec<T> ka[G], qa[G];
      for (int j = 0; j < G; ++j) ka[j] = qa[j] = vec<T>{};
      for (int64_t i = 0; i < K; i += L) {
        const vec<T> ak = vload<T, T>(P.ak + i, L), q = vload<T, T>(P.q + i, L);
        P.next.fetch(G * L * sizeof(Src));
#pragma GCC unroll 4
        for (int j = 0; j < G; ++j) {
          const vec<T> s = vload<T, Src>(src + (j0 + j) * sld + i, L);
          ka[j] += ak * s;
          qa[j] += q * s;
        }
      }
      for (int j = 0; j < G; ++j) {
        zk[j0 + j] = ka[j];
        zq[j0 + j] = qa[j];
      }
    }
    dk = lane_sums_vec<T>(zk);
    dq = lane_sums_vec<T>(zq);
  }
  vfirst_outputs<T>(A, P, tok, hv, c, L, dk, dq, u);
}

// The write of L value rows from c, S'_j = a . S_j + u_j k (u from vfirst_lanes_dots).
template <typename T, bool NT, typename Src, typename Dst>
inline void vfirst_lanes_write(const ServingArgs<T>& A, const Prep<T>& P, const vec<T>* u,
                               const Src* src, int64_t sld, Dst* dst, int64_t dld) {
  constexpr int64_t L = kL<T>;
  const int64_t K = A.K;
  if (src == nullptr) {
    for (int64_t i = 0; i < K; i += L) {
      const vec<T> kk = vload<T, T>(P.k + i, L);
      for (int j = 0; j < L; ++j) vstore<T, Dst>(dst + j * dld + i, u[j] * kk, L);
    }
    return;
  }
#if defined(__AVX512F__)
  if (K % L == 0 && with_vectors(K / L, [&](auto cv) {
        vfirst_write_rows<decltype(cv)::value, T, NT, Src, Dst>(P, u, src, sld, dst, dld, K);
      })) {
    return;
  }
  if (K % (8 * L) == 0) return vfirst_write_rows<8, T, NT, Src, Dst>(P, u, src, sld, dst, dld, K);
#elif defined(__AVX2__)
  if (K % (4 * L) == 0) return vfirst_write_rows<4, T, NT, Src, Dst>(P, u, src, sld, dst, dld, K);
#endif
  // Row by row (each written as one contiguous stream, as the old 2-column blocks did: 16
  // interleaved row streams measured slower where the state comes from memory).
  for (int j = 0; j < L; ++j) {
    const Src* row = src + j * sld;
    Dst* out = dst + j * dld;
    for (int64_t i = 0; i < K; i += L) {
      const vec<T> a = vload<T, T>(P.a + i, L), kk = vload<T, T>(P.k + i, L);
      const vec<T> s = vload<T, Src>(row + i, L);
      vput<NT, T, Dst>(out + i, a * s + u[j] * kk, L);
    }
  }
}

// Whole vectors of value columns: either each block of kL<T> rows is read (its dot products)
// and then written while still in L1, or (P.two_pass) the rows of up to kVfirstSpan
// columns are all read first and then all written, as K-first's two passes over a head do.
// Measured on the Zen 4 box (H32, 1 thread, the state from memory from B4 on): the interleaved
// order ran B1 1.2x faster than two passes (93-96 vs 111 us: the write re-reads L1, not L2), two
// passes ran B4 and B8 1.05-1.2x faster (B8 1,930-2,260 vs 2,170-2,470 us). Same bits either way.
constexpr int64_t kVfirstSpan = 128;

template <typename T, bool Full, bool NT, typename Src, typename Dst>
void vfirst_block(const ServingArgs<T>& A, const Prep<T>& P, int64_t tok, int64_t hv, int64_t c,
                  int64_t w, const Src* src, int64_t sld, Dst* dst, int64_t dld) {
  constexpr int CB = kColBlock;
  constexpr int64_t L = kL<T>;
  int64_t j = 0;
  if constexpr (Full) {
    const int64_t most = P.two_pass ? kVfirstSpan : L;
    vec<T> u[kVfirstSpan];
    while (j + L <= w) {
      const int64_t span = imin(most, (w - j) / L * L);
      for (int64_t b = 0; b < span; b += L) {
        vfirst_lanes_dots<T, Src>(A, P, tok, hv, c + j + b, src ? src + (j + b) * sld : nullptr,
                                  sld, u + b);
      }
      if (dst != nullptr) {
        for (int64_t b = 0; b < span; b += L) {
          vfirst_lanes_write<T, NT, Src, Dst>(A, P, u + b, src ? src + (j + b) * sld : nullptr,
                                              sld, dst + (j + b) * dld, dld);
        }
      }
      j += span;
    }
  }
  for (; j + CB <= w; j += CB) {
    vfirst_cols<T, CB, Full, NT, Src, Dst>(A, P, tok, hv, c + j, src ? src + j * sld : nullptr, sld,
                                       dst ? dst + j * dld : nullptr, dld);
  }
  for (; j < w; ++j) {
    vfirst_cols<T, 1, Full, NT, Src, Dst>(A, P, tok, hv, c + j, src ? src + j * sld : nullptr, sld,
                                      dst ? dst + j * dld : nullptr, dld);
  }
}

template <typename T, bool NT, typename Src, typename Dst>
void step_vfirst(const ServingArgs<T>& A, const Prep<T>& P, int64_t tok, int64_t hv, int64_t c,
                 int64_t w, const Src* src, int64_t sld, Dst* dst, int64_t dld) {
  if (A.K % kL<T> == 0) {
    vfirst_block<T, true, NT, Src, Dst>(A, P, tok, hv, c, w, src, sld, dst, dld);
  } else {
    vfirst_block<T, false, false, Src, Dst>(A, P, tok, hv, c, w, src, sld, dst, dld);
  }
}

// Column blocks of a K-first unit: up to kMaxNV vectors per pass (all the unit's columns at
// K = V = 128 with AVX-512: one sequential sweep over the rows).
// NT: non-temporal stores of whole vectors (vput); the ragged paths store normally.
template <typename T, bool NT, typename Src, typename Dst>
void step_impl(const ServingArgs<T>& A, const Prep<T>& P, int64_t tok, int64_t hv, int64_t c0,
               int64_t c1, const Src* src, int64_t sld, Dst* dst, int64_t dld) {
  // src/dst point at the (hv) block of a state row; offsets of column c are added here.
  constexpr int64_t L = kL<T>;
  if (A.v_first) {
    step_vfirst<T, NT, Src, Dst>(A, P, tok, hv, c0, c1 - c0, src ? src + c0 * sld : nullptr, sld,
                             dst ? dst + c0 * dld : nullptr, dld);
    return;
  }
  // Passes of whole vectors, the widest that fit (kMaxNV, 4, 2, 1), then a ragged rest of fewer
  // than L columns: each column's sums are the same in any pass. One ragged pass over all of
  // w had FMAs on empty vectors: at V = 48 (3 of 8 vectors) K-first decode took 1.9-2.2x
  // V-first's time (B1 / B8, H32, K = 48, one Zen 4 core).
  for (int64_t c = c0; c < c1;) {
    const int64_t left = c1 - c;
    const Src* s = src ? src + c : nullptr;
    Dst* d = dst ? dst + c : nullptr;
    int64_t w;
    if (left >= kMaxNV * L) {
      w = kMaxNV * L;
      step_kfirst<T, kMaxNV, true, NT, Src, Dst>(A, P, tok, hv, c, w, s, sld, d, dld);
    } else if (kMaxNV > 4 && left >= 4 * L) {
      w = 4 * L;
      step_kfirst<T, (kMaxNV > 4 ? 4 : 2), true, NT, Src, Dst>(A, P, tok, hv, c, w, s, sld, d, dld);
    } else if (left >= 2 * L) {
      w = 2 * L;
      step_kfirst<T, 2, true, NT, Src, Dst>(A, P, tok, hv, c, w, s, sld, d, dld);
    } else if (left >= L) {
      w = L;
      step_kfirst<T, 1, true, NT, Src, Dst>(A, P, tok, hv, c, w, s, sld, d, dld);
    } else {
      w = left;
      step_kfirst<T, 1, false, false, Src, Dst>(A, P, tok, hv, c, w, s, sld, d, dld);
    }
    c += w;
  }
}

template <typename T, typename Src, typename Dst>
void step(const ServingArgs<T>& A, const Prep<T>& P, int64_t tok, int64_t hv, int64_t c0,
          int64_t c1, const Src* src, int64_t sld, Dst* dst, int64_t dld, bool nt = false) {
  if constexpr (std::is_same<T, float>::value && std::is_same<Dst, float>::value) {
    if (nt) return step_impl<T, true, Src, Dst>(A, P, tok, hv, c0, c1, src, sld, dst, dld);
  }
  step_impl<T, false, Src, Dst>(A, P, tok, hv, c0, c1, src, sld, dst, dld);
}

// Copies (converting) columns [c0, c1) of one head's state block.
template <typename T, typename Src, typename Dst>
void copy_block(const ServingArgs<T>& A, int64_t c0, int64_t c1, const Src* src, int64_t sld,
                Dst* dst, int64_t dld) {
  constexpr int64_t L = kL<T>;
  const int64_t rows = A.v_first ? c1 - c0 : A.K;
  const int64_t cols = A.v_first ? A.K : c1 - c0;
  const int64_t off_s = A.v_first ? c0 * sld : c0, off_d = A.v_first ? c0 * dld : c0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < cols; i += L) {
      const vec<T> x = src ? vload<T, Src>(src + off_s + r * sld + i, cols - i) : vec<T>{};
      vstore<T, Dst>(dst + off_d + r * dld + i, x, cols - i);
    }
  }
}

// Snapshot writes of a multi-token unit (the state after each token, copied from the unit's
// fp32 buffer to a pool slot that is not read again in this call): non-temporal stores where the
// row is vector-aligned, so the write does not first read the destination lines (no
// read-for-ownership: a verify call then moves about the bytes of its sequential decode calls'
// writes, without their reads). Falls back to plain stores otherwise.
template <typename T, typename S>
inline bool stream_row(S* dst, const T* src, int64_t n) {
#if defined(__AVX2__)
  if constexpr (std::is_same<T, float>::value && std::is_same<S, float>::value) {
    constexpr int64_t L = kL<float>;
    if (n % L != 0 || reinterpret_cast<uintptr_t>(dst) % KDA_SRV_VEC_BYTES != 0) return false;
    for (int64_t i = 0; i < n; i += L) {
#if defined(__AVX512F__)
      _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#else
      _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
    }
    return true;
  }
#endif
  (void)dst;
  (void)src;
  (void)n;
  return false;
}

template <typename T>
struct Buffer {  // 64-byte aligned heap memory, freed on scope exit
  explicit Buffer(int64_t n) {
    const size_t bytes = ((static_cast<size_t>(n) * sizeof(T) + 63) / 64) * 64 + 64;
    p = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (p == nullptr) std::abort();
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* p;
};

template <typename T, typename Src, typename Dst>
void unit_typed(const ServingArgs<T>& A, int64_t n, int64_t hv, int64_t c0, int64_t c1,
                bool next_head) {
  const int64_t K = A.K, V = A.V;
  const int64_t head = hv * K * V;  // offset of head hv inside a state row
  // Row strides of one head's [K, V] (or [V, K]) block.
  const int64_t ld = A.v_first ? K : V;
  const int64_t t0 = A.seq_start[n], t1 = A.seq_end[n], Tn = t1 - t0;
  Src* pool = static_cast<Src*>(A.src);
  const Src* src = A.src_row[n] >= 0 ? pool + A.src_row[n] * A.src_stride + head : nullptr;
  Dst* dst = A.dst_row[n] >= 0 ? static_cast<Dst*>(A.dst) + A.dst_row[n] * A.dst_stride + head
                               : nullptr;
  auto snap_at = [&](int64_t t) -> Src* {
    if (A.snap == nullptr) return nullptr;
    const int64_t r = A.snap[n * A.snap_ld + t];
    return r >= 0 ? pool + r * A.src_stride + head : nullptr;
  };
  if (A.pad[n]) {  // zero output; a fresh final state is zeros; the pool is not touched
    for (int64_t t = t0; t < t1; ++t) {
      T* o = A.o + (t * A.HV + hv) * V;
      for (int64_t c = c0; c < c1; ++c) o[c] = 0;
    }
    if (dst != nullptr && A.dst != A.src) copy_block<T, Dst, Dst>(A, c0, c1, nullptr, ld, dst, ld);
    return;
  }
  if (Tn == 0) {  // the state passes through
    if (dst != nullptr && static_cast<const void*>(dst) != static_cast<const void*>(src)) {
      copy_block<T, Src, Dst>(A, c0, c1, src, ld, dst, ld);
    }
    return;
  }
  // Pre-processed vectors of one token (q, k, a, ak), on the stack for K <= 256.
  constexpr int64_t kStackK = 256;
  alignas(64) T stack_buf[4 * kStackK];
  T* pb = stack_buf;
  Buffer<T>* heap = nullptr;
  if (K > kStackK) {
    heap = new Buffer<T>(4 * K);
    pb = heap->p;
  }
  Prep<T> P{pb, pb + K, pb + 2 * K, pb + 3 * K, 0, 0};
  if (Tn == 1) {  // decode: read the slice once, write it once, straight from src to its target
    prep_token<T>(A, t0, hv, P);
    P.two_pass = A.vfirst_two_pass;
    // The next head's block sits right after this one in the same state row. (Only the thread's
    // own next unit: another thread's block would be pulled out of that core's cache.)
    if (next_head && src != nullptr) {
      const uintptr_t next = reinterpret_cast<uintptr_t>(src + K * V);
      P.next = Ahead{next, next + K * V * sizeof(Src)};
    }
    Src* snap = snap_at(0);
    if (snap != nullptr) {
      step<T, Src, Src>(A, P, t0, hv, c0, c1, src, ld, snap, ld);
    } else {
      step<T, Src, Dst>(A, P, t0, hv, c0, c1, src, ld, dst, ld, A.stream_dst);
#if defined(__AVX2__)
      if (A.stream_dst) _mm_sfence();  // order the non-temporal stores before the call returns
#endif
    }
  } else {  // several tokens: the slice lives in a local fp32 buffer between tokens
    // Laid out like one head's block of a state row (only columns [c0, c1) are used), so the
    // same column offsets address the pool and the buffer.
    const int64_t bld = ld;
    Buffer<T> buf(K * V);
    T* b0 = buf.p;
    for (int64_t t = 0; t < Tn; ++t) {
      prep_token<T>(A, t0 + t, hv, P);
      if (t == 0) {
        step<T, Src, T>(A, P, t0, hv, c0, c1, src, ld, b0, bld);
      } else {
        step<T, T, T>(A, P, t0 + t, hv, c0, c1, b0, bld, b0, bld);
      }
      Src* snap = snap_at(t);
      if (snap != nullptr) {
        // rows of the head block: K rows of columns [c0, c1) (K-first) or rows c0..c1 of K
        const int64_t rows = A.v_first ? c1 - c0 : K, cols = A.v_first ? K : c1 - c0;
        const int64_t off = A.v_first ? c0 * ld : c0;
        bool streamed = true;
        for (int64_t r = 0; r < rows && streamed; ++r) {
          streamed = stream_row<T, Src>(snap + off + r * ld, b0 + off + r * bld, cols);
        }
        if (!streamed) copy_block<T, T, Src>(A, c0, c1, b0, bld, snap, ld);
      }
    }
    if (dst != nullptr) copy_block<T, T, Dst>(A, c0, c1, b0, bld, dst, ld);
#if defined(__AVX2__)
    _mm_sfence();  // order the non-temporal snapshot stores before the call returns
#endif
  }
  delete heap;
}

// The destination's storage type, for a given source storage type.
template <typename T, typename Src>
void unit_dst(const ServingArgs<T>& A, int64_t n, int64_t hv, int64_t c0, int64_t c1,
              bool next_head) {
  switch (A.dst_type) {
    case StateType::kBF16:
      return unit_typed<T, Src, bf16>(A, n, hv, c0, c1, next_head);
    case StateType::kF32:
      return unit_typed<T, Src, float>(A, n, hv, c0, c1, next_head);
    case StateType::kF64:
      if constexpr (std::is_same<T, double>::value) {
        return unit_typed<T, Src, double>(A, n, hv, c0, c1, next_head);
      }
      break;
  }
  std::abort();  // the op (kernel_state) never passes an fp64 state to the fp32 kernels
}

template <typename T>
void unit(const ServingArgs<T>& A, int64_t n, int64_t hv, int64_t c0, int64_t c1, bool next_head) {
  // Storage types, for the source (pool / initial state) and the destination (pool in place, or
  // the fresh final state): fp32 or bf16, and fp64 for fp64 inputs. An fp32 pool with fp64
  // inputs is addressed as fp32 (never as the compute type: it is written in place, snapshots
  // included). The op converts anything else (only read-only sources).
  switch (A.src_type) {
    case StateType::kBF16:
      return unit_dst<T, bf16>(A, n, hv, c0, c1, next_head);
    case StateType::kF32:
      return unit_dst<T, float>(A, n, hv, c0, c1, next_head);
    case StateType::kF64:
      if constexpr (std::is_same<T, double>::value) {
        return unit_dst<T, double>(A, n, hv, c0, c1, next_head);
      }
      break;
  }
  std::abort();
}

const ServingTable kServingTable = {KDA_SSTR(KDA_ISA), &unit<float>, &unit<double>};

}  // namespace

const ServingTable& serving() { return kServingTable; }

}  // namespace KDA_ISA
}  // namespace kernels
}  // namespace kda
