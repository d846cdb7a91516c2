// CPU forward of the fused recurrent KDA: the driver (token blocks, pre-processing per block)
// that runs the fused kernels (csrc/cpu/kernels) over (sequence, value head, V-slice) units.
#include "cpu/kda_cpu.h"
#include "cpu/kernels/recurrent_kernels.h"
#include "cpu/output_cache.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kda {
namespace detail {

namespace {
// "[b, t, h" of a global token index (token = b * T + t).
std::string where_of(int64_t token, int64_t T, int64_t h) {
  return message("[", T > 0 ? token / T : 0, ", ", T > 0 ? token % T : token, ", ", h);
}

}  // namespace

// Raises what the pre-processing pass found (docs/bad_inputs.md, "Values outside the domain"),
// with the value read from the caller's tensor. (The warning about beta * ||k||^2 > 2 is
// Python's: a TORCH_WARN from an op called through torch.ops reaches stderr, not Python.)
void report_domain(const FirstBad& bad, const Inputs& in, const Config& cfg,
                   const Dims& d) {
  const int64_t bg = bad.g.load(), bb = bad.beta.load();
  if (bg >= 0) {
    const int64_t token = bg / (d.HV * d.K), hv = (bg / d.K) % d.HV, i = bg % d.K;
    const double val = in.g.reshape({-1})[bg].item<double>();
    KDA_CHECK_VALUE(false, cfg.op, "g must be a log-decay <= 0 with "
                      "use_gate_in_kernel=False, got g", where_of(token, d.T, hv), ", ", i,
                      "] = ", val, "; pass log(decay) for a decay in (0, 1], or the raw gate "
                      "input with use_gate_in_kernel=True and A_log");
  }
  if (bb >= 0) {
    // bb indexes beta [B, T, HV], or the head-wise [B, T, HV, V] of the serving calls.
    const int64_t C = in.beta.dim() == 4 ? d.V : 1;
    const int64_t token = bb / (d.HV * C), hv = (bb / C) % d.HV;
    const std::string column = C > 1 ? ", " + std::to_string(bb % C) : std::string();
    const double val = in.beta.reshape({-1})[bb].item<double>();
    KDA_CHECK_VALUE(false, cfg.op, "beta must lie in [0, 2] with "
                      "use_beta_sigmoid_in_kernel=False, got beta", where_of(token, d.T, hv),
                      column, "] = ", val,
                      "; pass use_beta_sigmoid_in_kernel=True if beta holds logits");
  }
}

GateParams gate_params(const Inputs& in, const Config& cfg, at::ScalarType ct) {
  GateParams gp;
  if (cfg.use_gate_in_kernel && in.A_log) {
    gp.A_log = in.A_log->to(ct).contiguous();
    gp.expA = at::exp(gp.A_log).contiguous();
  }
  if (cfg.use_gate_in_kernel && in.dt_bias) {
    gp.bias = in.dt_bias->to(ct).contiguous().reshape({-1});
  }
  return gp;
}

template <typename T>
kernels::PrepArgs<T> block_prep_args(const Config& cfg, const Dims& d, int64_t stride,
                                     const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& g, const at::Tensor& beta,
                                     const GateParams& gate) {
  kernels::PrepArgs<T> P;
  P.BT = stride;
  P.H = d.H;
  P.HV = d.HV;
  P.K = d.K;
  P.scale = cfg.scale;
  P.l2norm = cfg.use_qk_l2norm_in_kernel;
  P.gate = !cfg.use_gate_in_kernel ? kernels::GateMode::kNone
           : cfg.lower_bound       ? kernels::GateMode::kBounded
                                   : kernels::GateMode::kSoftplus;
  P.lower_bound = cfg.lower_bound.value_or(0.0);
  P.beta_sigmoid = cfg.use_beta_sigmoid_in_kernel;
  P.beta_mult = cfg.allow_neg_eigval ? 2.0 : 1.0;
  // Each input through the pointer its dtype names (q and k share one storage).
  const at::ScalarType ct = std::is_same_v<T, float> ? at::kFloat : at::kDouble;
  auto point = [&](const at::Tensor& t, kernels::Storage& st, const T*& p32,
                   const uint16_t*& p16) {
    st = storage_of(t.scalar_type(), ct).value();
    if (st == kernels::Storage::kCompute) {
      p32 = t.data_ptr<T>();
    } else {
      p16 = static_cast<const uint16_t*>(t.data_ptr());
    }
  };
  point(q, P.q_store, P.q, P.q16);
  point(k, P.q_store, P.k, P.k16);
  point(g, P.g_store, P.g, P.g16);
  point(beta, P.beta_store, P.beta, P.beta16);
  P.expA = gate.expA.defined() ? gate.expA.data_ptr<T>() : nullptr;
  P.A_log = gate.A_log.defined() ? gate.A_log.data_ptr<T>() : nullptr;
  P.dt_bias = gate.bias.defined() ? gate.bias.data_ptr<T>() : nullptr;
  return P;
}
template kernels::PrepArgs<float> block_prep_args<float>(const Config&, const Dims&, int64_t,
                                                         const at::Tensor&, const at::Tensor&,
                                                         const at::Tensor&, const at::Tensor&,
                                                         const GateParams&);
template kernels::PrepArgs<double> block_prep_args<double>(const Config&, const Dims&, int64_t,
                                                           const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, const at::Tensor&,
                                                           const GateParams&);

template <typename T>
void prep_rows(const kernels::PrepArgs<T>& P, const BlockRows& rows, bool shifted_inputs,
               int64_t b, int64_t e, FirstBad& bad) {
  const auto prep = prep_kernel<T>();
  for_block_rows(rows, b, e, [&](int64_t n, int64_t rb, int64_t stop) {
    kernels::PrepArgs<T> Pn = P;
    Pn.out_shift = rows.shift[n];
    Pn.in_shift = shifted_inputs ? rows.shift[n] : 0;
    bad.add(prep(Pn, rows.rs[n] + (rb - rows.loc[n]), rows.rs[n] + (stop - rows.loc[n])));
  });
}
template <typename T>
void prep_block(const kernels::PrepArgs<T>& P, const BlockRows& rows, bool shifted_inputs,
                FirstBad& bad) {
  at::parallel_for(0, rows.loc.back(), block_rows_grain(rows), [&](int64_t b, int64_t e) {
    prep_rows(P, rows, shifted_inputs, b, e, bad);
  });
}
#define KDA_PREP_INSTANTIATE(T)                                                               \
  template void prep_rows<T>(const kernels::PrepArgs<T>&, const BlockRows&, bool, int64_t,   \
                             int64_t, FirstBad&);                                            \
  template void prep_block<T>(const kernels::PrepArgs<T>&, const BlockRows&, bool, FirstBad&);
KDA_PREP_INSTANTIATE(float)
KDA_PREP_INSTANTIATE(double)
#undef KDA_PREP_INSTANTIATE

std::optional<kernels::Storage> storage_of(at::ScalarType st, at::ScalarType ct) {
  if (st == ct) return kernels::Storage::kCompute;
  if (ct == at::kFloat && st == at::kBFloat16) return kernels::Storage::kBf16;
  if (ct == at::kFloat && st == at::kHalf) return kernels::Storage::kF16;
  return std::nullopt;
}

void copy_block_rows(const at::Tensor& dst, const at::Tensor& src, const BlockRows& rows) {
  const int64_t N = static_cast<int64_t>(rows.rs.size());
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = rows.loc[n + 1] - rows.loc[n];
    if (len > 0) dst.narrow(0, rows.loc[n], len).copy_(src.narrow(0, rows.rs[n], len));
  }
}

void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (!t.defined() || t.nbytes() < 2 * kHuge) return;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t b = (p + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (p + t.nbytes()) & ~(kHuge - 1);
  if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

Sequences make_sequences(const Inputs& in, const Dims& d) {
  Sequences s;
  s.start.resize(d.N);
  s.end.resize(d.N);
  s.origin.resize(d.N);
  s.slot_base.resize(d.N);
  const int64_t n_chunks = (d.T + kernels::kChunk - 1) / kernels::kChunk;
  if (d.varlen) {
    const auto cu = in.cu_seqlens->to(at::kLong).contiguous();
    const int64_t* c = cu.data_ptr<int64_t>();
    for (int64_t n = 0; n < d.N; ++n) {
      s.start[n] = c[n];
      s.end[n] = c[n + 1];
      s.origin[n] = 0;
      s.slot_base[n] = 0;
    }
  } else {
    for (int64_t n = 0; n < d.N; ++n) {
      s.start[n] = n * d.T;
      s.end[n] = (n + 1) * d.T;
      s.origin[n] = n * d.T;
      s.slot_base[n] = n * n_chunks;
    }
  }
  return s;
}

kernels::SeqInfo seq_info(const Sequences& s) {
  kernels::SeqInfo info;
  info.n_seq = static_cast<int64_t>(s.start.size());
  info.seq_start = s.start.data();
  info.seq_end = s.end.data();
  info.origin = s.origin.data();
  info.slot_base = s.slot_base.data();
  return info;
}

at::Tensor state_kv(const std::optional<at::Tensor>& s, const Config& cfg, at::ScalarType ct) {
  if (!s) return at::Tensor();
  // Converted and transposed in one copy into a block of the output cache (when either is
  // needed): a fresh 32 MB state at B64 H32 faulted 8K pages per call.
  return to_output(cfg.state_v_first ? s->transpose(-1, -2) : *s, ct);
}

namespace {

// Token blocks of the forward: the pre-processed q, k, decay, decay*k and beta of one block of
// every sequence (tb tokens each) live in a small workspace (a few MB: cache-resident, and reused
// by the allocator from call to call instead of page-faulting fresh full-size arrays in); the
// recurrence runs over the block, then the next block is pre-processed. The chunk forward
// pre-processes each chunk's rows of one head itself, right before its products read them from L1 /
// L2 (through the block's rows they were read long after the pass wrote them, from L3 or memory:
// docs/benchmarks.md, "The chunk forward pre-processes its own rows"); its blocks hold only
// converted inputs and o rows, 2 MB of what would be its pre-processed rows (with 8 MB of such rows
// the first reads had missed L2: B1 T8K H4 bf16, 1 thread, Zen 5 box, chunk forward 42.6-43.0 ->
// 36.7-38.6 ms; the recurrent kernels gain nothing from smaller blocks: 32.4 ms with 1 MB against
// 32.5 ms with 8 MB). For the recurrent kernels (BlockKernel::kRecurrent) the workspace is 2 MB per
// thread, at least 2 MB: each block costs two parallel regions (the pre-processing pass, then the
// units), and on the 16-core host 64-token blocks (H32) spent more in those barriers than the
// smaller workspace saved (H32 at 16 threads 117-161K -> 160-170K tokens/s with 32 MB); at 1 thread
// on the 2-core Zen 4 box 2 MB ran 4-14% faster than 8 MB (B1 T8K H4 / H16, fp32 and bf16,
// alternating in one process; the pass that writes the rows took about half as long with H16's
// 64-token blocks), and 32 MB 5-10% slower. Their results do not depend on the block size (each
// token's arithmetic is the same in any block), so neither do they on the thread count
// (tests/test_concurrency.py compares 1 and 8 threads where the plans differ). The chunk forward's
// products do depend on how many chunks a block holds (in the last bits), so its blocks stay a
// function of the shapes.
struct BlockPlan {
  int64_t tb = 0;        // tokens of a sequence per block
  int64_t n_blocks = 0;
  int64_t nb = 0;        // workspace rows (tokens of all sequences in one block)
};

constexpr int64_t kMinChunksPerBlock = 4;

BlockPlan plan_blocks(const Dims& d, const Sequences& s, size_t elt, BlockKernel kernel) {
  const int64_t per_token =
      std::max<int64_t>(1, ((2 * d.H + 2 * d.HV) * d.K + d.HV) * static_cast<int64_t>(elt));
  int64_t tb;
  if (kernel == BlockKernel::kRecurrent) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    tb = (2 * threads << 20) / per_token;
  } else {
    // At least kMinChunksPerBlock chunks of each sequence: with 2 MB a block of H16 holds one
    // chunk, and on the 16-core host every 64 tokens then ended in a barrier of all threads
    // (B1 T8K H16 bf16, 16 threads: chunk forward 1.1-1.4x slower than with 8 MB blocks).
    tb = std::max<int64_t>((int64_t(2) << 20) / per_token, kMinChunksPerBlock * kernels::kChunk);
  }
  tb = std::min<int64_t>(4096, std::max<int64_t>(kernels::kChunk, tb / kernels::kChunk * kernels::kChunk));
  int64_t max_len = 0;
  for (size_t n = 0; n < s.start.size(); ++n) max_len = std::max(max_len, s.end[n] - s.start[n]);
  const int64_t BT = d.B * d.T;
  BlockPlan p;
  if (d.N * tb >= BT) {  // short sequences (decoding, small batches): one block, whole arrays
    p.tb = std::max<int64_t>(1, max_len);
    p.n_blocks = 1;
    p.nb = BT;
  } else {
    p.tb = tb;
    p.n_blocks = (max_len + tb - 1) / tb;
    p.nb = std::min(BT, d.N * tb);
  }
  return p;
}


}  // namespace

template <typename T>
void run_fwd_blocked(const Inputs& in, const Config& cfg, const Dims& d, const Sequences& seqs,
                     const at::Tensor& h0, const at::Tensor& o, const at::Tensor& ht,
                     const at::Tensor& ckpt, BlockKernel kernel,
                     const BlockRunner<T>& run_block) {
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const int64_t BT = d.B * d.T;
  const BlockPlan plan = plan_blocks(d, seqs, sizeof(T), kernel);
  const int64_t nb = plan.nb;
  // bf16 / fp16 inputs of an fp32 computation are read as they are by the pre-processing pass,
  // which widens them in registers (half the bytes, no conversion pass; v is widened into the
  // block's rows by the same pass). Other mixes (fp32 under fp64 q, or fp16 g with bf16 q) are
  // converted block by block into the workspace (in cache) instead of as whole-array copies; so
  // is the output o when its dtype is not the compute dtype.
  const auto q_st = storage_of(in.q.scalar_type(), ct), g_st = storage_of(in.g.scalar_type(), ct),
             b_st = storage_of(in.beta.scalar_type(), ct), v_st = storage_of(in.v.scalar_type(), ct);
  const bool direct = q_st && g_st && b_st;
  const bool conv_in = !direct;
  const bool conv_vo = in.v.scalar_type() != ct || o.scalar_type() != ct;
  const bool widen_v = direct && v_st && *v_st != kernels::Storage::kCompute;
  const at::Tensor q_in = in.q.reshape({BT, d.H * d.K});
  const at::Tensor k_in = in.k.reshape({BT, d.H * d.K});
  const at::Tensor g_in = in.g.reshape({BT, d.HV * d.K});
  const at::Tensor b_in = in.beta.reshape({BT, d.HV});
  at::Tensor v_in = in.v.reshape({BT, d.HV * d.V});
  at::Tensor q_c, k_c, g_c, b_c, v_c;  // compute-dtype inputs read by the kernels
  at::Tensor q_w, k_w, g_w, b_w, o_w;  // block buffers of the conversions (v's: Workspace::v)
  if (conv_in) {
    q_w = empty_output({nb, d.H * d.K}, opts);
    k_w = empty_output({nb, d.H * d.K}, opts);
    g_w = empty_output({nb, d.HV * d.K}, opts);
    b_w = at::empty({nb, d.HV}, opts);
    q_c = q_w, k_c = k_w, g_c = g_w, b_c = b_w;
  } else {
    q_c = q_in.contiguous(), k_c = k_in.contiguous(), g_c = g_in.contiguous();
    b_c = b_in.contiguous();
  }
  if (widen_v) v_in = v_in.contiguous();
  // The chunk kernel pre-processes (and widens) its own rows: no block arrays of them.
  const bool own_rows = kernel == BlockKernel::kChunk;
  if (conv_vo) {
    o_w = empty_output({nb, d.HV * d.V}, opts);
  } else {
    v_c = v_in.contiguous();
  }
  const GateParams gate = gate_params(in, cfg, ct);

  // The recurrent kernels' blocks are pre-processed one ahead: block j + 1's pass runs in the
  // parallel region of block j's units (SideWork), into the second of two workspaces, instead of
  // in a parallel region of its own between them. The pass is bound by memory and the units by
  // arithmetic: at 16 threads the pass ran at a fifth of its one-thread speed per thread, all
  // threads at once between two barriers (docs/benchmarks.md, "Prefill without page faults").
  // Only for inputs the pass reads as they are (the conversions' block buffers are single), and
  // with more than one thread: one thread would pre-process block j + 1 between block j's pass
  // and its units, and read block j's rows back from further out than its L2.
  const bool ahead = !own_rows && !conv_in && plan.n_blocks > 1 && at::get_num_threads() > 1;
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; };
  kernels::PrepArgs<T> P0 = block_prep_args<T>(cfg, d, nb, q_c, k_c, g_c, b_c, gate);
  if (widen_v) {
    P0.v_store = *v_st;
    P0.v16 = static_cast<const uint16_t*>(v_in.data_ptr());
    P0.VW = d.HV * d.V;
  }
  BlockPrep<T> own;
  own.P = P0;  // the chunk kernel's: inputs set, outputs its own
  own.shifted_inputs = conv_in;

  // A block's rows (its token range [rs, re) of every sequence, their rows in the workspace, the
  // shifts), its pre-processed rows: [H, nb, K] q and k, [HV, nb, K] decay and decay*k (a * khat
  // only for the recurrent kernel: its fused read of the next token's state), [HV, nb] beta, v
  // converted or widened, and the pass's and the kernel's arguments on them. The buffers come
  // from the output cache too (1-2 MB each): glibc hands heap blocks of this size back to the
  // system when it trims its heap, and then the next call faults them in again.
  struct Workspace {
    explicit Workspace(int64_t N) : rows(N), re(N) {}
    BlockRows rows;
    std::vector<int64_t> re;
    at::Tensor q, k, a, ak, beta, v;
    kernels::PrepArgs<T> P;
    kernels::FwdArgs<T> A;
  };
  std::vector<std::unique_ptr<Workspace>> wss;  // (the arguments point into their own vectors)
  for (int w = 0; w < (ahead ? 2 : 1); ++w) {
    Workspace& W = *wss.emplace_back(std::make_unique<Workspace>(d.N));
    if (conv_vo && !(own_rows && widen_v)) W.v = empty_output({nb, d.HV * d.V}, opts);
    if (!own_rows) {
      W.q = empty_output({d.H, nb, d.K}, opts);
      W.k = empty_output({d.H, nb, d.K}, opts);
      W.a = empty_output({d.HV, nb, d.K}, opts);
      W.ak = empty_output({d.HV, nb, d.K}, opts);
      W.beta = empty_output({d.HV, nb}, opts);
    }
    W.P = P0;
    W.P.q_out = ptr(W.q);
    W.P.k_out = ptr(W.k);
    W.P.a_out = ptr(W.a);
    W.P.ak_out = ptr(W.ak);
    W.P.beta_out = ptr(W.beta);
    if (widen_v) W.P.v_out = ptr(W.v);
    kernels::FwdArgs<T>& A = W.A;
    A.seqs = seq_info(seqs);
    A.seqs.shift = W.rows.shift.data();
    // v and o of the block's rows live in the block buffers (row = token - shift) when converted
    A.seqs.vo_shift = conv_vo ? W.rows.shift.data() : nullptr;
    point_at_block_rows(A, W.P, d);
    A.v = conv_vo ? ptr(W.v) : ptr(v_c);
    A.h0 = h0.defined() ? h0.data_ptr<T>() : nullptr;
    A.o = conv_vo ? o_w.data_ptr<T>() : o.data_ptr<T>();
    A.ht = ht.data_ptr<T>();
    A.ckpt = ckpt.defined() && ckpt.numel() > 0 ? ckpt.data_ptr<T>() : nullptr;
  }
  // Block j's token range of every sequence, and its rows in W.
  auto set_block = [&](Workspace& W, int64_t j) {
    int64_t used = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t rs = std::min(seqs.end[n], seqs.start[n] + j * plan.tb);
      W.rows.rs[n] = rs;
      W.re[n] = std::min(seqs.end[n], rs + plan.tb);
      W.rows.loc[n] = used;
      W.rows.shift[n] = rs - used;
      used += W.re[n] - rs;
    }
    W.rows.loc[d.N] = used;
  };
  // Pre-processing of a block's rows; values outside the domain are reported before the
  // block's recurrence runs.
  auto prep_now = [&](const Workspace& W) {
    FirstBad bad;
    prep_block<T>(W.P, W.rows, conv_in, bad);
    report_domain(bad, in, cfg, d);
  };
  if (ahead) {
    set_block(*wss[0], 0);
    prep_now(*wss[0]);
  }
  for (int64_t j = 0; j < plan.n_blocks; ++j) {
    Workspace& W = *wss[j % wss.size()];
    if (!ahead) set_block(W, j);
    if (conv_in) {
      copy_block_rows(q_w, q_in, W.rows);
      copy_block_rows(k_w, k_in, W.rows);
      copy_block_rows(g_w, g_in, W.rows);
      copy_block_rows(b_w, b_in, W.rows);
    }
    if (conv_vo && !widen_v) copy_block_rows(W.v, v_in, W.rows);
    if (!own_rows && !ahead) prep_now(W);
    // One ahead: block j + 1's pass beside block j's units, in tasks of a few rows.
    Workspace* next = ahead && j + 1 < plan.n_blocks ? wss[(j + 1) % 2].get() : nullptr;
    SideWork side;
    FirstBad bad_next;
    if (next) {
      set_block(*next, j + 1);
      const RowTasks passes(next->rows);
      side.tasks = passes.count;
      side.run = [&, next, passes](int64_t i) {
        prep_rows<T>(next->P, next->rows, false, passes.begin(i), passes.end(i), bad_next);
      };
    }
    run_block(W.A, own, W.rows.rs, W.re, j, plan.n_blocks, side);
    if (next) report_domain(bad_next, in, cfg, d);
    if (conv_vo) {
      const at::Tensor o2 = o.view({BT, d.HV * d.V});
      for (int64_t n = 0; n < d.N; ++n) {
        const int64_t len = W.re[n] - W.rows.rs[n];
        if (len > 0) o2.narrow(0, W.rows.rs[n], len).copy_(o_w.narrow(0, W.rows.loc[n], len));
      }
    }
  }
}
template void run_fwd_blocked<float>(const Inputs&, const Config&, const Dims&, const Sequences&,
                                     const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, BlockKernel, const BlockRunner<float>&);
template void run_fwd_blocked<double>(const Inputs&, const Config&, const Dims&, const Sequences&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, BlockKernel, const BlockRunner<double>&);

namespace {

// The recurrence over one token block (run_fwd_blocked's BlockRunner).
template <typename T>
void run_recurrent(const Inputs& in, const Config& cfg, const Dims& d, const Sequences& seqs,
                   const at::Tensor& h0, const at::Tensor& o, const at::Tensor& ht,
                   const at::Tensor& ckpt) {
  const auto& tab = kernels::table();
  auto fwd = [&]() {
    if constexpr (std::is_same_v<T, float>) {
      return tab.fwd_f32;
    } else {
      return tab.fwd_f64;
    }
  }();
  // Units: (sequence, value head, group of V-slices). Fewer groups means the q/k/decay rows of a
  // token block are reused from cache by more slices; more groups give threads work when there
  // are few heads. Each column is computed the same way whatever the grouping, so the result
  // does not depend on it (nor on the thread count).
  const int64_t n_slices = (d.V + kernels::kFwdSlice - 1) / kernels::kFwdSlice;
  const int64_t heads = std::max<int64_t>(1, d.N * d.HV);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t groups =
      std::max<int64_t>(1, std::min(n_slices, (2 * threads + heads - 1) / heads));
  const int64_t units = d.N * d.HV * groups;

  // One scratch per thread (reads, zeros, states of the unit's slices), reused by all its units
  // and blocks: no allocation inside the parallel regions.
  const int64_t ws_stride = kernels::fwd_scratch_elems(d.K, n_slices);
  const auto opts = in.q.options().dtype(compute_dtype(in.q));
  const at::Tensor thread_ws = empty_output({threads * ws_stride}, opts);
  T* const ws0 = thread_ws.data_ptr<T>();
  // The running states between token blocks, in the kernels' layout (FwdArgs::slices), made at
  // the first block of a call in several; a call in one block keeps them in the threads'
  // scratch instead.
  at::Tensor states;
  run_fwd_blocked<T>(in, cfg, d, seqs, h0, o, ht, ckpt, BlockKernel::kRecurrent,
                     [&](const kernels::FwdArgs<T>& block_args, const BlockPrep<T>&,
                         const std::vector<int64_t>& rs, const std::vector<int64_t>& re,
                         int64_t j, int64_t n_blocks, const SideWork& side) {
    if (j == 0 && n_blocks > 1) {
      states = empty_output({kernels::fwd_slices_elems(d.N, d.HV, d.K, d.V)}, opts);
    }
    kernels::FwdArgs<T> A = block_args;
    A.slices = states.defined() ? states.data_ptr<T>() : nullptr;
    auto unit = [&](int64_t u) {
      const int64_t gi = u % groups;
      const int64_t hv = (u / groups) % d.HV;
      const int64_t n = u / (groups * d.HV);
      // An empty sequence still runs once (in block 0), so its final state is its initial one.
      if (rs[n] == re[n] && !(j == 0 && seqs.start[n] == seqs.end[n])) return;
      T* ws = ws0 + std::min<int64_t>(at::get_thread_num(), threads - 1) * ws_stride;
      fwd(A, n, hv, gi * n_slices / groups, (gi + 1) * n_slices / groups, rs[n], re[n], ws);
    };
    // The units and the next block's pass in one parallel region (the pass writes other rows).
    run_units_beside(units, side, [&](const auto& take) {
      for (int64_t u; take(u);) unit(u);
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_forward(const Inputs& in, const Config& cfg,
                                                           bool with_checkpoints,
                                                           ForwardRunner<float> run_float,
                                                           ForwardRunner<double> run_double) {
  const Dims d = check_inputs(in, cfg, /*check_values=*/true);
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const Sequences seqs = make_sequences(in, d);
  const at::Tensor h0 = state_kv(in.initial_state, cfg, ct);

  // o in q's dtype, written once (block by block through the workspace when it is not ct). The
  // large outputs reuse freed blocks of earlier calls (csrc/cpu/output_cache.h: no page faults).
  at::Tensor o = empty_output({d.B, d.T, d.HV, d.V}, in.q.options());
  at::Tensor ht = empty_output({d.N, d.HV, d.K, d.V}, opts);
  at::Tensor ckpt = with_checkpoints ? empty_output({d.n_slots, d.HV, d.K, d.V}, opts)
                                     : at::empty({0}, opts);
  if (ct == at::kDouble) {
    run_double(in, cfg, d, seqs, h0, o, ht, ckpt);
  } else {
    run_float(in, cfg, d, seqs, h0, o, ht, ckpt);
  }
  if (cfg.state_v_first) {
    at::Tensor t = empty_output({d.N, d.HV, d.V, d.K}, opts);
    t.copy_(ht.transpose(-1, -2));
    ht = t;
  }
  return {o, ht, ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd_cpu(const Inputs& in,
                                                                  const Config& cfg,
                                                                  bool with_checkpoints) {
  return run_forward(in, cfg, with_checkpoints, &run_recurrent<float>, &run_recurrent<double>);
}

}  // namespace detail
}  // namespace kda
