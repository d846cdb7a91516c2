// Every input the C++ entry points reject, one test per row of docs/bad_inputs.md that
// tests/cpp/test_kda.cpp (BadCalls) does not already cover, plus valid edge shapes (T = 0, empty and
// length-1 sequences, K or V = 1, odd sizes, non-contiguous inputs) run forward and backward so
// that `make test-sanitize` (AddressSanitizer + UBSan) sees every indexing path.
//
// The entry points: the public API kda::fused_recurrent (kda/kda.h) and the registered ops
// kda::fused_recurrent_fwd / kda::fused_recurrent_bwd called through the dispatcher, as
// AOTAutograd or a C++ user holding an OperatorHandle would call them.
#include <kda/kda.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptT = std::optional<Tensor>;

struct Shapes {
  int64_t B = 2, T = 9, H = 2, HV = 4, K = 5, V = 3;
  at::ScalarType dtype = at::kFloat;
};

struct Inputs {
  Shapes s;
  Tensor q, k, v, g, beta, A_log, dt_bias, h0;
  kda::FusedRecurrentOptions opts;  // gate, norm and sigmoid in the op, with an initial state
};

Inputs make_inputs(const Shapes& s, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(s.dtype);
  auto r = [&](at::IntArrayRef shape) { return at::randn(shape, gen, o); };
  Inputs in;
  in.s = s;
  in.q = r({s.B, s.T, s.H, s.K});
  in.k = r({s.B, s.T, s.H, s.K});
  in.v = r({s.B, s.T, s.HV, s.V});
  in.g = r({s.B, s.T, s.HV, s.K});
  in.beta = r({s.B, s.T, s.HV});
  in.A_log = at::randn({s.HV}, gen, at::kFloat) * 0.5;
  in.dt_bias = at::randn({s.HV * s.K}, gen, at::kFloat) * 0.5;
  in.h0 = at::randn({s.B, s.HV, s.K, s.V}, gen, at::kFloat) * 0.5;
  in.opts.use_qk_l2norm_in_kernel = true;
  in.opts.use_gate_in_kernel = true;
  in.opts.use_beta_sigmoid_in_kernel = true;
  in.opts.A_log = in.A_log;
  in.opts.dt_bias = in.dt_bias;
  in.opts.initial_state = in.h0;
  return in;
}

// Runs fn, which must throw c10::Error whose message contains every needle.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected a c10::Error containing '" << needles.front() << "'";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << n << " | " << msg;
  }
}

void call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
          const kda::FusedRecurrentOptions& o) {
  kda::fused_recurrent(q, k, v, g, beta, o);
}

// ---- the public API: one test per rejected input ---------------------------------------------

class BadInput : public ::testing::Test {
 protected:
  Inputs x = make_inputs(Shapes{}, 101);
  void expect(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
              const Tensor& beta, const kda::FusedRecurrentOptions& o,
              const std::vector<std::string>& needles) {
    expect_error([&] { call(q, k, v, g, beta, o); }, needles);
  }
};

TEST_F(BadInput, UndefinedQ) {
  expect(Tensor(), x.k, x.v, x.g, x.beta, x.opts, {"q must be a defined tensor"});
}

TEST_F(BadInput, UndefinedK) {
  expect(x.q, Tensor(), x.v, x.g, x.beta, x.opts, {"must be defined tensors"});
  expect(x.q, x.k, x.v, x.g, Tensor(), x.opts, {"must be defined tensors"});
}

TEST_F(BadInput, ZeroHeads) {
  auto q = x.q.slice(2, 0, 0), k = x.k.slice(2, 0, 0);
  expect(q, k, x.v, x.g, x.beta, x.opts, {"at least one head", "H = 0"});
}

TEST_F(BadInput, ZeroKeyDim) {
  auto o = x.opts;
  o.scale = 1.0;  // the default K ** -0.5 is undefined for K = 0
  auto q = x.q.slice(3, 0, 0), k = x.k.slice(3, 0, 0);
  expect(q, k, x.v, x.g.slice(3, 0, 0), x.beta, o, {"K = q.size(3) must be > 0", "got 0"});
}

TEST_F(BadInput, ZeroValueDim) {
  expect(x.q, x.k, x.v.slice(3, 0, 0), x.g, x.beta, x.opts, {"V = v.size(3) must be > 0"});
}

TEST_F(BadInput, ZeroValueHeads) {
  expect(x.q, x.k, x.v.slice(2, 0, 0), x.g.slice(2, 0, 0), x.beta.slice(2, 0, 0), x.opts,
         {"HV = v.size(2)", "got HV = 0"});
}

TEST_F(BadInput, VNot4D) {
  expect(x.q, x.k, x.v.select(2, 0), x.g, x.beta, x.opts, {"v must be 4-D"});
}

TEST_F(BadInput, VBatchMismatch) {
  expect(x.q, x.k, x.v.slice(0, 0, 1), x.g, x.beta, x.opts, {"v must have shape", "B = 2"});
}

TEST_F(BadInput, BetaIntegerDtype) {
  expect(x.q, x.k, x.v, x.g, x.beta.to(at::kInt), x.opts, {"beta must be a floating tensor"});
}

TEST_F(BadInput, ALogIntegerDtype) {
  auto o = x.opts;
  o.A_log = x.A_log.to(at::kLong);
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"A_log must be a floating tensor"});
}

TEST_F(BadInput, ALog2D) {
  auto o = x.opts;
  o.A_log = x.A_log.reshape({2, 2});
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"A_log must have shape [HV]"});
}

TEST_F(BadInput, DtBiasIntegerDtype) {
  auto o = x.opts;
  o.dt_bias = x.dt_bias.to(at::kInt);
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"dt_bias must be a floating tensor"});
}

TEST_F(BadInput, DtBiasWrong2DShape) {
  auto o = x.opts;
  o.dt_bias = at::randn({x.s.HV, x.s.K + 1});
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"dt_bias must have shape", "[HV, K]"});
}

TEST_F(BadInput, InitialStateIntegerDtype) {
  auto o = x.opts;
  o.initial_state = x.h0.to(at::kInt);
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"initial_state must be a floating tensor"});
}

TEST_F(BadInput, InitialStateWrongLayoutForStateVFirst) {
  auto o = x.opts;
  o.state_v_first = true;  // expects [N, HV, V, K]; h0 is [N, HV, K, V] with K != V
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"initial_state must have shape", "state_v_first"});
}

TEST_F(BadInput, InitialStateWrongBatch) {
  auto o = x.opts;
  o.initial_state = x.h0.slice(0, 0, 1);
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"initial_state must have shape", "[N, HV, K, V]"});
}

TEST_F(BadInput, LowerBoundZeroOrNaN) {
  auto o = x.opts;
  o.lower_bound = 0.0;
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"lower_bound must be a finite negative number", "got 0"});
  o.lower_bound = std::numeric_limits<double>::quiet_NaN();
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"lower_bound must be a finite negative number"});
  o.lower_bound = -std::numeric_limits<double>::infinity();
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"lower_bound must be a finite negative number", "inf"});
}

TEST_F(BadInput, NonFiniteScale) {
  auto o = x.opts;
  o.scale = std::numeric_limits<double>::quiet_NaN();
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"scale must be finite", "nan"});
  o.scale = std::numeric_limits<double>::infinity();
  expect(x.q, x.k, x.v, x.g, x.beta, o, {"scale must be finite", "inf"});
}

// Values outside the domain (docs/bad_inputs.md "Values outside the domain"), found by the
// pre-processing pass: named with the value and its place [b, t, hv(, k)].
TEST_F(BadInput, PositiveLogDecayWithoutGateInKernel) {
  auto o = x.opts;
  o.use_gate_in_kernel = false;
  o.A_log.reset();
  o.dt_bias.reset();
  Tensor g = -at::softplus(x.g);
  g[1][7][3][4] = 0.5;  // token 7 of batch row 1, value head 3, channel 4
  expect(x.q, x.k, x.v, g, x.beta, o,
         {"g must be a log-decay <= 0", "g[1, 7, 3, 4] = 0.5", "use_gate_in_kernel=True"});
  // NaN is not out of the domain: it propagates (policy), no error
  g[1][7][3][4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NO_THROW(call(x.q, x.k, x.v, g, x.beta, o));
}

TEST_F(BadInput, PrecomputedBetaOutsideZeroTwo) {
  auto o = x.opts;
  o.use_beta_sigmoid_in_kernel = false;
  Tensor beta = at::sigmoid(x.beta);
  beta[0][2][1] = 3.0;
  expect(x.q, x.k, x.v, x.g, beta, o,
         {"beta must lie in [0, 2]", "beta[0, 2, 1] = 3", "use_beta_sigmoid_in_kernel=True"});
  beta[0][2][1] = 2.0;  // the range's end (negative eigenvalue -1) is valid
  EXPECT_NO_THROW(call(x.q, x.k, x.v, x.g, beta, o));
}

// TORCH_CHECK_VALUE / TORCH_CHECK_TYPE: Python sees ValueError / TypeError, as from the Python
// checks; both are c10::Error, so C++ callers catching c10::Error are unaffected.
TEST_F(BadInput, ValueAndTypeErrorsHaveTheirTypes) {
  EXPECT_THROW(call(x.q, x.k.slice(3, 0, 2), x.v, x.g, x.beta, x.opts), c10::ValueError);
  EXPECT_THROW(call(x.q, x.k, x.v, x.g.to(at::kLong), x.beta, x.opts), c10::TypeError);
}

TEST_F(BadInput, GateParametersWithoutGateInKernel) {
  auto o = x.opts;
  o.use_gate_in_kernel = false;  // A_log and dt_bias still set: they would be silently ignored
  expect(x.q, x.k, x.v, x.g, x.beta, o,
         {"A_log and dt_bias are only used with use_gate_in_kernel=True"});
}

TEST_F(BadInput, BoundedGateWithoutALogIsAccepted) {  // the contrast: not an error
  auto o = x.opts;
  o.A_log.reset();
  o.lower_bound = -2.0;
  auto [out, st] = kda::fused_recurrent(x.q, x.k, x.v, x.g, x.beta, o);
  EXPECT_TRUE(at::isfinite(out).all().item<bool>());
  EXPECT_EQ(st.sizes(), x.h0.sizes());
}

// ---- cu_seqlens --------------------------------------------------------------------------------

class BadCuSeqlens : public ::testing::Test {
 protected:
  Inputs x = [] {
    Shapes s;
    s.B = 1;
    s.T = 20;
    auto in = make_inputs(s, 202);
    in.opts.initial_state.reset();
    return in;
  }();
  void expect_cu(const Tensor& cu, const std::vector<std::string>& needles) {
    auto o = x.opts;
    o.cu_seqlens = cu;
    expect_error([&] { call(x.q, x.k, x.v, x.g, x.beta, o); }, needles);
  }
  static Tensor i64(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }
};

TEST_F(BadCuSeqlens, Empty) { expect_cu(at::empty({0}, at::kLong), {"cu_seqlens must be 1-D"}); }

TEST_F(BadCuSeqlens, NoSequencesButTokens) {
  expect_cu(i64({0}), {"cu_seqlens[-1] must equal T = 20", "got 0"});
}

TEST_F(BadCuSeqlens, NegativeOffset) { expect_cu(i64({0, -5, 20}), {"non-decreasing"}); }

TEST_F(BadCuSeqlens, HugeOffsetOutOfRange) {
  expect_cu(i64({0, int64_t(1) << 40, 20}), {"non-decreasing"});
  expect_cu(i64({0, 20, int64_t(1) << 40}), {"must equal T"});
}

TEST_F(BadCuSeqlens, Int32Decreasing) {
  expect_cu(i64({0, 12, 5, 20}).to(at::kInt), {"non-decreasing", "cu_seqlens[1] = 12"});
}

TEST_F(BadCuSeqlens, NonContiguousViewIsReadByValue) {
  // every other element of {0, 99, 7, -1, 20}: the view {0, 7, 20} is valid...
  Tensor base = i64({0, 99, 7, -1, 20});
  auto o = x.opts;
  o.cu_seqlens = base.slice(0, 0, 5, 2);
  ASSERT_FALSE(o.cu_seqlens->is_contiguous());
  auto [out, st] = kda::fused_recurrent(x.q, x.k, x.v, x.g, x.beta, o);
  EXPECT_EQ(st.size(0), 2);
  EXPECT_TRUE(at::isfinite(out).all().item<bool>());
  // ...and the view {99, -1} of the odd elements is not.
  expect_cu(base.slice(0, 1, 5, 2), {"cu_seqlens[0] must be 0", "got 99"});
}

TEST_F(BadInput, ServingCallsCheckVBeforeSizingTheirOutputs) {
  // A serving call (here out= with an initial state) sizes o and the final state from v before
  // the op runs: an undefined v raises the op's TypeError, a 3-D one its ValueError.
  auto o = x.opts;
  o.out = at::empty_like(x.v);
  expect_error([&] { call(x.q, x.k, Tensor(), x.g, x.beta, o); },
               {"kda::fused_recurrent: ", "q, k, v, g and beta must be defined tensors"});
  try {
    call(x.q, x.k, Tensor(), x.g, x.beta, o);
  } catch (const c10::TypeError&) {
  } catch (...) {
    ADD_FAILURE() << "an undefined v must raise c10::TypeError";
  }
  expect_error([&] { call(x.q, x.k, x.v.select(2, 0), x.g, x.beta, o); },
               {"kda::fused_recurrent: ", "v must be 4-D [B, T, HV, V], got shape"});
}

TEST_F(BadCuSeqlens, ServingCallsCheckItBeforeSizingTheirFinalState) {
  // A serving call that is not in place sizes its final state [N, ...] from cu_seqlens before
  // the op runs: a cu_seqlens without offsets must still get the op's message, not ATen's.
  auto o = x.opts;
  o.out = at::empty_like(x.v);
  for (const Tensor& cu : {at::empty({0}, at::kLong), at::scalar_tensor(20, at::kLong)}) {
    o.cu_seqlens = cu;
    expect_error([&] { call(x.q, x.k, x.v, x.g, x.beta, o); },
                 {"kda::fused_recurrent_serving: ", "cu_seqlens must be 1-D"});
  }
}

TEST_F(BadCuSeqlens, InitialStateCountMismatch) {
  auto o = x.opts;
  o.cu_seqlens = i64({0, 3, 3, 20});  // N = 3
  o.initial_state = at::randn({2, x.s.HV, x.s.K, x.s.V});
  expect_error([&] { call(x.q, x.k, x.v, x.g, x.beta, o); },
               {"initial_state must have shape", "[3, 4, 5, 3]"});
}

// ---- mixed devices: the Meta kernel must not hand back uninitialised CPU memory ---------------
// A meta tensor among CPU tensors makes the dispatcher pick the Meta kernel (Meta has the higher
// dispatch priority); the op must still reject the device mismatch instead of returning an
// uninitialised CPU tensor (as fwd_meta did before 3b6d11c).

TEST_F(BadInput, KOnOtherDevice) {
  expect(x.q, x.k.to(at::kMeta), x.v, x.g, x.beta, x.opts, {"k must be on the device of q"});
}

TEST_F(BadCuSeqlens, OnOtherDevice) {
  expect_cu(i64({0, 5, 20}).to(at::kMeta), {"cu_seqlens"});
}

// ---- the registered ops called through the dispatcher (fwd / bwd) ----------------------------

using FwdSig = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, const OptT&,
    bool, bool, bool, bool, std::optional<double>, bool, const OptT&, const OptT&, const OptT&);
using Grads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using BwdSig = Grads(const Tensor&, const OptT&, const Tensor&, const Tensor&, const Tensor&,
                     const Tensor&, const Tensor&, const Tensor&, double, const OptT&, bool, bool,
                     bool, bool, std::optional<double>, bool, const OptT&, const OptT&,
                     const OptT&);

class BadOpCalls : public ::testing::Test {
 protected:
  Inputs x = [] {
    Shapes s;
    s.T = 70;  // two checkpoint slots per sequence
    return make_inputs(s, 303);
  }();
  c10::TypedOperatorHandle<FwdSig> fwd_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kda::fused_recurrent_fwd", "").typed<FwdSig>();
  c10::TypedOperatorHandle<BwdSig> bwd_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kda::fused_recurrent_bwd", "").typed<BwdSig>();

  std::tuple<Tensor, Tensor, Tensor> fwd() {
    return fwd_op.call(x.q, x.k, x.v, x.g, x.beta, 0.4, x.h0, true, true, true, false,
                       std::nullopt, false, std::nullopt, x.A_log, x.dt_bias);
  }
  Grads bwd(const Tensor& d_o, const OptT& d_ht, const Tensor& ckpt) {
    return bwd_op.call(d_o, d_ht, ckpt, x.q, x.k, x.v, x.g, x.beta, 0.4, x.h0, true, true, true,
                       false, std::nullopt, false, std::nullopt, x.A_log, x.dt_bias);
  }
};

// The rows below unpack fwd() with std::tie, not a structured binding: C++17 lambdas cannot capture
// a structured binding (GCC allows it, Clang does not).
TEST_F(BadOpCalls, ValidCallRuns) {  // the baseline of the rows below
  Tensor o, ht, ck;
  std::tie(o, ht, ck) = fwd();
  EXPECT_EQ(ck.sizes(), at::IntArrayRef({x.s.B * 2, x.s.HV, x.s.K, x.s.V}));
  auto r = bwd(at::randn_like(o), at::randn_like(ht), ck);
  EXPECT_EQ(std::get<0>(r).sizes(), x.q.sizes());
  EXPECT_TRUE(at::isfinite(std::get<3>(r)).all().item<bool>());
}

TEST_F(BadOpCalls, FwdOpChecksToo) {
  expect_error([&] {
    fwd_op.call(x.q, x.k, x.v.slice(3, 0, 2), x.g, x.beta.slice(1, 0, 3), 0.4, x.h0, true, true,
                true, false, std::nullopt, false, std::nullopt, x.A_log, x.dt_bias);
  }, {"beta must have shape"});
}

TEST_F(BadOpCalls, GradOutputWrongShape) {
  Tensor o, ht, ck;
  std::tie(o, ht, ck) = fwd();
  expect_error([&] { bwd(o.slice(1, 0, 5), ht, ck); }, {"grad_o must have shape"});
}

TEST_F(BadOpCalls, GradOutputIntegerDtype) {
  Tensor o, ht, ck;
  std::tie(o, ht, ck) = fwd();
  expect_error([&] { bwd(o.to(at::kInt), ht, ck); }, {"grad_o must be a floating tensor"});
}

TEST_F(BadOpCalls, GradFinalStateWrongShape) {
  Tensor o, ht, ck;
  std::tie(o, ht, ck) = fwd();
  expect_error([&] { bwd(o, ht.transpose(-1, -2), ck); }, {"grad_final_state must have shape"});
}

TEST_F(BadOpCalls, GradFinalStateIntegerDtype) {
  Tensor o, ht, ck;
  std::tie(o, ht, ck) = fwd();
  expect_error([&] { bwd(o, ht.to(at::kLong), ck); },
               {"grad_final_state must be a floating tensor"});
}

TEST_F(BadOpCalls, CheckpointsWrongShape) {
  Tensor o, ht, ck;
  std::tie(o, ht, ck) = fwd();
  expect_error([&] { bwd(o, ht, ck.slice(0, 0, 1)); }, {"checkpoints must have shape"});
  expect_error([&] { bwd(o, ht, at::empty({0})); }, {"checkpoints must have shape"});
}

TEST_F(BadOpCalls, CheckpointsIntegerDtype) {
  Tensor o, ht, ck;
  std::tie(o, ht, ck) = fwd();
  expect_error([&] { bwd(o, ht, ck.to(at::kInt)); }, {"checkpoints must be a floating tensor"});
}

// ---- valid edge shapes, forward and backward (for the sanitizers: every index path) ----------

struct Edge {
  const char* name;
  Shapes s;
  std::vector<int64_t> cu;  // empty: no cu_seqlens
  bool state_v_first;
};

void run_edge(const Edge& e, bool lower_bound) {
  SCOPED_TRACE(e.name);
  Inputs x = make_inputs(e.s, 404);
  const int64_t N = e.cu.empty() ? e.s.B : static_cast<int64_t>(e.cu.size()) - 1;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(405);
  Tensor h0 = e.state_v_first ? at::randn({N, e.s.HV, e.s.V, e.s.K}, gen, at::kFloat)
                              : at::randn({N, e.s.HV, e.s.K, e.s.V}, gen, at::kFloat);
  std::vector<Tensor> leaves = {x.q, x.k, x.v, x.g, x.beta, h0, x.A_log, x.dt_bias};
  for (auto& t : leaves) t = t.detach().clone().requires_grad_(true);
  kda::FusedRecurrentOptions o = x.opts;
  o.initial_state = leaves[5];
  o.A_log = leaves[6];
  o.dt_bias = leaves[7];
  o.state_v_first = e.state_v_first;
  if (lower_bound) {
    o.lower_bound = -5.0;
    o.allow_neg_eigval = true;
  }
  if (!e.cu.empty()) o.cu_seqlens = at::tensor(e.cu, at::kLong);
  // non-contiguous q: same values, other strides
  Tensor q = leaves[0].transpose(1, 2).contiguous().transpose(1, 2);
  auto [out, st] = kda::fused_recurrent(q, leaves[1], leaves[2], leaves[3], leaves[4], o);
  ASSERT_EQ(out.sizes(), at::IntArrayRef({e.s.B, e.s.T, e.s.HV, e.s.V}));
  ASSERT_EQ(st.sizes(), h0.sizes());
  EXPECT_TRUE(at::isfinite(out).all().item<bool>());
  EXPECT_TRUE(at::isfinite(st).all().item<bool>());
  // empty sequences pass their initial state through unchanged
  for (int64_t n = 0; n + 1 < static_cast<int64_t>(e.cu.size()); ++n) {
    if (e.cu[n] == e.cu[n + 1]) EXPECT_TRUE(at::equal(st[n], h0[n])) << "sequence " << n;
  }
  if (e.s.T == 0 && e.cu.empty()) EXPECT_TRUE(at::equal(st, h0));
  Tensor wo = at::randn(out.sizes(), gen, at::kFloat);
  Tensor ws = at::randn(st.sizes(), gen, at::kFloat);
  ((out.to(at::kFloat) * wo).sum() + (st * ws).sum()).backward();
  for (size_t i = 0; i < leaves.size(); ++i) {
    ASSERT_TRUE(leaves[i].grad().defined()) << i;
    EXPECT_EQ(leaves[i].grad().sizes(), leaves[i].sizes()) << i;
    EXPECT_TRUE(at::isfinite(leaves[i].grad()).all().item<bool>()) << i;
  }
}

Shapes shp(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
           at::ScalarType dt = at::kFloat) {
  Shapes s;
  s.B = B, s.T = T, s.H = H, s.HV = HV, s.K = K, s.V = V, s.dtype = dt;
  return s;
}

TEST(EdgeShapes, ForwardAndBackwardRunCleanly) {
  const std::vector<Edge> edges = {
      {"T=0", shp(2, 0, 1, 2, 5, 3), {}, false},
      {"T=1 K=1 V=1", shp(1, 1, 1, 1, 1, 1), {}, false},
      {"odd sizes GVA x3", shp(2, 67, 1, 3, 33, 37), {}, true},
      {"K=160 V=160", shp(1, 65, 1, 1, 160, 160), {}, false},
      {"varlen empty and length-1", shp(1, 70, 2, 4, 7, 65), {0, 0, 1, 1, 64, 70, 70}, false},
      {"varlen N=0 T=0", shp(1, 0, 1, 1, 4, 4), {0}, false},
      {"varlen all empty", shp(1, 0, 1, 2, 3, 5), {0, 0, 0}, true},
      {"bf16", shp(2, 33, 2, 2, 17, 40, at::kBFloat16), {}, false},
      {"fp16 varlen", shp(1, 40, 1, 2, 8, 9, at::kHalf), {0, 1, 39, 40}, true},
      {"fp64", shp(1, 130, 1, 1, 9, 70, at::kDouble), {}, false},
  };
  for (const auto& e : edges) {
    run_edge(e, false);
    run_edge(e, true);
  }
}

}  // namespace
