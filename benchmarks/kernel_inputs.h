// What the standalone g++-built kernel benchmarks share: 64-byte aligned float buffers (the op's
// tensors and the kernels' scratch are aligned so), and synthetic inputs shaped like the
// pre-processed ones of csrc/cpu/kernels/recurrent_kernels.h (docs/math.md "Forward recurrence"):
// unit-norm k, q scaled by K^-1/2, beta = 0.5, v ~ N(0, 1), per-channel decays
// a = exp(-strength (h + 1) softplus(z)) with z ~ N(0, 1) per channel, token and head h.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

struct AlignedFloats {
  std::vector<float> v;
  float* p;
  explicit AlignedFloats(size_t n) : v(n + 16) {
    p = v.data();
    while (reinterpret_cast<uintptr_t>(p) % 64) ++p;
  }
};

// q, k, a, ak [H, T, K]; beta [H, T]; v [T, H, V]; rng continues where the inputs left it (the
// benchmarks draw their cotangents from it).
struct KernelInputs {
  std::vector<float> q, k, a, ak, beta, v;
  std::mt19937 rng{1};
  std::normal_distribution<float> nd;

  KernelInputs(int64_t H, int64_t T, int64_t K, int64_t V, float strength)
      : q(H * T * K), k(H * T * K), a(H * T * K), ak(H * T * K), beta(H * T, 0.5f), v(T * H * V) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        float nq = 0, nk = 0;
        const int64_t x0 = (h * T + t) * K;
        for (int64_t i = 0; i < K; ++i) {
          q[x0 + i] = nd(rng);
          k[x0 + i] = nd(rng);
          nq += q[x0 + i] * q[x0 + i];
          nk += k[x0 + i] * k[x0 + i];
        }
        for (int64_t i = 0; i < K; ++i) {
          q[x0 + i] /= std::sqrt(nq * K);
          k[x0 + i] /= std::sqrt(nk);
          a[x0 + i] = std::exp(-strength * (h + 1) * std::log1p(std::exp(nd(rng))));
          ak[x0 + i] = a[x0 + i] * k[x0 + i];
        }
      }
    }
    for (auto& x : v) x = nd(rng);
  }
};
