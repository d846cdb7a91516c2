// bf16 state products of the chunk forward (see chunk_products.h).
#include "cpu/chunk_products.h"

#include "cpu/chunk_common.h"
#include "cpu/chunk_vec.h"
#include "cpu/error_message.h"

#include <ATen/native/CPUBlas.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kda {
namespace detail {
namespace chunk {

namespace {

// Column blocks of a packed B operand: N is cut into blocks of block_n() columns (the last one
// shorter, a multiple of 16), each laid out as its own [Kd, width] matrix, one after the other,
// and each product runs per block. 64 with AMX (the row lengths oneDNN's own packing routine
// makes for its tiles); 128 on AVX-512 BF16 alone, where one call per 128 columns instead of two
// ran the bf16 chunk forward ~1% faster on a Zen 4 core (B1 T8K H4, bitwise equal results).
int64_t block_n() {
  static const int64_t n = amx_tiles() ? 64 : 128;
  return n;
}

}  // namespace

bool amx_tiles() {
  static const bool amx = at::native::cpublas::could_pack(at::kBFloat16);
  return amx;
}

namespace {

// The value of the chunk knob `name` (auto when unset or empty), one of auto, a or b; any other
// value raises c10::Error naming the knob (the chunk knobs choose numerics or shapes, so a typo
// must not silently run something else; env_knob.h's knobs warn instead).
std::string chunk_knob(const char* name, const char* a, const char* b, const char* op) {
  const char* env = std::getenv(name);
  const std::string knob = env && *env ? env : "auto";
  KDA_CHECK_VALUE(knob == "auto" || knob == a || knob == b, op, name, " must be auto, ", a, " or ",
                  b, ", got '", knob, "'");
  return knob;
}

}  // namespace

bool amx_shapes(const char* op) {
  const std::string knob = chunk_knob("TORCH_KDA_CHUNK_SHAPES", "amx", "blocked", op);
  return knob == "auto" ? amx_tiles() : knob == "amx";
}

// Whether cpublas::brgemm runs bf16 products with fp32 accumulation on the CPU's own bf16 hardware
// for B operands in pack_b's layout: AMX tiles (where ATen packs bf16 itself, could_pack), or the
// AVX-512 BF16 dot products (vdpbf16ps: AMD Zen 4 / Zen 5, Intel Cooper Lake; could_pack is false
// there, since ATen packs for AMX only, but oneDNN's micro-kernel reads the same VNNI layout: a
// [64, 128] x [128, 64] product ran at 221 GFLOP/s on a Zen 4 core, 1.9x its fp32 one). Not on
// AVX-512 without BF16, where oneDNN would emulate bf16 products in software. The micro-kernel is
// asked once per process for a 32 x 32 x 32 product of small integers (exact in bf16 and fp32),
// compared with its exact value: a torch built without oneDNN's micro-kernels raises, and a
// layout this code did not expect would give other values; either way, no hardware products.
// Both paths also need oneDNN enabled (torch.backends.mkldnn.enabled), read at each call as
// ATen's brgemm reads it.
bool bf16_products_in_hardware() {
  if (!at::globalContext().userEnabledMkldnn()) return false;
  if (amx_tiles()) return true;
  static const bool vnni_dot = [] {
    if (!kBf16Convert) return false;
    constexpr int64_t n = 32;
    ProductWork p;
    p.mode = Products::kBf16;
    std::vector<float> a(n * n), b(n * n), c(n * n, 0.0f);
    for (int64_t i = 0; i < n * n; ++i) {
      a[i] = static_cast<float>(i % 7 - 3);
      b[i] = static_cast<float>(i % 5 - 2);
    }
    std::vector<at::BFloat16> a16(a.begin(), a.end());
    std::vector<uint32_t> packed(n * n / 2);
    pack_b(p, n, n, n, b.data(), n, packed.data());
    try {
      gemm16(p, n, n, n, a16.data(), n, packed.data(), c.data(), n, /*add=*/false);
      at::native::cpublas::brgemm_release(/*is_vnni=*/true);
    } catch (const std::exception&) {
      return false;
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double exact = 0.0;
        for (int64_t d = 0; d < n; ++d) exact += double(a[i * n + d]) * b[d * n + j];
        if (c[i * n + j] != exact) return false;
      }
    }
    return true;
  }();
  return vnni_dot;
}

Products choose_products(at::ScalarType input, int64_t K, int64_t V, const char* op) {
  const std::string knob = chunk_knob("TORCH_KDA_CHUNK_PRODUCTS", "fp32", "bf16", op);
  const bool half = input == at::kBFloat16 || input == at::kHalf;
  if (!half || knob == "fp32" || K <= 0 || V <= 0 || K % 16 != 0 || V % 16 != 0) {
    return Products::kNative;
  }
  // fp16 keeps 3 mantissa bits more than a bf16 operand: its products round to bf16 only when
  // the knob says so (auto: fp32 products; bf16 products measured 3.1e-3 relative RMS against
  // float64 where the fp32 ones gave 2.1e-4, K = V = 128, T = 4096).
  if (input == at::kHalf && knob != "bf16") return Products::kNative;
  if (bf16_products_in_hardware()) return Products::kBf16;
  return knob == "bf16" ? Products::kBf16Emulated : Products::kNative;
}

ProductWork::ProductWork(Products mode_, Carver& c, int64_t K, int64_t V) : mode(mode_) {
  const int64_t R = std::max(K, kC);
  tinv = c.take<at::BFloat16>(kC * kC);
  s = c.take<float>(K * V);  // packed bf16 needs half of this; the emulation's fp32 all of it
  vn = c.take<float>(kC * V);
  rhs = c.take<float>(kC * (K + V));
  fa = c.take<float>(R * R);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KDA_BF16_CONVERT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace {
bool cpu_converts_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

// The first m (< 16) floats of x as a vector, the rest zero.
KDA_BF16_CONVERT inline __m512 load_first(const float* x, int64_t m) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << m) - 1), x);
}
}  // namespace

const bool kBf16Convert = cpu_converts_bf16();

KDA_BF16_CONVERT void round_bf16_convert(const float* x, uint16_t* y, int64_t n) {
  int64_t e = 0;
  for (; e + 32 <= n; e += 32) {
    const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + e + 16), _mm512_loadu_ps(x + e));
    _mm512_storeu_si512(y + e, reinterpret_cast<__m512i>(r));
  }
  for (; e < n; e += 16) {
    const int64_t m = std::min<int64_t>(16, n - e);
    const __m512 v = m == 16 ? _mm512_loadu_ps(x + e) : load_first(x + e, m);
    const __m256bh r = _mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(y + e, static_cast<__mmask16>((1u << m) - 1),
                             reinterpret_cast<__m256i>(r));
  }
}

// The VNNI words of two rows' 16 floats: cvtne2ps(b, a) holds bf16(a) in words 0-15 and bf16(b)
// in 16-31; the permutation interleaves them (word 2e = a[e], 2e + 1 = b[e]).
KDA_BF16_CONVERT inline __m512i pair_words(__m512 a, __m512 b) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(pairs, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
}

KDA_BF16_CONVERT void pack_pair_convert(const float* x0, const float* x1, uint32_t* y,
                                        int64_t n) {
  for (int64_t e = 0; e < n; e += 16) {
    const int64_t m = std::min<int64_t>(16, n - e);
    const __m512 a = m == 16 ? _mm512_loadu_ps(x0 + e) : load_first(x0 + e, m);
    const __m512 b = !x1 ? _mm512_setzero_ps()
                         : (m == 16 ? _mm512_loadu_ps(x1 + e) : load_first(x1 + e, m));
    _mm512_mask_storeu_epi32(y + e, static_cast<__mmask16>((1u << m) - 1), pair_words(a, b));
  }
}

KDA_BF16_CONVERT void pack_pair_scale_convert(float* x0, float* x1, float f0, float f1,
                                              uint32_t* y, int64_t n) {
  const __m512 s0 = _mm512_set1_ps(f0), s1 = _mm512_set1_ps(f1);
  for (int64_t e = 0; e < n; e += 16) {
    const __m512 a = _mm512_loadu_ps(x0 + e), b = _mm512_loadu_ps(x1 + e);
    _mm512_storeu_si512(y + e, pair_words(a, b));
    _mm512_storeu_ps(x0 + e, _mm512_mul_ps(a, s0));
    _mm512_storeu_ps(x1 + e, _mm512_mul_ps(b, s1));
  }
}
#else
const bool kBf16Convert = false;
void round_bf16_convert(const float*, uint16_t*, int64_t) {}
void pack_pair_convert(const float*, const float*, uint32_t*, int64_t) {}
void pack_pair_scale_convert(float*, float*, float, float, uint32_t*, int64_t) {}
#endif

namespace {

// f(r, e0, width, y) for every row pair (r, r + 1), r in [r0, r1), and column block
// [e0, e0 + width) of a packed B operand [Kd, N] at dst, y the pair's words in that block: word
// (r / 2) * width + e of a block holds bf16(row r, column e0 + e) in its low half and
// bf16(row r + 1, ...) in its high half.
template <typename F>
KDA_ALWAYS_INLINE void for_each_packed_pair(int64_t Kd, int64_t N, int64_t r0, int64_t r1,
                                            void* dst, F&& f) {
  uint32_t* const d = static_cast<uint32_t*>(dst);
  const int64_t bn = block_n();
  for (int64_t e0 = 0; e0 < N; e0 += bn) {
    const int64_t width = std::min(bn, N - e0);
    uint32_t* const block = d + e0 * Kd / 2;
    for (int64_t r = r0; r < r1; r += 2) f(r, e0, width, block + (r / 2) * width);
  }
}

}  // namespace

KDA_CLONES void pack_b_rows(const ProductWork& p, int64_t Kd, int64_t N, int64_t r0, int64_t r1,
                            int64_t have, const float* src, int64_t lds, void* dst) {
  auto row = [&](int64_t r) { return r < have ? src + (r - r0) * lds : nullptr; };
  if (p.mode == Products::kBf16Emulated) {
    float* d = static_cast<float*>(dst);
    for (int64_t r = r0; r < r1; ++r) {
      const float* __restrict x = row(r);
      float* __restrict y = d + r * N;
      if (!x) {
        std::fill(y, y + N, 0.0f);
        continue;
      }
      for (int64_t e = 0; e < N; ++e) y[e] = static_cast<float>(at::BFloat16(x[e]));
    }
    return;
  }
  for_each_packed_pair(Kd, N, r0, r1, dst, [&](int64_t r, int64_t e0, int64_t width,
                                                uint32_t* __restrict y) {
    const float* __restrict x0 = row(r);
    const float* __restrict x1 = row(r + 1);
    if (kBf16Convert && x0) {
      pack_pair_convert(x0 + e0, x1 ? x1 + e0 : nullptr, y, width);
    } else if (x1) {
      KDA_IVDEP
      for (int64_t e = 0; e < width; ++e) {
        y[e] = bf16_bits(x0[e0 + e]) | (bf16_bits(x1[e0 + e]) << 16);
      }
    } else if (x0) {
      KDA_IVDEP
      for (int64_t e = 0; e < width; ++e) y[e] = bf16_bits(x0[e0 + e]);
    } else {
      std::fill(y, y + width, 0u);
    }
  });
}

KDA_CLONES void pack_b_scaled(const ProductWork& p, int64_t Kd, int64_t N, float* src,
                              int64_t lds, const float* scale, void* dst) {
  if (p.mode == Products::kBf16Emulated) {
    float* d = static_cast<float*>(dst);
    for (int64_t r = 0; r < Kd; ++r) {
      float* __restrict x = src + r * lds;
      float* __restrict y = d + r * N;
      const float f = scale[r];
      for (int64_t e = 0; e < N; ++e) {
        y[e] = static_cast<float>(at::BFloat16(x[e]));
        x[e] *= f;
      }
    }
    return;
  }
  for_each_packed_pair(Kd, N, 0, Kd, dst, [&](int64_t r, int64_t e0, int64_t width,
                                              uint32_t* __restrict y) {
    float* __restrict x0 = src + r * lds + e0;
    float* __restrict x1 = x0 + lds;
    const float f0 = scale[r], f1 = scale[r + 1];
    if (kBf16Convert) {
      pack_pair_scale_convert(x0, x1, f0, f1, y, width);
      return;
    }
    KDA_IVDEP
    for (int64_t e = 0; e < width; ++e) {
      y[e] = bf16_bits(x0[e]) | (bf16_bits(x1[e]) << 16);
      x0[e] *= f0;
      x1[e] *= f1;
    }
  });
}

void gemm16(const ProductWork& p, int64_t M, int64_t N, int64_t Kd, const at::BFloat16* A,
            int64_t lda, const void* B, float* C, int64_t ldc, bool add, int64_t kb) {
  if (M <= 0 || N <= 0) return;
  if (kb < Kd) kb = Kd;
  if (p.mode == Products::kBf16Emulated) {
    // bf16 x bf16 products are exact in fp32 (8 + 8 significant bits), so widening the operands
    // and running the fp32 GEMM gives the numerics of bf16 products with fp32 accumulation.
    for (int64_t i = 0; i < M; ++i) {
      const at::BFloat16* __restrict a = A + i * lda;
      float* __restrict f = p.fa + i * Kd;
      for (int64_t d = 0; d < Kd; ++d) f[d] = static_cast<float>(a[d]);
    }
    at::native::cpublas::brgemm(M, N, Kd, Kd, N, ldc, add, p.fa, static_cast<const float*>(B),
                                C, /*is_vnni=*/false);
    return;
  }
  const at::BFloat16* b = static_cast<const at::BFloat16*>(B);
  const int64_t bn = block_n();
  for (int64_t e0 = 0; e0 < N; e0 += bn) {
    const int64_t width = std::min(bn, N - e0);
    at::native::cpublas::brgemm(M, width, Kd, lda, width, ldc, add, A, b + e0 * kb, C + e0,
                                /*is_vnni=*/true);
  }
}

}  // namespace chunk
}  // namespace detail
}  // namespace kda

// For backend="auto" (src/torch_kda/_native.py, prefer_chunk): whether the chunk forward would
// take bf16 state products on the CPU's matrix engine (packed bf16: AMX) for inputs of dtype
// `dtype` and head sizes K, V (as choose_products decides, TORCH_KDA_CHUNK_PRODUCTS included).
TORCH_LIBRARY_FRAGMENT(kda, m) {
  m.def("_chunk_bf16_products(ScalarType dtype, int K, int V) -> bool",
        [](c10::ScalarType dtype, int64_t K, int64_t V) {
          return kda::detail::chunk::choose_products(dtype, K, V,
                                                     "kda::_chunk_bf16_products: ") ==
                 kda::detail::chunk::Products::kBf16;
        });
}
