// What the two CPU backwards (csrc/cpu/recurrent_bwd.cpp: the reverse recurrence; csrc/cpu/
// chunk_bwd.cpp: the chunkwise form) share: the set-up (checks, recomputed pre-processing,
// sequences, states and gradients in the compute dtype) and the chain rule from the kernels'
// gradients w.r.t. the pre-processed inputs to the op's inputs (docs/math.md "Backward",
// "Through the pre-processing").
//
// Determinism: every value is computed by one thread and every sum runs in a fixed order, so
// results are bitwise identical for any thread count.
#include "cpu/clones.h"
#include "cpu/kda_cpu.h"
#include "cpu/output_cache.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include <vector>

namespace kda {
namespace detail {

namespace {

// The sum of term(i) for i in [0, K), in 8 interleaved partial sums combined as a fixed tree
// (an order that depends on K only: deterministic). One running sum put the latency of an add
// on every element: the dot products and dA_log rows were most of the chain rule's time.
template <typename T, typename F>
inline T sum_k(int64_t K, F term) {
  T s[8] = {};
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    for (int l = 0; l < 8; ++l) s[l] += term(i + l);
  }
  for (int l = 0; i < K; ++i, ++l) s[l] += term(i);
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// The chain rule from the kernels' gradients to the op's inputs, one pass over tokens (it was ~20
// separate ATen ops over [B*T, HV, K] arrays): the sums over the V-slice groups p (partials of
// the kernels, in order p = 0, 1, ...), over the value heads of a key head (in order), then
//   q (l2 norm):  dq = (dqh - qhat (qhat . dqh)) * rnorm_q * scale     (else dq = dqh * scale)
//   k (l2 norm):  dk = (dkh - khat (khat . dkh)) * rnorm_k              (else dk = dkh)
//   gate softplus: dz = dgl * (-exp(A_log)) * sigmoid(z),   dA_log row = sum_i dgl_i g_i
//   gate bounded:  dz = dgl * lower_bound * s (1 - s) [* exp(A_log)],   dA_log row = sum_i dz_i z_i
//   beta sigmoid:  dbeta = db * beta (1 - beta / c)
// (docs/math.md, "Backward"). Writes dq, dk [BT, H, K], dg [BT, HV, K] (dz with the gate in the
// op), dbeta [BT, HV] and the per-token rows of dA_log [BT, HV]; their sums over tokens run
// afterwards in token order. Every value is computed by one thread in a fixed order: the result
// does not depend on the thread count. Compiled per instruction set (KDA_CLONES): built for the
// baseline only, its loops ran at SSE2 width, ~6% of the recurrent backward on an AVX-512 CPU.
template <typename T>
KDA_CLONES void chain_rule_tokens(const ChainArgs<T>& C, int64_t t0, int64_t t1) {
  const int64_t H = C.H, HV = C.HV, K = C.K, BT = C.BT, P = C.groups, G = HV / H;
  const int64_t gs = BT * HV * K, gsb = BT * HV;  // strides between partials
  std::vector<T> acc(2 * K), hv_sum(K);
  T* aq = acc.data();
  T* ak = acc.data() + K;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      for (int which = 0; which < 2; ++which) {
        const T* part = which == 0 ? C.dq_p : C.dk_p;
        T* a = which == 0 ? aq : ak;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = (t * HV + h * G + g) * K;
          for (int64_t i = 0; i < K; ++i) hv_sum[i] = part[row + i];
          for (int64_t p = 1; p < P; ++p) {
            for (int64_t i = 0; i < K; ++i) hv_sum[i] += part[p * gs + row + i];
          }
          if (g == 0) {
            for (int64_t i = 0; i < K; ++i) a[i] = hv_sum[i];
          } else {
            for (int64_t i = 0; i < K; ++i) a[i] += hv_sum[i];
          }
        }
      }
      T* dq = C.dq + (t * H + h) * K;
      T* dk = C.dk + (t * H + h) * K;
      // Fields of C read into locals before the loops: a store through dq could alias C as far
      // as GCC knows, so it re-read C.scale every element and kept the loop scalar.
      const T scale = C.scale;
      if (C.q_rnorm) {
        const T rq = C.q_rnorm[t * H + h], rk = C.k_rnorm[t * H + h];
        const T fq = rq * scale;
        const T* q = C.q + (t * H + h) * K;
        const T* kh = C.k_hm + (h * BT + t) * K;
        const T dotq = sum_k<T>(K, [&](int64_t i) { return q[i] * rq * aq[i]; });
        const T dotk = sum_k<T>(K, [&](int64_t i) { return kh[i] * ak[i]; });
        for (int64_t i = 0; i < K; ++i) {
          dq[i] = (aq[i] - q[i] * rq * dotq) * fq;
          dk[i] = (ak[i] - kh[i] * dotk) * rk;
        }
      } else {
        for (int64_t i = 0; i < K; ++i) {
          dq[i] = aq[i] * scale;
          dk[i] = ak[i];
        }
      }
    }
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t row = (t * HV + hv) * K;
      T* dg = C.dg + row;
      for (int64_t i = 0; i < K; ++i) dg[i] = C.dg_p[row + i];
      for (int64_t p = 1; p < P; ++p) {
        for (int64_t i = 0; i < K; ++i) dg[i] += C.dg_p[p * gs + row + i];
      }
      if (C.gate_s) {
        const T* s = C.gate_s + row;
        const T* gz = C.g + row;
        T rowA;
        // Saturated gates (docs/math.md "Saturation"): where exp(A_log) overflowed to inf the
        // gate sits at its limit and every gradient through it is 0; where the log-decay
        // overflowed to -inf the decay underflowed, dg = a * (...) is exactly 0, and its product
        // with g is the limit 0 of exp(g) g, not 0 * inf = NaN.
        const bool rate_inf = C.expA && std::isinf(C.expA[hv]);
        if (C.softplus) {
          const T mA = -C.expA[hv];
          rowA = sum_k<T>(K, [&](int64_t i) {
            const T d = dg[i];
            return (d == T(0) || rate_inf) ? T(0) : d * gz[i];
          });
          for (int64_t i = 0; i < K; ++i) dg[i] = rate_inf ? T(0) : dg[i] * mA * s[i];
        } else {
          const T lb = C.lower_bound, eA = C.expA ? C.expA[hv] : T(1);
          const T* bias = C.bias ? C.bias + hv * K : nullptr;
          for (int64_t i = 0; i < K; ++i) {
            T dz = dg[i] * lb * s[i] * (T(1) - s[i]);
            if (C.expA) dz = rate_inf ? T(0) : dz * eA;
            dg[i] = dz;
          }
          rowA = sum_k<T>(K, [&](int64_t i) { return dg[i] * (gz[i] + (bias ? bias[i] : T(0))); });
        }
        if (C.dA_rows) C.dA_rows[t * HV + hv] = rowA;
      }
      T db = C.db_p[t * HV + hv];
      for (int64_t p = 1; p < P; ++p) db += C.db_p[p * gsb + t * HV + hv];
      if (C.beta_sigmoid) {
        const T b = C.beta[hv * BT + t];
        db = db * b * (T(1) - b / C.beta_c);
      }
      C.dbeta[t * HV + hv] = db;
    }
  }
}

// Column sums of a [R, C] array, each column summed over rows in order (parallel over columns).
template <typename T>
at::Tensor column_sums(const at::Tensor& x2d) {
  const at::Tensor x = x2d.contiguous();
  const int64_t R = x.size(0), Cn = x.size(1);
  at::Tensor out = at::empty({Cn}, x.options());
  const T* p = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, Cn, 64, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) o[c] = 0;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = c0; c < c1; ++c) o[c] += p[r * Cn + c];
    }
  });
  return out;
}

}  // namespace

BwdSetup backward_setup(const at::Tensor& d_o, const std::optional<at::Tensor>& d_final_state,
                        const at::Tensor& checkpoints, const Inputs& in, const Config& cfg,
                        bool with_prepared) {
  BwdSetup s;
  s.d = check_inputs(in, cfg, /*check_values=*/true);
  const auto ct = compute_dtype(in.q);
  const int64_t BT = s.d.B * s.d.T;
  if (with_prepared) s.p = preprocess(in, cfg, s.d, /*for_backward=*/true);
  s.seqs = make_sequences(in, s.d);
  s.h0 = state_kv(in.initial_state, cfg, ct);
  s.dht = state_kv(d_final_state, cfg, ct);
  // 16-bit grad_o: widened into a reused block of the output cache (not a fresh full-size copy),
  // or by the recurrent backward's blocks.
  s.dout = to_output(d_o, with_prepared ? ct : d_o.scalar_type()).reshape({BT, s.d.HV, s.d.V});
  s.ckpt = to_output(checkpoints, ct);
  return s;
}

std::vector<at::Tensor> backward_finish(const BwdSetup& s, const KernelGrads& kg,
                                        const Inputs& in, const Config& cfg) {
  const Dims& d = s.d;
  const Prepared& p = s.p;
  const auto ct = compute_dtype(in.q);
  const int64_t BT = d.B * d.T;
  const int64_t groups = kg.groups;
  const auto opts = in.q.options().dtype(ct);
  // With one partial, the chain rule runs in place (chain_rule_tokens reads a token's partial
  // rows before it writes the same rows): no fresh full-size arrays, no page faults for them.
  // dq and dk also need one value head per key head (no grouped heads to sum).
  const bool in_place = groups == 1;
  const bool qk_in_place = in_place && d.HV == d.H;
  InputGrads o;
  o.dq = qk_in_place ? kg.dq.view({BT, d.H, d.K}) : empty_output({BT, d.H, d.K}, opts);
  o.dk = qk_in_place ? kg.dk.view({BT, d.H, d.K}) : empty_output({BT, d.H, d.K}, opts);
  if (!qk_in_place) {
    advise_huge_pages(o.dq);
    advise_huge_pages(o.dk);
  }
  o.dg = in_place ? kg.dg.view({BT, d.HV, d.K}) : empty_output({BT, d.HV, d.K}, opts);
  o.dbeta = in_place ? kg.dbeta.view({BT, d.HV}) : empty_output({BT, d.HV}, opts);
  if (!in_place) advise_huge_pages(o.dg);
  if (cfg.use_gate_in_kernel && in.A_log) o.dA_rows = at::empty({BT, d.HV}, opts);
  o.dv = kg.dv;
  o.dh0 = kg.dh0;
  const bool gate = cfg.use_gate_in_kernel;
  at::Tensor expA, bias;
  if (gate && in.A_log) expA = at::exp(in.A_log->to(ct)).contiguous();
  if (gate && in.dt_bias) bias = in.dt_bias->to(ct).contiguous().reshape({-1});
  auto chain = [&](auto zero) {
    using T = decltype(zero);
    ChainArgs<T> C;
    C.BT = BT;
    C.H = d.H;
    C.HV = d.HV;
    C.K = d.K;
    C.groups = groups;
    C.dq_p = kg.dq.data_ptr<T>();
    C.dk_p = kg.dk.data_ptr<T>();
    C.dg_p = kg.dg.data_ptr<T>();
    C.db_p = kg.dbeta.data_ptr<T>();
    C.q = p.q_in.data_ptr<T>();
    C.q_rnorm = cfg.use_qk_l2norm_in_kernel ? p.q_rnorm.data_ptr<T>() : nullptr;
    C.k_hm = p.k_hm.data_ptr<T>();
    C.k_rnorm = cfg.use_qk_l2norm_in_kernel ? p.k_rnorm.data_ptr<T>() : nullptr;
    C.g = gate ? (cfg.lower_bound ? p.g_in.data_ptr<T>() : p.g.data_ptr<T>()) : nullptr;
    C.gate_s = gate ? p.gate_s.data_ptr<T>() : nullptr;
    C.expA = expA.defined() ? expA.data_ptr<T>() : nullptr;
    C.bias = bias.defined() ? bias.data_ptr<T>() : nullptr;
    C.beta = p.beta_hm.data_ptr<T>();
    C.softplus = gate && !cfg.lower_bound;
    C.beta_sigmoid = cfg.use_beta_sigmoid_in_kernel;
    C.scale = static_cast<T>(cfg.scale);
    C.lower_bound = static_cast<T>(cfg.lower_bound.value_or(0.0));
    C.beta_c = cfg.allow_neg_eigval ? T(2) : T(1);
    C.dq = o.dq.data_ptr<T>();
    C.dk = o.dk.data_ptr<T>();
    C.dg = o.dg.data_ptr<T>();
    C.dbeta = o.dbeta.data_ptr<T>();
    C.dA_rows = o.dA_rows.defined() ? o.dA_rows.data_ptr<T>() : nullptr;
    at::parallel_for(0, BT, 16, [&](int64_t b, int64_t e) { chain_rule_tokens<T>(C, b, e); });
  };
  if (ct == at::kDouble) {
    chain(0.0);
  } else {
    chain(0.0f);
  }
  return backward_outputs(o, d, in, cfg);
}

InputGrads empty_input_grads(const Dims& d, const Inputs& in, const Config& cfg) {
  const auto opts = in.q.options().dtype(compute_dtype(in.q));
  const int64_t BT = d.B * d.T;
  // From the output cache (csrc/cpu/output_cache.h): the gradients are freed after each training
  // step, and fresh blocks were faulted in (and zeroed by the kernel) on every call, ~10% of a
  // B1 T8K H4 backward in clear_page on the 2-core box.
  InputGrads o;
  o.dq = empty_output({BT, d.H, d.K}, opts);
  o.dk = empty_output({BT, d.H, d.K}, opts);
  o.dg = empty_output({BT, d.HV, d.K}, opts);
  o.dbeta = empty_output({BT, d.HV}, opts);
  o.dv = empty_output({BT, d.HV, d.V}, opts);
  o.dh0 = empty_output({d.N, d.HV, d.K, d.V}, opts);
  if (cfg.use_gate_in_kernel && in.A_log) o.dA_rows = empty_output({BT, d.HV}, opts);
  // (A cached block is advised already; this covers the cache turned off.)
  for (const at::Tensor* t : {&o.dq, &o.dk, &o.dv, &o.dg, &o.dh0}) advise_huge_pages(*t);
  return o;
}

template <typename T>
void chain_rule_rows(const ChainArgs<T>& C, const BlockRows& rows, const ChainGlobals<T>& G) {
  const int64_t H = C.H, HV = C.HV, K = C.K;
  parallel_block_rows(rows, [&](int64_t n, int64_t b, int64_t stop) {
    const int64_t sh = rows.shift[n];
    ChainArgs<T> Cn = C;
    if (G.q) Cn.q = G.q + (G.q_in_block ? 0 : sh) * H * K;
    if (G.g) Cn.g = G.g + (G.g_in_block ? 0 : sh) * HV * K;
    Cn.dq = G.dq + sh * H * K;
    Cn.dk = G.dk + sh * H * K;
    Cn.dg = G.dg + sh * HV * K;
    Cn.dbeta = G.dbeta + sh * HV;
    Cn.dA_rows = G.dA_rows ? G.dA_rows + sh * HV : nullptr;
    chain_rule_tokens<T>(Cn, b, stop);
  });
}
template void chain_rule_rows<float>(const ChainArgs<float>&, const BlockRows&,
                                     const ChainGlobals<float>&);
template void chain_rule_rows<double>(const ChainArgs<double>&, const BlockRows&,
                                      const ChainGlobals<double>&);

std::vector<at::Tensor> backward_outputs(const InputGrads& o, const Dims& d, const Inputs& in,
                                         const Config& cfg) {
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const int64_t BT = d.B * d.T;
  const bool gate = cfg.use_gate_in_kernel;
  // The sums over tokens of dA_log and dt_bias, in token order.
  at::Tensor dA, dbias;
  if (ct == at::kDouble) {
    if (o.dA_rows.defined()) dA = column_sums<double>(o.dA_rows);
    if (gate && in.dt_bias) dbias = column_sums<double>(o.dg.reshape({BT, d.HV * d.K}));
  } else {
    if (o.dA_rows.defined()) dA = column_sums<float>(o.dA_rows);
    if (gate && in.dt_bias) dbias = column_sums<float>(o.dg.reshape({BT, d.HV * d.K}));
  }

  // In the inputs' dtypes: the gradients themselves in the compute dtype, else converted into
  // blocks of the output cache (a block returns to the cache only when the caller's gradient
  // tensor is freed, so a gradient still held is never handed out again).
  std::vector<at::Tensor> out(8);
  out[0] = to_output(o.dq.reshape({d.B, d.T, d.H, d.K}), in.q.scalar_type());
  out[1] = to_output(o.dk.reshape({d.B, d.T, d.H, d.K}), in.k.scalar_type());
  out[2] = to_output(o.dv.reshape({d.B, d.T, d.HV, d.V}), in.v.scalar_type());
  out[3] = to_output(o.dg.reshape({d.B, d.T, d.HV, d.K}), in.g.scalar_type());
  out[4] = to_output(o.dbeta.reshape({d.B, d.T, d.HV}), in.beta.scalar_type());
  if (in.initial_state) {
    at::Tensor h = cfg.state_v_first ? o.dh0.transpose(-1, -2) : o.dh0;
    out[5] = to_output(h, in.initial_state->scalar_type());
  } else {
    out[5] = at::empty({0}, opts);
  }
  out[6] = dA.defined() ? dA.reshape(in.A_log->sizes()).to(in.A_log->scalar_type())
                        : at::empty({0}, opts);
  out[7] = dbias.defined() ? dbias.reshape(in.dt_bias->sizes()).to(in.dt_bias->scalar_type())
                           : at::empty({0}, opts);
  return out;
}

}  // namespace detail
}  // namespace kda
