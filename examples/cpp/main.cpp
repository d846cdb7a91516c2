// Trains a tiny KDA block from C++: projections -> kda::fused_recurrent (gate, l2 norm and sigmoid
// beta computed in the op) -> loss, with gradients from the op's C++ autograd.
#include <kda/kda.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  torch::manual_seed(0);
  const int64_t B = 2, T = 96, M = 32, H = 2, K = 16, V = 16;
  torch::nn::Linear q_proj(M, H * K), k_proj(M, H * K), v_proj(M, H * V), f_proj(M, H * K),
      b_proj(M, H);
  torch::Tensor A_log = torch::zeros({H}).requires_grad_(true);
  torch::Tensor dt_bias = torch::zeros({H * K}).requires_grad_(true);

  std::vector<torch::Tensor> params = {A_log, dt_bias};
  for (auto* m : {&q_proj, &k_proj, &v_proj, &f_proj, &b_proj}) {
    for (auto& p : (*m)->parameters()) params.push_back(p);
  }
  torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-2));

  const torch::Tensor x = torch::randn({B, T, M});
  const torch::Tensor target = torch::randn({B, T, H, V}) * 0.1;

  kda::FusedRecurrentOptions o;
  o.use_qk_l2norm_in_kernel = true;
  o.use_gate_in_kernel = true;
  o.use_beta_sigmoid_in_kernel = true;
  o.A_log = A_log;
  o.dt_bias = dt_bias;

  std::printf("torch-kda C++ example (kernels: %s)\n", kda::cpu_kernel_isa());
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    auto q = q_proj(x).view({B, T, H, K});
    auto k = k_proj(x).view({B, T, H, K});
    auto v = v_proj(x).view({B, T, H, V});
    auto g = f_proj(x).view({B, T, H, K});
    auto beta = b_proj(x);
    // kda::chunk(q, k, v, g, beta, o) is the chunkwise form: same arguments, results (to
    // rounding) and gradients, faster for long sequences.
    auto [out, final_state] = kda::fused_recurrent(q, k, v, g, beta, o);
    auto loss = torch::mse_loss(out, target);
    opt.zero_grad();
    loss.backward();
    opt.step();
    last = loss.item<double>();
    if (step == 0) {
      first = last;
      std::printf("o %s, final_state %s, |dA_log| %.3e\n",
                  c10::str(out.sizes()).c_str(), c10::str(final_state.sizes()).c_str(),
                  A_log.grad().norm().item<double>());
    }
    if (step % 5 == 0 || step == 19) std::printf("step %2d  loss %.6f\n", step, last);
  }
  if (!(last < first)) {
    std::printf("FAILED: the loss did not decrease\n");
    return 1;
  }
  std::printf("ok: loss %.6f -> %.6f\n", first, last);
  return 0;
}
