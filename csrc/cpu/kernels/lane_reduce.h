// Lane sums of vectors in a fixed order (deterministic), and the in-register tile transposition
// built on the same shuffle tree (transpose_tile), shared by the kernel files.
//
// A textual fragment, not a normal header: each kernel file includes it INSIDE its per-ISA
// anonymous namespace (kda::kernels::KDA_ISA::{}), after defining vec_t<T> (a GCC vector of
// its register width) and kLanes<T>, so every ISA gets its own internal copy (see the linkage
// note in recurrent_kernels.cpp). The callers need <cstring> and, under AVX2, <immintrin.h>.
//
// hsum reduces one vector as a balanced tree (lanes l and l + w added, w = L/2, ..., 1);
// transpose_reduce reduces L vectors at once through the same pairs (shuffles put lane l + w of
// one vector beside lane l), so lane_sums gives every column the same bits whether it falls in a
// block of L or in the ragged tail: results never depend on how columns are grouped.

// Sum of the lanes of x, as a balanced tree (fixed order: deterministic).
template <typename T>
inline T hsum(const vec_t<T>& x) {
  T b[kLanes<T>];
  std::memcpy(b, &x, sizeof(b));
  for (int64_t w = kLanes<T> / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) b[l] += b[l + w];
  }
  return b[0];
}

// Lane sums of L = kLanes consecutive vectors w[0..L) (the backward's column partials), returned
// as one vector in order: a transposing tree of shuffles and adds (about 3 operations per vector
// instead of a full horizontal sum each). Fixed order: deterministic.
#if defined(__GNUC__) && !defined(__clang__)
#define KDA_HAVE_TRANSPOSE_REDUCE 1
template <typename T>
struct MaskOf;
template <>
struct MaskOf<float> {
  typedef int32_t type __attribute__((vector_size(sizeof(vec_t<float>))));
};
template <>
struct MaskOf<double> {
  typedef int64_t type __attribute__((vector_size(sizeof(vec_t<double>))));
};

// Lane masks for one level: a/b take the first/second half of each bs-lane block of X and Y.
template <typename T>
inline void level_masks(int64_t bs, typename MaskOf<T>::type& ma, typename MaskOf<T>::type& mb) {
  constexpr int64_t L = kLanes<T>;
  int64_t o = 0;
  for (int64_t m = 0; m < L / bs; ++m) {
    for (int64_t l = 0; l < bs / 2; ++l, ++o) {
      ma[2 * m * (bs / 2) + l] = m * bs + l;                      // X block m, first half
      ma[2 * m * (bs / 2) + bs / 2 + l] = L + m * bs + l;         // Y block m, first half
      mb[2 * m * (bs / 2) + l] = m * bs + bs / 2 + l;             // X block m, second half
      mb[2 * m * (bs / 2) + bs / 2 + l] = L + m * bs + bs / 2 + l;
    }
  }
}

template <typename T>
struct ReduceMasks {
  static constexpr int64_t L = kLanes<T>;
  static constexpr int kLevels = L == 16 ? 4 : (L == 8 ? 3 : (L == 4 ? 2 : 1));
  typename MaskOf<T>::type a[4], b[4], natural;
  ReduceMasks() {
    int64_t bs = L;
    for (int lv = 0; lv < kLevels; ++lv, bs /= 2) level_masks<T>(bs, a[lv], b[lv]);
    // After the levels lane l holds row bitreverse(l); bit reversal is its own inverse.
    for (int64_t l = 0; l < L; ++l) {
      int64_t r = 0;
      for (int bit = 0; bit < kLevels; ++bit) r |= ((l >> bit) & 1) << (kLevels - 1 - bit);
      natural[l] = r;
    }
  }
};

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 floats under AVX2: hsum's tree (lanes l and l + 4, then l + 2, then l + 1) with fixed
// shuffles (128-bit lane swaps, shufps, one final vpermps). The generic form above takes its
// masks from memory, which GCC turns into two vpermps and a vblendvps per shuffle: as the
// backward's row reductions (before its slices were transposed) they took ~40% of its time on
// Zen 3. Lane l of the result is hsum(w[l]), bit for bit.
inline vec_t<float> reduce_rows8(const vec_t<float>* w) {
  // Direct 32-byte loads: a memcpy into a local array became 16-byte copies through the stack
  // and 32-byte reloads (failed store forwarding).
  const float* f = reinterpret_cast<const float*>(w);
  __m256 x[8];
  for (int m = 0; m < 8; ++m) x[m] = _mm256_loadu_ps(f + 8 * m);
  __m256 h[4];
  for (int m = 0; m < 4; ++m) {
    // [a0+a4, a1+a5, a2+a6, a3+a7 | the same of b] for a = w[2m], b = w[2m+1]
    h[m] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * m], x[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(x[2 * m], x[2 * m + 1], 0x31));
  }
  __m256 qd[2];
  for (int m = 0; m < 2; ++m) {
    // [(l, l+2) sums, l = 0, 1, of w[4m], then of w[4m+2] | the same of w[4m+1], w[4m+3]]
    qd[m] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * m], h[2 * m + 1], 0x44),
                          _mm256_shuffle_ps(h[2 * m], h[2 * m + 1], 0xEE));
  }
  // [w0, w2, w4, w6 | w1, w3, w5, w7], each the sum of its two remaining partials.
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(qd[0], qd[1], 0x88),
                                 _mm256_shuffle_ps(qd[0], qd[1], 0xDD));
  const __m256 natural = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  return reinterpret_cast<const vec_t<float>&>(natural);
}
#endif

template <typename T>
inline vec_t<T> transpose_reduce(const vec_t<T>* w, const ReduceMasks<T>& M) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) return reduce_rows8(w);
#endif
  constexpr int64_t L = kLanes<T>;
  vec_t<T> x[L];
  for (int64_t i = 0; i < L; ++i) x[i] = w[i];
  int64_t n = L;
  for (int lv = 0; lv < ReduceMasks<T>::kLevels; ++lv, n /= 2) {
    for (int64_t m = 0; m < n / 2; ++m) {
      x[m] = __builtin_shuffle(x[2 * m], x[2 * m + 1], M.a[lv]) +
             __builtin_shuffle(x[2 * m], x[2 * m + 1], M.b[lv]);
    }
  }
  return __builtin_shuffle(x[0], M.natural);
}

// Transposes an L x L tile in registers (x[r]: row r in, column r out): at each level the rows r
// and r + h of every group of 2h rows swap their off-diagonal h-lane blocks (level_masks' two
// halves, the transposing tree of transpose_reduce without its adds), h = L / 2, ..., 1.
template <typename T>
inline void transpose_tile(vec_t<T> (&x)[kLanes<T>], const ReduceMasks<T>& M) {
  constexpr int64_t L = kLanes<T>;
  int64_t bs = L;
  for (int lv = 0; lv < ReduceMasks<T>::kLevels; ++lv, bs /= 2) {
    const int64_t h = bs / 2;
    for (int64_t g = 0; g < L; g += bs) {
      for (int64_t r = g; r < g + h; ++r) {
        const vec_t<T> lo = __builtin_shuffle(x[r], x[r + h], M.a[lv]);
        const vec_t<T> hi = __builtin_shuffle(x[r], x[r + h], M.b[lv]);
        x[r] = lo;
        x[r + h] = hi;
      }
    }
  }
}
#endif

// The lane sums of Z[0..L) as one vector (lane j: hsum(Z[j]), bit for bit): the transposing
// reduction where the compiler has it.
template <typename T>
inline vec_t<T> lane_sums_vec(const vec_t<T>* Z) {
#if defined(KDA_HAVE_TRANSPOSE_REDUCE)
  static const ReduceMasks<T> masks;
  return transpose_reduce<T>(Z, masks);
#else
  vec_t<T> r;
  for (int64_t j = 0; j < kLanes<T>; ++j) r[j] = hsum<T>(Z[j]);
  return r;
#endif
}

// out[j] = the lane sum of Z[j], j < width (L columns at a time through lane_sums_vec, the
// ragged rest one horizontal sum each; a fixed order: deterministic).
template <typename T>
inline void lane_sums(T* out, const vec_t<T>* Z, int64_t width) {
  constexpr int64_t L = kLanes<T>;
  int64_t j = 0;
  for (; j + L <= width; j += L) {
    const vec_t<T> r = lane_sums_vec<T>(Z + j);
    std::memcpy(out + j, &r, sizeof(r));
  }
  for (; j < width; ++j) out[j] = hsum<T>(Z[j]);
}
