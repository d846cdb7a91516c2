// GoogleTest suite for the native KDA ops, through the public C++ API (kda/kda.h): every oracle
// test runs for both forms, kda::fused_recurrent and kda::chunk (forward chunks of 32 tokens,
// 64 with AMX; checkpoints and backward chunks of 64; the shapes below cross chunk boundaries
// and include sequences shorter than one chunk).
// The oracle is a naive per-token loop written with ATen ops (differentiable, float64).
#include <kda/kda.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

struct Problem {
  int64_t B = 2, T = 70, H = 2, HV = 4, K = 7, V = 11;
  at::ScalarType dtype = at::kDouble;
};

struct Data {
  Tensor q, k, v, g, beta, A_log, dt_bias, h0;
};

Data make_data(const Problem& p, uint64_t seed, bool gate_raw = true) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(p.dtype);
  auto r = [&](at::IntArrayRef s) { return at::randn(s, gen, o); };
  Data d;
  d.q = r({p.B, p.T, p.H, p.K});
  d.k = r({p.B, p.T, p.H, p.K});
  d.v = r({p.B, p.T, p.HV, p.V});
  d.g = gate_raw ? r({p.B, p.T, p.HV, p.K}) : -at::softplus(r({p.B, p.T, p.HV, p.K}));
  d.beta = r({p.B, p.T, p.HV});
  d.A_log = r({p.HV}) * 0.5;
  d.dt_bias = r({p.HV * p.K});
  d.h0 = r({p.B, p.HV, p.K, p.V});
  return d;
}

// Naive recurrence of docs/math.md, one token at a time; h0 in [N, HV, K, V]; one sequence per
// batch row. Gate in op: softplus form (lower_bound unset) or bounded form.
std::tuple<Tensor, Tensor> naive(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& g, const Tensor& beta, double scale,
                                 const kda::FusedRecurrentOptions& o) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3), G = HV / H;
  Tensor qq = q, kk = k;
  if (o.use_qk_l2norm_in_kernel) {
    qq = q / at::sqrt(q.square().sum(-1, true) + 1e-6);
    kk = k / at::sqrt(k.square().sum(-1, true) + 1e-6);
  }
  Tensor gl = g;
  if (o.use_gate_in_kernel) {
    Tensor z = o.dt_bias ? g + o.dt_bias->reshape({HV, K}) : g;
    if (!o.lower_bound) {
      gl = -at::exp(*o.A_log).reshape({HV, 1}) * at::softplus(z);
    } else {
      Tensor w = o.A_log ? at::exp(*o.A_log).reshape({HV, 1}) * z : z;
      gl = *o.lower_bound * at::sigmoid(w);
    }
  }
  Tensor b = beta;
  if (o.use_beta_sigmoid_in_kernel) b = at::sigmoid(beta) * (o.allow_neg_eigval ? 2.0 : 1.0);
  std::vector<Tensor> outs, finals;
  for (int64_t n = 0; n < B; ++n) {
    Tensor S = o.initial_state ? o.initial_state->select(0, n) : at::zeros({HV, K, V}, q.options());
    std::vector<Tensor> os;
    for (int64_t t = 0; t < T; ++t) {
      Tensor qt = qq.select(0, n).select(0, t).repeat_interleave(G, 0) * scale;  // [HV, K]
      Tensor kt = kk.select(0, n).select(0, t).repeat_interleave(G, 0);
      Tensor at_ = at::exp(gl.select(0, n).select(0, t));                       // [HV, K]
      Tensor vt = v.select(0, n).select(0, t);                                  // [HV, V]
      Tensor bt = b.select(0, n).select(0, t).unsqueeze(-1);                    // [HV, 1]
      S = S * at_.unsqueeze(-1);
      Tensor r = vt - (S * kt.unsqueeze(-1)).sum(1);
      S = S + kt.unsqueeze(-1) * (bt * r).unsqueeze(1);
      os.push_back((S * qt.unsqueeze(-1)).sum(1));
    }
    outs.push_back(T ? at::stack(os) : at::zeros({0, HV, V}, q.options()));
    finals.push_back(S);
  }
  return {at::stack(outs), at::stack(finals)};
}

double rel_err(const Tensor& a, const Tensor& b) {
  const double den = b.to(at::kDouble).norm().item<double>();
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() / (den > 0 ? den : 1.0);
}

kda::FusedRecurrentOptions full_options(const Data& d) {
  kda::FusedRecurrentOptions o;
  o.scale = 0.37;
  o.use_qk_l2norm_in_kernel = true;
  o.use_gate_in_kernel = true;
  o.A_log = d.A_log;
  o.dt_bias = d.dt_bias;
  o.use_beta_sigmoid_in_kernel = true;
  o.initial_state = d.h0;
  return o;
}

// The two public forms share one signature, options and contract.
using KdaFn = std::tuple<Tensor, Tensor> (*)(const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&, const Tensor&,
                                             const kda::FusedRecurrentOptions&);
struct Form {
  const char* name;
  KdaFn fn;
};

class Forms : public ::testing::TestWithParam<Form> {
 protected:
  std::tuple<Tensor, Tensor> kda_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& g, const Tensor& beta,
                                    const kda::FusedRecurrentOptions& o) const {
    return GetParam().fn(q, k, v, g, beta, o);
  }
};

TEST_P(Forms, ForwardMatchesNaiveLoopGvaGateNormSigmoid) {
  Problem p;
  const Data d = make_data(p, 1);
  const auto o = full_options(d);
  auto [out, st] = kda_op(d.q, d.k, d.v, d.g, d.beta, o);
  auto [ro, rs] = naive(d.q, d.k, d.v, d.g, d.beta, 0.37, o);
  EXPECT_EQ(out.sizes(), ro.sizes());
  EXPECT_EQ(out.scalar_type(), at::kDouble);
  EXPECT_LT(rel_err(out, ro), 1e-12);
  EXPECT_LT(rel_err(st, rs), 1e-12);
}

// scale unset means K ** -0.5 as the Python API computes it (std::pow), not 1 / sqrt(K): they
// differ in the last bit at K = 8, and then the two APIs would give different bits.
TEST_P(Forms, DefaultScaleIsThePythonApisPowerOfK) {
  Problem p;
  p.K = 8;  // float64: the last bit of the scale reaches the outputs
  const Data d = make_data(p, 9);
  auto o = full_options(d);
  o.scale = std::nullopt;
  auto [out, st] = kda_op(d.q, d.k, d.v, d.g, d.beta, o);
  o.scale = std::pow(8.0, -0.5);
  auto [want, want_st] = kda_op(d.q, d.k, d.v, d.g, d.beta, o);
  EXPECT_TRUE(at::equal(out, want));
  EXPECT_TRUE(at::equal(st, want_st));
  auto [ro, rs] = naive(d.q, d.k, d.v, d.g, d.beta, std::pow(8.0, -0.5), o);
  EXPECT_LT(rel_err(out, ro), 1e-12);
}

TEST_P(Forms, ForwardBoundedGateNegEigvalStateVFirst) {
  Problem p;
  p.K = 9;
  p.V = 40;  // two V-slices
  const Data d = make_data(p, 2);
  auto o = full_options(d);
  o.lower_bound = -4.0;
  o.allow_neg_eigval = true;
  auto [ro, rs] = naive(d.q, d.k, d.v, d.g, d.beta, 0.37, o);
  o.state_v_first = true;
  o.initial_state = d.h0.transpose(-1, -2).contiguous();
  auto [out, st] = kda_op(d.q, d.k, d.v, d.g, d.beta, o);
  EXPECT_LT(rel_err(out, ro), 1e-12);
  EXPECT_EQ(st.sizes(), at::IntArrayRef({p.B, p.HV, p.V, p.K}));
  EXPECT_LT(rel_err(st.transpose(-1, -2), rs), 1e-12);
}

TEST_P(Forms, Float32AndBFloat16Outputs) {
  Problem p;
  const Data d = make_data(p, 3);
  const auto o = full_options(d);
  auto [ro, rs] = naive(d.q, d.k, d.v, d.g, d.beta, 0.37, o);
  auto f = [](const Tensor& t, at::ScalarType s) { return t.to(s); };
  auto [o32, s32] = kda_op(f(d.q, at::kFloat), f(d.k, at::kFloat),
                                         f(d.v, at::kFloat), d.g, d.beta, o);
  EXPECT_EQ(o32.scalar_type(), at::kFloat);
  EXPECT_EQ(s32.scalar_type(), at::kFloat);
  EXPECT_LT(rel_err(o32, ro), 1e-5);
  auto [o16, s16] = kda_op(f(d.q, at::kBFloat16), f(d.k, at::kBFloat16),
                                         f(d.v, at::kBFloat16), d.g, d.beta, o);
  EXPECT_EQ(o16.scalar_type(), at::kBFloat16);
  EXPECT_EQ(s16.scalar_type(), at::kFloat);
  EXPECT_LT(rel_err(o16, ro), 3e-2);
}

TEST_P(Forms, VarlenMatchesPerSequence) {
  Problem p;
  p.B = 1;
  p.T = 150;
  const Data d = make_data(p, 4);
  const std::vector<int64_t> cu = {0, 37, 37, 101, 150};  // includes an empty sequence
  const int64_t N = 4;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(44);
  Tensor h0 = at::randn({N, p.HV, p.K, p.V}, gen, at::kDouble);
  auto o = full_options(d);
  o.initial_state = h0;
  o.cu_seqlens = at::tensor(cu, at::kLong);
  auto [out, st] = kda_op(d.q, d.k, d.v, d.g, d.beta, o);
  for (int64_t n = 0; n < N; ++n) {
    auto sl = [&](const Tensor& t) { return t.slice(1, cu[n], cu[n + 1]); };
    auto on = o;
    on.cu_seqlens.reset();
    on.initial_state = h0.slice(0, n, n + 1);
    auto [ro, rs] = naive(sl(d.q), sl(d.k), sl(d.v), sl(d.g), sl(d.beta), 0.37, on);
    if (cu[n + 1] > cu[n]) EXPECT_LT(rel_err(sl(out), ro), 1e-12) << "sequence " << n;
    EXPECT_LT(rel_err(st.slice(0, n, n + 1), rs), 1e-12) << "sequence " << n;
  }
  // int32 offsets give the same result.
  o.cu_seqlens = at::tensor(cu, at::kLong).to(at::kInt);
  auto [out2, st2] = kda_op(d.q, d.k, d.v, d.g, d.beta, o);
  EXPECT_TRUE(at::equal(out, out2));
  EXPECT_TRUE(at::equal(st, st2));
}

TEST_P(Forms, EmptySequencePassesStateThrough) {
  Problem p;
  p.T = 0;
  const Data d = make_data(p, 5);
  const auto o = full_options(d);
  auto [out, st] = kda_op(d.q, d.k, d.v, d.g, d.beta, o);
  EXPECT_EQ(out.sizes(), at::IntArrayRef({p.B, 0, p.HV, p.V}));
  EXPECT_TRUE(at::equal(st, d.h0));
}

TEST_P(Forms, BackwardMatchesAutogradThroughNaiveLoop) {
  for (bool bounded : {false, true}) {
    Problem p;
    p.T = 70;  // crosses a checkpoint boundary (64)
    const Data d = make_data(p, 6);
    std::vector<Tensor> ins = {d.q, d.k, d.v, d.g, d.beta, d.h0, d.A_log, d.dt_bias};
    std::vector<Tensor> a, b;
    for (auto& t : ins) {
      a.push_back(t.clone().requires_grad_(true));
      b.push_back(t.clone().requires_grad_(true));
    }
    auto mk = [&](const std::vector<Tensor>& x) {
      kda::FusedRecurrentOptions o;
      o.scale = 0.37;
      o.use_qk_l2norm_in_kernel = true;
      o.use_gate_in_kernel = true;
      o.use_beta_sigmoid_in_kernel = true;
      o.allow_neg_eigval = bounded;
      if (bounded) o.lower_bound = -3.0;
      o.initial_state = x[5];
      o.A_log = x[6];
      o.dt_bias = x[7];
      return o;
    };
    auto gen = at::make_generator<at::CPUGeneratorImpl>(66);
    Tensor wo = at::randn({p.B, p.T, p.HV, p.V}, gen, at::kDouble);
    Tensor ws = at::randn({p.B, p.HV, p.K, p.V}, gen, at::kDouble);
    auto [o1, s1] = kda_op(a[0], a[1], a[2], a[3], a[4], mk(a));
    ((o1 * wo).sum() + (s1 * ws).sum()).backward();
    auto [o2, s2] = naive(b[0], b[1], b[2], b[3], b[4], 0.37, mk(b));
    ((o2 * wo).sum() + (s2 * ws).sum()).backward();
    const char* names[] = {"q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"};
    for (size_t i = 0; i < ins.size(); ++i) {
      ASSERT_TRUE(a[i].grad().defined()) << names[i];
      EXPECT_EQ(a[i].grad().sizes(), ins[i].sizes()) << names[i];
      EXPECT_LT(rel_err(a[i].grad(), b[i].grad()), 1e-10) << names[i] << " bounded=" << bounded;
    }
  }
}

TEST_P(Forms, SecondOrderGradientNamesReferenceBackend) {
  Problem p;
  p.T = 5;
  const Data d = make_data(p, 7);
  Tensor q = d.q.clone().requires_grad_(true);
  auto o = full_options(d);
  auto [out, st] = kda_op(q, d.k, d.v, d.g, d.beta, o);
  auto gq = torch::autograd::grad({out.sum()}, {q}, {}, true, true)[0];
  try {
    gq.sum().backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("backend=\"reference\""), std::string::npos) << e.what();
  }
}

TEST_P(Forms, BitwiseIdenticalForOneAndTwoThreads) {
  Problem p;
  p.B = 1;
  p.T = 130;
  p.HV = 2;
  p.H = 1;
  p.V = 100;
  p.dtype = at::kFloat;
  const Data d = make_data(p, 8);
  auto run = [&](int threads) {
    at::set_num_threads(threads);
    std::vector<Tensor> x = {d.q.clone().requires_grad_(true), d.k.clone().requires_grad_(true),
                             d.v.clone().requires_grad_(true), d.g.clone().requires_grad_(true)};
    auto o = full_options(d);
    auto [out, st] = kda_op(x[0], x[1], x[2], x[3], d.beta, o);
    (out.square().sum() + st.sum()).backward();
    return std::vector<Tensor>{out, st, x[0].grad(), x[1].grad(), x[2].grad(), x[3].grad()};
  };
  const int before = at::get_num_threads();
  auto a = run(1);
  auto b = run(2);
  at::set_num_threads(before);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "tensor " << i;
}

// Inside another parallel region at::parallel_for runs its tasks one after the other on the
// calling thread: the chunk forward's tasks (one per thread, handing work to each other), the
// recurrent forward's (its units beside the next token block's pre-processing; T spans three of
// its 4096-token blocks) and the recurrent backward's (a block's units beside the chain rule of
// the block after it and the pre-processing of the block before it; three blocks here too) must
// still finish, with the bits of a top-level call.
TEST_P(Forms, NestedInAParallelRegionMatchesTopLevel) {
  Problem p;
  p.B = 2;
  p.T = 2 * 4096 + 100;
  p.dtype = at::kFloat;
  const Data d = make_data(p, 10);
  const auto o = full_options(d);
  const Tensor w = at::randn({p.B, p.T, p.HV, p.V}, at::TensorOptions().dtype(p.dtype));
  // Output, final state and the gradients w.r.t. q, k, v, g.
  auto run = [&]() {
    std::vector<Tensor> x = {d.q.clone().requires_grad_(true), d.k.clone().requires_grad_(true),
                             d.v.clone().requires_grad_(true), d.g.clone().requires_grad_(true)};
    auto [out, st] = kda_op(x[0], x[1], x[2], x[3], d.beta, o);
    std::vector<Tensor> r = torch::autograd::grad({(out * w).sum() + st.sum()}, x);
    r.push_back(out.detach());
    r.push_back(st.detach());
    return r;
  };
  const int before = at::get_num_threads();
  at::set_num_threads(8);  // the recurrent backward overlaps its blocks' passes from 8 threads on
  const std::vector<Tensor> ref = run();
  std::vector<std::vector<Tensor>> nested(2);
  at::parallel_for(0, 2, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) nested[i] = run();
  });
  at::set_num_threads(before);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(nested[i].size(), ref.size());
    for (size_t j = 0; j < ref.size(); ++j) {
      EXPECT_TRUE(at::equal(nested[i][j], ref[j])) << "call " << i << ", tensor " << j;
    }
  }
}

TEST_P(Forms, NonContiguousInputsAreNotModified) {
  Problem p;
  const Data d = make_data(p, 9);
  const auto o = full_options(d);
  Tensor qt = d.q.transpose(1, 2).contiguous().transpose(1, 2);  // same values, other strides
  Tensor kc = d.k.clone();
  auto [out, st] = kda_op(qt, d.k, d.v, d.g, d.beta, o);
  auto [ref, rs] = kda_op(d.q, d.k, d.v, d.g, d.beta, o);
  EXPECT_TRUE(at::equal(out, ref));
  EXPECT_TRUE(at::equal(kc, d.k));
}

INSTANTIATE_TEST_SUITE_P(KDA, Forms,
                         ::testing::Values(Form{"fused_recurrent", &kda::fused_recurrent},
                                           Form{"chunk", &kda::chunk}),
                         [](const ::testing::TestParamInfo<Form>& i) { return i.param.name; });

// ---- bad calls: c10::Error with a message, never a crash --------------------------------------

class BadCalls : public ::testing::Test {
 protected:
  Problem p;
  Data d = make_data(p, 10);
  kda::FusedRecurrentOptions o = full_options(d);
  void expect_error(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                    const Tensor& beta, const kda::FusedRecurrentOptions& opts,
                    const std::string& needle, KdaFn fn = &kda::fused_recurrent) {
    try {
      fn(q, k, v, g, beta, opts);
      ADD_FAILURE() << "expected c10::Error containing '" << needle << "'";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
};

TEST_F(BadCalls, InconsistentSizes) {
  expect_error(d.q, d.k.slice(3, 0, 3), d.v, d.g, d.beta, o, "k must have shape");
  expect_error(d.q, d.k, d.v.slice(1, 0, 3), d.g, d.beta, o, "v must have shape");
  expect_error(d.q, d.k, d.v.slice(2, 0, 3), d.g.slice(2, 0, 3), d.beta.slice(2, 0, 3), o,
               "HV");
  expect_error(d.q, d.k, d.v, d.g.slice(3, 0, 2), d.beta, o, "g must have shape");
  expect_error(d.q, d.k, d.v, d.g, d.beta.unsqueeze(-1), o, "beta must have shape");
  expect_error(d.q.select(0, 0), d.k, d.v, d.g, d.beta, o, "q must be 4-D");
  auto o2 = o;
  o2.initial_state = d.h0.slice(2, 0, 2);
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, "initial_state must have shape");
  o2 = o;
  o2.dt_bias = d.dt_bias.slice(0, 0, 5);
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, "dt_bias");
  o2 = o;
  o2.A_log = d.A_log.slice(0, 0, 1);
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, "A_log");
}

TEST_F(BadCalls, BadCuSeqlens) {
  Problem p1;
  p1.B = 1;
  p1.T = 20;
  Data d1 = make_data(p1, 11);
  auto o1 = full_options(d1);
  o1.initial_state.reset();
  auto with = [&](std::vector<int64_t> cu) {
    auto x = o1;
    x.cu_seqlens = at::tensor(cu, at::kLong);
    return x;
  };
  expect_error(d1.q, d1.k, d1.v, d1.g, d1.beta, with({1, 5, 20}), "cu_seqlens[0] must be 0");
  expect_error(d1.q, d1.k, d1.v, d1.g, d1.beta, with({0, 12, 5, 20}), "non-decreasing");
  expect_error(d1.q, d1.k, d1.v, d1.g, d1.beta, with({0, 5, 19}), "must equal T");
  expect_error(d1.q, d1.k, d1.v, d1.g, d1.beta, with({0, 5, 21}), "must equal T");
  auto x = o1;
  x.cu_seqlens = at::tensor(std::vector<double>{0, 20});
  expect_error(d1.q, d1.k, d1.v, d1.g, d1.beta, x, "int64 or int32");
  x.cu_seqlens = at::zeros({2, 2}, at::kLong);
  expect_error(d1.q, d1.k, d1.v, d1.g, d1.beta, x, "1-D");
  auto ob = o;
  ob.initial_state.reset();
  ob.cu_seqlens = at::tensor(std::vector<int64_t>{0, p.T}, at::kLong);
  expect_error(d.q, d.k, d.v, d.g, d.beta, ob, "batch size must be 1");
  auto oh = with({0, 5, 20});
  oh.initial_state = at::zeros({3, p1.HV, p1.K, p1.V}, at::kDouble);  // N = 2
  expect_error(d1.q, d1.k, d1.v, d1.g, d1.beta, oh, "initial_state must have shape");
}

TEST_F(BadCalls, WrongDtypesAndFlags) {
  expect_error(d.q.to(at::kInt), d.k.to(at::kInt), d.v.to(at::kInt), d.g, d.beta, o,
               "q must be float64");
  expect_error(d.q, d.k.to(at::kFloat), d.v, d.g, d.beta, o, "k must have the dtype of q");
  expect_error(d.q, d.k, d.v.to(at::kFloat), d.g, d.beta, o, "v must have the dtype of q");
  expect_error(d.q, d.k, d.v, d.g.to(at::kLong), d.beta, o, "g must be a floating tensor");
  auto o2 = o;
  o2.A_log.reset();
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, "requires A_log");
  o2 = o;
  o2.lower_bound = 0.5;
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, "lower_bound must be a finite negative number");
  o2 = o;
  o2.use_beta_sigmoid_in_kernel = false;
  o2.allow_neg_eigval = true;
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, "allow_neg_eigval");
}

TEST_F(BadCalls, ChunkChecksArgumentsAndRejectsServingOptions) {
  expect_error(d.q, d.k.slice(3, 0, 3), d.v, d.g, d.beta, o, "k must have shape", &kda::chunk);
  expect_error(d.q.select(0, 0), d.k, d.v, d.g, d.beta, o, "kda::chunk: q must be 4-D",
               &kda::chunk);
  const std::string serving = "not supported by the chunkwise form";
  auto o2 = o;
  o2.out = at::empty_like(d.v);
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, serving, &kda::chunk);
  o2 = o;
  o2.inplace_final_state = true;
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, serving, &kda::chunk);
  o2 = o;
  o2.ssm_state_indices = at::arange(p.B, at::kLong);
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, serving, &kda::chunk);
  o2 = o;
  o2.num_accepted_tokens = at::ones({p.B}, at::kLong);
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, serving, &kda::chunk);
  expect_error(d.q, d.k, d.v, d.g, d.beta.unsqueeze(-1).expand({p.B, p.T, p.HV, p.V}), o,
               serving, &kda::chunk);
  o2 = o;
  o2.pad_slot_id = 0;
  expect_error(d.q, d.k, d.v, d.g, d.beta, o2, "pad_slot_id", &kda::chunk);
}

}  // namespace
