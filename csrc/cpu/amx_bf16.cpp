// bf16 products on AMX tiles (see amx_bf16.h).
#include "cpu/amx_bf16.h"

#include "cpu/chunk_vec.h"
#include "cpu/clones.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

// AMX intrinsics: GCC 11+ and Clang 12+ on x86-64 Linux (the tile data permission is a Linux
// system call); elsewhere available() is false and the callers keep ATen's brgemm.
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define KDA_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kda {
namespace detail {
namespace amx {

#if defined(KDA_HAVE_AMX)

namespace {

bool detect() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
  if (!tile || !bf16) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA enabled by the OS
  // Linux: a process must ask for the tile data state before its first tile instruction
  // (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); asking again once granted is harmless.
  constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) return false;
  unsigned long long granted = 0;
  if (syscall(SYS_arch_prctl, kGetXcompPerm, &granted) != 0) return false;
  return (granted >> kXtiledata) & 1u;
}

// The tile configuration (palette 1): tiles 0-3 accumulate a 32 x 32 block of C (four 16 x 16
// fp32 tiles), 4-5 hold 16 rows x 32 k of A, 6-7 16 k-pairs x 16 columns of B; all 16 rows of 64
// bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

}  // namespace

bool available() {
  static const bool ok = detect();
  return ok;
}

KDA_CLONES void pack_b(int64_t Kd, int64_t N, int64_t rows, const float* src, int64_t lds,
                       at::BFloat16* dst) {
  // A pair of rows r, r + 1 becomes one row of N 32-bit words: the low half row r's bf16 bits,
  // the high half row r + 1's (little-endian, so the pair lies in memory as {B[r, e], B[r+1, e]}).
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t r = 0; r < Kd; r += 2, d += N) {
    if (r >= rows) {
      std::fill(d, d + N, 0u);
      continue;
    }
    const float* __restrict x0 = src + r * lds;
    uint32_t* __restrict y = d;
    if (r + 1 < rows) {
      const float* __restrict x1 = x0 + lds;
      KDA_IVDEP
      for (int64_t e = 0; e < N; ++e) {
        y[e] = chunk::bf16_bits(x0[e]) | chunk::bf16_bits(x1[e]) << 16;
      }
    } else {
      KDA_IVDEP
      for (int64_t e = 0; e < N; ++e) y[e] = chunk::bf16_bits(x0[e]);
    }
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void gemm(int64_t M, int64_t N, int64_t Kd,
                                                       const at::BFloat16* A, int64_t lda,
                                                       const at::BFloat16* B, float* C,
                                                       int64_t ldc, bool add) {
  if (M <= 0 || N <= 0) return;
  static const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t sa = 2 * lda, sb = 4 * N;  // tile row strides in bytes
  alignas(64) float part[32 * 32];         // C of a block with fewer than 16 or 32 rows
  for (int64_t i0 = 0; i0 < M; i0 += 32) {
    const int64_t mr = std::min<int64_t>(32, M - i0);
    const bool two_r = mr > 16;
    const bool direct = mr == 16 || mr == 32;  // whole tiles: C read and written in place
    const at::BFloat16* a0 = A + i0 * lda;
    const at::BFloat16* a1 = a0 + 16 * lda;
    for (int64_t j0 = 0; j0 < N; j0 += 32) {
      const bool two_c = N - j0 > 16;
      const int64_t nc = two_c ? 32 : 16;
      float* c = direct ? C + i0 * ldc + j0 : part;
      const int64_t lc = direct ? ldc : 32, sc = 4 * lc;
      if (!direct) {
        for (int64_t i = 0; i < mr; ++i) {
          if (add) std::memcpy(part + i * 32, C + (i0 + i) * ldc + j0, sizeof(float) * nc);
        }
      }
      if (add) {
        _tile_loadd(0, c, sc);
        if (two_c) _tile_loadd(1, c + 16, sc);
        if (two_r) _tile_loadd(2, c + 16 * lc, sc);
        if (two_r && two_c) _tile_loadd(3, c + 16 * lc + 16, sc);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      const at::BFloat16* b = B + 2 * j0;
      for (int64_t k0 = 0; k0 < Kd; k0 += 32) {
        const at::BFloat16* bk = b + k0 * N;  // k-pair row k0 / 2, 2 N bf16 each
        _tile_loadd(4, a0 + k0, sa);
        _tile_loadd(6, bk, sb);
        _tile_dpbf16ps(0, 4, 6);
        if (two_c) {
          _tile_loadd(7, bk + 32, sb);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_r) {
          _tile_loadd(5, a1 + k0, sa);
          _tile_dpbf16ps(2, 5, 6);
          if (two_c) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c, sc);
      if (two_c) _tile_stored(1, c + 16, sc);
      if (two_r) _tile_stored(2, c + 16 * lc, sc);
      if (two_r && two_c) _tile_stored(3, c + 16 * lc + 16, sc);
      if (!direct) {
        for (int64_t i = 0; i < mr; ++i) {
          std::memcpy(C + (i0 + i) * ldc + j0, part + i * 32, sizeof(float) * nc);
        }
      }
    }
  }
}

#else  // no AMX intrinsics: never available

bool available() { return false; }

void pack_b(int64_t, int64_t, int64_t, const float*, int64_t, at::BFloat16*) {
  TORCH_CHECK(false, "kda: AMX products are not built for this platform");
}

void gemm(int64_t, int64_t, int64_t, const at::BFloat16*, int64_t, const at::BFloat16*, float*,
          int64_t, bool) {
  TORCH_CHECK(false, "kda: AMX products are not built for this platform");
}

#endif

}  // namespace amx
}  // namespace detail
}  // namespace kda
