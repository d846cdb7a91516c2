/* A one-op ggml graph (GGML_OP_GATED_DELTA_NET) over caller-owned buffers, timed around
 * ggml_graph_compute: the best case of llama.cpp's CPU op, for torch-kda's peer benchmark
 * (src/torch_kda/peers.py loads this library with ctypes; benchmarks/peers/setup.sh builds it).
 *
 * ggml's conventions (see ggml.h, ggml_gated_delta_net): dimensions are listed fastest first, so
 * q/k [S_k, H, T, B] and v [S_v, H, T, B] are the C-order [B, T, H, *] arrays torch-kda takes;
 * the per-channel log decay g has the v layout (KDA) and beta is [1, H, T, B]; the state is
 * [S_v, S_v, H, B] with the value index slowest inside a head (V-first: element [j][i] is the
 * state entry of key row i, value column j). The op scales q by 1/sqrt(S_v) itself. Its result
 * is one buffer: the outputs [B, T, H, S_v], then the final state in the state's layout.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"

struct kda_ggml_bench {
  struct ggml_context* ctx;
  struct ggml_cgraph* graph;
  struct ggml_threadpool* pool;
  struct ggml_cplan plan;
  void* work;
};

static struct ggml_tensor* wrap(struct ggml_context* ctx, float* data, int64_t n0, int64_t n1,
                                int64_t n2, int64_t n3) {
  struct ggml_tensor* t = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, n0, n1, n2, n3);
  t->data = data;
  return t;
}

/* Builds the graph over the given buffers (all fp32, contiguous, C order):
 * q, k [B, T, H, K]; v, g [B, T, H, V]; beta [B, T, H]; state [B, H, V, K];
 * out [B*T*H*V + B*H*V*K] receives the outputs, then the final state (V-first).
 * Returns NULL if K != V (the op requires S_k == S_v) or on allocation failure. */
struct kda_ggml_bench* kda_ggml_create(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V,
                                       float* q, float* k, float* v, float* g, float* beta,
                                       float* state, float* out, int n_threads) {
  if (K != V || n_threads < 1) return NULL;
  ggml_cpu_init();
  struct kda_ggml_bench* b = (struct kda_ggml_bench*)calloc(1, sizeof(*b));
  if (!b) return NULL;
  struct ggml_init_params ip;
  ip.mem_size = 16 * ggml_tensor_overhead() + ggml_graph_overhead();
  ip.mem_buffer = NULL;
  ip.no_alloc = true; /* tensors point at the caller's buffers */
  b->ctx = ggml_init(ip);
  if (!b->ctx) {
    free(b);
    return NULL;
  }
  struct ggml_tensor* tq = wrap(b->ctx, q, K, H, T, B);
  struct ggml_tensor* tk = wrap(b->ctx, k, K, H, T, B);
  struct ggml_tensor* tv = wrap(b->ctx, v, V, H, T, B);
  struct ggml_tensor* tg = wrap(b->ctx, g, V, H, T, B);
  struct ggml_tensor* tb = wrap(b->ctx, beta, 1, H, T, B);
  struct ggml_tensor* ts = wrap(b->ctx, state, V, V, H, B);
  struct ggml_tensor* r = ggml_gated_delta_net(b->ctx, tq, tk, tv, tg, tb, ts, 1);
  r->data = out;
  b->graph = ggml_new_graph(b->ctx);
  ggml_build_forward_expand(b->graph, r);

  /* A persistent pool that sleeps between calls (poll = 0), so idle ggml workers never spin
   * while another implementation is being timed. */
  struct ggml_threadpool_params tp = ggml_threadpool_params_default(n_threads);
  tp.poll = 0;
  b->pool = ggml_threadpool_new(&tp);
  b->plan = ggml_graph_plan(b->graph, n_threads, b->pool);
  if (b->plan.work_size > 0) {
    b->work = malloc(b->plan.work_size);
    if (!b->work) {
      ggml_threadpool_free(b->pool);
      ggml_free(b->ctx);
      free(b);
      return NULL;
    }
    memset(b->work, 0, b->plan.work_size);
    b->plan.work_data = (uint8_t*)b->work;
  }
  return b;
}

/* One ggml_graph_compute; returns its wall time in seconds (negative on failure). */
double kda_ggml_compute(struct kda_ggml_bench* b) {
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  enum ggml_status st = ggml_graph_compute(b->graph, &b->plan);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (st != GGML_STATUS_SUCCESS) return -1.0;
  return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

void kda_ggml_free(struct kda_ggml_bench* b) {
  if (!b) return;
  free(b->work);
  ggml_threadpool_free(b->pool);
  ggml_free(b->ctx);
  free(b);
}
