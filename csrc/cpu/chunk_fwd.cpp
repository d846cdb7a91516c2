// CPU forward of the chunkwise KDA (docs/math.md, "Chunkwise form"): the token blocks of the
// recurrent forward (run_fwd_blocked), and in each block the chunks of fwd_chunk(amx) tokens of
// every (sequence, value head) unit through the shared pieces of csrc/cpu/chunk_common.h: in
// waves of a few chunks per unit, the state-independent part of every chunk in parallel (each chunk
// pre-processes its own rows of one head with the recurrent forward's pass, then chunk_intra),
// and each unit's state steps in chunk order as soon as its chunks' parts are done.
//
// Chunks start at origin + c * fwd_chunk(amx), the recurrent forward's checkpoint interval kChunk
// or half of it, so every chunk or every other one starts at a checkpoint (a sequence of a
// varlen batch that starts inside a chunk has a shorter first chunk), and the checkpoints
// [n_slots, HV, K, V] hold exactly what kda::fused_recurrent_fwd stores there: either backward
// can consume them.
#include "cpu/chunk_common.h"
#include "cpu/kda_cpu.h"
#include "cpu/output_cache.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <type_traits>

namespace kda {
namespace detail {

namespace {

// One chunk's pre-processed rows of one head (a thread's, reused by each of its chunks): the
// ChunkIn arrays, and v widened from 16 bits (else the chunk reads the caller's v).
template <typename T>
struct ChunkRows {
  T *q, *k, *a, *beta, *v;
  ChunkRows(Carver& c, int64_t K, int64_t V)
      : q(c.take<T>(chunk::kC * K)),
        k(c.take<T>(chunk::kC * K)),
        a(c.take<T>(chunk::kC * K)),
        beta(c.take<T>(chunk::kC)),
        v(c.take<T>(chunk::kC * V)) {}
};

// The forward's chunk length: half the checkpoint interval kC (every other chunk starts at a
// checkpoint), or kC with the AMX shapes (chunk::amx_shapes). The state-independent work per
// token (A0, M, T, T R', M Vn) grows with the chunk length, the state step's products per token
// do not: at B1 T8K H4 on one Zen 4 core, chunks of 32 tokens ran the op 7% faster than chunks
// of 64 with bf16 products and 8% with fp32 ones (chunks of 16 were slower than 32); on the AMX
// Xeon host, where every product call costs more set-up, 3-10% slower (docs/benchmarks.md,
// session 27).
int64_t fwd_chunk(bool amx) { return amx ? chunk::kC : chunk::kC / 2; }

template <typename U>
U* at_offset(U* p, int64_t off) {
  return p ? p + off : p;
}

// Pre-processes tokens [t0, t1) (at most kChunk) of sequence n for key head h and value head hv
// into rows (prep_tokens on a view of those heads: the pass reads only their columns), and
// keeps in bad what it found outside the domain, numbered as the whole pass numbers it.
template <typename T>
void prep_chunk_rows(const BlockPrep<T>& bp, const Dims& d, const kernels::SeqInfo& seqs,
                     int64_t n, int64_t h, int64_t hv, int64_t t0, int64_t t1,
                     const ChunkRows<T>& rows, FirstBad& bad) {
  const int64_t K = d.K, V = d.V, HV = d.HV;
  kernels::PrepArgs<T> P = bp.P;
  P.q_ld = d.H * K;
  P.g_ld = HV * K;
  P.beta_ld = HV;
  P.v_ld = HV * V;
  P.H = 1;
  P.HV = 1;
  P.VW = V;
  P.q = at_offset(P.q, h * K);
  P.k = at_offset(P.k, h * K);
  P.q16 = at_offset(P.q16, h * K);
  P.k16 = at_offset(P.k16, h * K);
  P.g = at_offset(P.g, hv * K);
  P.g16 = at_offset(P.g16, hv * K);
  P.beta = at_offset(P.beta, hv);
  P.beta16 = at_offset(P.beta16, hv);
  P.v16 = at_offset(P.v16, hv * V);
  P.expA = at_offset(P.expA, hv);
  P.A_log = at_offset(P.A_log, hv);
  P.dt_bias = at_offset(P.dt_bias, hv * K);
  P.BT = chunk::kC;
  P.out_shift = t0;
  P.in_shift = bp.shifted_inputs ? seqs.shift[n] : 0;
  P.q_out = rows.q;
  P.k_out = rows.k;
  P.a_out = rows.a;
  P.ak_out = nullptr;
  P.beta_out = rows.beta;
  P.v_out = P.v16 ? rows.v : nullptr;
  kernels::PrepReport r = prep_kernel<T>()(P, t0, t1);
  // The view numbers g's entries t * K + i and beta's t; the whole pass, t * HV * K + hv * K + i
  // and t * HV + hv.
  if (r.bad_g >= 0) r.bad_g = (r.bad_g / K * HV + hv) * K + r.bad_g % K;
  if (r.bad_beta >= 0) r.bad_beta = r.bad_beta * HV + hv;
  bad.add(r);
}

template <typename T>
void run_chunks(const Inputs& in, const Config& cfg, const Dims& d, const Sequences& seqs,
                const at::Tensor& h0, const at::Tensor& o, const at::Tensor& ht,
                const at::Tensor& ckpt) {
  const int64_t K = d.K, V = d.V, HV = d.HV, H = d.H, KV = K * V, units = d.N * HV;
  // bf16 state products for 16-bit inputs (chunk_products.h); fp64 keeps its own.
  const chunk::Products products = std::is_same_v<T, float>
      ? chunk::choose_products(in.q.scalar_type(), K, V, cfg.op)
      : chunk::Products::kNative;
  const bool bf16 = products != chunk::Products::kNative;
  const bool amx = chunk::amx_shapes(cfg.op);  // the product shapes (chunk_products.h)
  // A thread's workspace: the ChunkWork parts, then (bf16 products) the ProductWork parts.
  auto thread_work = [&](Carver& c) {
    chunk::ChunkWork<T> w(c, K, V);
    if (bf16) {
      w.prod = chunk::ProductWork(products, c, K, V);
      w.prod.whole = amx;
    }
    return w;
  };
  Carver sizer(nullptr);  // carves no memory: the parts stay null, only the sizes count
  chunk::ChunkWork<T> sized = thread_work(sizer);
  const int64_t rows_at = sizer.bytes();  // then the thread's ChunkRows
  ChunkRows<T>(sizer, K, V);
  const int64_t work = sizer.bytes();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // From the output cache, as every per-call buffer of the ops (csrc/cpu/output_cache.h).
  const at::Tensor ws = empty_output({threads * work + 64}, ht.options().dtype(at::kByte));
  // 64-byte aligned start (every part then is too).
  char* const ws0 = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(ws.data_ptr()) + 63) / 64 * 64);
  // Waves: the next `wave` chunks of every unit of a group of at most 4 units per thread. Their
  // state-independent parts (chunk_intra, ~3/4 of the work) are items taken one by one from a
  // shared counter (units differ: strongly decaying heads cost up to twice as much, and with
  // about as many units as threads a static split leaves most threads waiting for the slowest
  // head), and each unit's state steps follow its items in chunk order, in the same parallel
  // region (data flow, below). A wave has 4 to 8 chunks per thread; their results (~160 KB
  // each at K = V = 128) live in `store` until their state steps.
  const int64_t group = std::min(units, 4 * threads);
  const int64_t wave = (4 * threads + group - 1) / std::max<int64_t>(1, group);
  Carver item_sizer(nullptr);
  chunk::bind_results(sized, item_sizer, K, V, bf16);
  const int64_t item_bytes = item_sizer.bytes();
  const at::Tensor store =
      empty_output({group * wave * item_bytes + 64}, ht.options().dtype(at::kByte));
  char* const store0 = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(store.data_ptr()) + 63) / 64 * 64);
  const T* s0 = h0.defined() ? h0.data_ptr<T>() : nullptr;
  // Checkpoints every C = kC tokens; the chunks themselves are L = fwd_chunk(amx) tokens.
  constexpr int64_t C = chunk::kC;
  const int64_t L = fwd_chunk(amx);

  // A thread's workspace, with the results of item `item` of the wave; the thread's rows.
  auto thread_ws = [&]() {
    return ws0 + std::min<int64_t>(at::get_thread_num(), threads - 1) * work;
  };
  auto workspace = [&](int64_t item) {
    Carver c(thread_ws());
    chunk::ChunkWork<T> w = thread_work(c);
    Carver results(store0 + item * item_bytes);
    chunk::bind_results(w, results, K, V, bf16);
    return w;
  };
  auto thread_rows = [&]() {
    Carver c(thread_ws() + rows_at);
    return ChunkRows<T>(c, K, V);
  };

  run_fwd_blocked<T>(in, cfg, d, seqs, h0, o, ht, ckpt, BlockKernel::kChunk,
                     [&](const kernels::FwdArgs<T>& A, const BlockPrep<T>& bp,
                         const std::vector<int64_t>& rs, const std::vector<int64_t>& re,
                         int64_t j, int64_t, const SideWork&) {
    // The chunks of sequence n in this block start at cs[n][k] (the last one ends at re[n]);
    // they start at origin + c * kChunk (a sequence starting inside a chunk has a shorter first
    // one), so the checkpoints are those of the recurrent forward.
    std::vector<std::vector<int64_t>> cs(d.N);
    for (int64_t n = 0; n < d.N; ++n) {
      for (int64_t t0 = rs[n]; t0 < re[n];) {
        cs[n].push_back(t0);
        t0 = std::min(re[n], seqs.origin[n] + ((t0 - seqs.origin[n]) / L + 1) * L);
      }
    }
    // Chunk k of unit (n, hv): its length, and (with rows) its inputs, pre-processed into rows
    // (the state steps read only chunk_intra's results).
    auto chunk_in = [&](int64_t n, int64_t hv, int64_t k, const ChunkRows<T>* rows,
                        FirstBad* bad) {
      const int64_t t0 = cs[n][k];
      const int64_t t1 = k + 1 < int64_t(cs[n].size()) ? cs[n][k + 1] : re[n];
      chunk::ChunkIn<T> ci;
      ci.n = t1 - t0;
      ci.K = K;
      ci.V = V;
      if (!rows) return ci;
      prep_chunk_rows(bp, d, A.seqs, n, hv / (HV / H), hv, t0, t1, *rows, *bad);
      ci.q = rows->q;
      ci.k = rows->k;
      ci.a = rows->a;
      ci.beta = rows->beta;
      if (bp.P.v16) {
        ci.v = rows->v;
        ci.ldv = V;
      } else {
        const int64_t vsh = A.seqs.vo_row_shift(n);
        ci.v = A.v + ((t0 - vsh) * HV + hv) * V;
        ci.ldv = HV * V;
      }
      return ci;
    };
    FirstBad bad;
    // The running state lives in ht (between token blocks too); a block that starts a sequence
    // starts it from h0 (an empty sequence: in block 0). Most blocks start none (B1: all but
    // the first) and skip the parallel region.
    auto starts = [&](int64_t n) { return rs[n] == seqs.start[n] && (j == 0 || rs[n] != re[n]); };
    bool any_starts = false;
    for (int64_t n = 0; n < d.N && !any_starts; ++n) any_starts = starts(n);
    if (any_starts) at::parallel_for(0, units, 1, [&](int64_t ub, int64_t ue) {
      for (int64_t u = ub; u < ue; ++u) {
        const int64_t n = u / HV;
        if (!starts(n)) continue;
        T* S = A.ht + u * KV;
        if (s0) {
          std::memcpy(S, s0 + u * KV, sizeof(T) * KV);
        } else {
          std::fill(S, S + KV, T(0));
        }
      }
    });
    // The wave's chunks, unit u0 + uu's chunk k at item item_at[uu * wave + k - k0]; items in
    // chunk-major order (every unit's first chunk of the wave, then every second one, ...), so
    // that every unit's state steps can start early.
    std::vector<int64_t> item_u, item_k, item_at(group * wave), unit_end;
    // The state step of wave item i (its chunk_intra done): checkpoint, outputs, next state.
    auto step_item = [&](int64_t i) {
      const int64_t u = item_u[i], n = u / HV, hv = u % HV, k = item_k[i];
      const int64_t origin = seqs.origin[n], t0 = cs[n][k];
      T* S = A.ht + u * KV;
      if (A.ckpt && (t0 - origin) % C == 0) {
        const int64_t slot = seqs.slot_base[n] + (t0 - origin) / C;
        std::memcpy(A.ckpt + (slot * HV + hv) * KV, S, sizeof(T) * KV);
      }
      chunk::ChunkWork<T> w = workspace(i);
      const chunk::ChunkIn<T> ci = chunk_in(n, hv, k, nullptr, nullptr);
      const int64_t vsh = A.seqs.vo_row_shift(n);
      chunk::state_step(ci, w, S, A.o + ((t0 - vsh) * HV + hv) * V, HV * V);
    };
    for (int64_t u0 = 0; u0 < units; u0 += group) {
      const int64_t u1 = std::min(units, u0 + group), nu = u1 - u0;
      int64_t most = 0;
      for (int64_t u = u0; u < u1; ++u) most = std::max<int64_t>(most, cs[u / HV].size());
      for (int64_t k0 = 0; k0 < most; k0 += wave) {
        item_u.clear();
        item_k.clear();
        unit_end.assign(nu, k0);
        for (int64_t k = k0; k < std::min(most, k0 + wave); ++k) {
          for (int64_t u = u0; u < u1; ++u) {
            if (k >= int64_t(cs[u / HV].size())) continue;
            item_at[(u - u0) * wave + k - k0] = item_u.size();
            item_u.push_back(u);
            item_k.push_back(k);
            unit_end[u - u0] = k + 1;
          }
        }
        const int64_t items = item_u.size();
        // Item i's state step needs two things done: its chunk_intra and the unit's previous
        // state step (done before the wave for the unit's first chunk in it). Each one counts
        // itself in arrivals[i], and the thread that counts second runs the step, then the
        // unit's next one if that has its item done too. Every step runs exactly once and no
        // thread ever waits for another: a thread leaves when no item is left, and a serial run
        // (one thread, or a call nested in another parallel region) completes too. The
        // counter's acquire / release hands the item's results and the unit's state over
        // between threads.
        std::unique_ptr<std::atomic<int>[]> arrivals(new std::atomic<int>[items]);
        for (int64_t i = 0; i < items; ++i) {
          arrivals[i].store(item_k[i] == k0 ? 1 : 0, std::memory_order_relaxed);
        }
        auto arrive = [&](int64_t i) {
          while (i >= 0 && arrivals[i].fetch_add(1, std::memory_order_acq_rel) == 1) {
            step_item(i);
            const int64_t uu = item_u[i] - u0, k = item_k[i] + 1;
            i = k < unit_end[uu] ? item_at[uu * wave + k - k0] : -1;
          }
        };
        // One task per thread, as data flow instead of two phases with a barrier between them:
        // items are taken from a shared counter, and state steps run as their inputs complete.
        // Every item and step computes the same bits on any thread, so the results do not
        // depend on the schedule.
        std::atomic<int64_t> next{0};
        at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
          chunk::FlushDenormals ftz;
          const ChunkRows<T> rows = thread_rows();
          for (int64_t i = next++; i < items; i = next++) {
            chunk::ChunkWork<T> w = workspace(i);
            chunk::chunk_intra(chunk_in(item_u[i] / HV, item_u[i] % HV, item_k[i], &rows, &bad),
                               w);
            arrive(i);
          }
          chunk::gemm_release(products);
        });
      }
    }
    // What the chunks' pre-processing found outside the domain, the smallest index of the block
    // (as the recurrent forward reports it: the same message at any thread count).
    report_domain(bad, in, cfg, d);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_fwd_cpu(const Inputs& in, const Config& cfg,
                                                              bool with_checkpoints) {
  return run_forward(in, cfg, with_checkpoints, &run_chunks<float>, &run_chunks<double>);
}

}  // namespace detail
}  // namespace kda
