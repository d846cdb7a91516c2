// Fused recurrent KDA: forward and backward inner loops for one unit of work.
//
// Compiled once per instruction set (KDA_ISA = avx512 | avx2 | generic, see cmake/KdaKernels.cmake).
// The code is written with GCC/Clang vector extensions: one "vector" is KDA_VEC_BYTES bytes
// (cpu/kernels/vec_math.h), the register width of the instruction set: 64 (one zmm) with AVX-512, 32 (one ymm) with AVX2. Wider
// vectors than the registers (64-byte vectors under AVX2) made GCC 12 move halves through general
// registers and the stack: the AVX2 kernels ran at ~10% of the GEMM rate instead of ~75%.
//
// Math: docs/math.md ("Forward recurrence", "Backward"). A unit owns a
// K x W slice of the state (W <= 32 floats: 16 KB at K = 128, resident in L1 for all T) and never
// allocates: its scratch comes from the driver, one per thread, reused by all its units.
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu/kernels/vec_math.h"

#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define KDA_STR2(x) #x
#define KDA_STR(x) KDA_STR2(x)
#define KDA_ISA_NAME KDA_STR(KDA_ISA)

#ifndef KDA_ISA
#error "KDA_ISA must name the instruction set this file is compiled for"
#endif

namespace kda {
namespace kernels {
namespace KDA_ISA {
namespace {

template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(KDA_VEC_BYTES)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(KDA_VEC_BYTES)));
};
template <typename T>
using vec_t = typename VecOf<T>::type;
template <typename T>
constexpr int64_t kLanes = KDA_VEC_BYTES / static_cast<int64_t>(sizeof(T));

// Rows of the state processed per step of the row loops (independent accumulators).
#if defined(__AVX512F__)
constexpr int kRows = 4;
#elif defined(__AVX2__)
constexpr int kRows = 1;  // 16 ymm registers: NV = 4 columns of o and r accumulators per row
#else
constexpr int kRows = 2;
#endif

// Everything here has internal linkage and uses no std:: templates: this file is compiled with
// different -m flags, and a shared (weak) template instance could otherwise be taken from the
// AVX-512 object by a caller on a CPU without AVX-512.
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

template <typename T>
inline vec_t<T> splat(T x) {
  return x - vec_t<T>{};  // x - 0 == x exactly (also for -0), so this is a plain broadcast
}

// Loads m valid elements (m may be <= 0 or >= lanes); the rest of the vector is zero. The
// whole-vector path has its own variable: a zeroed one shared with the partial path made GCC
// load through the stack.
template <typename T>
inline vec_t<T> load_cols(const T* p, int64_t m) {
  if (__builtin_expect(m >= kLanes<T>, 1)) {
    vec_t<T> r;
    std::memcpy(&r, p, sizeof(r));
    return r;
  }
  vec_t<T> r{};
  for (int64_t l = 0; l < m; ++l) r[l] = p[l];
  return r;
}

// The partial path copies x to a lane array: indexing x itself made GCC keep every stored
// vector on the stack, also on the whole-vector path (the backward sweep's row gradients went
// register -> stack -> register -> memory at every step). Taking x by value instead made the
// AVX2 backward kernel 1.4x slower (GCC 12's inlining).
template <typename T>
inline void store_cols(T* p, const vec_t<T>& x, int64_t m) {
  if (__builtin_expect(m >= kLanes<T>, 1)) {
    std::memcpy(p, &x, sizeof(x));
    return;
  }
  T lanes[kLanes<T>];
  std::memcpy(lanes, &x, sizeof(x));
  for (int64_t l = 0; l < m; ++l) p[l] = lanes[l];
}

// load_cols / store_cols where the caller knows at compile time whether the whole vector is in
// range (Full): no length test, and no lane array for GCC to route the vector through.
template <bool Full, typename T>
inline vec_t<T> load_rows(const T* p, int64_t m) {
  if constexpr (Full) {
    vec_t<T> r;
    std::memcpy(&r, p, sizeof(r));
    return r;
  } else {
    return load_cols(p, m);
  }
}

template <bool Full, typename T>
inline void store_rows(T* p, const vec_t<T>& x, int64_t m) {
  if constexpr (Full) {
    std::memcpy(p, &x, sizeof(x));
  } else {
    store_cols(p, x, m);
  }
}

#include "cpu/kernels/lane_reduce.h"  // hsum, transpose_reduce, lane_sums (fixed-order lane sums)

template <typename T, int NV>
inline vec_t<T> vsum_n(const vec_t<T> (&x)[NV]) {
  vec_t<T> s = x[0];
  for (int c = 1; c < NV; ++c) s += x[c];
  return s;
}

template <typename T, int NV>
inline T hsum_n(const vec_t<T> (&x)[NV]) {
  return hsum<T>(vsum_n<T, NV>(x));
}


// Copies the slice [j0, j0 + width) of a row-major K x V state into the padded K x NV buffer.
template <typename T, int NV>
inline void load_slice(vec_t<T>* dst, const T* src, int64_t K, int64_t V, int64_t width) {
  constexpr int64_t L = kLanes<T>;
  for (int64_t i = 0; i < K; ++i) {
    for (int c = 0; c < NV; ++c) {
      dst[i * NV + c] = src ? load_cols(src + i * V + c * L, width - c * L) : vec_t<T>{};
    }
  }
}

template <typename T, int NV>
inline void store_slice(T* dst, const vec_t<T>* src, int64_t K, int64_t V, int64_t width) {
  constexpr int64_t L = kLanes<T>;
  for (int64_t i = 0; i < K; ++i) {
    for (int c = 0; c < NV; ++c) {
      if (width - c * L > 0) store_cols(dst + i * V + c * L, src[i * NV + c], width - c * L);
    }
  }
}

// The checkpoints (written every kChunk tokens, read only by a later backward call) with
// non-temporal stores: plain stores fetched every line first (read for ownership, from memory:
// the checkpoints of a long sequence exceed the caches) and the store buffer filled up behind
// those misses, ~10-15% of the AVX-512 forward on the 2-core Xeon. Rows that are not whole
// aligned vectors take the plain path. stream_fence() orders them before the call returns.
#if (defined(__AVX512F__) && KDA_VEC_BYTES == 64) || (defined(__AVX__) && KDA_VEC_BYTES == 32)
#define KDA_HAVE_STREAM 1
// One aligned vector stored past the caches (register-wide vectors only).
template <typename T>
inline void stream_vec(T* p, const vec_t<T>& x) {
#if KDA_VEC_BYTES == 64
  if constexpr (std::is_same_v<T, float>) _mm512_stream_ps(p, x); else _mm512_stream_pd(p, x);
#else
  if constexpr (std::is_same_v<T, float>) _mm256_stream_ps(p, x); else _mm256_stream_pd(p, x);
#endif
}
#endif

template <typename T, int NV>
inline void stream_slice(T* dst, const vec_t<T>* src, int64_t K, int64_t V, int64_t width) {
#if defined(KDA_HAVE_STREAM)
  constexpr int64_t L = kLanes<T>;
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % KDA_VEC_BYTES == 0 &&
                       (V * static_cast<int64_t>(sizeof(T))) % KDA_VEC_BYTES == 0;
  if (aligned && width == NV * L) {
    for (int64_t i = 0; i < K; ++i) {
      for (int c = 0; c < NV; ++c) stream_vec<T>(dst + i * V + c * L, src[i * NV + c]);
    }
    return;
  }
#endif
  store_slice<T, NV>(dst, src, K, V, width);
}

inline void stream_fence() {
#if defined(KDA_HAVE_STREAM)
  _mm_sfence();
#endif
}

// Prefetch of the row of a token a few tokens ahead: v, o, dout and dv rows of one value head
// lie HV * V floats apart (2 KB at HV = 4), a new page every few tokens, which the hardware
// prefetchers do not follow; the read of v was a miss to memory on the critical path of every
// token (the whole row sweep waits for u), ~13% of the AVX-512 forward.
constexpr int64_t kPrefetchTokens = 2;
// Tokens at the end of a backward chunk over which the next call's checkpoint is prefetched.
constexpr int64_t kCkptPrefetchTokens = 16;
template <typename T>
inline void prefetch_cols(const T* p, int64_t width, bool for_write) {
  for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(T)); b += 64) {
    if (for_write) {
      __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 1);
    } else {
      __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0);
    }
  }
}

// r = sum_i ak[i] S[i, :]   (S'^T k of a token; ak = its decay times its key)
template <typename T, int NV>
inline void decayed_key_read(vec_t<T> (&r)[NV], const vec_t<T>* S, const T* ak, int64_t K) {
  using V = vec_t<T>;
  V acc[kRows][NV] = {};
  int64_t i = 0;
  for (; i + kRows <= K; i += kRows) {
#pragma GCC unroll 4
    for (int rr = 0; rr < kRows; ++rr) {
      const V c = splat<T>(ak[i + rr]);
#pragma GCC unroll 4
      for (int cc = 0; cc < NV; ++cc) acc[rr][cc] += c * S[(i + rr) * NV + cc];
    }
  }
  for (; i < K; ++i) {
    const V c = splat<T>(ak[i]);
    for (int cc = 0; cc < NV; ++cc) acc[0][cc] += c * S[i * NV + cc];
  }
  for (int cc = 0; cc < NV; ++cc) {
    V s = acc[0][cc];
    for (int rr = 1; rr < kRows; ++rr) s += acc[rr][cc];
    r[cc] = s;
  }
}

// One token's write, fused with the reads around it:
//   Sout[i] = a[i] Sin[i] + k[i] u          (S_t = S'_t + k u^T)
//   o      = sum_i q[i] Sout[i]             (only if WithOut)
//   rnext  = sum_i akn[i] Sout[i]           (S'_{t+1}^T k_{t+1}: the next token's read)
template <typename T, int NV, bool WithOut>
inline void write_step(vec_t<T>* Sout, const vec_t<T>* Sin, const vec_t<T> (&u)[NV], const T* a,
                       const T* k, const T* q, const T* akn, int64_t K,
                       vec_t<T> (&o)[NV], vec_t<T> (&rnext)[NV]) {
  using V = vec_t<T>;
  V oacc[kRows][NV] = {};
  V racc[kRows][NV] = {};
  int64_t i = 0;
  for (; i + kRows <= K; i += kRows) {
#pragma GCC unroll 4
    for (int rr = 0; rr < kRows; ++rr) {
      const int64_t ii = i + rr;
      const V av = splat<T>(a[ii]);
      const V kv = splat<T>(k[ii]);
      const V cn = splat<T>(akn[ii]);
      V qv{};
      if (WithOut) qv = splat<T>(q[ii]);
#pragma GCC unroll 4
      for (int cc = 0; cc < NV; ++cc) {
        const V s = av * Sin[ii * NV + cc] + kv * u[cc];
        Sout[ii * NV + cc] = s;
        if (WithOut) oacc[rr][cc] += qv * s;
        racc[rr][cc] += cn * s;
      }
    }
  }
  for (; i < K; ++i) {
    const V av = splat<T>(a[i]);
    const V kv = splat<T>(k[i]);
    const V cn = splat<T>(akn[i]);
    V qv{};
    if (WithOut) qv = splat<T>(q[i]);
    for (int cc = 0; cc < NV; ++cc) {
      const V s = av * Sin[i * NV + cc] + kv * u[cc];
      Sout[i * NV + cc] = s;
      if (WithOut) oacc[0][cc] += qv * s;
      racc[0][cc] += cn * s;
    }
  }
  for (int cc = 0; cc < NV; ++cc) {
    V so = oacc[0][cc], sr = racc[0][cc];
    for (int rr = 1; rr < kRows; ++rr) {
      so += oacc[rr][cc];
      sr += racc[rr][cc];
    }
    o[cc] = so;
    rnext[cc] = sr;
  }
}

// ---- pre-processing --------------------------------------------------------------------------

// 16-bit inputs widened to float as they are read (Storage): bf16 is the top half of a float
// (exact); fp16 through the F16C / AVX-512 conversion where the ISA has it (exact too).
inline float widen1(uint16_t x, Storage st) {
  return st == Storage::kBf16 ? bf16_to_float(x) : half_to_float(x);
}

// m elements (m may exceed the lanes) of p widened into a float vector; the rest is zero.
template <bool Full = false>
inline vec_t<float> widen(const uint16_t* p, int64_t m, Storage st) {
  constexpr int64_t L = kLanes<float>;
  vec_t<float> r{};
  if (!Full && m < L) {
    for (int64_t l = 0; l < m; ++l) r[l] = widen1(p[l], st);
    return r;
  }
  if (st == Storage::kBf16) {
    typedef uint16_t u16v __attribute__((vector_size(KDA_VEC_BYTES / 2)));
    typedef int32_t i32v __attribute__((vector_size(KDA_VEC_BYTES)));
    u16v h;
    std::memcpy(&h, p, sizeof(h));
    const i32v w = __builtin_convertvector(h, i32v) << 16;
    std::memcpy(&r, &w, sizeof(r));
    return r;
  }
#if defined(__AVX512F__) && KDA_VEC_BYTES == 64
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&r, &x, sizeof(r));
#elif defined(__F16C__) && KDA_VEC_BYTES == 32
  const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&r, &x, sizeof(r));
#else
  for (int64_t l = 0; l < L; ++l) r[l] = widen1(p[l], st);
#endif
  return r;
}

// Elements [off, off + m) of an input stored as st (the compute-type or the 16-bit array); Full:
// the caller knows m >= lanes (load_rows).
template <bool Full = false, typename T>
inline vec_t<T> load_in(const T* p, const uint16_t* p16, Storage st, int64_t off, int64_t m) {
  if constexpr (std::is_same_v<T, float>) {
    if (st != Storage::kCompute) return widen<Full>(p16 + off, m, st);
  }
  return load_rows<Full>(p + off, m);
}
template <typename T>
inline T load1_in(const T* p, const uint16_t* p16, Storage st, int64_t off) {
  if constexpr (std::is_same_v<T, float>) {
    if (st != Storage::kCompute) return widen1(p16[off], st);
  }
  return p[off];
}

// Vectors of gates the pre-processing runs through its softplus / sigmoid and exp at once
// (vec_math.h: their dependency chains interleave). 8 (a whole row of 128 floats with AVX-512):
// the pass alone (benchmarks/prep_kernel.cpp, H4 K128, rows in cache, 2-core AMD Zen 5 guest)
// took 280 -> 225 / 188 / 160 ns per token and head with 2 / 4 / 8 vectors at once, the AVX2
// kernel 545 -> 465 / 400 / 385. 1 for the generic kernel: its 64-byte vectors are four SSE
// registers each, and 4 or 8 of them at once spilled (2.5-2.8 -> 3.0-3.3 us).
#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int kPrepVecs = 8;
#else
constexpr int kPrepVecs = 1;
#endif

constexpr int64_t kPrepPrefetch = 4;

template <typename T, bool Full>
PrepReport prep_rows(const PrepArgs<T>& P, int64_t t0, int64_t t1) {
  using V = vec_t<T>;
  constexpr int64_t L = kLanes<T>;
  const int64_t K = P.K, H = P.H, HV = P.HV, BT = P.BT;
  const int64_t q_ld = P.q_ld ? P.q_ld : H * K, g_ld = P.g_ld ? P.g_ld : HV * K;
  const int64_t beta_ld = P.beta_ld ? P.beta_ld : HV, v_ld = P.v_ld ? P.v_ld : P.VW;
  PrepReport rep;
  const V zero{};
  // Lanes that ever held a log-decay > 0 (NaN compares false: it propagates, it is not rejected).
  // One OR per vector; the offending index is searched only if a lane is set.
  decltype(zero > zero) g_pos{};
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t ti = t - P.in_shift, to = t - P.out_shift;  // input / output rows of token t
    // The rows of q, k and g of a token a few ahead (the loads of each row's first use waited on
    // memory: ~23% of this pass on the 2-core Xeon).
    if (t + kPrepPrefetch < t1) {
      const int64_t ta = ti + kPrepPrefetch;
      if (P.q_store == Storage::kCompute) {
        prefetch_cols(P.q + ta * q_ld, H * K, false);
        prefetch_cols(P.k + ta * q_ld, H * K, false);
      } else {
        prefetch_cols(P.q16 + ta * q_ld, H * K, false);
        prefetch_cols(P.k16 + ta * q_ld, H * K, false);
      }
      if (P.g_store == Storage::kCompute) {
        prefetch_cols(P.g + ta * g_ld, HV * K, false);
      } else {
        prefetch_cols(P.g16 + ta * g_ld, HV * K, false);
      }
      if (P.v16) prefetch_cols(P.v16 + ta * v_ld, P.VW, false);
    }
    // q, k: l2 norm (optional) and scale. Row r < 2H is q of head r, then k of head r - H. The
    // sums of squares of L rows at a time are reduced together (lane_sums: row r's sum has the
    // bits of hsum(row r), in about 3 shuffles and adds per row instead of a horizontal sum each).
    for (int64_t r0 = 0; r0 < 2 * H; r0 += L) {
      const int64_t nr = imin(L, 2 * H - r0);
      T ss[L];
      if (P.l2norm) {
        V Z[L];
        for (int64_t r = 0; r < L; ++r) {
          V acc{};
          if (r < nr) {
            const int64_t h = (r0 + r) % H;
            const T* src = r0 + r < H ? P.q : P.k;
            const uint16_t* src16 = r0 + r < H ? P.q16 : P.k16;
            for (int64_t i = 0; i < K; i += L) {
              const V xv = load_in<Full>(src, src16, P.q_store, ti * q_ld + h * K + i, K - i);
              acc += xv * xv;
            }
          }
          Z[r] = acc;
        }
        lane_sums<T>(ss, Z, L);
      }
      for (int64_t r = 0; r < nr; ++r) {
        const bool is_q = r0 + r < H;
        const int64_t h = (r0 + r) % H;
        const T* src = is_q ? P.q : P.k;
        const uint16_t* src16 = is_q ? P.q16 : P.k16;
        const int64_t x0 = ti * q_ld + h * K;
        T* y = (is_q ? P.q_out : P.k_out) + (h * BT + to) * K;
        T f = is_q ? P.scale : T(1);
        if (P.l2norm) {
          const T rn = T(1) / s_sqrt(ss[r] + T(1e-6));
          T* rn_out = is_q ? P.q_rnorm : P.k_rnorm;
          if (rn_out) rn_out[to * H + h] = rn;
          f = rn * f;
        }
        // The storage read into a local: a store through y may alias P as far as GCC knows, and
        // it re-read P.q_store and re-tested it at every vector.
        const Storage st = P.q_store;
        for (int64_t i = 0; i < K; i += L) {
          store_rows<Full>(y + i, load_in<Full>(src, src16, st, x0 + i, K - i) * f, K - i);
        }
      }
    }
    // gate and decay, kPrepVecs vectors at a time (vec_math.h: their chains interleave)
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t g0 = ti * g_ld + hv * K;
      const T* bias = P.dt_bias ? P.dt_bias + hv * K : nullptr;
      T* a = P.a_out + (hv * BT + to) * K;
      // a * khat (khat of this value head's key head), for the recurrent kernel only
      T* ak = P.ak_out ? P.ak_out + (hv * BT + to) * K : nullptr;
      const T* kh = P.k_out + ((hv / (HV / H)) * BT + to) * K;
      T* gout = P.g_out ? P.g_out + (to * HV + hv) * K : nullptr;
      T* slope = P.gate_slope_out ? P.gate_slope_out + (to * HV + hv) * K : nullptr;
      // A rate >= kLogSpaceRate forms the softplus gate in log space; an overflowed one
      // (A_log > log(max); docs/math.md "Saturation") makes the bounded gate's sigmoid(inf * z)
      // its step (sign(z) + 1) / 2 (inf * 0 would be NaN).
      const GateRate<T> rate = gate_rate(P.expA, hv);  // a tiny one: rate_times (vec_math.h)
      const bool rate_inf = __builtin_isinf(rate.rate);
      for (int64_t i = 0; i < K; i += kPrepVecs * L) {
        // Vector c covers [i + c L, i + c L + m[c]); past K (m <= 0) it holds zeros and is
        // neither read nor stored.
        int64_t m[kPrepVecs];
        V gl[kPrepVecs];
        for (int c = 0; c < kPrepVecs; ++c) {
          m[c] = K - i - c * L;
          gl[c] = load_in<Full>(P.g, P.g16, P.g_store, g0 + i + c * L, m[c]);
        }
        if (P.gate == GateMode::kSoftplus) {
          V z[kPrepVecs];
          for (int c = 0; c < kPrepVecs; ++c) {
            z[c] = gl[c];
            if (bias) z[c] += load_rows<Full>(bias + i + c * L, m[c]);
          }
          if (rate.log_space) {
            // the slope here is the whole derivative of the log decay in z (bwd_common.cpp)
            for (int c = 0; c < kPrepVecs; ++c) {
              V sl;
              gl[c] = vsoftplus_gate_log_space(z[c], P.A_log[hv], sl);
              if (slope) store_rows<Full>(slope + i + c * L, sl, m[c]);
            }
          } else {
            if (slope) {
              V sg[kPrepVecs];
              vsoftplus_sigmoid_n<kPrepVecs>(z, sg);
              for (int c = 0; c < kPrepVecs; ++c) store_rows<Full>(slope + i + c * L, sg[c], m[c]);
            } else {
              vsoftplus_n<kPrepVecs>(z);
            }
            for (int c = 0; c < kPrepVecs; ++c) gl[c] = -rate_times(rate, z[c]);
          }
        } else if (P.gate == GateMode::kBounded) {
          V sg[kPrepVecs], sn[kPrepVecs];  // sigmoid(x), sigmoid(-x) (the slope, backward only)
          for (int c = 0; c < kPrepVecs; ++c) {
            V z = gl[c];
            if (bias) z += load_rows<Full>(bias + i + c * L, m[c]);
            sg[c] = rate_inf ? vsigmoid_step(z) : rate_times(rate, z);
          }
          if (slope && !rate_inf) {
            for (int c = 0; c < kPrepVecs; ++c) sn[c] = zero - sg[c];
            vsigmoid_n<kPrepVecs>(sn);
          }
          if (!rate_inf) vsigmoid_n<kPrepVecs>(sg);
          for (int c = 0; c < kPrepVecs; ++c) {
            gl[c] = P.lower_bound * sg[c];
            // a saturated rate's step has slope 0 (no gradient flows through it)
            if (slope) store_rows<Full>(slope + i + c * L, rate_inf ? zero : sg[c] * sn[c], m[c]);
          }
        } else {
          for (int c = 0; c < kPrepVecs; ++c) g_pos |= gl[c] > zero;
        }
        V av[kPrepVecs];
        for (int c = 0; c < kPrepVecs; ++c) {
          if (gout) store_rows<Full>(gout + i + c * L, gl[c], m[c]);
          av[c] = gl[c];
        }
        vexp_n<kPrepVecs>(av);
        for (int c = 0; c < kPrepVecs; ++c) {
          store_rows<Full>(a + i + c * L, av[c], m[c]);
          if (ak) {
            store_rows<Full>(ak + i + c * L, av[c] * load_rows<Full>(kh + i + c * L, m[c]), m[c]);
          }
        }
      }
    }
    // beta
    for (int64_t hv = 0; hv < HV; ++hv) {
      T b = load1_in(P.beta, P.beta16, P.beta_store, ti * beta_ld + hv);
      if (P.beta_sigmoid) {
        const T sig = T(1) / (T(1) + s_exp(-b));
        if (P.beta_slope_out) {
          P.beta_slope_out[hv * BT + to] = P.beta_mult * sig * (T(1) / (T(1) + s_exp(b)));
        }
        b = P.beta_mult * sig;
      } else if ((b < T(0) || b > T(2)) && rep.bad_beta < 0) {
        rep.bad_beta = t * HV + hv;
      }
      P.beta_out[hv * BT + to] = b;
    }
    // v (16-bit, forward blocks): widened into the block's compute-type rows.
    if (P.v16) {
      const uint16_t* vs = P.v16 + ti * v_ld;
      T* vd = P.v_out + to * P.VW;
      for (int64_t i = 0; i < P.VW; i += L) {
        store_cols(vd + i, load_in<false, T>(nullptr, vs, P.v_store, i, P.VW - i), P.VW - i);
      }
    }
  }
  bool any_g = false;
  for (int64_t l = 0; l < L; ++l) any_g = any_g || g_pos[l] != 0;
  for (int64_t t = t0; any_g && t < t1; ++t) {
    const int64_t g0 = (t - P.in_shift) * g_ld;
    for (int64_t j = 0; j < HV * K; ++j) {
      if (load1_in(P.g, P.g16, P.g_store, g0 + j) > T(0)) {
        rep.bad_g = t * HV * K + j;
        any_g = false;
        break;
      }
    }
  }
  return rep;
}

// Full: K is a multiple of kPrepVecs vectors (of 64 floats under AVX2, 128 under AVX-512, 16 in
// the generic kernels), so every vector of a row is whole, and the pass runs without a length test
// and a partial path per vector. At K = 128 under AVX2 that took it from ~4,200 to ~3,000
// instructions per token and head (callgrind of benchmarks/prep_kernel.cpp) and from ~390 to ~315
// ns with its rows in cache (2-core Zen 3 box); the same values.
template <typename T>
PrepReport prep_tokens(const PrepArgs<T>& P, int64_t t0, int64_t t1) {
  if (P.K % (kPrepVecs * kLanes<T>) == 0) return prep_rows<T, true>(P, t0, t1);
  return prep_rows<T, false>(P, t0, t1);
}

// Forward of tokens [t0, t1) of sequence n for one slice of columns [j0, j0 + width); the token
// range being run is [rs, re) (t1 <= re). S (K x NV vectors) and r (the read S'^T k of token t0)
// carry the slice between blocks of the range.
template <typename T, int NV>
void fwd_block(const FwdArgs<T>& A, int64_t n, int64_t hv, int64_t j0, int64_t width, int64_t t0,
               int64_t t1, int64_t rs, int64_t re, vec_t<T>* S, vec_t<T>* r_io, const T* zeros) {
  using V = vec_t<T>;
  constexpr int64_t L = kLanes<T>;
  const int64_t K = A.K, Vd = A.V, H = A.H, HV = A.HV;
  const int64_t h = hv / (HV / H);
  const int64_t origin = A.seqs.origin[n], slot_base = A.seqs.slot_base[n];
  const int64_t sh = A.seqs.row_shift(n);
  const int64_t vsh = A.seqs.vo_row_shift(n);
  const int64_t ckpt_off = hv * K * Vd + j0;  // in one slot of [slots, HV, K, V]
  const int64_t slot_stride = HV * K * Vd;
  // Rows of the pre-processed arrays at the local token index (t - sh).
  const T* a_h = A.a + (hv * A.BT - sh) * K;
  const T* ak_h = A.ak + (hv * A.BT - sh) * K;
  const T* k_h = A.k + (h * A.BT - sh) * K;
  const T* q_h = A.q + (h * A.BT - sh) * K;
  const T* b_h = A.beta + hv * A.BT - sh;

  V r[NV];
  if (t0 == rs) {
    // Start of a range: the read of its first token from the state (the same sums, in the same
    // order, as the fused read of write_step, so the result does not depend on the ranges).
    decayed_key_read<T, NV>(r, S, ak_h + rs * K, K);
  } else {
    for (int cc = 0; cc < NV; ++cc) r[cc] = r_io[cc];
  }
  for (int64_t t = t0; t < t1; ++t) {
    if (A.ckpt && (t - origin) % kChunk == 0) {
      const int64_t slot = slot_base + (t - origin) / kChunk;
      stream_slice<T, NV>(A.ckpt + slot * slot_stride + ckpt_off, S, K, Vd, width);
    }
    if (t + kPrefetchTokens < t1) {
      const int64_t ta = t + kPrefetchTokens - vsh;
      prefetch_cols(A.v + (ta * HV + hv) * Vd + j0, width, false);
      prefetch_cols(A.o + (ta * HV + hv) * Vd + j0, width, true);
    }
    const T* at = a_h + t * K;
    const T* kt = k_h + t * K;
    const T* qt = q_h + t * K;
    const T* akn = t + 1 < re ? ak_h + (t + 1) * K : zeros;
    const V b = splat<T>(b_h[t]);
    const T* vt = A.v + ((t - vsh) * HV + hv) * Vd + j0;
    V u[NV];
    for (int cc = 0; cc < NV; ++cc) u[cc] = b * (load_cols(vt + cc * L, width - cc * L) - r[cc]);
    V o[NV];
    write_step<T, NV, true>(S, S, u, at, kt, qt, akn, K, o, r);
    T* ot = A.o + ((t - vsh) * HV + hv) * Vd + j0;
    for (int cc = 0; cc < NV; ++cc) {
      if (width - cc * L > 0) store_cols(ot + cc * L, o[cc], width - cc * L);
    }
  }
  for (int cc = 0; cc < NV; ++cc) r_io[cc] = r[cc];
}

// Forward of slices [s_begin, s_end) (kFwdSlice columns each) of value head hv of sequence n.
// Time-blocked: a block of tokens runs through every slice before the next block, so the
// block's q/k/decay rows are read from memory once and reused from cache by all slices, while
// each slice's state stays in L1 during its block. The states live in A.slices from range to
// range (no reload per token block), or for a call in one token block in the scratch.
template <typename T>
void fwd_unit(const FwdArgs<T>& A, int64_t n, int64_t hv, int64_t s_begin, int64_t s_end,
              int64_t rs, int64_t re, T* ws) {
  using V = vec_t<T>;
  constexpr int64_t L = kLanes<T>;
  constexpr int64_t NVmax = (kFwdSlice + L - 1) / L;
  constexpr int64_t kBlock = 64;
  const int64_t K = A.K, Vd = A.V, HV = A.HV;
  const int64_t ts = A.seqs.seq_start[n], te = A.seqs.seq_end[n];
  const int64_t n_sl = s_end - s_begin;
  const int64_t n_all = (Vd + kFwdSlice - 1) / kFwdSlice;
  static_assert(NVmax * L == kFwdSlice, "a slice is a whole number of vectors");
  // The caller's scratch (fwd_scratch_elems): reads, zeros, states. The states are the unit's
  // slots of A.slices, kept from range to range, or without A.slices (every sequence in one
  // range) the scratch's. Either way they are loaded at the range that starts the sequence and
  // stored at the one that ends it.
  V* const r_ws = reinterpret_cast<V*>(ws);
  T* const zeros = ws + n_sl * kFwdSlice;
  T* const S_base = A.slices ? A.slices + ((n * HV + hv) * n_all + s_begin) * fwd_slice_stride(K)
                         : zeros + (K + 15) / 16 * 16;
  auto state = [&](int64_t i) { return reinterpret_cast<V*>(S_base + i * fwd_slice_stride(K)); };
  for (int64_t i = 0; i < K; ++i) zeros[i] = T(0);
  const int64_t state_base = (n * HV + hv) * K * Vd;  // in [N, HV, K, V]
  auto slice = [&](int64_t i, int64_t& j0, int64_t& width, int64_t& nv) {
    j0 = (s_begin + i) * kFwdSlice;
    width = imin(kFwdSlice, Vd - j0);
    nv = (width + L - 1) / L;
  };
  // The range that starts the sequence reads the initial state (or zeros); later ones find the
  // running state where the previous range left it.
  for (int64_t i = 0; rs == ts && i < n_sl; ++i) {
    int64_t j0, width, nv;
    slice(i, j0, width, nv);
    V* Si = state(i);
    const T* src = A.h0 ? A.h0 + state_base + j0 : nullptr;
    if (nv <= 1) {
      load_slice<T, 1>(Si, src, K, Vd, width);
    } else if (nv == 2) {
      load_slice<T, 2>(Si, src, K, Vd, width);
    } else if (nv == 3) {
      load_slice<T, 3>(Si, src, K, Vd, width);
    } else {
      load_slice<T, static_cast<int>(NVmax)>(Si, src, K, Vd, width);
    }
  }
  for (int64_t t0 = rs; t0 < re; t0 += kBlock) {
    const int64_t t1 = imin(re, t0 + kBlock);
    for (int64_t i = 0; i < n_sl; ++i) {
      int64_t j0, width, nv;
      slice(i, j0, width, nv);
      V* Si = state(i);
      V* ri = r_ws + i * NVmax;
      if (nv <= 1) {
        fwd_block<T, 1>(A, n, hv, j0, width, t0, t1, rs, re, Si, ri, zeros);
      } else if (nv == 2 || NVmax <= 2) {
        fwd_block<T, (NVmax >= 2 ? 2 : 1)>(A, n, hv, j0, width, t0, t1, rs, re, Si, ri, zeros);
      } else if (nv == 3 || NVmax <= 3) {
        fwd_block<T, (NVmax >= 3 ? 3 : 1)>(A, n, hv, j0, width, t0, t1, rs, re, Si, ri, zeros);
      } else {
        // Wider slices (doubles under AVX2) run the NVmax variant; padded columns stay zero.
        fwd_block<T, static_cast<int>(NVmax)>(A, n, hv, j0, width, t0, t1, rs, re, Si, ri, zeros);
      }
    }
  }
  if (A.ckpt) stream_fence();  // the checkpoints' non-temporal stores, before another thread reads
  for (int64_t i = 0; re == te && i < n_sl; ++i) {
    int64_t j0, width, nv;
    slice(i, j0, width, nv);
    V* Si = state(i);
    T* dst = A.ht + state_base + j0;
    if (nv <= 1) {
      store_slice<T, 1>(dst, Si, K, Vd, width);
    } else if (nv == 2) {
      store_slice<T, 2>(dst, Si, K, Vd, width);
    } else if (nv == 3) {
      store_slice<T, 3>(dst, Si, K, Vd, width);
    } else {
      store_slice<T, static_cast<int>(NVmax)>(dst, Si, K, Vd, width);
    }
  }
}

// ---- backward -------------------------------------------------------------------------------
//
// The backward keeps its slices TRANSPOSED: column j of a K x W slice is ceil(K / L) vectors whose
// lanes are the rows i (rows K..Kp padded with zeros, Kp = K rounded up to 16). Every
// quantity the backward needs per row (dq_i, dk_i, dg_i: sums over the slice's columns) is then a
// vertical sum over the columns, and the per-row inputs a_i, k_i, q_i are vector loads. The sums
// over rows (delta = D^T k, and the recompute's read S'^T k: one per column, two per token)
// become lane sums, reduced 16 columns at a time by transpose_reduce. Row-major slices (as the
// forward's) needed three row reductions per row and token instead: on AVX-512 ~6 permutes per
// row on port 5, one of the two ports of the ~17 FMAs per row, and most of that port's pressure.

// Rows of a transposed column: K padded to a multiple of 16 (of every lane count).
inline int64_t padded_rows(int64_t K) { return (K + 15) / 16 * 16; }

// The slice [j0, j0 + width) of a row-major K x V state, transposed into dst (width columns of
// Kp elements, rows K..Kp zero); src == null: zeros. Whole L x L tiles go through registers
// (transpose_tile): element by element, this load of each chunk's checkpoint was ~2% of the
// backward kernel on the 2-core Xeon (K = V = 128).
template <typename T>
inline void load_slice_tr(T* dst, const T* src, int64_t K, int64_t V, int64_t width) {
  const int64_t Kp = padded_rows(K);
  for (int64_t j = 0; j < width; ++j) {
    for (int64_t i = K; i < Kp; ++i) dst[j * Kp + i] = T(0);
  }
  if (!src) {
    for (int64_t j = 0; j < width; ++j) {
      for (int64_t i = 0; i < K; ++i) dst[j * Kp + i] = T(0);
    }
    return;
  }
  int64_t Kt = 0, Wt = 0;  // rows and columns covered by whole tiles
#if defined(KDA_HAVE_TRANSPOSE_REDUCE)
  constexpr int64_t L = kLanes<T>;
  static const ReduceMasks<T> masks;
  Kt = K / L * L;
  Wt = width / L * L;
  for (int64_t ib = 0; ib < Kt; ib += L) {
    for (int64_t jb = 0; jb < Wt; jb += L) {
      vec_t<T> x[L];
      for (int64_t r = 0; r < L; ++r) std::memcpy(&x[r], src + (ib + r) * V + jb, sizeof(x[r]));
      transpose_tile<T>(x, masks);
      for (int64_t c = 0; c < L; ++c) std::memcpy(dst + (jb + c) * Kp + ib, &x[c], sizeof(x[c]));
    }
  }
#endif
  for (int64_t i = 0; i < K; ++i) {
    for (int64_t j = i < Kt ? Wt : 0; j < width; ++j) dst[j * Kp + i] = src[i * V + j];
  }
}

template <typename T>
inline void store_slice_tr(T* dst, const T* src, int64_t K, int64_t V, int64_t width) {
  const int64_t Kp = padded_rows(K);
  for (int64_t i = 0; i < K; ++i) {
    for (int64_t j = 0; j < width; ++j) dst[i * V + j] = src[j * Kp + i];
  }
}


// Keeps a loaded vector in its register: GCC folds every use of a load into the arithmetic as a
// memory operand (P = S_{t-1}[i, j] was loaded three times, D twice), and the sweep then issued
// as many loads as FMAs, the two ports of each bound together. One register per vector under
// AVX2 / AVX-512 only (the generic 64-byte vectors span several registers).
#if (defined(__AVX512F__) && KDA_VEC_BYTES == 64) || (defined(__AVX2__) && KDA_VEC_BYTES == 32)
#define KDA_KEEP(x) asm("" : "+v"(x))
#else
#define KDA_KEEP(x) (void)0
#endif

// Row vectors of the backward sweep and the recompute per step of its row loop (independent
// accumulators per step). Each step of the sweep pays a prologue (its rows of a, k, q) and an
// epilogue (its rows of the gradients): under AVX2, 2 row vectors per step are 8-11% faster in
// the kernel than 1 although their 18 vectors of inputs and accumulators spill past the 16
// registers (3 and 4: 9% and 12-13% slower than 2; benchmarks/bwd_kernel.cpp on a Zen 3).
// The recompute holds three row vectors per step (a, k, the next a k) and no accumulators, so
// it takes more rows per step: fewer read-modify-writes of the column partials Z (AVX2: 4 row
// vectors 5-6% faster than 2 in the kernel, benchmarks/bwd_kernel.cpp on a Zen 3).
#if defined(__AVX512F__)
constexpr int kRowVecs = 2;
constexpr int kRecVecs = 4;
#elif defined(__AVX2__)
constexpr int kRowVecs = 2;
constexpr int kRecVecs = 4;
#else
constexpr int kRowVecs = 1;
constexpr int kRecVecs = 2;
#endif

// Z[j] (+)= sum over the NB row vectors from ib of c_i S[i, j]: the lane partials of a column sum.
template <typename T, int NB>
inline void col_partials(vec_t<T>* Z, const vec_t<T>* S, const T* c, int64_t K, int64_t KV,
                         int64_t ib, int64_t width) {
  using V = vec_t<T>;
  constexpr int64_t L = kLanes<T>;
  V cv[NB];
  for (int b = 0; b < NB; ++b) cv[b] = load_cols(c + (ib + b) * L, K - (ib + b) * L);
  for (int64_t j = 0; j < width; ++j) {
    V z = cv[0] * S[j * KV + ib];
#pragma GCC unroll 4
    for (int b = 1; b < NB; ++b) z += cv[b] * S[j * KV + ib + b];
    Z[j] = ib == 0 ? z : Z[j] + z;
  }
}

// Columns ahead (in the order of the stores) whose lines the recompute prefetches for writing:
// half of its states go to the chunk buffer in L2, and a store that misses L1 waits for the
// line's read for ownership; the prefetches start those reads while the FMAs of the columns
// before run (the backward kernel 4-5% faster on the 2-core Xeon at 2 columns ahead, 3% at 8;
// the results are the same bits).
constexpr int64_t kStorePrefetchCols = 2;

// One recomputed token of a transposed slice, rows [ib, ib + NB vectors):
//   Sout[i, j] = a_i Sin[i, j] + k_i u_j,   Z[j] (+)= lane partials of sum_i akn_i Sout[i, j]
// (the next token's read S'^T k).
template <typename T, int NB>
inline void write_rows_tr(vec_t<T>* Sout, const vec_t<T>* Sin, const T* u, const T* a,
                          const T* k, const T* akn, int64_t K, int64_t KV, int64_t ib,
                          int64_t width, vec_t<T>* Z) {
  using V = vec_t<T>;
  constexpr int64_t L = kLanes<T>;
  V av[NB], kv[NB], cv[NB];
  for (int b = 0; b < NB; ++b) {
    const int64_t m = K - (ib + b) * L;
    av[b] = load_cols(a + (ib + b) * L, m);
    kv[b] = load_cols(k + (ib + b) * L, m);
    cv[b] = load_cols(akn + (ib + b) * L, m);
  }
  for (int64_t j = 0; j < width; ++j) {
    // The lines of column j + kStorePrefetchCols, or past the slice's width those of the next
    // row vectors' first columns (rows past KV: lines of the slot after, harmless hints).
    const V* pf = j + kStorePrefetchCols < width
                      ? Sout + (j + kStorePrefetchCols) * KV + ib
                      : Sout + (j + kStorePrefetchCols - width) * KV + ib + NB;
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) __builtin_prefetch(pf + b, 1, 3);
    const V uj = splat<T>(u[j]);
    V z{};
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const V s = av[b] * Sin[j * KV + ib + b] + kv[b] * uj;
      Sout[j * KV + ib + b] = s;
      z = b == 0 ? cv[b] * s : z + cv[b] * s;
    }
    Z[j] = ib == 0 ? z : Z[j] + z;
  }
}

// One token of the backward: its recomputed S_{t-1} (transposed), its rows of the
// pre-processed inputs, and per column r_t, u_t and do_t (zero past the slice's width).
template <typename T>
struct BwdToken {
  // S_{t-1}, or with derive S_{t-2}: the sweep then forms S_{t-1} = a_{t-1} S_{t-2} +
  // k_{t-1} u_{t-1}^T from the previous token's rows (the chunk buffer keeps every other state).
  const vec_t<T>* Sp;
  bool derive;
  const T *at, *kt, *qt;
  T bs;
  alignas(64) T r[kBwdSlice];
  alignas(64) T u[kBwdSlice];
  alignas(64) T dov[kBwdSlice];
};

// The per-column values of one token's pass 2 (bwd_rows_tr): delta and beta delta.
template <typename T>
struct BwdCols {
  alignas(64) T delta[kBwdSlice];
  alignas(64) T bdelta[kBwdSlice];
};

// Where bwd_rows_tr writes token c's row gradients: partial p's rows of dq, dk, dg (store when
// first, else add), and u.do of the token.
template <typename T>
struct RowGradOut {
  T *dq, *dk, *dg;
  T udo;
  bool first;
};

// Rows [ib, ib + NB vectors) of one sweep over a transposed slice (bwd_chunk): pass 2 of token c
// and/or pass 1 of token n (Derive: c.Sp holds S_{t-2}, and P = a'_i S_{t-2}[i, :] + k'_i u'
// with token n's rows). With P = S_{t-1}[i, :] and D = H + q do^T of token c:
//   pass 2: H_{t-1}[i, j] = a_i (D - beta k_i delta_j), and per row, summed over the columns,
//           P.do, D.u, P.(beta delta), H_{t-1}.P, giving (docs/math.md "Backward")
//           dq_i = a_i (P.do) + k_i (u.do),  dk_i = D.u - a_i (P.(beta delta)),  dg_i = H_{t-1}.P
//           (beta inside the column sum: one broadcast per column less than P.delta, which cost
//           4-5% of the kernel under AVX2, where every column's scalars are broadcast per step)
//   pass 1: D' = H_{t-1} + q' do'^T of token n (stored back) and Z[j] (+)= lane partials of
//           sum_i k'_i D'[i, j] (its delta).
template <typename T, int NB, bool Pass2, bool Pass1, bool Derive, bool Full>
inline void bwd_rows_tr(vec_t<T>* Hs, int64_t K, int64_t KV, int64_t ib, int64_t width,
                        const BwdToken<T>& c, const BwdCols<T>& cc, const BwdToken<T>& n,
                        vec_t<T>* Z, const RowGradOut<T>& g) {
  using V = vec_t<T>;
  constexpr int64_t L = kLanes<T>;
  V av[NB], kv[NB], kn[NB], qn[NB], an[NB];
  V w0[NB] = {}, w1[NB] = {}, w2[NB] = {}, w3[NB] = {};
  for (int b = 0; b < NB; ++b) {
    const int64_t m = K - (ib + b) * L;
    if (Pass2) {
      av[b] = load_rows<Full>(c.at + (ib + b) * L, m);
      kv[b] = load_rows<Full>(c.kt + (ib + b) * L, m);
    }
    if (Pass1) {
      kn[b] = load_rows<Full>(n.kt + (ib + b) * L, m);
      qn[b] = load_rows<Full>(n.qt + (ib + b) * L, m);
    }
    if (Derive) an[b] = load_rows<Full>(n.at + (ib + b) * L, m);
  }
  for (int64_t j = 0; j < width; ++j) {
    V Hn[NB];
    if (Pass2) {
      const V doj = splat<T>(c.dov[j]), uj = splat<T>(c.u[j]), bdj = splat<T>(cc.bdelta[j]);
      V unj{};
      if (Derive) unj = splat<T>(n.u[j]);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        V D = Hs[j * KV + ib + b];
        V P = c.Sp[j * KV + ib + b];
        if (Derive) P = an[b] * P + kn[b] * unj;
        KDA_KEEP(D);
        KDA_KEEP(P);
        Hn[b] = av[b] * (D - kv[b] * bdj);
        w0[b] += P * doj;
        w1[b] += D * uj;
        w2[b] += P * bdj;
        w3[b] += Hn[b] * P;
      }
    } else {
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) Hn[b] = Hs[j * KV + ib + b];
    }
    if (Pass1) {
      const V donj = splat<T>(n.dov[j]);
      V z{};
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const V D = Hn[b] + qn[b] * donj;
        Hs[j * KV + ib + b] = D;
        z = b == 0 ? kn[b] * D : z + kn[b] * D;
      }
      Z[j] = ib == 0 ? z : Z[j] + z;
    } else {
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) Hs[j * KV + ib + b] = Hn[b];
    }
  }
  if (Pass2) {
    const V udo = splat<T>(g.udo);
    for (int b = 0; b < NB; ++b) {
      const int64_t i0 = (ib + b) * L, m = K - i0;
      V gq = av[b] * w0[b] + kv[b] * udo;
      V gk = w1[b] - av[b] * w2[b];
      V gg = w3[b];
      if (!g.first) {
        gq += load_rows<Full>(g.dq + i0, m);
        gk += load_rows<Full>(g.dk + i0, m);
        gg += load_rows<Full>(g.dg + i0, m);
      }
      store_rows<Full>(g.dq + i0, gq, m);
      store_rows<Full>(g.dk + i0, gk, m);
      store_rows<Full>(g.dg + i0, gg, m);
    }
  }
}

// One sweep over all rows of a transposed slice, kRowVecs row vectors per step (then one); the
// row vectors wholly inside K load and store their rows without a length check.
template <typename T, bool Pass2, bool Pass1, bool Derive>
inline void bwd_sweep_rows(vec_t<T>* Hs, int64_t K, int64_t KV, int64_t width,
                           const BwdToken<T>& c, const BwdCols<T>& cc, const BwdToken<T>& n,
                           vec_t<T>* Z, const RowGradOut<T>& g) {
  const int64_t KF = K / kLanes<T>;  // whole row vectors
  int64_t ib = 0;
  for (; ib + kRowVecs <= KF; ib += kRowVecs) {
    bwd_rows_tr<T, kRowVecs, Pass2, Pass1, Derive, true>(Hs, K, KV, ib, width, c, cc, n, Z, g);
  }
  for (; ib < KV; ++ib) {
    bwd_rows_tr<T, 1, Pass2, Pass1, Derive, false>(Hs, K, KV, ib, width, c, cc, n, Z, g);
  }
}

// A sweep that derives c's state S_{t-1} (c.derive) needs token n = t - 1: pass 1 runs with it.
template <typename T, bool Pass2, bool Pass1>
inline void bwd_sweep_tr(vec_t<T>* Hs, int64_t K, int64_t KV, int64_t width,
                         const BwdToken<T>& c, const BwdCols<T>& cc, const BwdToken<T>& n,
                         vec_t<T>* Z, const RowGradOut<T>& g) {
  if constexpr (Pass2 && Pass1) {
    if (c.derive) return bwd_sweep_rows<T, true, true, true>(Hs, K, KV, width, c, cc, n, Z, g);
  }
  bwd_sweep_rows<T, Pass2, Pass1, false>(Hs, K, KV, width, c, cc, n, Z, g);
}

// Backward of chunk c of sequence n for one slice of columns [j0, j0 + width): recompute the
// chunk's states from its checkpoint, then run the backward recurrence over it, last token first.
// Buffers (transposed slices of KV vectors per column): Sbuf the chunk's states (every other
// one, see state() below), rbuf kChunk reads
// S'^T k (kBwdSlice columns each; both reused), Hs the slice's running gradient of the state
// (carried between chunks), Z one vector per column (lane partials of the column sums).
template <typename T>
void bwd_chunk(const BwdArgs<T>& A, int64_t n, int64_t hv, int64_t j0, int64_t width, int64_t p,
               bool first, int64_t c, const T* ck, const T* ck_next, vec_t<T>* Sbuf, T* rbuf,
               vec_t<T>* Hs, vec_t<T>* Z) {
  using V = vec_t<T>;
  constexpr int64_t L = kLanes<T>;
  constexpr int64_t NC = kBwdSlice / L;  // column vectors of a slice
  const int64_t K = A.K, Vd = A.V, H = A.H, HV = A.HV;
  const int64_t Kp = padded_rows(K), KV = Kp / L, SS = kBwdSlice * KV;
  const int64_t h = hv / (HV / H);
  const int64_t ts = A.seqs.seq_start[n], te = A.seqs.seq_end[n];
  const int64_t origin = A.seqs.origin[n];
  const int64_t sh = A.seqs.row_shift(n);
  const int64_t vsh = A.seqs.vo_row_shift(n);  // v, grad_o: block rows or not
  // Rows of the pre-processed block arrays at the local token index (t - sh).
  const T* a_h = A.a + (hv * A.BT - sh) * K;
  const T* ak_h = A.ak + (hv * A.BT - sh) * K;
  const T* k_h = A.k + (h * A.BT - sh) * K;
  const T* q_h = A.q + (h * A.BT - sh) * K;
  const T* b_h = A.beta + hv * A.BT - sh;
  T* const Sb = reinterpret_cast<T*>(Sbuf);
  // State m of the chunk (S_{s0 - 1 + m}): the even ones in the chunk buffer, the odd one being
  // recomputed in one more slot (it stays in L1), and the sweep derives the odd ones again from
  // the even ones (bwd_rows_tr, Derive). The buffer lives in L2 (1 MB for 64 states), and its
  // traffic (each state written, read for ownership and written back, then read by the sweep)
  // was ~24% of the kernel's time on the 2-core Xeon; two more FMAs per element on every other
  // token cost less.
  auto state = [&](int64_t m) { return Sbuf + (m % 2 == 0 ? m / 2 : kChunk - 1) * SS; };

  const int64_t s0 = imax(ts, origin + c * kChunk);
  const int64_t e = imin(te, origin + (c + 1) * kChunk);
  // Recompute the states S_{t-1} (t in [s0, e)) and the reads r_t of the chunk.
  load_slice_tr<T>(Sb, ck, K, Vd, width);
  {
    int64_t ib = 0;
    for (; ib + kRecVecs <= KV; ib += kRecVecs) {
      col_partials<T, kRecVecs>(Z, Sbuf, ak_h + s0 * K, K, KV, ib, width);
    }
    for (; ib < KV; ++ib) col_partials<T, 1>(Z, Sbuf, ak_h + s0 * K, K, KV, ib, width);
    lane_sums<T>(rbuf, Z, width);
  }
  for (int64_t t = s0; t + 1 < e; ++t) {
    const int64_t slot = t - s0;
    if (t + kPrefetchTokens < e) {
      prefetch_cols(A.v + ((t + kPrefetchTokens - vsh) * HV + hv) * Vd + j0, width, false);
    }
    const V b = splat<T>(b_h[t]);
    const T* vt = A.v + ((t - vsh) * HV + hv) * Vd + j0;
    alignas(64) T u[kBwdSlice];
    for (int cc = 0; cc < NC; ++cc) {
      const V r = load_cols(rbuf + slot * kBwdSlice + cc * L, width - cc * L);
      store_cols(u + cc * L, b * (load_cols(vt + cc * L, width - cc * L) - r), L);
    }
    V* Sout = state(slot + 1);
    const V* Sin = state(slot);
    const T *at = a_h + t * K, *kt = k_h + t * K, *akn = ak_h + (t + 1) * K;
    int64_t ib = 0;
    for (; ib + kRecVecs <= KV; ib += kRecVecs) {
      write_rows_tr<T, kRecVecs>(Sout, Sin, u, at, kt, akn, K, KV, ib, width, Z);
    }
    for (; ib < KV; ++ib) write_rows_tr<T, 1>(Sout, Sin, u, at, kt, akn, K, KV, ib, width, Z);
    lane_sums<T>(rbuf + (slot + 1) * kBwdSlice, Z, width);
  }

  // Backward through the chunk, last token first. Pass 2 of token t and pass 1 of token t - 1
  // run in one sweep over the slice (bwd_rows_tr): H_{t-1} goes from one to the other in
  // registers, and each recomputed state is read once.
  BwdToken<T> tok[2];
  auto load_token = [&](int64_t t, BwdToken<T>& tk) {
    const int64_t slot = t - s0;
    tk.derive = slot % 2 != 0;
    tk.Sp = state(slot - (tk.derive ? 1 : 0));  // S_{t-1}, or S_{t-2} to derive it from
    tk.at = a_h + t * K;
    tk.kt = k_h + t * K;
    tk.qt = q_h + t * K;
    tk.bs = b_h[t];
    const V b = splat<T>(tk.bs);
    const T* dot = A.dout + ((t - vsh) * HV + hv) * Vd + j0;
    const T* vt = A.v + ((t - vsh) * HV + hv) * Vd + j0;
    for (int cc = 0; cc < NC; ++cc) {
      // r_t = v_t - S'^T k (rbuf holds the read S'^T k), u_t = beta r_t
      const int64_t m = width - cc * L;
      const V r = load_cols(vt + cc * L, m) - load_cols(rbuf + slot * kBwdSlice + cc * L, m);
      store_cols(tk.r + cc * L, r, L);
      store_cols(tk.u + cc * L, b * r, L);
      store_cols(tk.dov + cc * L, load_cols(dot + cc * L, m), L);
    }
  };
  int ci = 0;
  load_token(e - 1, tok[ci]);
  BwdCols<T> cols;
  const RowGradOut<T> none{nullptr, nullptr, nullptr, T(0), true};
  bwd_sweep_tr<T, false, true>(Hs, K, KV, width, tok[ci], cols, tok[ci], Z, none);
  lane_sums<T>(cols.delta, Z, width);
  for (int64_t j = width; j < kBwdSlice; ++j) cols.delta[j] = T(0);
  // The next call's checkpoint (its first load), a few rows per token in this chunk's last
  // kCkptPrefetchTokens tokens: late enough that this chunk's states, streaming through L2, do
  // not evict it before that call reads it.
  const int64_t ck_rows = (K + kCkptPrefetchTokens - 1) / kCkptPrefetchTokens;
  for (int64_t t = e - 1; t >= s0; --t) {
    const BwdToken<T>& cur = tok[ci];
    BwdToken<T>& nxt = tok[ci ^ 1];
    const V b = splat<T>(cur.bs);
    // The rows of token t - 2 (the sweep after next reads them first): from L2 otherwise, and
    // each step of the sweep's row loop waited for its four row vectors (~2% of the kernel, AVX2).
    if (t - 2 >= s0) {
      prefetch_cols(a_h + (t - 2) * K, K, false);
      prefetch_cols(k_h + (t - 2) * K, K, false);
      prefetch_cols(q_h + (t - 2) * K, K, false);
    }
    if (t - kPrefetchTokens >= s0) {
      const int64_t tp = t - kPrefetchTokens;
      prefetch_cols(A.dout + ((tp - vsh) * HV + hv) * Vd + j0, width, false);
      prefetch_cols(A.dv + (tp * HV + hv) * Vd + j0, width, true);
    }
    if (ck_next && t - s0 < kCkptPrefetchTokens) {
      const int64_t r0 = (t - s0) * ck_rows;
      for (int64_t i = r0; i < imin(K, r0 + ck_rows); ++i) {
        prefetch_cols(ck_next + i * Vd, width, false);
      }
    }
    T* dvt = A.dv + (t * HV + hv) * Vd + j0;
    V wb[NC], wu[NC];
    for (int cc = 0; cc < NC; ++cc) {
      const V dl = load_cols(cols.delta + cc * L, L);
      const V bd = b * dl;
      if (width - cc * L > 0) store_cols(dvt + cc * L, bd, width - cc * L);
      store_cols(cols.bdelta + cc * L, bd, L);
      wb[cc] = dl * load_cols(cur.r + cc * L, L);
      wu[cc] = load_cols(cur.u + cc * L, L) * load_cols(cur.dov + cc * L, L);
    }
    const T dbt = hsum_n<T, NC>(wb);
    RowGradOut<T> g;
    g.udo = hsum_n<T, NC>(wu);
    g.first = first;
    T* dbp = A.dbeta + p * A.group_stride_beta + (t - sh) * HV + hv;
    *dbp = first ? dbt : *dbp + dbt;
    const int64_t row = p * A.group_stride + ((t - sh) * HV + hv) * K;
    g.dq = A.dq + row;
    g.dk = A.dk + row;
    g.dg = A.dg + row;
    if (t > s0) {
      load_token(t - 1, nxt);
      bwd_sweep_tr<T, true, true>(Hs, K, KV, width, cur, cols, nxt, Z, g);
      lane_sums<T>(cols.delta, Z, width);
      ci ^= 1;
    } else {
      bwd_sweep_tr<T, true, false>(Hs, K, KV, width, cur, cols, cur, Z, g);
    }
  }
}

// Backward of tokens [t0, t1) (whole chunks, but for the sequence's ends) and slices
// [s_begin, s_end) of value head hv of sequence n, writing partial p of the sums over columns (the
// first slice stores, the others add, in slice order). Chunks run last first; inside a chunk every
// slice runs before the next chunk, so the chunk's input rows and gradient rows are fetched once
// and reused from cache by all slices. The running state gradient is loaded from dht at the range
// that ends the sequence, stays in A.slices (or the scratch) between ranges, and goes to dh0 at
// the range that starts it. ws: the caller's scratch (bwd_scratch_elems); nothing is allocated
// here.
template <typename T>
void bwd_unit(const BwdArgs<T>& A, int64_t n, int64_t hv, int64_t s_begin, int64_t s_end,
              int64_t p, int64_t t0, int64_t t1, T* ws) {
  using V = vec_t<T>;
  static_assert(kBwdSlice % kLanes<T> == 0, "a slice is a whole number of vectors");
  const int64_t K = A.K, Vd = A.V, HV = A.HV;
  const int64_t SS = bwd_slice_elems(K);  // elements of a transposed slice
  const int64_t n_sl = s_end - s_begin;
  const int64_t n_all = (Vd + kBwdSlice - 1) / kBwdSlice;
  const int64_t ts = A.seqs.seq_start[n], te = A.seqs.seq_end[n];
  const int64_t origin = A.seqs.origin[n];
  const int64_t state_base = (n * HV + hv) * K * Vd;  // in [N, HV, K, V]
  // The caller's scratch, in the order of bwd_scratch_elems; the running state gradients in
  // the unit's slots of A.slices where the sequence runs in several ranges.
  T* const Sbuf = ws;
  T* const rbuf = Sbuf + kChunk * SS;
  T* const Hs = A.slices ? A.slices + ((n * HV + hv) * n_all + s_begin) * SS
                         : rbuf + kChunk * kBwdSlice;
  T* const Z = rbuf + kChunk * kBwdSlice + n_sl * SS;
  auto slice = [&](int64_t i, int64_t& j0, int64_t& width) {
    j0 = (s_begin + i) * kBwdSlice;
    width = imin(kBwdSlice, Vd - j0);
  };
  const int64_t slot_base = A.seqs.slot_base[n];
  // The state that starts chunk c (the sequence's initial state before its first token, a
  // checkpoint after it), in slice i: what bwd_chunk loads first; null: zeros.
  auto chunk_start = [&](int64_t c, int64_t i) -> const T* {
    int64_t j0, width;
    slice(i, j0, width);
    if (origin + c * kChunk <= ts) return A.h0 ? A.h0 + state_base + j0 : nullptr;
    return A.ckpt + (slot_base + c) * HV * K * Vd + hv * K * Vd + j0;
  };
  for (int64_t i = 0; t1 == te && i < n_sl; ++i) {
    int64_t j0, width;
    slice(i, j0, width);
    load_slice_tr<T>(Hs + i * SS, A.dht ? A.dht + state_base + j0 : nullptr, K, Vd, width);
  }
  if (t0 < t1) {
    const int64_t c_first = (t0 - origin) / kChunk;
    const int64_t c_last = (t1 - 1 - origin) / kChunk;
    for (int64_t c = c_last; c >= c_first; --c) {
      for (int64_t i = 0; i < n_sl; ++i) {
        int64_t j0, width;
        slice(i, j0, width);
        // what the call after this one loads first: the next slice's, or the chunk before's
        const T* ck_next = i + 1 < n_sl ? chunk_start(c, i + 1)
                           : c > c_first ? chunk_start(c - 1, 0)
                                         : nullptr;
        bwd_chunk<T>(A, n, hv, j0, width, p, i == 0, c, chunk_start(c, i), ck_next,
                     reinterpret_cast<V*>(Sbuf), rbuf, reinterpret_cast<V*>(Hs + i * SS),
                     reinterpret_cast<V*>(Z));
      }
    }
  }
  for (int64_t i = 0; t0 == ts && i < n_sl; ++i) {
    int64_t j0, width;
    slice(i, j0, width);
    store_slice_tr<T>(A.dh0 + state_base + j0, Hs + i * SS, K, Vd, width);
  }
}
const Table kTable = {
    KDA_ISA_NAME,
    &prep_tokens<float>,
    &prep_tokens<double>,
    &fwd_unit<float>,
    &fwd_unit<double>,
    &bwd_unit<float>,
    &bwd_unit<double>,
};

}  // namespace

const Table& get() { return kTable; }

}  // namespace KDA_ISA
}  // namespace kernels
}  // namespace kda
