// The serving op: a state pool addressed by slot indices (docs/serving.md). The checks that turn
// a call into a ServingPlan (nothing is written before they all pass), its CPU, Meta and Autograd
// kernels, kda::_fused_recurrent_serving_fast (the functional API's serving call from Python in
// one call) and their registration. The kernels are csrc/cpu/serving.cpp's.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/SmallVector.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu/output_cache.h"
#include "cpu/serving.h"
#include "op_checks.h"

namespace kda {
namespace detail {
namespace {

constexpr const char* kSrv = "kda::fused_recurrent_serving: ";

std::optional<at::Tensor> defined_or_none(const std::optional<at::Tensor>& t) {
  return (t && t->defined()) ? t : std::nullopt;
}

// Whether two elements of t may share memory (a stride 0, or slots that overlap). Sufficient test
// for separate elements: sorted by stride, each stride exceeds the largest offset the smaller ones
// reach; every view made by slicing, permuting and (non-zero) striding a fresh tensor passes it.
bool may_self_overlap(const at::Tensor& t) {
  c10::SmallVector<std::pair<int64_t, int64_t>, 8> dims;  // (stride, size)
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += (size - 1) * stride;
  }
  return false;
}

// The byte range [first, end) spanned by t's elements; empty ({0, 0}) when t has none.
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t last = 0;
  for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

// The tensors a serving call writes or reads (NamedTensor, op_checks.h): pointers, not copies,
// as these lists are built at every call, decode's included (a list of (std::string, Tensor)
// pairs took 15% of a one-token call from C++; docs/benchmarks.md "Short calls").
using NamedTensors = c10::SmallVector<NamedTensor, 16>;

// PyTorch refuses to bump the version of an inference tensor outside inference mode, which a
// serving call does after writing: refused here instead, before anything is written (the rule
// and the words of torch_kda._checks.check_serving_inputs).
bool check_writable(const NamedTensors& written, bool probe) {
  for (const auto& [name, t] : written) {
    KDA_RULE(VALUE, !t->is_inference() || c10::InferenceMode::is_enabled(), kSrv, name,
             " was made under inference mode and is written in place here, outside it; call "
             "under torch.inference_mode() / c10::InferenceMode, or make ", name,
             " outside inference mode");
  }
  return true;
}

// Memory a serving call writes in place (out, the pool with inplace_final_state, a caller's
// final_state) must not alias itself, another output or an input: the kernels write while other
// threads still read (out = q returned wrong values; an expanded pool wrote two sequences' states
// into one place). The rule and the words of torch_kda._checks.check_no_aliasing.
bool check_no_aliasing(const NamedTensors& written, const NamedTensors& read, bool probe) {
  for (const auto& [name, t] : written) {
    if (!may_self_overlap(*t)) continue;
    if (probe) return false;
    const std::string layout = "(shape " + shape_str(t->sizes()) + ", strides " +
                               shape_str(t->strides()) + "; an expanded tensor?)";
    if (std::strcmp(name, "initial_state") == 0) {
      KDA_CHECK_VALUE(false, kSrv, "the slots of the state pool (initial_state) overlap in memory ",
                        layout, ", so two slot indices could name one state that "
                        "inplace_final_state=True writes; pass a pool whose slots are separate "
                        "(e.g. initial_state.contiguous())");
    }
    KDA_CHECK_VALUE(false, kSrv, name, " has elements that share memory ", layout,
                      ", and it is written in place; pass a tensor of separate elements (e.g. "
                      "torch.empty)");
  }
  NamedTensors all(written);
  all.append(read.begin(), read.end());
  c10::SmallVector<std::pair<uintptr_t, uintptr_t>, 16> spans;
  for (const auto& named : all) spans.push_back(byte_span(*named.tensor));
  for (size_t i = 0; i < written.size(); ++i) {
    for (size_t j = i + 1; j < all.size(); ++j) {
      const bool disjoint = spans[i].first >= spans[i].second ||
                            spans[j].first >= spans[j].second ||
                            spans[i].first >= spans[j].second || spans[j].first >= spans[i].second;
      KDA_RULE(VALUE, disjoint, kSrv, all[i].name, " shares memory with ", all[j].name,
               ": it is written in place while the call reads ", all[j].name,
               ", which would corrupt the result; pass a separate tensor as ", all[i].name);
    }
  }
  return true;
}

// Every check of a serving call, and the plan it resolves to (raising, or probing: see KDA_RULE).
// Nothing is written before this returns, so a rejected call leaves the pool (and out) untouched.
// An undefined `out` (probing only: kda::_fused_recurrent_serving_fast allocates it afterwards)
// is skipped, as an undefined final_state is.
bool check_serving(KDA_SERVING_ARGS, bool probe, Inputs& in, Config& cfg, Dims& d,
                   ServingPlan& plan) {
  const auto pool = defined_or_none(initial_state);
  const auto idx = defined_or_none(ssm_state_indices);
  const auto nat = defined_or_none(num_accepted_tokens);
  const auto fresh = defined_or_none(final_state);
  KDA_RULE(TYPE, beta.defined(), kSrv, "beta must be a defined tensor");
  KDA_RULE(TYPE, out.defined() || probe, kSrv, "out must be a defined tensor");
  const bool headwise = beta.dim() == 4;
  KDA_RULE(VALUE, !headwise || beta.size(3) > 0, kSrv, "head-wise beta [B, T, HV, V] needs V = "
           "v.shape[3] > 0 columns, got shape ", shape_str(beta.sizes()));
  // The plain checks, with the pool and a head-wise beta replaced by what they check.
  in = make_inputs(q, k, v, g, headwise ? beta.select(3, 0) : beta, idx ? std::nullopt : pool,
                   cu_seqlens, A_log, dt_bias);
  cfg = make_config(kSrv, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first);
  if (probe) {
    if (!q.is_cpu() || any_tangent(in) ||
        !check_inputs(in, cfg, /*check_values=*/true, /*probe=*/true, d)) {
      return false;
    }
  } else {
    check_cpu(kSrv, in);
    d = check_inputs(in, cfg, /*check_values=*/true);
  }
  in.beta = beta;
  in.initial_state = pool;
  if (headwise &&
      !check_shape(kSrv, beta, "beta", {d.B, d.T, d.HV, d.V}, "[B, T, HV, V] (head-wise)", probe)) {
    return false;
  }
  const auto ct = compute_dtype(q);
  const std::vector<int64_t> per_slot = state_v_first ? std::vector<int64_t>{d.HV, d.V, d.K}
                                                      : std::vector<int64_t>{d.HV, d.K, d.V};
  const char* layout = state_v_first ? "[num_slots, HV, V, K] (state_v_first)" : "[num_slots, HV, K, V]";
  int64_t num_slots = 0;
  if (idx || inplace_final_state) {
    KDA_RULE(VALUE, pool.has_value(), kSrv, idx ? "ssm_state_indices" : "inplace_final_state=True",
             " needs the state pool as initial_state ", layout, ", got None");
    const auto& p = *pool;
    if (!check_device(kSrv, p, "initial_state", q, probe)) return false;
    KDA_RULE(VALUE, p.dim() == 4 && p.size(1) == per_slot[0] && p.size(2) == per_slot[1] &&
                        p.size(3) == per_slot[2],
             kSrv, "initial_state (the state pool) must have shape ", layout,
             " with [HV, ., .] = ", shape_str(per_slot), ", got ", shape_str(p.sizes()));
    KDA_RULE(TYPE, p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16 ||
                       (p.scalar_type() == at::kDouble && ct == at::kDouble),
             kSrv, "the state pool (initial_state) must be float32 or bfloat16 (or float64 "
             "with float64 inputs), got ", p.scalar_type());
    num_slots = p.size(0);
  }
  if (inplace_final_state) {
    const auto& p = *pool;
    KDA_RULE(VALUE, p.stride(3) == 1 && p.stride(2) == p.size(3) &&
                        p.stride(1) == p.size(2) * p.size(3),
             kSrv, "inplace_final_state=True needs each slot of the pool contiguous, got "
             "strides ", shape_str(p.strides()));
    KDA_RULE(VALUE, !fresh, kSrv, "final_state must be None with inplace_final_state=True "
             "(the pool receives the states)");
  }
  if (out.defined()) {
    if (!check_device(kSrv, out, "out", q, probe) ||
        !check_shape(kSrv, out, "out", {d.B, d.T, d.HV, d.V}, "[B, T, HV, V]", probe)) {
      return false;
    }
    KDA_RULE(TYPE, out.scalar_type() == q.scalar_type(), kSrv, "out must have the dtype of q (",
             q.scalar_type(), "), got ", out.scalar_type());
  }
  if (fresh) {
    if (!check_device(kSrv, *fresh, "final_state", q, probe)) return false;
    const bool shape_ok =
        state_v_first
            ? check_shape(kSrv, *fresh, "final_state", {d.N, d.HV, d.V, d.K}, "[N, HV, V, K]", probe)
            : check_shape(kSrv, *fresh, "final_state", {d.N, d.HV, d.K, d.V}, "[N, HV, K, V]", probe);
    if (!shape_ok) return false;
    KDA_RULE(TYPE, fresh->scalar_type() == ct && fresh->is_contiguous(), kSrv,
             "final_state must be a contiguous ", ct, " tensor, got a ",
             fresh->is_contiguous() ? "contiguous " : "non-contiguous ", fresh->scalar_type(),
             " tensor");
  }

  {
    NamedTensors written;
    if (out.defined()) written.push_back({"out", &out});
    if (inplace_final_state) written.push_back({"initial_state", &*pool});
    if (fresh) written.push_back({"final_state", &*fresh});
    NamedTensors read{{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}};
    const NamedTensor optional_reads[] = {
        {"initial_state", inplace_final_state ? nullptr : defined_ptr(pool)},
        {"A_log", defined_ptr(A_log)}, {"dt_bias", defined_ptr(dt_bias)},
        {"cu_seqlens", defined_ptr(cu_seqlens)}, {"ssm_state_indices", defined_ptr(idx)},
        {"num_accepted_tokens", defined_ptr(nat)}};
    for (const NamedTensor& t : optional_reads) {
      if (t.tensor != nullptr) read.push_back(t);
    }
    if (!check_writable(written, probe) || !check_no_aliasing(written, read, probe)) return false;
  }

  plan = ServingPlan();
  const Sequences seqs = make_sequences(in, d);
  plan.seq_start = seqs.start;
  plan.seq_end = seqs.end;
  plan.src_row.assign(d.N, -1);
  plan.dst_row.assign(d.N, -1);
  plan.pad.assign(d.N, 0);
  std::vector<int64_t> accepted;
  if (nat) {
    KDA_RULE(VALUE, idx && idx->dim() == 2, kSrv, "num_accepted_tokens (speculative decoding) "
             "needs 2-D ssm_state_indices [N, T_max]");
    KDA_RULE(TYPE, nat->scalar_type() == at::kLong || nat->scalar_type() == at::kInt, kSrv,
             "num_accepted_tokens must be int64 or int32, got ", nat->scalar_type());
    if (!check_device(kSrv, *nat, "num_accepted_tokens", q, probe) ||
        !check_shape(kSrv, *nat, "num_accepted_tokens", {d.N}, "[N]", probe)) {
      return false;
    }
    const auto a = nat->to(at::kLong).contiguous();
    accepted.assign(a.data_ptr<int64_t>(), a.data_ptr<int64_t>() + d.N);
  }
  if (!idx) {
    for (int64_t n = 0; n < d.N; ++n) {
      plan.src_row[n] = pool ? n : -1;
      plan.dst_row[n] = inplace_final_state || fresh ? n : -1;
    }
    return true;
  }
  KDA_RULE(TYPE, idx->scalar_type() == at::kLong || idx->scalar_type() == at::kInt, kSrv,
           "ssm_state_indices must be int64 or int32, got ", idx->scalar_type());
  if (!check_device(kSrv, *idx, "ssm_state_indices", q, probe)) return false;
  KDA_RULE(VALUE, (idx->dim() == 1 || idx->dim() == 2) && idx->size(0) == d.N, kSrv,
           "ssm_state_indices must have shape [N] or [N, T_max] with N = ", d.N,
           ", got ", shape_str(idx->sizes()));
  KDA_RULE(VALUE, idx->dim() == 1 || inplace_final_state, kSrv,
           "2-D ssm_state_indices write per-token snapshots into the pool and need "
           "inplace_final_state=True");
  const auto iv = idx->to(at::kLong).contiguous();
  const int64_t* ix = iv.data_ptr<int64_t>();
  const int64_t cols = idx->dim() == 2 ? idx->size(1) : 1;
  constexpr int64_t kBad = -2;  // a slot out of range (probing; raising throws instead)
  auto slot = [&](int64_t n, int64_t t) -> int64_t {  // -1: pad
    const int64_t s = ix[n * cols + t];
    if (s == pad_slot_id) return -1;
    if (s >= 0 && s < num_slots) return s;
    KDA_CHECK_VALUE(probe, kSrv, "ssm_state_indices[", n,
                      idx->dim() == 2 ? ", " + std::to_string(t) : std::string(), "] = ", s,
                      " is out of range: expected a slot in [0, ", num_slots,
                      ") (num_slots = initial_state.shape[0]) or pad_slot_id = ", pad_slot_id);
    return kBad;
  };
  // The writer of each slot: its sequence and token (column of 2-D indices; 0 for 1-D ones).
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> writer;
  auto claim = [&](int64_t s, int64_t n, int64_t t) -> bool {
    if (s < 0) return true;
    const auto [n0, t0] = writer.emplace(s, std::make_pair(n, t)).first->second;
    KDA_RULE(VALUE, n0 == n, kSrv, "two sequences write slot ", s, " in one call (sequences ",
             n0, " and ", n, "); each slot may be written by one sequence only");
    // Two snapshots of one row in one slot: the later one would silently replace the state that
    // num_accepted_tokens may name on the next call.
    KDA_RULE(VALUE, t0 == t, kSrv, "sequence ", n, " writes slot ", s,
             " twice (at ssm_state_indices[", n, ", ", t0, "] and [", n, ", ", t,
             "]); each token's snapshot needs its own slot");
    return true;
  };
  if (idx->dim() == 1) {
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t s = slot(n, 0);
      if (s == kBad) return false;
      plan.pad[n] = s < 0;
      plan.src_row[n] = s;
      if (inplace_final_state) {
        plan.dst_row[n] = s;
        if (!claim(s, n, 0)) return false;
      } else if (fresh) {
        plan.dst_row[n] = n;
      }
    }
  } else {
    plan.snap_ld = cols;
    plan.snap.assign(d.N * cols, -1);
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t Tn = plan.seq_end[n] - plan.seq_start[n];
      KDA_RULE(VALUE, Tn <= cols, kSrv, "sequence ", n, " has ", Tn,
               " tokens but ssm_state_indices has T_max = ", cols, " columns");
      if (Tn == 0) {
        plan.pad[n] = 1;
        continue;
      }
      const int64_t a = nat ? accepted[n] : 1;
      KDA_RULE(VALUE, a >= 1 && a <= Tn, kSrv, "num_accepted_tokens[", n,
               "] must be in [1, T_n] = [1, ", Tn, "], got ", a);
      std::vector<int64_t> row(Tn);
      for (int64_t t = 0; t < Tn; ++t) {
        row[t] = slot(n, t);
        if (row[t] == kBad) return false;
      }
      plan.src_row[n] = row[a - 1];
      plan.pad[n] = row[a - 1] < 0;
      if (plan.pad[n]) continue;
      for (int64_t t = 0; t < Tn; ++t) {
        plan.snap[n * cols + t] = row[t];
        if (!claim(row[t], n, t)) return false;
      }
    }
  }
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t s = plan.src_row[n];
    if (s < 0) continue;
    const auto it = writer.find(s);
    KDA_RULE(VALUE, it == writer.end() || it->second.first == n, kSrv, "slot ", s,
             " is read by sequence ", n, " and written by sequence ", it->second.first,
             " in the same call; give each sequence its own slots");
  }
  return true;
}

ServingPlan check_serving(KDA_SERVING_ARGS, Inputs& in, Config& cfg, Dims& d) {
  ServingPlan plan;
  check_serving(KDA_SERVING_FORWARD, /*probe=*/false, in, cfg, d, plan);
  return plan;
}

// A checked serving call: the values (g, beta), then the kernels. dst: the pool (in place), a
// fresh final_state, or undefined.
void run_serving(const Inputs& in, const Config& cfg, const Dims& d, const ServingPlan& plan,
                 const at::Tensor& dst, bool fresh_dst, const at::Tensor& out) {
  check_domain(in, cfg, d);  // the values last, as in Python; still before any write
  // A fresh final state is first touched by the kernels: 2 MB pages make that hundreds of times
  // fewer page faults (B = 64, H = 32: 128 MB).
  if (fresh_dst) advise_huge_pages(dst);
  serving_cpu(in, cfg, d, plan, in.initial_state ? *in.initial_state : at::Tensor(), dst, out);
}

void fused_recurrent_serving_cpu(KDA_SERVING_ARGS) {
  Inputs in;
  Config cfg;
  Dims d;
  const ServingPlan plan = check_serving(KDA_SERVING_FORWARD, in, cfg, d);
  const auto fresh = defined_or_none(final_state);
  const at::Tensor dst = inplace_final_state ? *in.initial_state : fresh ? *fresh : at::Tensor();
  run_serving(in, cfg, d, plan, dst, !inplace_final_state && fresh, out);
}

// The outputs are the caller's tensors: nothing to make, only the devices to check. One meta
// tensor among CPU tensors sends the call here, which then returned with nothing written.
void fused_recurrent_serving_meta(KDA_SERVING_ARGS) {
  KDA_CHECK_TYPE(q.defined() && k.defined() && v.defined() && g.defined() && beta.defined(), kSrv,
                 "q, k, v, g and beta must be defined tensors");
  check_same_device(kSrv, q, {{"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta},
                              {"initial_state", defined_ptr(initial_state)},
                              {"ssm_state_indices", defined_ptr(ssm_state_indices)},
                              {"num_accepted_tokens", defined_ptr(num_accepted_tokens)},
                              {"out", out.defined() ? &out : nullptr},
                              {"final_state", defined_ptr(final_state)},
                              {"cu_seqlens", defined_ptr(cu_seqlens)}, {"A_log", defined_ptr(A_log)},
                              {"dt_bias", defined_ptr(dt_bias)}});
}

// The serving ops write out, the pool (in place) and a caller's final_state below autograd's
// ADInplaceOrView kernel, which is where PyTorch's in-place ops bump a tensor's version: bumped
// here, so a graph that saved one of them raises at backward ("modified by an inplace
// operation") instead of computing with the new values. As for PyTorch's own in-place ops, an
// inference tensor written outside InferenceMode raises.
void bump_written_versions(const at::Tensor& out, const std::optional<at::Tensor>& initial_state,
                           bool inplace_final_state, const std::optional<at::Tensor>& final_state) {
  if (out.defined()) torch::autograd::impl::bump_version(out);
  if (inplace_final_state && initial_state && initial_state->defined()) {
    torch::autograd::impl::bump_version(*initial_state);
  }
  if (final_state && final_state->defined()) torch::autograd::impl::bump_version(*final_state);
}

// Serving is inference only: the pool and out are written in place, which autograd cannot follow.
void fused_recurrent_serving_autograd(KDA_SERVING_ARGS) {
  reject_tangents(kSrv, make_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias));
  if (at::GradMode::is_enabled()) {
    auto req = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
    const char* name = q.requires_grad() ? "q" : k.requires_grad() ? "k" : v.requires_grad() ? "v"
                       : g.requires_grad() ? "g" : beta.requires_grad() ? "beta"
                       : req(initial_state) ? "initial_state" : req(A_log) ? "A_log"
                       : req(dt_bias) ? "dt_bias" : out.requires_grad() ? "out"
                       : req(final_state) ? "final_state" : nullptr;
    KDA_CHECK_VALUE(name == nullptr, kSrv, "serving calls are inference only (the pool, out and "
                      "final_state are written in place), but ", name, " requires grad; run under "
                      "torch::NoGradGuard / torch.no_grad(), or use backend=\"reference\" for "
                      "gradients");
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("kda::fused_recurrent_serving", "")
                       .typed<void(KDA_SERVING_ARGS)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(KDA_SERVING_FORWARD);
  }
  bump_written_versions(out, initial_state, inplace_final_state, final_state);
}

// kda::_fused_recurrent_serving_fast: fused_recurrent_kda's serving call (a state pool through
// ssm_state_indices, in-place final states, out=, head-wise beta, per-token snapshots) on CPU
// tensors in one Python -> C++ call, as kda::_fused_recurrent_fast is for the plain call:
// check_serving probed (the rules of torch_kda._checks.check_serving_inputs), refused too under
// grad mode when a tensor requires grad (serving is inference only: Python raises), then the
// serving kernels and the place of the unstable-write warning. Allocates o when `out` is None and
// the final state with output_final_state (not in place). Returns (o, or undefined when `out` was
// given; the fresh final state or undefined; status as kda::_fused_recurrent_fast's).
std::tuple<at::Tensor, at::Tensor, int64_t> fused_recurrent_serving_fast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, std::optional<double> scale,
    const std::optional<at::Tensor>& initial_state,
    const std::optional<at::Tensor>& ssm_state_indices,
    const std::optional<at::Tensor>& num_accepted_tokens, const std::optional<at::Tensor>& out,
    bool output_final_state, int64_t pad_slot_id, bool inplace_final_state,
    bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel,
    bool allow_neg_eigval, std::optional<double> lower_bound, bool state_v_first,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& A_log,
    const std::optional<at::Tensor>& dt_bias) {
  const std::tuple<at::Tensor, at::Tensor, int64_t> refused{at::Tensor(), at::Tensor(), kRefused};
  if (at::GradMode::is_enabled()) {
    auto req = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
    if (req(q) || req(k) || req(v) || req(g) || req(beta) || req(initial_state) || req(A_log) ||
        req(dt_bias) || req(out)) {
      return refused;
    }
  }
  if (!python_only_rules(lower_bound, q, cu_seqlens)) return refused;
  const at::Tensor out_given = out && out->defined() ? *out : at::Tensor();
  Inputs in;
  Config cfg;
  Dims d;
  ServingPlan plan;
  if (!check_serving(q, k, v, g, beta, scale.value_or(1.0), initial_state, ssm_state_indices,
                     num_accepted_tokens, out_given, std::nullopt, pad_slot_id,
                     inplace_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                     use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                     cu_seqlens, A_log, dt_bias, /*probe=*/true, in, cfg, d, plan)) {
    return refused;
  }
  if (!scale) cfg.scale = python_default_scale(d.K);
  // As the plain decode path: o and a fresh final state from the output cache (output_cache.h).
  const at::Tensor o =
      out_given.defined() ? out_given : empty_output({d.B, d.T, d.HV, d.V}, q.options());
  at::Tensor fresh;
  if (output_final_state && !inplace_final_state) {
    const auto opts = q.options().dtype(compute_dtype(q));
    fresh = state_v_first ? empty_output({d.N, d.HV, d.V, d.K}, opts)
                          : empty_output({d.N, d.HV, d.K, d.V}, opts);
    // as check_serving plans it for a caller's final_state (1-D or no indices: not in place)
    std::iota(plan.dst_row.begin(), plan.dst_row.end(), int64_t(0));
  }
  run_serving(in, cfg, d, plan, inplace_final_state ? *in.initial_state : fresh, fresh.defined(), o);
  bump_written_versions(out_given, initial_state, inplace_final_state, std::nullopt);
  int64_t first = -1;
  if (!use_qk_l2norm_in_kernel) {
    first = first_unstable_write(k, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval ? 2.0 : 1.0);
  }
  return {out_given.defined() ? at::Tensor() : o, fresh, first};
}

}  // namespace
}  // namespace detail
}  // namespace kda

TORCH_LIBRARY_FRAGMENT(kda, m) {
  // Serving (docs/serving.md): writes o into `out`, final states into the pool (in place) or into
  // `final_state`, and returns nothing; inference only.
  m.def("fused_recurrent_serving(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
        "Tensor(a!)? initial_state, Tensor? ssm_state_indices, Tensor? num_accepted_tokens, "
        "Tensor(b!) out, Tensor(c!)? final_state, int pad_slot_id=-1, "
        "bool inplace_final_state=False, bool use_qk_l2norm_in_kernel=False, "
        "bool use_gate_in_kernel=False, bool use_beta_sigmoid_in_kernel=False, "
        "bool allow_neg_eigval=False, float? lower_bound=None, bool state_v_first=False, "
        "Tensor? cu_seqlens=None, Tensor? A_log=None, Tensor? dt_bias=None) -> ()");
  m.def("_fused_recurrent_serving_fast(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "float? scale, Tensor(a!)? initial_state, Tensor? ssm_state_indices, "
        "Tensor? num_accepted_tokens, Tensor(b!)? out, bool output_final_state, int pad_slot_id, "
        "bool inplace_final_state, bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, "
        "bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, float? lower_bound, "
        "bool state_v_first, Tensor? cu_seqlens, Tensor? A_log, Tensor? dt_bias) "
        "-> (Tensor o, Tensor final_state, int status)");
}

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("fused_recurrent_serving", &kda::detail::fused_recurrent_serving_cpu);
}

TORCH_LIBRARY_IMPL(kda, Meta, m) {
  m.impl("fused_recurrent_serving", &kda::detail::fused_recurrent_serving_meta);
}

TORCH_LIBRARY_IMPL(kda, CompositeImplicitAutograd, m) {
  m.impl("_fused_recurrent_serving_fast", &kda::detail::fused_recurrent_serving_fast);
}

TORCH_LIBRARY_IMPL(kda, Autograd, m) {
  m.impl("fused_recurrent_serving", &kda::detail::fused_recurrent_serving_autograd);
}
