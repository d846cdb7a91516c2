// CPU forward of the chunkwise KDA (docs/math.md, "Chunkwise form"): the token blocks and the
// pre-processing of the recurrent forward (run_fwd_blocked), and in each block, per (sequence,
// value head) unit, the chunks of kChunk tokens in order, each through the shared pieces of
// csrc/cpu/chunk_common.h.
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

template <typename T>
void run_chunks(const Inputs& in, const Config& cfg, const Dims& d, const Sequences& seqs,
                const at::Tensor& h0, const at::Tensor& o, const at::Tensor& ht,
                const at::Tensor& ckpt) {
  const int64_t K = d.K, V = d.V, HV = d.HV, H = d.H, KV = K * V;
  // bf16 state products for 16-bit inputs (chunk_products.h); fp64 keeps its own.
  const chunk::Products products = std::is_same_v<T, float>
      ? chunk::choose_products(in.q.scalar_type(), K, V, cfg.op)
      : chunk::Products::kNative;
  const bool bf16 = products != chunk::Products::kNative;
  // Per thread: the ChunkWork elements, then (bf16 products) the ProductWork bytes, rounded up
  // to whole 64-byte lines.
  const int64_t chunk_elems = chunk::up(chunk::ChunkWork<T>::elems(K, V));
  const int64_t work =
      chunk_elems + (bf16 ? (chunk::ProductWork::bytes(K, V) + 63) / 64 * 64 / int64_t(sizeof(T)) : 0);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const at::Tensor ws = at::empty({threads * work + 16}, ht.options());
  // 64-byte aligned start (every part of ChunkWork then is too).
  T* const ws0 = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(ws.data_ptr<T>()) + 63) /
                                      64 * 64);
  const T* s0 = h0.defined() ? h0.data_ptr<T>() : nullptr;
  constexpr int64_t C = chunk::kC;

  run_fwd_blocked<T>(in, cfg, d, seqs, h0, o, ht, ckpt,
                     [&](const kernels::FwdArgs<T>& A, const std::vector<int64_t>& rs,
                         const std::vector<int64_t>& re, int64_t j) {
    at::parallel_for(0, d.N * HV, 1, [&](int64_t ub, int64_t ue) {
      chunk::FlushDenormals ftz;
      const int64_t tid = std::min<int64_t>(at::get_thread_num(), threads - 1);
      chunk::ChunkWork<T> w(ws0 + tid * work, K, V);
      if (bf16) {
        w.prod = chunk::ProductWork(products, ws0 + tid * work + chunk_elems, K, V);
      }
      for (int64_t u = ub; u < ue; ++u) {
        const int64_t n = u / HV, hv = u % HV, h = hv / (HV / H);
        const int64_t ts = seqs.start[n];
        if (rs[n] == re[n] && !(j == 0 && ts == seqs.end[n])) continue;
        const int64_t origin = seqs.origin[n], slot_base = seqs.slot_base[n];
        const int64_t sh = A.seqs.shift ? A.seqs.shift[n] : 0;
        const int64_t vsh = A.seqs.vo_shift ? A.seqs.vo_shift[n] : 0;
        // The running state lives in ht (between token blocks too).
        T* S = A.ht + (n * HV + hv) * KV;
        if (rs[n] == ts) {
          if (s0) {
            std::memcpy(S, s0 + (n * HV + hv) * KV, sizeof(T) * KV);
          } else {
            std::fill(S, S + KV, T(0));
          }
        }
        for (int64_t t0 = rs[n]; t0 < re[n];) {
          const int64_t c = (t0 - origin) / C;
          const int64_t t1 = std::min(re[n], origin + (c + 1) * C);
          if (A.ckpt && (t0 - origin) % C == 0) {
            std::memcpy(A.ckpt + ((slot_base + c) * HV + hv) * KV, S, sizeof(T) * KV);
          }
          chunk::ChunkIn<T> ci;
          ci.n = t1 - t0;
          ci.K = K;
          ci.V = V;
          ci.q = A.q + (h * A.BT + t0 - sh) * K;
          ci.k = A.k + (h * A.BT + t0 - sh) * K;
          ci.a = A.a + (hv * A.BT + t0 - sh) * K;
          ci.beta = A.beta + hv * A.BT + t0 - sh;
          ci.v = A.v + ((t0 - vsh) * HV + hv) * V;
          ci.ldv = HV * V;
          chunk::chunk_intra(ci, w);
          chunk::state_step(ci, w, S);
          T* out = A.o + ((t0 - vsh) * HV + hv) * V;
          for (int64_t i = 0; i < ci.n; ++i) {
            std::memcpy(out + i * HV * V, w.o + i * V, sizeof(T) * V);
          }
          t0 = t1;
        }
      }
      chunk::gemm_release(products);
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_fwd_cpu(const Inputs& in, const Config& cfg,
                                                              bool with_checkpoints) {
  return run_forward(in, cfg, with_checkpoints, &run_chunks<float>, &run_chunks<double>);
}

}  // namespace detail
}  // namespace kda
