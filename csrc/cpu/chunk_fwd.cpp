// CPU forward of the chunkwise KDA (docs/math.md, "Chunkwise form"): the pre-processing of the
// recurrent forward (detail::preprocess), then per (sequence, value head) unit the chunks of
// kChunk tokens in order, each through the shared pieces of csrc/cpu/chunk_common.h.
//
// Chunks start at origin + c * kChunk (as the recurrent forward's checkpoints: a sequence of a
// varlen batch that starts inside a chunk has a shorter first chunk), so the checkpoints
// [n_slots, HV, K, V] hold exactly what kda::fused_recurrent_fwd stores there and either
// backward can consume them.
#include "cpu/chunk_common.h"
#include "cpu/kda_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace kda {
namespace detail {

namespace {

// Output rows [n, V] of the compute dtype into o (row stride ld) in o's dtype.
template <typename T, typename O>
void store_rows(const T* src, int64_t n, int64_t V, O* dst, int64_t ld) {
  for (int64_t i = 0; i < n; ++i) {
    const T* s = src + i * V;
    O* d = dst + i * ld;
    if constexpr (std::is_same_v<T, O>) {
      std::memcpy(d, s, sizeof(T) * V);
    } else {
      for (int64_t e = 0; e < V; ++e) d[e] = static_cast<O>(s[e]);
    }
  }
}

template <typename T, typename O>
void run_chunk_fwd(const Prepared& p, const Dims& d, const Sequences& seqs, const at::Tensor& h0,
                   const at::Tensor& o, const at::Tensor& ht, const at::Tensor& ckpt) {
  const int64_t BT = d.B * d.T, K = d.K, V = d.V, HV = d.HV, H = d.H;
  const int64_t KV = K * V;
  const int64_t work = chunk::ChunkWork<T>::elems(K, V);
  const int64_t per_thread = work + (KV + 15) / 16 * 16;  // the workspace, then the state
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const at::Tensor ws = at::empty({threads * per_thread + 16}, p.q.options());
  // 64-byte aligned start (every part of ChunkWork then is too).
  T* const ws0 = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(ws.data_ptr<T>()) + 63) /
                                      64 * 64);
  const T* q = p.q.data_ptr<T>();
  const T* k = p.k_hm.data_ptr<T>();
  const T* a = p.a.data_ptr<T>();
  const T* beta = p.beta_hm.data_ptr<T>();
  const T* v = p.v.data_ptr<T>();
  const T* s0 = h0.defined() ? h0.data_ptr<T>() : nullptr;
  O* out = o.data_ptr<O>();
  T* fin = ht.data_ptr<T>();
  T* ck = ckpt.defined() && ckpt.numel() > 0 ? ckpt.data_ptr<T>() : nullptr;
  constexpr int64_t C = chunk::kC;

  const int64_t units = d.N * HV;
  at::parallel_for(0, units, 1, [&](int64_t ub, int64_t ue) {
    const int64_t tid = std::min<int64_t>(at::get_thread_num(), threads - 1);
    T* base = ws0 + tid * per_thread;
    chunk::ChunkWork<T> w(base, K, V);
    T* S = base + work;
    for (int64_t u = ub; u < ue; ++u) {
      const int64_t n = u / HV, hv = u % HV, h = hv / (HV / H);
      const int64_t ts = seqs.start[n], te = seqs.end[n];
      const int64_t origin = seqs.origin[n], slot_base = seqs.slot_base[n];
      if (s0) {
        std::memcpy(S, s0 + (n * HV + hv) * KV, sizeof(T) * KV);
      } else {
        std::fill(S, S + KV, T(0));
      }
      for (int64_t t0 = ts; t0 < te;) {
        const int64_t c = (t0 - origin) / C;
        const int64_t t1 = std::min(te, origin + (c + 1) * C);
        if (ck && (t0 - origin) % C == 0) {
          std::memcpy(ck + ((slot_base + c) * HV + hv) * KV, S, sizeof(T) * KV);
        }
        chunk::ChunkIn<T> ci;
        ci.n = t1 - t0;
        ci.K = K;
        ci.V = V;
        ci.q = q + (h * BT + t0) * K;
        ci.k = k + (h * BT + t0) * K;
        ci.a = a + (hv * BT + t0) * K;
        ci.beta = beta + hv * BT + t0;
        ci.v = v + (t0 * HV + hv) * V;
        ci.ldv = HV * V;
        chunk::chunk_intra(ci, w);
        chunk::state_step(ci, w, S);
        store_rows<T, O>(w.o, ci.n, V, out + (t0 * HV + hv) * V, HV * V);
        t0 = t1;
      }
      std::memcpy(fin + (n * HV + hv) * KV, S, sizeof(T) * KV);
    }
    chunk::gemm_release();
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_fwd_cpu(const Inputs& in, const Config& cfg,
                                                              bool with_checkpoints) {
  const Dims d = check_inputs(in, cfg, /*check_values=*/true);
  const auto ct = compute_dtype(in.q);
  const auto opts = in.q.options().dtype(ct);
  const Sequences seqs = make_sequences(in, d);
  const at::Tensor h0 = state_kv(in.initial_state, cfg, ct);
  const Prepared p = preprocess(in, cfg, d, /*for_backward=*/false);

  at::Tensor o = at::empty({d.B, d.T, d.HV, d.V}, in.q.options());
  at::Tensor ht = at::empty({d.N, d.HV, d.K, d.V}, opts);
  at::Tensor ckpt = with_checkpoints ? at::empty({d.n_slots, d.HV, d.K, d.V}, opts)
                                     : at::empty({0}, opts);
  advise_huge_pages(o);
  advise_huge_pages(ckpt);
  switch (in.q.scalar_type()) {
    case at::kDouble:
      run_chunk_fwd<double, double>(p, d, seqs, h0, o, ht, ckpt);
      break;
    case at::kFloat:
      run_chunk_fwd<float, float>(p, d, seqs, h0, o, ht, ckpt);
      break;
    case at::kBFloat16:
      run_chunk_fwd<float, at::BFloat16>(p, d, seqs, h0, o, ht, ckpt);
      break;
    case at::kHalf:
      run_chunk_fwd<float, at::Half>(p, d, seqs, h0, o, ht, ckpt);
      break;
    default:
      TORCH_CHECK(false, "kda::chunk: unsupported dtype ", in.q.scalar_type());
  }
  if (cfg.state_v_first) ht = ht.transpose(-1, -2).contiguous();
  return {o, ht, ckpt};
}

}  // namespace detail
}  // namespace kda
