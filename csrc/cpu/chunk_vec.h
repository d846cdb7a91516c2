// Elementwise helpers of the chunk code written so that the compiler vectorises them inside the
// multi-versioned (KDA_CLONES) callers: a loop annotation, bf16 rounding of a row and a blocked
// transposition. Header-only and always inlined, so each clone gets its own vector width
// (AVX-512 / AVX2 / SSE2); the results are the same bits on every clone (no reassociation:
// copies, shuffles and exact integer rounding only). The one exception: where the CPU converts
// float to bf16 itself (kBf16Convert, below), the rounding of rows calls that conversion,
// compiled once in chunk_products.cpp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The loops over the K or V channels of one token read and write distinct rows of the chunk
// workspace and the inputs; GCC cannot prove that through the struct members the pointers come
// from, and otherwise leaves them scalar (measured: the factor loops of chunk_common.cpp ran as
// scalar vmulss / vdivss). KDA_IVDEP before such a loop asserts there is no overlap.
#if defined(__clang__)
#define KDA_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define KDA_IVDEP _Pragma("GCC ivdep")
#else
#define KDA_IVDEP
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KDA_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define KDA_ALWAYS_INLINE inline
#endif

namespace kda {
namespace detail {
namespace chunk {

// Whether any of x[0, n) is nonzero (a NaN counts), from the magnitude bits: an OR of integers
// vectorises, where a max or sum of floats does not without -ffast-math. The zero tests of decay
// products (chunk forward and backward: once a running product is all zero, older columns add
// exact zeros).
template <typename T>
KDA_ALWAYS_INLINE bool any_nonzero(const T* __restrict x, int64_t n) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr U kMag = ~(U(1) << (8 * sizeof(T) - 1));
  U r = 0;
  for (int64_t d = 0; d < n; ++d) {
    U u;
    std::memcpy(&u, x + d, sizeof(u));
    r |= u & kMag;
  }
  return r != 0;
}

// The bits of bf16(x), rounded to nearest even (NaN -> the quiet NaN 0x7FC0): the same bits as
// at::BFloat16(float), in integer operations the compiler vectorises.
KDA_ALWAYS_INLINE uint32_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? 0x7FC0u : r;
}

// float -> bf16 by the CPU's own conversion (AVX512_BF16's vcvtne2ps2bf16: two vectors per
// instruction, where bf16_bits takes about ten integer operations per vector; pack_b_rows and
// round_bf16 spent ~8% of the AMX chunk forward in them). Every CPU with AMX has it, and the
// bf16 products run only there or in their emulation (chunk_products.h). Rounding to nearest even
// as bf16_bits; a NaN stays a NaN (not the one quiet NaN), and a subnormal becomes a zero of its
// sign, which AMX and the emulation's fp32 GEMM (under FlushDenormals) read a bf16 subnormal as
// anyway. The one difference in the products: a subnormal within half a bf16 step of the
// smallest normal float, which bf16_bits rounds up to it (1.2e-38) and the instruction to 0; the
// workers flush computed values, so only an input copied into an operand (an initial state) can
// hold one.
// kBf16Convert: whether this CPU has it (read once at load). round_bf16_convert: y[e] =
// bf16(x[e]), e < n. pack_pair_convert: y[e] = bf16(x0[e]) | bf16(x1[e]) << 16 (x1 null: 0),
// e < n, the VNNI word of a row pair (chunk_products.h). pack_pair_scale_convert: the same for
// two rows of whole vectors (n a multiple of 16), which it then multiplies in place by f0 and f1.
extern const bool kBf16Convert;
void round_bf16_convert(const float* x, uint16_t* y, int64_t n);
void pack_pair_convert(const float* x0, const float* x1, uint32_t* y, int64_t n);
void pack_pair_scale_convert(float* x0, float* x1, float f0, float f1, uint32_t* y, int64_t n);

// y[e] = bf16(x[e]) for e < n.
KDA_ALWAYS_INLINE void round_bf16(const float* __restrict x, at::BFloat16* __restrict y, int64_t n) {
  uint16_t* __restrict yb = reinterpret_cast<uint16_t*>(y);
  if (kBf16Convert && n >= 16) {
    round_bf16_convert(x, yb, n);
    return;
  }
  KDA_IVDEP
  for (int64_t e = 0; e < n; ++e) yb[e] = uint16_t(bf16_bits(x[e]));
}

// Zero columns [from, to) of `rows` rows (row stride ld). The bf16 products over a chunk's
// tokens read their operands up to product_cols(n) columns (chunk_products.h; the packed B takes
// rows in pairs, blocks of 16): the columns past n are zeroed so no stale value (possibly inf or
// NaN) meets the zeros of the other operand.
template <typename D>
KDA_ALWAYS_INLINE void zero_cols(D* a, int64_t rows, int64_t ld, int64_t from, int64_t to) {
  for (int64_t r = 0; r < rows; ++r) std::fill(a + r * ld + from, a + r * ld + to, D(0.0f));
}

namespace vec_detail {

#if defined(__GNUC__) || defined(__clang__)
typedef float v8sf __attribute__((vector_size(32)));
typedef int v8si __attribute__((vector_size(32)));

// Two-source shuffle with constant lane indices (below the lanes: a's, then b's), in GCC's
// spelling or Clang's; Mask is the int vector type of the lanes.
#if defined(__clang__)
#define KDA_SHUFFLE(a, b, Mask, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KDA_SHUFFLE(a, b, Mask, ...) __builtin_shuffle(a, b, Mask{__VA_ARGS__})
#endif
#define KDA_SHUFFLE8(a, b, ...) KDA_SHUFFLE(a, b, v8si, __VA_ARGS__)
#define KDA_LO1 0, 8, 1, 9, 4, 12, 5, 13
#define KDA_HI1 2, 10, 3, 11, 6, 14, 7, 15
#define KDA_LO2 0, 1, 8, 9, 4, 5, 12, 13
#define KDA_HI2 2, 3, 10, 11, 6, 7, 14, 15
#define KDA_LO3 0, 1, 2, 3, 8, 9, 10, 11
#define KDA_HI3 4, 5, 6, 7, 12, 13, 14, 15

// dst[c, r] = src[r, c] for an 8 x 8 tile, in three shuffle stages (pairs, quads, halves).
KDA_ALWAYS_INLINE void transpose8(const float* __restrict src, int64_t lds, float* __restrict dst,
                                  int64_t ldd) {
  v8sf r0, r1, r2, r3, r4, r5, r6, r7;
  std::memcpy(&r0, src + 0 * lds, 32);
  std::memcpy(&r1, src + 1 * lds, 32);
  std::memcpy(&r2, src + 2 * lds, 32);
  std::memcpy(&r3, src + 3 * lds, 32);
  std::memcpy(&r4, src + 4 * lds, 32);
  std::memcpy(&r5, src + 5 * lds, 32);
  std::memcpy(&r6, src + 6 * lds, 32);
  std::memcpy(&r7, src + 7 * lds, 32);
  const v8sf t0 = KDA_SHUFFLE8(r0, r1, KDA_LO1), t1 = KDA_SHUFFLE8(r0, r1, KDA_HI1);
  const v8sf t2 = KDA_SHUFFLE8(r2, r3, KDA_LO1), t3 = KDA_SHUFFLE8(r2, r3, KDA_HI1);
  const v8sf t4 = KDA_SHUFFLE8(r4, r5, KDA_LO1), t5 = KDA_SHUFFLE8(r4, r5, KDA_HI1);
  const v8sf t6 = KDA_SHUFFLE8(r6, r7, KDA_LO1), t7 = KDA_SHUFFLE8(r6, r7, KDA_HI1);
  const v8sf u0 = KDA_SHUFFLE8(t0, t2, KDA_LO2), u1 = KDA_SHUFFLE8(t0, t2, KDA_HI2);
  const v8sf u2 = KDA_SHUFFLE8(t1, t3, KDA_LO2), u3 = KDA_SHUFFLE8(t1, t3, KDA_HI2);
  const v8sf u4 = KDA_SHUFFLE8(t4, t6, KDA_LO2), u5 = KDA_SHUFFLE8(t4, t6, KDA_HI2);
  const v8sf u6 = KDA_SHUFFLE8(t5, t7, KDA_LO2), u7 = KDA_SHUFFLE8(t5, t7, KDA_HI2);
  const v8sf o[8] = {KDA_SHUFFLE8(u0, u4, KDA_LO3), KDA_SHUFFLE8(u1, u5, KDA_LO3),
                     KDA_SHUFFLE8(u2, u6, KDA_LO3), KDA_SHUFFLE8(u3, u7, KDA_LO3),
                     KDA_SHUFFLE8(u0, u4, KDA_HI3), KDA_SHUFFLE8(u1, u5, KDA_HI3),
                     KDA_SHUFFLE8(u2, u6, KDA_HI3), KDA_SHUFFLE8(u3, u7, KDA_HI3)};
  for (int c = 0; c < 8; ++c) std::memcpy(dst + c * ldd, &o[c], 32);
}
#undef KDA_LO1
#undef KDA_HI1
#undef KDA_LO2
#undef KDA_HI2
#undef KDA_LO3
#undef KDA_HI3
#define KDA_HAVE_TRANSPOSE8 1

// 16 floats (one AVX-512 register; two or four narrower ones in the other clones), unaligned and
// may alias the float rows they are read from.
typedef float v16sf __attribute__((vector_size(64), aligned(4), may_alias));
typedef int v16si __attribute__((vector_size(64)));

// The sum of the 16 lanes by a fixed tree (halves, quarters, ...): the same bits on every clone.
KDA_ALWAYS_INLINE float hsum16(v16sf x) {
  x += KDA_SHUFFLE(x, x, v16si, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += KDA_SHUFFLE(x, x, v16si, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += KDA_SHUFFLE(x, x, v16si, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return x[0] + x[1];
}

// Whether any bit of any lane is set (an OR tree as hsum16's).
KDA_ALWAYS_INLINE bool any16(v16si m) {
  m |= KDA_SHUFFLE(m, m, v16si, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  m |= KDA_SHUFFLE(m, m, v16si, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  m |= KDA_SHUFFLE(m, m, v16si, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return (m[0] | m[1]) != 0;
}
#undef KDA_SHUFFLE8
#undef KDA_SHUFFLE
#define KDA_HAVE_VEC16 1
#endif

template <typename D>
KDA_ALWAYS_INLINE void store_row8(const float* t, D* dst) {
  if constexpr (std::is_same_v<D, at::BFloat16>) {
    round_bf16(t, dst, 8);
  } else {
    for (int e = 0; e < 8; ++e) dst[e] = D(t[e]);
  }
}

}  // namespace vec_detail

// dst[c, r] = D(src[r, c]) for r < rows, c < cols (dst row stride ldd): float sources in 8 x 8
// tiles through vector shuffles (a bf16 dst gets the values rounded as at::BFloat16 does), the
// edges and other types element by element.
template <typename T, typename D>
KDA_ALWAYS_INLINE void transpose(const T* __restrict src, int64_t rows, int64_t cols, int64_t lds,
                                 D* __restrict dst, int64_t ldd) {
  int64_t r8 = 0, c8 = 0;
#if defined(KDA_HAVE_TRANSPOSE8)
  if constexpr (std::is_same_v<T, float>) {
    r8 = rows / 8 * 8;
    c8 = cols / 8 * 8;
    for (int64_t r0 = 0; r0 < r8; r0 += 8) {
      for (int64_t c0 = 0; c0 < c8; c0 += 8) {
        if constexpr (std::is_same_v<D, float>) {
          vec_detail::transpose8(src + r0 * lds + c0, lds, dst + c0 * ldd + r0, ldd);
        } else {
          float t[64];
          vec_detail::transpose8(src + r0 * lds + c0, lds, t, 8);
          for (int c = 0; c < 8; ++c) vec_detail::store_row8(t + 8 * c, dst + (c0 + c) * ldd + r0);
        }
      }
    }
  }
#endif
  // The edges: rows [r8, rows) of every column, then columns [c8, cols) of rows [0, r8).
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = (c < c8 ? r8 : 0); r < rows; ++r) dst[c * ldd + r] = D(src[r * lds + c]);
  }
}

}  // namespace chunk
}  // namespace detail
}  // namespace kda
