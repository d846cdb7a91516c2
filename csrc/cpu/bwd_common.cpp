// What the two CPU backwards (csrc/cpu/recurrent_bwd.cpp: the reverse recurrence; csrc/cpu/
// chunk_bwd.cpp: the chunkwise form) share: the set-up (checks, sequences, states and gradients
// in the compute dtype), the token blocks (the recomputed pre-processing, the kernels' partial
// gradients and the chain rule of a few whole chunks at a time, last first, in a workspace that
// stays in cache) and the chain rule from the kernels' gradients w.r.t. the pre-processed inputs
// to the op's inputs (docs/math.md "Backward", "Through the pre-processing").
//
// Token blocks: nothing full-size is allocated besides the outputs (no page-fault storm per call,
// no round trip of full-size pre-processed arrays through memory); the gradient of the state
// carries across blocks in dh0, and every output is written once.
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

// Arguments of the chain rule (chain_rule_tokens).
template <typename T>
struct ChainArgs {
  int64_t BT = 0, H = 0, HV = 0, K = 0, groups = 1;
  const T *dq_p = nullptr, *dk_p = nullptr, *dg_p = nullptr, *db_p = nullptr;  // [P, BT, HV, *]
  const T* q = nullptr;       // [BT, H, K] raw q (compute dtype)
  const T* q_rnorm = nullptr; // [BT, H] or null (no l2 norm)
  const T* k_hm = nullptr;    // [H, BT, K] khat
  const T* k_rnorm = nullptr; // [BT, H] or null
  const T* g = nullptr;       // [BT, HV, K] log decay (softplus gate) or raw gate input (bounded)
  const T* gate_slope = nullptr;  // [BT, HV, K] PrepArgs::gate_slope_out, or null (no gate in the op)
  const T* expA = nullptr;    // [HV] exp(A_log) or null
  const T* bias = nullptr;    // [HV * K] dt_bias or null
  const T* beta_slope = nullptr;  // [HV, BT] PrepArgs::beta_slope_out, or null (no sigmoid)
  bool softplus = false;
  T scale = 1, lower_bound = 0;
  T *dq = nullptr, *dk = nullptr, *dg = nullptr, *dbeta = nullptr, *dA_rows = nullptr;
};

// The chain rule from the kernels' gradients to the op's inputs, one pass over tokens (it was ~20
// separate ATen ops over [B*T, HV, K] arrays): the sums over the V-slice groups p (partials of
// the kernels, in order p = 0, 1, ...), over the value heads of a key head (in order), then
//   q (l2 norm):  dq = (dqh - qhat (qhat . dqh)) * rnorm_q * scale     (else dq = dqh * scale)
//   k (l2 norm):  dk = (dkh - khat (khat . dkh)) * rnorm_k              (else dk = dkh)
//   gate softplus: dz = dgl * (-exp(A_log)) * sigmoid(z),   dA_log row = sum_i dgl_i g_i
//   gate bounded:  dz = dgl * lower_bound * sigmoid(x) sigmoid(-x) [* exp(A_log)],
//                  dA_log row = sum_i dz_i z_i   (x = exp(A_log) z)
//   beta sigmoid:  dbeta = db * c sigmoid(x) sigmoid(-x)   (beta = c sigmoid(x))
// with the slopes sigmoid(z), sigmoid(x) sigmoid(-x) from the pre-processing pass (PrepArgs).
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
      if (C.gate_slope) {
        const T* slope = C.gate_slope + row;
        const T* gz = C.g + row;
        T rowA;
        // Saturated gates (docs/math.md "Saturation"): under a rate >= kLogSpaceRate (inf too)
        // the softplus gate was formed in log space and its pass stored the whole derivative of
        // the log decay in z as the slope; where exp(A_log) overflowed the bounded gate sits at
        // its step and every gradient through it is 0. Where the log-decay overflowed to -inf
        // the decay underflowed, dg = a * (...) is exactly 0, and its products with g and the
        // slope are the limit 0 (of exp(g) g), not 0 * inf = NaN. Likewise the bounded gate at
        // an infinite z (g or dt_bias infinite): its slope is 0, and dz z is the limit 0.
        const bool rate_inf = C.expA && std::isinf(C.expA[hv]);
        if (C.softplus) {
          const bool log_space = C.expA[hv] >= static_cast<T>(kernels::kLogSpaceRate);
          const T mA = -C.expA[hv];
          rowA = sum_k<T>(K, [&](int64_t i) {
            const T d = dg[i];
            return d == T(0) ? T(0) : d * gz[i];
          });
          for (int64_t i = 0; i < K; ++i) {
            const T d = dg[i];
            dg[i] = !log_space ? d * mA * slope[i] : (d == T(0) ? T(0) : d * slope[i]);
          }
        } else {
          const T lb = C.lower_bound, eA = C.expA ? C.expA[hv] : T(1);
          const T* bias = C.bias ? C.bias + hv * K : nullptr;
          for (int64_t i = 0; i < K; ++i) {
            T dz = dg[i] * lb * slope[i];
            if (C.expA) dz = rate_inf ? T(0) : dz * eA;
            dg[i] = dz;
          }
          rowA = sum_k<T>(K, [&](int64_t i) {
            const T d = dg[i];
            return d == T(0) ? T(0) : d * (gz[i] + (bias ? bias[i] : T(0)));
          });
        }
        if (C.dA_rows) C.dA_rows[t * HV + hv] = rowA;
      }
      T db = C.db_p[t * HV + hv];
      for (int64_t p = 1; p < P; ++p) db += C.db_p[p * gsb + t * HV + hv];
      if (C.beta_slope) db *= C.beta_slope[hv * BT + t];
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

// (kda_cpu.h, BwdSetup)
BwdSetup backward_setup(const at::Tensor& d_o, const std::optional<at::Tensor>& d_final_state,
                        const at::Tensor& checkpoints, const Inputs& in, const Config& cfg) {
  BwdSetup s;
  s.d = check_inputs(in, cfg, /*check_values=*/true);
  const auto ct = compute_dtype(in.q);
  s.seqs = make_sequences(in, s.d);
  s.h0 = state_kv(in.initial_state, cfg, ct);
  s.dht = state_kv(d_final_state, cfg, ct);
  s.dout = to_output(d_o, d_o.scalar_type()).reshape({s.d.B * s.d.T, s.d.HV, s.d.V});
  s.ckpt = to_output(checkpoints, ct);
  return s;
}

// Fresh (uninitialised) InputGrads, 2 MB page advice on the large ones.
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

// The chain rule (chain_rule_tokens) over the rows [b0, e0) of one token block, on the calling
// thread: C's block arrays (partials, rnorms, khat, gate values, beta; BT = the block's row stride)
// are read at the row, G's arrays at the global token (row + shift[n]); q or g at the row too when
// q_in_block / g_in_block (block buffers of widened 16-bit inputs).
template <typename T>
struct ChainGlobals {
  const T* q = nullptr;  // [B*T, H, K] raw q (compute dtype), or null (no l2 norm)
  const T* g = nullptr;  // [B*T, HV, K] raw gate input (bounded gate), or null: C.g is used
  bool q_in_block = false, g_in_block = false;
  T *dq = nullptr, *dk = nullptr, *dg = nullptr, *dbeta = nullptr, *dA_rows = nullptr;
};
template <typename T>
void chain_rule_rows(const ChainArgs<T>& C, const BlockRows& rows, const ChainGlobals<T>& G,
                     int64_t b0, int64_t e0) {
  const int64_t H = C.H, HV = C.HV, K = C.K;
  for_block_rows(rows, b0, e0, [&](int64_t n, int64_t b, int64_t stop) {
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
// The sums over tokens (dA_log, dt_bias, in token order) and the op's outputs in the inputs'
// dtypes and shapes.
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

// Chunks of kChunk tokens per backward block: the block's pre-processed rows, partials and chain
// rule inputs take about max(8, 2 x threads) MB (cache-resident, reused; the recurrent forward's
// blocks are smaller at 1-3 threads, 2 MB per thread, measured for the forward only). With 8 MB at
// any thread count a block of H16 held one chunk, and on the 16-core host every 64 tokens ended in
// three barriers of all threads: B1 T8K H16 bf16 at 16 threads, the recurrent backward took 150-163
// ms with 32 MB blocks against 172-184 ms, the chunk backward 139-154 against 156-173. Results do
// not depend on where blocks start (tested), so the thread count may set their size.
int64_t chunks_per_block(const Dims& d, int64_t groups, bool with_ak, const Config& cfg,
                         size_t elt) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t budget = std::max<int64_t>(8, 2 * threads) << 20;
  int64_t per_token = (2 * d.H + d.HV) * d.K + d.HV;               // q, k, decay, beta
  if (with_ak) per_token += d.HV * d.K;                            // decay * k
  if (cfg.use_qk_l2norm_in_kernel) per_token += 2 * d.H;           // 1/||q||, 1/||k||
  if (cfg.use_gate_in_kernel) per_token += 2 * d.HV * d.K;         // log decay, gate sigmoid
  per_token += groups * (3 * d.HV * d.K + d.HV);                   // partials of dq, dk, dg, dbeta
  per_token *= static_cast<int64_t>(elt);
  return std::max<int64_t>(1, std::min<int64_t>(64, budget / (per_token * kernels::kChunk)));
}

}  // namespace

template <typename T>
void run_bwd_blocked(const Inputs& in, const Config& cfg, const BwdSetup& s,
                     const InputGrads& out, const BwdBlockKernel<T>& kernel) {
  const Dims& d = s.d;
  const Sequences& seqs = s.seqs;
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
  const bool vo_block = in.v.scalar_type() != ct || s.dout.scalar_type() != ct;
  const at::Tensor v_in = input(in.v, vo_block).reshape({BT, HV * d.V});
  const at::Tensor do_in = s.dout.reshape({BT, HV * d.V});  // contiguous, its own dtype
  const GateParams gate_p = gate_params(in, cfg, ct);

  const int64_t groups = kernel.groups;
  const int64_t cb = chunks_per_block(d, groups, kernel.with_ak, cfg, sizeof(T));
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

  // A block's workspace: its rows, pre-processed rows and chain-rule inputs, per-group partials,
  // block buffers of the widened inputs, and the pass's, kernel's and chain rule's arguments on
  // them. From the output cache (csrc/cpu/output_cache.h), as the forward's: glibc hands heap
  // blocks of a few MB back to the system when it trims its heap, and the next call faulted them
  // in again. The block buffers are parts of one block of the cache: each alone is often under
  // its 1 MB threshold (512 KB at H16), and glibc mapped and unmapped such blocks call after call
  // (~1.4K faults at T8K H16).
  struct Workspace {
    explicit Workspace(int64_t N) : rows(N), re(N) {}
    BlockRows rows;
    std::vector<int64_t> re;
    std::vector<at::Tensor> buffers;  // (owned here; the arguments point into them)
    at::Tensor q_w, g_w, v_w, do_w;   // block buffers (empty when not used)
    kernels::PrepArgs<T> P;
    kernels::BwdArgs<T> A;
    ChainArgs<T> C;
    ChainGlobals<T> G;
  };
  const int64_t q_cols = q_block ? H * K : 0, g_cols = g_block ? HV * K : 0;
  const int64_t vo_cols = vo_block ? HV * d.V : 0;
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; };
  auto make_workspace = [&]() {
    auto W = std::make_unique<Workspace>(d.N);
    auto buffer = [&](at::IntArrayRef sizes) -> T* {
      W->buffers.push_back(empty_output(sizes, opts));
      return ptr(W->buffers.back());
    };
    const at::Tensor in_ws = empty_output({nb * (q_cols + g_cols + 2 * vo_cols)}, opts);
    W->buffers.push_back(in_ws);
    int64_t in_off = 0;
    auto part = [&](int64_t cols) {
      at::Tensor t = in_ws.narrow(0, in_off, nb * cols).view({nb, cols});
      in_off += nb * cols;
      return t;
    };
    W->q_w = part(q_cols), W->g_w = part(g_cols), W->v_w = part(vo_cols);
    W->do_w = part(vo_cols);

    kernels::PrepArgs<T>& P = W->P;
    P = block_prep_args<T>(cfg, d, nb, q_c, k_c, g_c, b_c, gate_p);
    P.q_out = buffer({H, nb, K});
    P.k_out = buffer({H, nb, K});
    P.a_out = buffer({HV, nb, K});
    P.ak_out = kernel.with_ak ? buffer({HV, nb, K}) : nullptr;
    P.beta_out = buffer({HV, nb});
    P.q_rnorm = l2 ? buffer({nb, H}) : nullptr;
    P.k_rnorm = l2 ? buffer({nb, H}) : nullptr;
    P.gate_slope_out = gate ? buffer({nb, HV, K}) : nullptr;
    P.beta_slope_out = cfg.use_beta_sigmoid_in_kernel ? buffer({HV, nb}) : nullptr;
    // the softplus gate's log decay
    P.g_out = gate && !cfg.lower_bound ? buffer({nb, HV, K}) : nullptr;

    kernels::BwdArgs<T>& A = W->A;
    A.seqs = seq_info(seqs);
    A.seqs.shift = W->rows.shift.data();
    A.seqs.vo_shift = vo_block ? W->rows.shift.data() : nullptr;
    point_at_block_rows(A, P, d);
    A.v = vo_block ? ptr(W->v_w) : v_in.data_ptr<T>();
    A.h0 = ptr(s.h0);
    A.ckpt = s.ckpt.numel() > 0 ? s.ckpt.data_ptr<T>() : nullptr;
    A.dout = vo_block ? ptr(W->do_w) : do_in.data_ptr<T>();
    A.dht = ptr(s.dht);
    A.dq = buffer({groups, nb, HV, K});
    A.dk = buffer({groups, nb, HV, K});
    A.dg = buffer({groups, nb, HV, K});
    A.dbeta = buffer({groups, nb, HV});
    A.group_stride = nb * HV * K;
    A.group_stride_beta = nb * HV;
    A.dv = out.dv.data_ptr<T>();
    A.dh0 = out.dh0.data_ptr<T>();

    // The chain rule reads the block arrays at the row and the caller's arrays (raw q, the
    // bounded gate's raw input; the outputs) at the global token: those pointers move by shift[n].
    ChainArgs<T>& Cb = W->C;
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
    Cb.gate_slope = P.gate_slope_out;
    Cb.expA = P.expA;
    Cb.bias = P.dt_bias;
    Cb.beta_slope = P.beta_slope_out;
    Cb.softplus = gate && !cfg.lower_bound;
    Cb.scale = static_cast<T>(cfg.scale);
    Cb.lower_bound = static_cast<T>(cfg.lower_bound.value_or(0.0));
    Cb.g = P.g_out;  // the softplus gate's log decay (block rows)
    ChainGlobals<T>& G = W->G;
    // Raw q (l2 norm) and the bounded gate's raw input: the caller's arrays, or block buffers.
    G.q_in_block = q_block;
    G.g_in_block = g_block;
    if (l2) G.q = q_block ? ptr(W->q_w) : q_c.data_ptr<T>();
    if (gate && cfg.lower_bound) G.g = g_block ? ptr(W->g_w) : g_c.data_ptr<T>();
    G.dq = out.dq.data_ptr<T>();
    G.dk = out.dk.data_ptr<T>();
    G.dg = out.dg.data_ptr<T>();
    G.dbeta = out.dbeta.data_ptr<T>();
    G.dA_rows = ptr(out.dA_rows);
    return W;
  };

  // Blocks run last first. For a kernel that takes side work, with several blocks, 8 threads or
  // more and at least as many units as threads, three workspaces take turns: block j's units run in
  // one parallel region beside the chain rule of block j + 1 (whose units ran in the region before)
  // and the pre-processing of block j - 1 (whose units run in the region after), instead of three
  // regions, each ending in a barrier of all threads, per block (recurrent backward, B1 T8K, 16
  // threads, 16-core host, session 17: H16 0.86-1.00x the time in fp32 (median 0.88x), 0.90-1.00x
  // in bf16; H32 0.76-1.07x, median 0.92x; docs/benchmarks.md). The three blocks' rows, partials
  // and buffers are apart, and each row is computed as in the sequential order: the same bits.
  // Otherwise one workspace, the steps in turn: with fewer units than threads (B1 H4 at 16 threads:
  // 4 units) the units ran 1.3-1.5x slower beside 12 threads streaming the side work, where alone
  // in their region they kept the cache and the chip's clock to themselves; with 2 threads (2-core
  // box, B1 T8K H4 / H16) the overlap read 0.81-1.68x the time, median 1.03x: no gain where few
  // barriers are saved.
  constexpr int64_t kOverlapMinThreads = 8;
  const int64_t threads = at::get_num_threads();
  const bool overlap = kernel.side_work && n_blocks > 1 && threads >= kOverlapMinThreads &&
                       kernel.units >= threads;
  std::vector<std::unique_ptr<Workspace>> wss;
  for (int w = 0; w < (overlap ? 3 : 1); ++w) wss.push_back(make_workspace());
  auto ws_of = [&](int64_t j) -> Workspace& { return *wss[j % wss.size()]; };
  // Block j's token range of every sequence (whole chunks), its rows in W, and its widened
  // inputs (ATen copies, on this thread between the parallel regions).
  auto set_block = [&](Workspace& W, int64_t j) {
    BlockRows& rows = W.rows;
    int64_t used = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t ts = seqs.start[n], te = seqs.end[n], origin = seqs.origin[n];
      const int64_t c0 = cf[n] + j * cb;
      rows.rs[n] = std::clamp(origin + c0 * C, ts, te);
      W.re[n] = std::clamp(origin + (c0 + cb) * C, ts, te);
      rows.loc[n] = used;
      rows.shift[n] = rows.rs[n] - used;
      used += W.re[n] - rows.rs[n];
    }
    rows.loc[d.N] = used;
    if (q_block) copy_block_rows(W.q_w, q_c.reshape({BT, H * K}), rows);
    if (g_block) copy_block_rows(W.g_w, g_c.reshape({BT, HV * K}), rows);
    if (vo_block) {
      copy_block_rows(W.v_w, v_in, rows);
      copy_block_rows(W.do_w, do_in, rows);
    }
  };

  // Values outside the domain, gathered over all blocks and reported once at the end: the
  // smallest index, as the forward reports it (raising at the first block that had one named an
  // element that depended on where blocks start, so on the thread count).
  FirstBad bad;
  auto prep_all = [&](const Workspace& W) { prep_block<T>(W.P, W.rows, false, bad); };
  // The chain rule over the block's rows, written to the outputs at the global tokens.
  auto chain_all = [&](const Workspace& W) {
    at::parallel_for(0, W.rows.loc.back(), block_rows_grain(W.rows), [&](int64_t b, int64_t e) {
      chain_rule_rows<T>(W.C, W.rows, W.G, b, e);
    });
  };

  if (!overlap) {
    Workspace& W = ws_of(0);
    for (int64_t j = n_blocks - 1; j >= 0; --j) {
      set_block(W, j);
      prep_all(W);
      kernel.run_block(W.A, W.rows.rs, W.re, j, SideWork{});
      chain_all(W);
    }
  } else {
    set_block(ws_of(n_blocks - 1), n_blocks - 1);
    prep_all(ws_of(n_blocks - 1));
    for (int64_t j = n_blocks - 1; j >= 0; --j) {
      // Beside block j's units: the chain rule of block j + 1, the pass of block j - 1.
      const Workspace* done = j + 1 < n_blocks ? &ws_of(j + 1) : nullptr;
      const Workspace* next = j > 0 ? &ws_of(j - 1) : nullptr;
      if (next) set_block(ws_of(j - 1), j - 1);
      const RowTasks chains = done ? RowTasks(done->rows) : RowTasks();
      const RowTasks passes = next ? RowTasks(next->rows) : RowTasks();
      SideWork side;
      side.tasks = chains.count + passes.count;
      side.run = [&](int64_t i) {
        if (i < chains.count) {
          chain_rule_rows<T>(done->C, done->rows, done->G, chains.begin(i), chains.end(i));
        } else {
          i -= chains.count;
          prep_rows<T>(next->P, next->rows, false, passes.begin(i), passes.end(i), bad);
        }
      };
      Workspace& W = ws_of(j);
      kernel.run_block(W.A, W.rows.rs, W.re, j, side);
    }
    chain_all(ws_of(0));
  }
  report_domain(bad, in, cfg, d);
}
template void run_bwd_blocked<float>(const Inputs&, const Config&, const BwdSetup&,
                                     const InputGrads&, const BwdBlockKernel<float>&);
template void run_bwd_blocked<double>(const Inputs&, const Config&, const BwdSetup&,
                                      const InputGrads&, const BwdBlockKernel<double>&);

std::vector<at::Tensor> run_backward(const at::Tensor& d_o,
                                     const std::optional<at::Tensor>& d_final_state,
                                     const at::Tensor& checkpoints, const Inputs& in,
                                     const Config& cfg, BackwardRunner<float> run_float,
                                     BackwardRunner<double> run_double) {
  const BwdSetup s = backward_setup(d_o, d_final_state, checkpoints, in, cfg);
  // The outputs, written once (in the compute dtype; converted at the end only for other dtypes).
  const InputGrads o = empty_input_grads(s.d, in, cfg);
  if (compute_dtype(in.q) == at::kDouble) {
    run_double(in, cfg, s, o);
  } else {
    run_float(in, cfg, s, o);
  }
  return backward_outputs(o, s.d, in, cfg);
}

}  // namespace detail
}  // namespace kda
