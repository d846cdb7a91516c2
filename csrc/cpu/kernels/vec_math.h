// Elementwise math of the pre-processing (exp, softplus, sigmoid; bf16 widening) on GCC/Clang
// vector-extension vectors, shared by the per-ISA kernel files (recurrent_kernels.cpp,
// serving_kernels.cpp). Include it after defining KDA_ISA: like those files, it defines
// everything inside kda::kernels::<isa> with internal linkage (one object per instruction set;
// no template instance may be shared between objects compiled with different -m flags).
//
// The functions are templates over the vector type VF: float vectors get vectorised polynomials
// (about 1 ulp, so the pre-processing is not dominated by scalar libm calls), double vectors libm
// per lane (exact to the last bits). The int vector of VF's lanes is decltype(x < x).
#pragma once

#include "cpu/kernels/recurrent_kernels.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#ifndef KDA_ISA
#error "KDA_ISA must name the instruction set this file is compiled for"
#endif

// The vector width (bytes) of the recurrence kernels and their pre-processing, which run these
// functions: one zmm under AVX-512, one ymm under AVX2, and 64 bytes (several SSE registers) in
// the generic kernels. tests/cpp/vec_math_cases.cpp tests the functions at this width.
#if defined(__AVX512F__)
#define KDA_VEC_BYTES 64
#elif defined(__AVX2__)
#define KDA_VEC_BYTES 32
#else
#define KDA_VEC_BYTES 64
#endif

namespace kda {
namespace kernels {
namespace KDA_ISA {
namespace {

template <typename VF>
using vm_elem_t = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<VF>()[0])>>;

template <typename VF, typename F>
inline VF per_lane(VF x, F f) {
  for (int64_t l = 0; l < static_cast<int64_t>(sizeof(VF) / sizeof(vm_elem_t<VF>)); ++l) {
    x[l] = f(x[l]);
  }
  return x;
}

// max(lo, x), min(hi, x) and -|x| of float vectors, x NaN kept as it is: x86's maxps / minps
// return their second operand where either is NaN, so with x second they are one instruction
// each where the vector is one register, instead of a compare and a select (GCC does not turn
// the selects into them); -|x| sets the sign bit. The generic vectors select.
template <typename VF>
inline VF vmax_lo(VF lo, VF x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(VF) == sizeof(__m512)) return (VF)_mm512_max_ps((__m512)lo, (__m512)x);
#endif
#if defined(__AVX__)
  if constexpr (sizeof(VF) == sizeof(__m256)) return (VF)_mm256_max_ps((__m256)lo, (__m256)x);
#endif
  return x < lo ? lo : x;
}
template <typename VF>
inline VF vmin_hi(VF hi, VF x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(VF) == sizeof(__m512)) return (VF)_mm512_min_ps((__m512)hi, (__m512)x);
#endif
#if defined(__AVX__)
  if constexpr (sizeof(VF) == sizeof(__m256)) return (VF)_mm256_min_ps((__m256)hi, (__m256)x);
#endif
  return x > hi ? hi : x;
}
template <typename VF>
inline VF vneg_abs(VF x) {
  using VI = decltype(x < x);
  VI bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits |= VI{} + static_cast<int32_t>(0x80000000u);
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// The gates at extreme rates (docs/math.md "Saturation"), shared by the prefill's pass and the
// serving kernels. A NaN z stays NaN, as under any other rate (NaN propagates by policy,
// docs/bad_inputs.md).
//
// sigmoid(inf * z), the bounded gate's limit where exp(A_log) overflowed: the step
// (sign(z) + 1) / 2, 1/2 at z = 0 (inf * 0 would be NaN).
template <typename VF>
inline VF vsigmoid_step(VF z) {
  using E = vm_elem_t<VF>;
  const VF zero{};
  return z > zero ? zero + E(1) : (z < zero ? zero : (z == zero ? zero + E(0.5) : z));
}

// Scalar libm through builtins (C functions: no inline C++ overloads shared across ISAs).
inline float s_sqrt(float x) { return __builtin_sqrtf(x); }
inline double s_sqrt(double x) { return __builtin_sqrt(x); }
inline float s_exp(float x) { return __builtin_expf(x); }
inline double s_exp(double x) { return __builtin_exp(x); }
inline float s_log(float x) { return __builtin_logf(x); }
inline double s_log(double x) { return __builtin_log(x); }
inline float s_log1p(float x) { return __builtin_log1pf(x); }
inline double s_log1p(double x) { return __builtin_log1p(x); }

// The softplus gate's log decay -exp(A) softplus(z) for a rate exp(A) >= kLogSpaceRate (A =
// A_log; exp(A) may have overflowed), formed in log space: -exp(A + log softplus(z)). Below
// z = -20, log softplus(z) = z + log1p(y (y / 3 - 1 / 2)), y = e^z (softplus(z) = y (1 - y / 2 +
// y^2 / 3 - ...)), so it keeps its precision where softplus(z) leaves the normal range (z < -87.3
// in float), where the product with such a rate is not negligible. That is the product wherever
// the product is finite, so a z far below 0 keeps its decay near 1 (as float64's finite exp(A)
// gives it), and -inf (a decay of 0) where it overflows; A = +inf is a decay of 0 for every z
// that is a number (z = -inf too: inf - inf is not formed). slope gets its derivative in z,
// -exp(A) sigmoid(z) = -exp(A + log sigmoid(z)) (finite wherever the decay is not 0:
// sigmoid(z) < softplus(z)). Per lane through libm: only heads of such rates take it.
template <typename VF, typename T>
inline VF vsoftplus_gate_log_space(VF z, T A, VF& slope) {
  VF out = z;
  for (int64_t l = 0; l < static_cast<int64_t>(sizeof(VF) / sizeof(T)); ++l) {
    const T t = z[l];
    const bool a_inf = A == static_cast<T>(__builtin_inf()) && t == t;
    // y = e^-|t|; a NaN t fails every compare and stays NaN through l1p
    const T y = s_exp(t < T(0) ? t : -t), l1p = s_log1p(y);
    const T log_sp = t < T(-20) ? t + s_log1p(y * (y * (T(1) / 3) - T(0.5)))  // log softplus(t)
                                : s_log(t > T(20) ? t : (t > T(0) ? t : T(0)) + l1p);
    const T log_sig = (t < T(0) ? t : T(0)) - l1p;  // log sigmoid(t) = -softplus(-t)
    out[l] = a_inf ? -A : -s_exp(A + log_sp);
    slope[l] = a_inf ? -A : -s_exp(A + log_sig);
  }
  return out;
}

// The float functions take N vectors and run every step for all N before the next one
// (vexp_n, vsoftplus_sigmoid_n, vsoftplus_n, vsigmoid_n): the N dependency chains
// then lie side by side in program order and the core overlaps them. One vector at a time, each
// softplus and exp is a chain of ~90 dependent operations, and the pre-processing pass ran at
// about a third of the FP ports' throughput. Each lane still goes through the same operations in
// the same order as with N = 1: the same values for every N. The one-vector forms (vexp,
// vsoftplus, vsigmoid) are N = 1.

// exp: Cephes-style range reduction x = n ln2 + r and a degree-6 polynomial (about 1 ulp);
// below -87.5 it underflows to 0 (results under the smallest normal float are flushed) and past
// ln(FLT_MAX) = 88.72 it overflows to inf, as exp does in fp32. n reaches 128 from x = 88.38:
// 2^128 has no float exponent, so there y is doubled and scaled by 2^127 (it returned exp(88)
// from 88 to 88.75 before, when the reduction was clamped at 88). Under AVX2
// (8 floats) the floor of n is one vroundps instead of two conversions, a compare and a
// correction: the same n.
// With AVX-512 (16 floats), n = floor(t) is one vrndscaleps and y * 2^n one vscalefps, instead
// of two conversions, a compare and a correction for the floor and an integer assembly of 2^n
// and a multiply: the same values (floor and a product by a power of two are exact, and
// rounded once where it goes subnormal), about half the operations. In place, x[0..N).
template <int N, typename VF>
inline void vexp_n(VF (&x)[N]) {
  if constexpr (std::is_same_v<vm_elem_t<VF>, double>) {
    for (int c = 0; c < N; ++c) x[c] = per_lane(x[c], [](double t) { return __builtin_exp(t); });
  } else {
    using VI = decltype(x[0] < x[0]);
#if defined(__AVX512F__)
    constexpr bool kScalef = sizeof(VF) == sizeof(__m512);
#else
    constexpr bool kScalef = false;
#endif
#if defined(__AVX__)
    constexpr bool kRound = !kScalef && sizeof(VF) == sizeof(__m256);
#else
    constexpr bool kRound = false;
#endif
    const VF zero{};
    VF nf[N], r[N], p[N];
    VI n[N];
    for (int c = 0; c < N; ++c) {
      const VF xc = vmin_hi(zero + 88.75f, vmax_lo(zero - 87.5f, x[c]));  // NaN stays NaN
      const VF t = xc * 1.44269504088896341f + 0.5f;
      if constexpr (kScalef) {
#if defined(__AVX512F__)
        nf[c] = (VF)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#endif
      } else if constexpr (kRound) {
#if defined(__AVX__)
        nf[c] = (VF)__builtin_ia32_roundps256((__m256)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#endif
        n[c] = __builtin_convertvector(nf[c], VI);
      } else {
        n[c] = __builtin_convertvector(t, VI);
        n[c] -= (__builtin_convertvector(n[c], VF) > t) ? VI{} + 1 : VI{};  // floor
        nf[c] = __builtin_convertvector(n[c], VF);
      }
      r[c] = xc - nf[c] * 0.693359375f + nf[c] * 2.12194440e-4f;
    }
    for (int c = 0; c < N; ++c) p[c] = zero + 1.9875691500e-4f;
    for (int c = 0; c < N; ++c) p[c] = p[c] * r[c] + 1.3981999507e-3f;
    for (int c = 0; c < N; ++c) p[c] = p[c] * r[c] + 8.3334519073e-3f;
    for (int c = 0; c < N; ++c) p[c] = p[c] * r[c] + 4.1665795894e-2f;
    for (int c = 0; c < N; ++c) p[c] = p[c] * r[c] + 1.6666665459e-1f;
    for (int c = 0; c < N; ++c) p[c] = p[c] * r[c] + 5.0000001201e-1f;
    for (int c = 0; c < N; ++c) {
      const VF y = p[c] * r[c] * r[c] + r[c] + 1.0f;
      VF res;
      if constexpr (kScalef) {
#if defined(__AVX512F__)
        res = (VF)_mm512_scalef_ps((__m512)y, (__m512)nf[c]);
#endif
      } else {
        const VI top = n[c] > 127;  // -1 where n = 128
        const VI bits = (n[c] + top + 127) << 23;
        VF scale;
        std::memcpy(&scale, &bits, sizeof(scale));
        res = (top ? y + y : y) * scale;
      }
      // Past 88.72 the clamped exp(88.75) overflows to inf, and a NaN x went through the
      // clamp and the polynomial as NaN: only the flush below -87.5 needs a select.
      x[c] = x[c] < -87.5f ? zero : res;
    }
  }
}

template <typename VF>
inline VF vexp(VF x) {
  VF a[1] = {x};
  vexp_n<1>(a);
  return a[0];
}

// softplus(z) = max(z, 0) + log1p(exp(-|z|)) (z > 20 gives z, the reference's threshold), and
// in sig the sigmoid of z from the same terms: 1 / w for z >= 0, y / w for z < 0 (w = 1 + y,
// y = exp(-|z|)), so the backward's pre-processing, which needs both, spends one exp on them
// instead of two (vsigmoid). log1p(y), y in [0, 1], is 2 atanh(s) with s = y / (2 + y) in
// [0, 1/3]: an odd series to s^15 (the next term is below 2^-29 of s), with the rounding of 2 + y
// corrected; within 2.3 ulp of libm for softplus (tests/cpp/test_vec_math.cpp), against ~2 for
// the Cephes logf polynomial of log(1 + y) it replaced (exponent and mantissa split, a degree-9
// polynomial, a division for the rounding of 1 + y). That made the pre-processing pass
// 0.69-0.72x its time under AVX2 and 0.97x under AVX-512 (benchmarks/prep_kernel.cpp). NaN
// propagates through both. In place: z[c] becomes softplus(z[c]).
template <int N, typename VF>
inline void vsoftplus_sigmoid_n(VF (&z)[N], VF (&sig)[N]) {
  if constexpr (std::is_same_v<vm_elem_t<VF>, double>) {
    for (int c = 0; c < N; ++c) {
      sig[c] = per_lane(z[c], [](double t) { return 1.0 / (1.0 + __builtin_exp(-t)); });
      z[c] = per_lane(z[c], [](double t) { return t > 20.0 ? t : __builtin_log1p(__builtin_exp(t)); });
    }
  } else {
    const VF zero{};
    VF y[N], s[N], q[N], p[N];
    for (int c = 0; c < N; ++c) y[c] = vneg_abs(z[c]);
    vexp_n<N>(y);
    // log1p(y) = 2 atanh(s), s = y / (2 + y) in [0, 1/3]: s + s^3/3 + ... + s^15/15
    for (int c = 0; c < N; ++c) {
      const VF d = 2.0f + y[c];
      const VF e = (2.0f - d) + y[c];  // the rounding of 2 + y, exactly (2 >= y)
      s[c] = y[c] / d;
      s[c] -= s[c] * e * ((1.0f - s[c]) * 0.5f);  // y / (d + e): 1 / d = (1 - s) / 2
      q[c] = s[c] * s[c];
    }
    for (int c = 0; c < N; ++c) p[c] = q[c] * (1.0f / 15) + 1.0f / 13;
    for (int c = 0; c < N; ++c) p[c] = p[c] * q[c] + 1.0f / 11;
    for (int c = 0; c < N; ++c) p[c] = p[c] * q[c] + 1.0f / 9;
    for (int c = 0; c < N; ++c) p[c] = p[c] * q[c] + 1.0f / 7;
    for (int c = 0; c < N; ++c) p[c] = p[c] * q[c] + 1.0f / 5;
    for (int c = 0; c < N; ++c) p[c] = p[c] * q[c] + 1.0f / 3;
    for (int c = 0; c < N; ++c) {
      const VF s2 = s[c] + s[c];
      const VF l1p = s2 + s2 * (q[c] * p[c]);
      const VF rw = 1.0f / (1.0f + y[c]);
      sig[c] = z[c] < 0.0f ? y[c] * rw : rw;
      const VF sp = vmax_lo(zero, z[c]) + l1p;
      z[c] = z[c] > 20.0f ? z[c] : sp;
    }
  }
}

template <int N, typename VF>
inline void vsoftplus_n(VF (&z)[N]) {
  VF unused[N];  // dead code for the compiler: the sigmoid's select
  vsoftplus_sigmoid_n<N>(z, unused);
}

template <typename VF>
inline VF vsoftplus(VF z) {
  VF a[1] = {z};
  vsoftplus_n<1>(a);
  return a[0];
}

// sigmoid(z) = 1 / (1 + exp(-z)), in place.
template <int N, typename VF>
inline void vsigmoid_n(VF (&z)[N]) {
  if constexpr (std::is_same_v<vm_elem_t<VF>, double>) {
    for (int c = 0; c < N; ++c) {
      z[c] = per_lane(z[c], [](double t) { return 1.0 / (1.0 + __builtin_exp(-t)); });
    }
  } else {
    for (int c = 0; c < N; ++c) z[c] = -z[c];
    vexp_n<N>(z);
    for (int c = 0; c < N; ++c) z[c] = 1.0f / (1.0f + z[c]);
  }
}

template <typename VF>
inline VF vsigmoid(VF z) {
  VF a[1] = {z};
  vsigmoid_n<1>(a);
  return a[0];
}

// bf16 is the top half of a float: widening is exact.
inline float bf16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// IEEE fp16 bits to float, exact (every fp16 value is a float), in integer operations: the
// compilers' _Float16 is not there on every target (GCC 12's C++ has it only on x86), and the
// vector kernels widen whole rows with the CPU's own conversion where it has one (F16C,
// AVX-512). A NaN keeps its sign and payload and comes out quiet, as those conversions make it.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  uint32_t w = sign | (mantissa << 13);
  if (exponent == 0x1F) {
    w |= 0x7F800000u | (mantissa ? 0x00400000u : 0u);  // infinity, or a quiet NaN
  } else {
    w |= (exponent + (127 - 15)) << 23;  // rebias the exponent
  }
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// ---- the gates' rate ---------------------------------------------------------------------------

// exp(A_log) as the gates multiply it into z (rate_times). A normal rate is kept as it is. The two
// ends below the normal range are `tiny`:
// - a subnormal rate (A_log below about -87.3 in float, -708 in double) is held as
//   (rate 2^64, zmul 2^-64), made from its bits. The chunk kernels run the pre-processing with
//   denormals read as zero (chunk::FlushDenormals), where rate * z read it as 0: no decay where a
//   huge z makes the product of order 1, and 0 * inf = NaN at an infinite z. The scaled factors
//   are normal wherever the product is (a smaller product is a decay of 1 either way), and powers
//   of two commute with rounding: the bits of rate * z computed without that mode.
// - an underflowed rate (0: A_log below about -103.9 in float, -745.1 in double) stays 0; its
//   true product with a finite z is below 2^-22, a decay within rounding of 1.
// At an infinite z a tiny rate's product is z itself, the limit of a positive rate (docs/math.md
// "Saturation"), not 0 * inf = NaN. An infinite rate (saturated) is the callers' case, as is the
// softplus gate of a rate >= kLogSpaceRate (log_space: vsoftplus_gate_log_space).
template <typename T>
struct GateRate {
  T rate = T(1), zmul = T(1);
  bool tiny = false;       // below the normal range (subnormal or 0)
  bool log_space = false;  // >= kLogSpaceRate (2^64), inf included
};

// 2^e for a normal power of two, made from its bits: no std:: inline function (std::ldexp),
// whose out-of-line copy the linker may take from an object compiled for another instruction set.
template <typename T>
inline T pow2(int e) {
  using Bits = std::conditional_t<std::is_same_v<T, float>, uint32_t, uint64_t>;
  constexpr int kMantissa = std::numeric_limits<T>::digits - 1;
  const Bits bits = Bits(e - std::numeric_limits<T>::min_exponent + 2) << kMantissa;
  T x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// The rate of value head hv (expA: [HV] exp(A_log), or null: the bounded gate without A_log, 1).
template <typename T>
GateRate<T> gate_rate(const T* expA, int64_t hv) {
  GateRate<T> r;
  if (!expA) return r;
  r.rate = expA[hv];
  using Bits = std::conditional_t<std::is_same_v<T, float>, uint32_t, uint64_t>;
  constexpr int kMantissa = std::numeric_limits<T>::digits - 1;
  Bits bits;
  std::memcpy(&bits, &r.rate, sizeof(bits));
  // Bit tests: under denormals-are-zero a compare reads a subnormal as 0.
  const Bits mantissa = bits & ((Bits(1) << kMantissa) - 1);
  r.tiny = ((bits << 1) >> (kMantissa + 1)) == 0;  // exponent field 0 (sign bit shifted out)
  r.log_space = r.rate >= static_cast<T>(kLogSpaceRate);  // a normal operand: no mode applies
  if (r.tiny && mantissa != 0) {
    // value = mantissa 2^(min_exponent - digits), so 2^64 value = mantissa 2^(that + 64): an
    // exact integer conversion times a normal power of two (no subnormal operand).
    constexpr int kShift =
        std::numeric_limits<T>::min_exponent - std::numeric_limits<T>::digits + 64;
    const T m = static_cast<T>(static_cast<int64_t>(mantissa));
    r.rate = (bits >> (8 * sizeof(T) - 1) ? -m : m) * pow2<T>(kShift);
    r.zmul = pow2<T>(-64);
  }
  return r;
}

// rate * z (GateRate's note): z itself where z is infinite under a tiny rate.
template <typename VF, typename T>
inline VF rate_times(const GateRate<T>& r, VF z) {
  if (!r.tiny) return r.rate * z;
  const VF inf = VF{} + static_cast<T>(__builtin_inf());
  return (z == inf || z == -inf) ? z : r.rate * (z * r.zmul);
}

}  // namespace
}  // namespace KDA_ISA
}  // namespace kernels
}  // namespace kda
