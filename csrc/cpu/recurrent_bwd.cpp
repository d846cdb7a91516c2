// CPU backward of the fused recurrent KDA: runs the backward kernels (recompute each chunk from
// the forward's checkpoints, then the reverse recurrence of docs/math.md "Backward") over (sequence, value
// head, group of V-slices) units; the per-group partials are summed in a fixed order and chained
// through the pre-processing (l2 norm, gate, sigmoid beta) by csrc/cpu/bwd_common.cpp.
//
// Token blocks, last first (as the forward's, csrc/cpu/recurrent_fwd.cpp): a block is a few
// whole checkpoint chunks of every sequence; its pre-processing, the per-group partial gradients
// and the chain rule run in a workspace of a few MB that stays in cache and is reused from block
// to block (and by the allocator from call to call), the gradient of the state carries across
// blocks in dh0, and every output is written once. Nothing full-size is allocated besides the
// outputs (no page-fault storm per call), and the kernels take per-thread scratch from here.
//
// Determinism: the partition into units and blocks depends on the shapes only, never on the
// thread count, and every sum runs in a fixed order, so results are bitwise identical for any
// thread count.
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu/output_cache.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace kda {
namespace detail {

namespace {

// Groups of V-slices per (sequence, value head): enough units to keep a few threads busy when
// there are few heads; a function of the shapes only.
int64_t n_groups(const Dims& d, int64_t n_slices) {
  const int64_t heads = std::max<int64_t>(1, d.N * d.HV);
  const int64_t want = std::max<int64_t>(1, (4 + heads - 1) / heads);
  return std::max<int64_t>(1, std::min(n_slices, want));
}

// Chunks of kChunk tokens per backward block: the block's pre-processed rows, partials and chain
// rule inputs take about kBudget bytes (cache-resident, reused). A function of the shapes only.
int64_t chunks_per_block(const Dims& d, int64_t groups, const Config& cfg, size_t elt) {
  constexpr int64_t kBudget = int64_t(8) << 20;
  int64_t per_token = (2 * d.H + 2 * d.HV) * d.K + d.HV;        // q, k, decay, decay*k, beta
  if (cfg.use_qk_l2norm_in_kernel) per_token += 2 * d.H;           // 1/||q||, 1/||k||
  if (cfg.use_gate_in_kernel) per_token += 2 * d.HV * d.K;         // log decay, gate sigmoid
  per_token += groups * (3 * d.HV * d.K + d.HV);                   // partials of dq, dk, dg, dbeta
  per_token *= static_cast<int64_t>(elt);
  return std::max<int64_t>(1, std::min<int64_t>(64, kBudget / (per_token * kernels::kChunk)));
}

template <typename T>
void run_bwd_blocked(const Inputs& in, const Config& cfg, const Dims& d, const Sequences& seqs,
                     const at::Tensor& h0, const at::Tensor& ckpt, const at::Tensor& dout,
                     const at::Tensor& dht, const InputGrads& out) {
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const int64_t BT = d.B * d.T, H = d.H, HV = d.HV, K = d.K;
  constexpr int64_t C = kernels::kChunk;
  const bool gate = cfg.use_gate_in_kernel;
  const bool l2 = cfg.use_qk_l2norm_in_kernel;
  // bf16 / fp16 q, k, g and beta of an fp32 backward are read as they are by the pre-processing
  // pass, which widens them in registers (as the forward's token blocks); raw q (l2 norm) and the
  // bounded gate's raw input, which the chain rule reads, are widened into block buffers, and so
  // are v and grad_o when either is not in the compute dtype: no full-size copies. Other mixes
  // (fp32 under fp64 q) are converted whole into blocks of the output cache.
  const auto q_st = storage_of(in.q.scalar_type(), ct), g_st = storage_of(in.g.scalar_type(), ct),
             b_st = storage_of(in.beta.scalar_type(), ct);
  const bool direct = q_st && g_st && b_st;
  const bool q_block = direct && *q_st != kernels::Storage::kCompute && l2;
  const bool g_block = direct && *g_st != kernels::Storage::kCompute && gate && cfg.lower_bound;
  auto input = [&](const at::Tensor& t, bool as_is) {
    return to_output(t, as_is ? t.scalar_type() : ct);  // contiguous
  };
  const at::Tensor q_c = input(in.q, direct), k_c = input(in.k, direct);
  const at::Tensor g_c = input(in.g, direct), b_c = input(in.beta, direct);
  const bool vo_block = in.v.scalar_type() != ct || dout.scalar_type() != ct;
  const at::Tensor v_in = input(in.v, vo_block).reshape({BT, HV * d.V});
  const at::Tensor do_in = dout.reshape({BT, HV * d.V});  // contiguous, its own dtype
  at::Tensor expA, bias;
  if (gate && in.A_log) expA = at::exp(in.A_log->to(ct)).contiguous();
  if (gate && in.dt_bias) bias = in.dt_bias->to(ct).contiguous().reshape({-1});

  const int64_t n_slices = (d.V + kernels::kBwdSlice - 1) / kernels::kBwdSlice;
  const int64_t groups = n_groups(d, n_slices);
  const int64_t cb = chunks_per_block(d, groups, cfg, sizeof(T));
  // Sequence n covers chunks [cf[n], cf[n] + nc[n]) (numbered from its origin).
  std::vector<int64_t> cf(d.N, 0), nc(d.N, 0);
  int64_t n_blocks = 1, nb = 0;
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t ts = seqs.start[n], te = seqs.end[n], origin = seqs.origin[n];
    if (ts == te) continue;
    cf[n] = (ts - origin) / C;
    nc[n] = (te - 1 - origin) / C - cf[n] + 1;
    n_blocks = std::max(n_blocks, (nc[n] + cb - 1) / cb);
    nb += std::min(te - ts, cb * C);
  }
  nb = std::max<int64_t>(1, nb);

  // The block workspace: pre-processed rows, chain-rule inputs, per-group partials, and one
  // kernel scratch per thread (recomputed chunk states, state gradients). From the output cache
  // (csrc/cpu/output_cache.h), as the forward's: glibc hands heap blocks of a few MB back to the
  // system when it trims its heap, and the next call faulted them in again.
  const at::Tensor ws_q = empty_output({H, nb, K}, opts), ws_k = empty_output({H, nb, K}, opts);
  const at::Tensor ws_a = empty_output({HV, nb, K}, opts);
  const at::Tensor ws_ak = empty_output({HV, nb, K}, opts);
  const at::Tensor ws_b = empty_output({HV, nb}, opts);
  at::Tensor ws_qr, ws_kr, ws_g, ws_s;
  if (l2) ws_qr = empty_output({nb, H}, opts), ws_kr = empty_output({nb, H}, opts);
  if (gate) {
    ws_s = empty_output({nb, HV, K}, opts);
    if (!cfg.lower_bound) ws_g = empty_output({nb, HV, K}, opts);  // the softplus gate's log decay
  }
  const at::Tensor dq_p = empty_output({groups, nb, HV, K}, opts);
  const at::Tensor dk_p = empty_output({groups, nb, HV, K}, opts);
  const at::Tensor dg_p = empty_output({groups, nb, HV, K}, opts);
  const at::Tensor db_p = empty_output({groups, nb, HV}, opts);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t ws_stride = kernels::bwd_scratch_elems(K, n_slices);
  // Block buffers of the widened inputs (rows of the block, as the pre-processed arrays), parts
  // of one block of the output cache: each alone is often under its 1 MB threshold (512 KB at
  // H16), and glibc mapped and unmapped such blocks call after call (~1.4K faults at T8K H16).
  const int64_t q_cols = q_block ? H * K : 0, g_cols = g_block ? HV * K : 0;
  const int64_t vo_cols = vo_block ? HV * d.V : 0;
  const at::Tensor in_ws = empty_output({nb * (q_cols + g_cols + 2 * vo_cols)}, opts);
  int64_t in_off = 0;
  auto part = [&](int64_t cols) {
    at::Tensor t = in_ws.narrow(0, in_off, nb * cols).view({nb, cols});
    in_off += nb * cols;
    return t;
  };
  const at::Tensor q_w = part(q_cols), g_w = part(g_cols), v_w = part(vo_cols), do_w = part(vo_cols);
  const at::Tensor thread_ws = empty_output({threads * ws_stride}, opts);
  advise_huge_pages(thread_ws);
  T* const ws0 = thread_ws.data_ptr<T>();
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; };

  kernels::PrepArgs<T> P = make_prep_args<T>(cfg, d, nb);
  if (direct) {
    P.q_store = *q_st;
    P.g_store = *g_st;
    P.beta_store = *b_st;
  }
  set_prep_inputs(P, q_c, k_c, g_c, b_c);
  P.expA = ptr(expA);
  P.dt_bias = ptr(bias);
  P.q_out = ws_q.data_ptr<T>();
  P.k_out = ws_k.data_ptr<T>();
  P.a_out = ws_a.data_ptr<T>();
  P.ak_out = ws_ak.data_ptr<T>();
  P.beta_out = ws_b.data_ptr<T>();
  P.q_rnorm = ptr(ws_qr);
  P.k_rnorm = ptr(ws_kr);
  P.g_out = ptr(ws_g);
  P.s_out = ptr(ws_s);

  BlockRows rows(d.N);
  std::vector<int64_t> re(d.N);
  kernels::BwdArgs<T> A;
  A.seqs = seq_info(seqs);
  A.seqs.shift = rows.shift.data();
  A.seqs.vo_shift = vo_block ? rows.shift.data() : nullptr;
  A.BT = nb;
  A.H = H;
  A.HV = HV;
  A.K = K;
  A.V = d.V;
  A.q = P.q_out;
  A.k = P.k_out;
  A.a = P.a_out;
  A.ak = P.ak_out;
  A.beta = P.beta_out;
  A.v = vo_block ? v_w.data_ptr<T>() : v_in.data_ptr<T>();
  A.h0 = ptr(h0);
  A.ckpt = ckpt.numel() > 0 ? ckpt.data_ptr<T>() : nullptr;
  A.dout = vo_block ? do_w.data_ptr<T>() : do_in.data_ptr<T>();
  A.dht = ptr(dht);
  A.dq = dq_p.data_ptr<T>();
  A.dk = dk_p.data_ptr<T>();
  A.dg = dg_p.data_ptr<T>();
  A.dbeta = db_p.data_ptr<T>();
  A.group_stride = nb * HV * K;
  A.group_stride_beta = nb * HV;
  A.dv = out.dv.data_ptr<T>();
  A.dh0 = out.dh0.data_ptr<T>();

  // The chain rule reads the block arrays at the row and the caller's arrays (raw q, the bounded
  // gate's raw input; the outputs) at the global token: those pointers move by shift[n].
  ChainArgs<T> Cb;
  Cb.BT = nb;
  Cb.H = H;
  Cb.HV = HV;
  Cb.K = K;
  Cb.groups = groups;
  Cb.dq_p = A.dq;
  Cb.dk_p = A.dk;
  Cb.dg_p = A.dg;
  Cb.db_p = A.dbeta;
  Cb.q_rnorm = P.q_rnorm;
  Cb.k_hm = P.k_out;
  Cb.k_rnorm = P.k_rnorm;
  Cb.gate_s = P.s_out;
  Cb.expA = P.expA;
  Cb.bias = P.dt_bias;
  Cb.beta = P.beta_out;
  Cb.softplus = gate && !cfg.lower_bound;
  Cb.beta_sigmoid = cfg.use_beta_sigmoid_in_kernel;
  Cb.scale = static_cast<T>(cfg.scale);
  Cb.lower_bound = static_cast<T>(cfg.lower_bound.value_or(0.0));
  Cb.beta_c = cfg.allow_neg_eigval ? T(2) : T(1);
  Cb.g = P.g_out;  // the softplus gate's log decay (block rows)
  ChainGlobals<T> G;
  // Raw q (l2 norm) and the bounded gate's raw input: the caller's arrays, or block buffers.
  G.q_in_block = q_block;
  G.g_in_block = g_block;
  if (l2) G.q = q_block ? q_w.data_ptr<T>() : q_c.data_ptr<T>();
  if (gate && cfg.lower_bound) G.g = g_block ? g_w.data_ptr<T>() : g_c.data_ptr<T>();
  G.dq = out.dq.data_ptr<T>();
  G.dk = out.dk.data_ptr<T>();
  G.dg = out.dg.data_ptr<T>();
  G.dbeta = out.dbeta.data_ptr<T>();
  G.dA_rows = ptr(out.dA_rows);

  const auto& tab = kernels::table();
  auto bwd = [&]() {
    if constexpr (std::is_same_v<T, float>) {
      return tab.bwd_f32;
    } else {
      return tab.bwd_f64;
    }
  }();
  const int64_t units = d.N * HV * groups;
  for (int64_t j = n_blocks - 1; j >= 0; --j) {
    int64_t used = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t ts = seqs.start[n], te = seqs.end[n], origin = seqs.origin[n];
      const int64_t c0 = cf[n] + j * cb;
      rows.rs[n] = std::clamp(origin + c0 * C, ts, te);
      re[n] = std::clamp(origin + (c0 + cb) * C, ts, te);
      rows.loc[n] = used;
      rows.shift[n] = rows.rs[n] - used;
      used += re[n] - rows.rs[n];
    }
    rows.loc[d.N] = used;
    if (q_block) copy_block_rows(q_w, q_c.reshape({BT, H * K}), rows);
    if (g_block) copy_block_rows(g_w, g_c.reshape({BT, HV * K}), rows);
    if (vo_block) {
      copy_block_rows(v_w, v_in, rows);
      copy_block_rows(do_w, do_in, rows);
    }
    FirstBad bad;
    prep_block<T>(P, rows, /*shifted_inputs=*/false, bad);
    report_domain(bad, in, cfg, d);
    // The recurrence over the block. An empty sequence still runs once (in block 0), so its
    // initial-state gradient is dht.
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      T* ws = ws0 + std::min<int64_t>(at::get_thread_num(), threads - 1) * ws_stride;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t g = u % groups;
        const int64_t hv = (u / groups) % HV;
        const int64_t n = u / (groups * HV);
        if (rows.rs[n] == re[n] && !(j == 0 && seqs.start[n] == seqs.end[n])) continue;
        bwd(A, n, hv, g * n_slices / groups, (g + 1) * n_slices / groups, g, rows.rs[n], re[n],
            ws);
      }
    });
    // The chain rule over the block's rows, written to the outputs at the global tokens.
    chain_rule_rows<T>(Cb, rows, G);
  }
}

}  // namespace

std::vector<at::Tensor> recurrent_bwd_cpu(const at::Tensor& d_o,
                                          const std::optional<at::Tensor>& d_final_state,
                                          const at::Tensor& checkpoints, const Inputs& in,
                                          const Config& cfg) {
  const BwdSetup s = backward_setup(d_o, d_final_state, checkpoints, in, cfg,
                                    /*with_prepared=*/false);
  // The outputs, written once (in the compute dtype; converted at the end only for other dtypes).
  const InputGrads o = empty_input_grads(s.d, in, cfg);
  if (compute_dtype(in.q) == at::kDouble) {
    run_bwd_blocked<double>(in, cfg, s.d, s.seqs, s.h0, s.ckpt, s.dout, s.dht, o);
  } else {
    run_bwd_blocked<float>(in, cfg, s.d, s.seqs, s.h0, s.ckpt, s.dout, s.dht, o);
  }
  return backward_outputs(o, s.d, in, cfg);
}

}  // namespace detail
}  // namespace kda
