// Short calls from C++: kda::fused_recurrent (the public C++ API, no Python) on B = 1 and T of
// 1-64 tokens, on the kernels the op picks (the serving kernels for calls of at most
// kShortCallWork state elements of work, csrc/cpu/serving.h) against the general recurrent kernels (the same call with
// TORCH_KDA_DECODE_KERNEL=recurrent, which the op reads at every call), interleaved: every
// repetition times `calls` calls of each, one after the other; then the serving form of the same
// call ("in place": the initial state is a one-slot pool updated in place, o written into a
// preallocated `out`), which allocates no tensor, as ggml's op writes the caller's buffers (the
// peers benchmark times that op so). fp32 inputs as the peers benchmark
// makes them (q, k L2-normalised, g a log decay in [-1, 0), beta in (0, 1), an initial state,
// scale K^-1/2), one thread, inference mode. Prints the median over the repetitions of each
// repetition's median call, in µs, general / picked (> 1: the pick is faster), and the in-place
// call's median.
// docs/benchmarks.md, "Short calls". Build against an installed wheel:
//
//   TORCH=$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')
//   KDA=$(python -c 'import torch_kda, os; print(os.path.dirname(torch_kda.__file__))')
//   g++ -O2 -std=c++17 -Icsrc/include -isystem $TORCH/include
//       -isystem $TORCH/include/torch/csrc/api/include
//       -D_GLIBCXX_USE_CXX11_ABI=1 benchmarks/short_calls.cpp -o /tmp/short_calls
//       -L$TORCH/lib -L$KDA -Wl,-rpath,$TORCH/lib -Wl,-rpath,$KDA -l:libkda.so -ltorch_cpu -lc10
//   /tmp/short_calls 32 1 4        # K = V, then heads H = HV (any number of them)
#include <kda/kda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

double median(std::vector<double> x) {
  std::nth_element(x.begin(), x.begin() + x.size() / 2, x.end());
  return x[x.size() / 2];
}

// Median µs of `calls` calls.
double time_calls(const std::vector<at::Tensor>& in, const kda::FusedRecurrentOptions& o,
                  int calls) {
  std::vector<double> t(calls);
  for (int c = 0; c < calls; ++c) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = kda::fused_recurrent(in[0], in[1], in[2], in[3], in[4], o);
    t[c] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t K = argc > 1 ? std::atoll(argv[1]) : 32;
  std::vector<int64_t> heads;
  for (int i = 2; i < argc; ++i) heads.push_back(std::atoll(argv[i]));
  if (heads.empty()) heads = {1, 4, 32};
  const int reps = 15, calls = 200;
  at::set_num_threads(1);
  c10::InferenceMode guard;
  torch::manual_seed(0);
  std::printf("K = V = %lld, one thread; median us per call (%d repetitions of %d calls)\n",
              static_cast<long long>(K), reps, calls);
  std::printf("| H | T | picked | general | general / picked | in place |\n"
              "|---|---|---|---|---|---|\n");
  for (const int64_t H : heads) {
    for (const int64_t T : {1, 2, 4, 8, 16, 32, 64}) {
      auto unit = [&](at::Tensor x) { return x / x.norm(2, -1, true); };
      const std::vector<at::Tensor> in = {
          unit(torch::randn({1, T, H, K})), unit(torch::randn({1, T, H, K})),
          torch::randn({1, T, H, K}), -torch::rand({1, T, H, K}) - 1e-3,
          torch::rand({1, T, H}) * 0.98 + 0.01};
      kda::FusedRecurrentOptions o;
      o.initial_state = torch::randn({1, H, K, K}) * 0.1;
      o.scale = 1.0 / std::sqrt(static_cast<double>(K));
      kda::FusedRecurrentOptions in_place = o;
      in_place.initial_state = o.initial_state->clone();
      in_place.inplace_final_state = true;
      in_place.out = torch::empty({1, T, H, K});
      std::vector<double> picked, general, pooled;
      for (int r = 0; r < reps + 1; ++r) {  // repetition 0 warms all three up
        unsetenv("TORCH_KDA_DECODE_KERNEL");
        const double p = time_calls(in, o, calls);
        setenv("TORCH_KDA_DECODE_KERNEL", "recurrent", 1);
        const double g = time_calls(in, o, calls);
        unsetenv("TORCH_KDA_DECODE_KERNEL");
        const double i = time_calls(in, in_place, calls);
        if (r > 0) {
          picked.push_back(p);
          general.push_back(g);
          pooled.push_back(i);
        }
      }
      const double p = median(picked), g = median(general), i = median(pooled);
      std::printf("| %lld | %lld | %.2f | %.2f | %.2f | %.2f |\n", static_cast<long long>(H),
                  static_cast<long long>(T), p, g, g / p, i);
    }
  }
  return 0;
}
