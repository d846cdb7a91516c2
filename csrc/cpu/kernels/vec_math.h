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

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef KDA_ISA
#error "KDA_ISA must name the instruction set this file is compiled for"
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

// exp: Cephes-style range reduction x = n ln2 + r and a degree-6 polynomial (about 1 ulp);
// below -87.5 it underflows to 0 and above 88.75 overflows to inf, as exp does in fp32.
// With AVX-512 (16 floats), n = floor(t) is one vrndscaleps and y * 2^n one vscalefps, instead
// of two conversions, a compare and a correction for the floor and an integer assembly of 2^n
// and a multiply: the same values (floor and a product by a power of two are exact, and
// rounded once where it goes subnormal), about half the operations; the pre-processing spent
// ~45% of its time in its two exp per gate element.
template <typename VF>
inline VF vexp(VF x) {
  if constexpr (std::is_same_v<vm_elem_t<VF>, double>) {
    return per_lane(x, [](double t) { return __builtin_exp(t); });
  } else {
    using VI = decltype(x < x);
    const VF zero{};
    const VF xc = x < -87.5f ? zero - 87.5f : (x > 88.0f ? zero + 88.0f : x);
    const VF t = xc * 1.44269504088896341f + 0.5f;
#if defined(__AVX512F__)
    constexpr bool kScalef = sizeof(VF) == sizeof(__m512);
#else
    constexpr bool kScalef = false;
#endif
    VI n{};
    VF nf;
    if constexpr (kScalef) {
#if defined(__AVX512F__)
      nf = (VF)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#endif
    } else {
      n = __builtin_convertvector(t, VI);
      n -= (__builtin_convertvector(n, VF) > t) ? VI{} + 1 : VI{};  // floor
      nf = __builtin_convertvector(n, VF);
    }
    const VF r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
    VF p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const VF y = p * r * r + r + 1.0f;
    VF res;
    if constexpr (kScalef) {
#if defined(__AVX512F__)
      res = (VF)_mm512_scalef_ps((__m512)y, (__m512)nf);
#endif
    } else {
      const VI bits = (n + 127) << 23;
      VF scale;
      std::memcpy(&scale, &bits, sizeof(scale));
      res = y * scale;
    }
    res = x < -87.5f ? zero : res;
    res = x > 88.75f ? zero + __builtin_inff() : res;
    return x != x ? x : res;  // NaN propagates
  }
}

// log for float u in [1, 2] (softplus only needs log(1 + y), y in (0, 1]): Cephes logf
// polynomial. u = m 2^e with m in [0.5, 1): from the bits, or with AVX-512 (16 floats) from
// vgetmantps and vgetexpps (the same m and e, as floats: fewer integer operations).
template <typename VF>
inline VF vlog_1_2(VF u) {
  using VI = decltype(u < u);
#if defined(__AVX512F__)
  constexpr bool kGetmant = sizeof(VF) == sizeof(__m512);
#else
  constexpr bool kGetmant = false;
#endif
  VF m, ef;
  if constexpr (kGetmant) {
#if defined(__AVX512F__)
    m = (VF)_mm512_getmant_ps((__m512)u, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_src);
    ef = (VF)_mm512_getexp_ps((__m512)u) + 1.0f;  // getexp is floor(log2 u), for m in [1, 2)
#endif
  } else {
    VI bits;
    std::memcpy(&bits, &u, sizeof(bits));
    const VI e = ((bits >> 23) & 0xff) - 126;
    const VI mb = (bits & 0x7fffff) | 0x3f000000;  // mantissa in [0.5, 1)
    std::memcpy(&m, &mb, sizeof(m));
    ef = __builtin_convertvector(e, VF);
  }
  const auto small = m < 0.707106781186547524f;
  ef = small ? ef - 1.0f : ef;
  VF x = small ? m + m - 1.0f : m - 1.0f;
  const VF z = x * x;
  VF y = VF{} + 7.0376836292e-2f;
  y = y * x - 1.1514610310e-1f;
  y = y * x + 1.1676998740e-1f;
  y = y * x - 1.2420140846e-1f;
  y = y * x + 1.4249322787e-1f;
  y = y * x - 1.6668057665e-1f;
  y = y * x + 2.0000714765e-1f;
  y = y * x - 2.4999993993e-1f;
  y = y * x + 3.3333331174e-1f;
  y = y * x * z;
  y += ef * -2.12194440e-4f;
  y += z * -0.5f;
  x = x + y;
  return x + ef * 0.693359375f;
}

// softplus(z) = max(z, 0) + log1p(exp(-|z|)) (z > 20 gives z, the reference's threshold), and
// in sig the sigmoid of z from the same terms: 1 / w for z >= 0, y / w for z < 0 (w = 1 + y,
// y = exp(-|z|)), so the backward's pre-processing, which needs both, spends one exp and one
// division on them instead of two each (vsigmoid). NaN propagates through both.
template <typename VF>
inline VF vsoftplus_sigmoid(VF z, VF& sig) {
  if constexpr (std::is_same_v<vm_elem_t<VF>, double>) {
    sig = per_lane(z, [](double t) { return 1.0 / (1.0 + __builtin_exp(-t)); });
    return per_lane(z, [](double t) { return t > 20.0 ? t : __builtin_log1p(__builtin_exp(t)); });
  } else {
    const VF zero{};
    const VF az = z < 0.0f ? -z : z;
    const VF y = vexp(-az);
    const VF w = 1.0f + y;
    const VF rw = 1.0f / w;
    // log1p(y) = log(w) - ((w - 1) - y) / w  (corrects the rounding of 1 + y)
    const VF l1p = vlog_1_2(w) - ((w - 1.0f) - y) * rw;
    sig = z < 0.0f ? y * rw : rw;
    const VF s = (z > 0.0f ? z : zero) + l1p;
    return z > 20.0f ? z : s;
  }
}

template <typename VF>
inline VF vsoftplus(VF z) {
  if constexpr (std::is_same_v<vm_elem_t<VF>, double>) {
    return per_lane(z, [](double t) { return t > 20.0 ? t : __builtin_log1p(__builtin_exp(t)); });
  } else {
    VF unused;  // dead code for the compiler: the sigmoid's select
    return vsoftplus_sigmoid(z, unused);
  }
}

template <typename VF>
inline VF vsigmoid(VF z) {
  if constexpr (std::is_same_v<vm_elem_t<VF>, double>) {
    return per_lane(z, [](double t) { return 1.0 / (1.0 + __builtin_exp(-t)); });
  } else {
    return 1.0f / (1.0f + vexp(-z));
  }
}

// bf16 is the top half of a float: widening is exact.
inline float bf16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

}  // namespace
}  // namespace KDA_ISA
}  // namespace kernels
}  // namespace kda
