// Serving through the public C++ API (kda::FusedRecurrentOptions' serving fields): a state pool
// updated in place by slot index equals gathering the states, a plain call and scattering back;
// unnamed slots are untouched; every rejected call names the argument and leaves the pool as it
// was; speculative snapshots equal sequential decode steps; the fresh outputs of a serving call
// reuse the blocks of earlier calls (no page faults per call).
#include <kda/kda.h>

#include "cpu/output_cache.h"
#include "cpu/serving.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <tuple>

namespace {

using at::Tensor;

struct Decode {
  Tensor q, k, v, g, beta;
  kda::FusedRecurrentOptions opts;
};

Decode make_decode(int64_t N, int64_t T, bool v_first, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t H = 2, HV = 4, K = 16, V = 24;
  Decode d;
  d.q = at::randn({N, T, H, K}, gen);
  d.k = at::randn({N, T, H, K}, gen);
  d.v = at::randn({N, T, HV, V}, gen);
  d.g = at::randn({N, T, HV, K}, gen);
  d.beta = at::randn({N, T, HV}, gen);
  d.opts.use_qk_l2norm_in_kernel = true;
  d.opts.use_gate_in_kernel = true;
  d.opts.use_beta_sigmoid_in_kernel = true;
  d.opts.A_log = at::randn({HV}, gen) * 0.5;
  d.opts.dt_bias = at::randn({HV * K}, gen) * 0.5;
  d.opts.state_v_first = v_first;
  return d;
}

Tensor make_pool(int64_t slots, bool v_first, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return v_first ? at::randn({slots, 4, 24, 16}, gen) * 0.5 : at::randn({slots, 4, 16, 24}, gen) * 0.5;
}

double rel(const Tensor& a, const Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() /
         b.to(at::kDouble).norm().item<double>();
}

class PoolLayouts : public ::testing::TestWithParam<bool> {};

TEST_P(PoolLayouts, InPlacePoolEqualsGatherCallScatter) {
  torch::NoGradGuard no_grad;
  const bool v_first = GetParam();
  Decode d = make_decode(3, 1, v_first, 1);
  Tensor pool = make_pool(6, v_first, 2);
  const Tensor before = pool.clone();
  auto opts = d.opts;
  opts.initial_state = pool;
  opts.ssm_state_indices = at::tensor({5, -1, 2}, at::kLong);
  opts.inplace_final_state = true;
  auto [o, fin] = kda::fused_recurrent(d.q, d.k, d.v, d.g, d.beta, opts);
  EXPECT_TRUE(fin.is_same(pool));

  const Tensor live = at::tensor({0, 2}, at::kLong);
  auto plain = d.opts;
  plain.initial_state = before.index_select(0, at::tensor({5, 2}, at::kLong)).to(at::kDouble);
  auto [o_ref, s_ref] = kda::fused_recurrent(
      d.q.index_select(0, live).to(at::kDouble), d.k.index_select(0, live).to(at::kDouble),
      d.v.index_select(0, live).to(at::kDouble), d.g.index_select(0, live).to(at::kDouble),
      d.beta.index_select(0, live).to(at::kDouble), plain);
  EXPECT_LT(rel(o.index_select(0, live), o_ref), 2e-5);
  EXPECT_LT(rel(pool.index_select(0, at::tensor({5, 2}, at::kLong)), s_ref), 2e-5);
  EXPECT_EQ(at::count_nonzero(o[1]).item<int64_t>(), 0);  // pad sequence: zero output
  for (int64_t s : {0, 1, 3, 4}) EXPECT_TRUE(at::equal(pool[s], before[s]));
}

TEST_P(PoolLayouts, SnapshotsEqualSequentialDecode) {
  torch::NoGradGuard no_grad;
  const bool v_first = GetParam();
  Decode d = make_decode(1, 3, v_first, 3);
  Tensor pool = make_pool(5, v_first, 4);
  const Tensor before = pool.clone();
  auto opts = d.opts;
  opts.initial_state = pool;
  opts.ssm_state_indices = at::tensor({1, 3, 4}, at::kLong).reshape({1, 3});
  opts.num_accepted_tokens = at::tensor({2}, at::kLong);  // starts from slot 3
  opts.inplace_final_state = true;
  kda::fused_recurrent(d.q, d.k, d.v, d.g, d.beta, opts);
  Tensor S = before.narrow(0, 3, 1).clone();
  const int64_t slots[3] = {1, 3, 4};
  for (int64_t t = 0; t < 3; ++t) {
    auto step = d.opts;
    step.initial_state = S;
    S = std::get<1>(kda::fused_recurrent(d.q.narrow(1, t, 1), d.k.narrow(1, t, 1),
                                         d.v.narrow(1, t, 1), d.g.narrow(1, t, 1),
                                         d.beta.narrow(1, t, 1), step));
    EXPECT_LT(rel(pool[slots[t]], S[0]), 2e-5) << "token " << t;
  }
  EXPECT_TRUE(at::equal(pool[0], before[0]));
  EXPECT_TRUE(at::equal(pool[2], before[2]));
}

INSTANTIATE_TEST_SUITE_P(Serving, PoolLayouts, ::testing::Values(false, true));

void expect_rejected(const kda::FusedRecurrentOptions& opts, const Decode& d, const Tensor& pool,
                     const std::string& needle) {
  const Tensor before = pool.clone();
  try {
    torch::NoGradGuard no_grad;
    kda::fused_recurrent(d.q, d.k, d.v, d.g, d.beta, opts);
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(pool, before)) << needle;
}

TEST(ServingBadInput, EveryRejectedCallNamesTheArgumentAndLeavesThePool) {
  Decode d = make_decode(2, 2, false, 5);
  Tensor pool = make_pool(6, false, 6);
  auto base = d.opts;
  base.initial_state = pool;
  base.inplace_final_state = true;

  auto o = base;
  o.ssm_state_indices = at::tensor({0, 6}, at::kLong);
  expect_rejected(o, d, pool, "ssm_state_indices[1] = 6 is out of range");
  o.ssm_state_indices = at::tensor({2, 2}, at::kLong);
  expect_rejected(o, d, pool, "two sequences write slot 2");
  o.ssm_state_indices = at::tensor({0.0, 1.0});
  expect_rejected(o, d, pool, "ssm_state_indices must be int64 or int32");
  o.ssm_state_indices = at::tensor({0, 1, 2, 3}, at::kLong).reshape({2, 2});
  o.num_accepted_tokens = at::tensor({3, 1}, at::kLong);
  expect_rejected(o, d, pool, "num_accepted_tokens[0] must be in [1, T_n] = [1, 2], got 3");
  o.num_accepted_tokens = at::tensor({1, 1}, at::kLong);
  o.ssm_state_indices = at::tensor({0, 1, 1, 3}, at::kLong).reshape({2, 2});
  expect_rejected(o, d, pool, "two sequences write slot 1");
  o.ssm_state_indices = at::tensor({0, 1}, at::kLong).reshape({2, 1});
  o.num_accepted_tokens.reset();
  expect_rejected(o, d, pool, "T_max = 1");
  auto nograd = base;
  nograd.ssm_state_indices = at::tensor({0, 1}, at::kLong);
  nograd.initial_state = pool.to(at::kHalf);
  try {
    torch::NoGradGuard no_grad;
    kda::fused_recurrent(d.q, d.k, d.v, d.g, d.beta, nograd);
    ADD_FAILURE() << "a float16 pool must be rejected";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("float32 or bfloat16"), std::string::npos) << e.what();
  }
  auto vfirst = base;
  vfirst.ssm_state_indices = at::tensor({0, 1}, at::kLong);
  vfirst.state_v_first = true;
  expect_rejected(vfirst, d, pool, "[num_slots, HV, V, K]");
  // Serving is inference only.
  auto grad = base;
  grad.ssm_state_indices = at::tensor({0, 1}, at::kLong);
  const Tensor before = pool.clone();
  Tensor q = d.q.clone().requires_grad_(true);
  try {
    kda::fused_recurrent(q, d.k, d.v, d.g, d.beta, grad);
    ADD_FAILURE() << "in-place serving with a tensor requiring grad must be rejected";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("inference only"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(pool, before));
}

// Found by a bug hunt: the serving path computed with values the plain call rejects (g > 0,
// beta outside [0, 2]) and wrote the pool; it wrote o into q when out was q, and two sequences'
// states into one place for an expanded pool.
kda::FusedRecurrentOptions in_place_at_slots_4_1(const Decode& d, const Tensor& pool) {
  auto o = d.opts;
  o.initial_state = pool;
  o.inplace_final_state = true;
  o.ssm_state_indices = at::tensor({4, 1}, at::kLong);
  return o;
}

TEST(ServingBadInput, ValuesOutsideTheDomainAndAliasedOutputsAreRejectedBeforeWriting) {
  Decode d = make_decode(2, 2, false, 7);
  Tensor pool = make_pool(6, false, 8);
  auto base = in_place_at_slots_4_1(d, pool);
  base.use_gate_in_kernel = false;  // g taken as a log-decay: must be <= 0
  base.A_log.reset();
  base.dt_bias.reset();
  Decode given = d;
  given.g = -at::rand_like(d.g);
  given.g.index_put_({1, 1, 2, 5}, 0.75);
  expect_rejected(base, given, pool, "kda::fused_recurrent_serving: g must be a log-decay <= 0");
  auto sig = in_place_at_slots_4_1(d, pool);
  sig.use_beta_sigmoid_in_kernel = false;  // beta taken as a strength: must lie in [0, 2]
  given = d;
  given.beta = at::full_like(d.beta, 0.5);
  given.beta.index_put_({0, 1, 3}, 2.5);
  expect_rejected(sig, given, pool, "beta must lie in [0, 2]");

  auto alias = in_place_at_slots_4_1(d, pool);
  alias.out = d.v;  // o [B, T, HV, V] has v's shape
  expect_rejected(alias, d, pool, "out shares memory with v");
  alias.out.reset();
  const Tensor expanded = pool.slice(0, 0, 1).expand({6, 4, 16, 24});
  alias.initial_state = expanded;
  expect_rejected(alias, d, expanded, "the slots of the state pool (initial_state) overlap");
}

// A serving call that returns a fresh final state (slots named, not in place) takes it from the
// output cache, as the plain call does: the second call maps no new block. (It came from
// at::empty, which glibc serves from a fresh mapping or from a heap it trims between calls:
// page faults again on later calls.) Its values equal a plain call on the gathered states.
TEST(ServingOutputs, FreshFinalStateComesFromTheOutputCache) {
  torch::NoGradGuard no_grad;
  const int64_t N = 8, H = 2, HV = 4, K = 64, V = 64;  // final state 8 * 4 * 64 * 64 fp32: 512 KB
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const Tensor q = at::randn({N, 1, H, K}, gen), k = at::randn({N, 1, H, K}, gen);
  const Tensor v = at::randn({N, 1, HV, V}, gen), g = -at::rand({N, 1, HV, K}, gen);
  const Tensor beta = at::rand({N, 1, HV}, gen);
  const Tensor pool = at::randn({N + 2, HV, K, V}, gen) * 0.1;
  const Tensor slots = at::arange(2, N + 2, at::kLong);
  kda::FusedRecurrentOptions opts;
  opts.use_qk_l2norm_in_kernel = true;
  opts.initial_state = pool;
  opts.ssm_state_indices = slots;
  auto call = [&]() { return std::get<1>(kda::fused_recurrent(q, k, v, g, beta, opts)); };
  call();  // maps the block (or finds one of an earlier test)
  const kda::detail::OutputCacheStats before = kda::detail::output_cache_stats();
  const Tensor fin = call();
  const kda::detail::OutputCacheStats after = kda::detail::output_cache_stats();
  EXPECT_EQ(after.misses, before.misses);
  EXPECT_GT(after.hits, before.hits);

  kda::FusedRecurrentOptions plain;
  plain.use_qk_l2norm_in_kernel = true;
  plain.initial_state = pool.index_select(0, slots).to(at::kDouble);
  const Tensor ref = std::get<1>(kda::fused_recurrent(q.to(at::kDouble), k.to(at::kDouble),
                                                      v.to(at::kDouble), g.to(at::kDouble),
                                                      beta.to(at::kDouble), plain));
  EXPECT_LT(rel(fin, ref), 2e-5);
}

}  // namespace

// A V-first decode batch of 25 MB of state traffic reads each head's rows before writing them on
// AMD CPUs (serving.cpp, vfirst_two_pass; under the L3 here, so not streamed); one sequence alone
// writes each 16-row block right after reading it. Both orders must give the same bits.
TEST(ServingDecode, VFirstBitsDoNotDependOnTheBatch) {
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(28);
  const int64_t N = 24, H = 8, K = 128, V = 128;
  const Tensor q = at::randn({N, 1, H, K}, gen), k = at::randn({N, 1, H, K}, gen);
  const Tensor v = at::randn({N, 1, H, V}, gen), g = -at::rand({N, 1, H, K}, gen);
  const Tensor beta = at::rand({N, 1, H}, gen), h0 = at::randn({N, H, V, K}, gen) * 0.5;
  kda::FusedRecurrentOptions opts;
  opts.use_qk_l2norm_in_kernel = true;
  opts.state_v_first = true;
  opts.initial_state = h0;
  auto [o, s] = kda::fused_recurrent(q, k, v, g, beta, opts);
  for (int64_t n : {int64_t(0), int64_t(13), N - 1}) {
    auto one = opts;
    one.initial_state = h0.narrow(0, n, 1);
    auto [o1, s1] = kda::fused_recurrent(q.narrow(0, n, 1), k.narrow(0, n, 1), v.narrow(0, n, 1),
                                         g.narrow(0, n, 1), beta.narrow(0, n, 1), one);
    EXPECT_TRUE(at::equal(o.narrow(0, n, 1), o1)) << n;
    EXPECT_TRUE(at::equal(s.narrow(0, n, 1), s1)) << n;
  }
  auto ref = opts;
  ref.initial_state = h0.narrow(0, 0, 1).to(at::kDouble);
  auto [o_ref, s_ref] = kda::fused_recurrent(
      q.narrow(0, 0, 1).to(at::kDouble), k.narrow(0, 0, 1).to(at::kDouble),
      v.narrow(0, 0, 1).to(at::kDouble), g.narrow(0, 0, 1).to(at::kDouble),
      beta.narrow(0, 0, 1).to(at::kDouble), ref);
  EXPECT_LT(rel(o.narrow(0, 0, 1), o_ref), 2e-5);
  EXPECT_LT(rel(s.narrow(0, 0, 1), s_ref), 2e-5);
}

// The decode's last-level cache bound reads sysfs's size strings (serving.cpp, llc_bytes).
TEST(ServingCacheSize, ParsesSysfsSizesAndRejectsOthers) {
  EXPECT_EQ(kda::detail::parse_cache_size("32768K"), int64_t(32) << 20);
  EXPECT_EQ(kda::detail::parse_cache_size("1M"), int64_t(1) << 20);
  EXPECT_EQ(kda::detail::parse_cache_size("512"), 512);
  EXPECT_EQ(kda::detail::parse_cache_size("48K"), 48 * 1024);
  for (const char* bad : {"", "K", "0K", "-4K", "32G", "32 K", "abc"}) {
    EXPECT_EQ(kda::detail::parse_cache_size(bad), -1) << "'" << bad << "'";
  }
}
