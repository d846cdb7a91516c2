// CPU driver of the serving / decode path: converts the inputs to contiguous compute-dtype tensors
// (no copy when they already are), points the kernels (csrc/cpu/kernels/serving_kernels.cpp) at
// the state tensors, and runs (sequence, value head, column group) units with at::parallel_for.
// The state is never copied: each unit reads its slice from the source row and writes it to its
// destination row (in place into the pool when asked).
#include "cpu/serving.h"

#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "cpu/env_knob.h"
#include "cpu/kernels/serving_kernels.h"
#include "cpu/output_cache.h"

namespace kda {
namespace kernels {
const ServingTable& serving_table() {
  // The instruction set recurrent kernels chose (csrc/cpu/isa_dispatch.cpp): one choice per process.
  static const ServingTable& t = []() -> const ServingTable& {
#if defined(KDA_HAVE_X86_ISAS)
    const char* isa = table().isa;
    if (std::strcmp(isa, "avx512") == 0) return avx512::serving();
    if (std::strcmp(isa, "avx2") == 0) return avx2::serving();
#endif
    return generic::serving();
  }();
  return t;
}
}  // namespace kernels

namespace detail {

namespace {
kernels::StateType state_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return kernels::StateType::kBF16;
    case at::kDouble:
      return kernels::StateType::kF64;
    default:
      return kernels::StateType::kF32;
  }
}

// A state tensor the kernels can address directly: fp32 or bf16 (and fp64 for fp64 inputs), each
// row's [HV, *, *] block contiguous. Anything else (only possible for read-only sources) is
// converted once. An fp32 pool with fp64 inputs must stay the pool: the kernels write it in
// place (final states and snapshots) through this pointer.
at::Tensor kernel_state(const at::Tensor& s, at::ScalarType ct) {
  if (!s.defined()) return s;
  const bool dtype_ok = s.scalar_type() == ct || s.scalar_type() == at::kBFloat16 ||
                        s.scalar_type() == at::kFloat;
  const bool inner_ok = s.stride(3) == 1 && s.stride(2) == s.size(3) &&
                        s.stride(1) == s.size(2) * s.size(3);
  if (dtype_ok && inner_ok) return s;
  return s.to(dtype_ok ? s.scalar_type() : ct).contiguous();
}

// The first word of /sys/devices/system/cpu/cpu0/cache/index<i>/<field> into text (at most n - 1
// characters); false if it cannot be read. C stdio: an iostream version crashed every unforced
// decode call on one 16-core Xeon host (docs/benchmarks.md, "Decode: the last-level cache from
// sysfs").
bool read_cache_field(int i, const char* field, char* text, int n) {
  char path[96], format[16];
  std::snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu0/cache/index%d/%s", i, field);
  std::snprintf(format, sizeof(format), "%%%ds", n - 1);
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  const bool read = std::fscanf(f, format, text) == 1;
  std::fclose(f);
  return read;
}

// The size of the level-3 cache that CPU 0 shares with the cores around it, as Linux's sysfs
// reports it (/sys/devices/system/cpu/cpu0/cache/index*/, the entry of level 3), or -1. On AMD
// guests glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) reports another number: the 2-core Zen 4 guest's
// sysfs says 32 MB (one CCD's L3), its sysconf 320 MB.
int64_t sysfs_l3_bytes() {
  for (int i = 0; i < 8; ++i) {
    char level[8] = {}, size[32] = {};
    if (!read_cache_field(i, "level", level, sizeof(level)) || std::strcmp(level, "3") != 0) {
      continue;
    }
    return read_cache_field(i, "size", size, sizeof(size)) ? parse_cache_size(size) : -1;
  }
  return -1;
}

// Bytes of the last-level cache: sysfs's level 3, else sysconf's, else 32 MB.
int64_t llc_bytes() {
  static const int64_t bytes = [] {
    const int64_t sysfs = sysfs_l3_bytes();
    if (sysfs > 0) return sysfs;
#if defined(_SC_LEVEL3_CACHE_SIZE)
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) return static_cast<int64_t>(l3);
#endif
    return static_cast<int64_t>(32) << 20;
  }();
  return bytes;
}

// The state bytes a decode call can count on staying cached: the last-level cache, at most 48 MB
// (see stream_final_state).
int64_t cacheable_bytes() { return std::min(llc_bytes(), int64_t(48) << 20); }

// The CPU's vendor and generation where a rule below was measured to differ between CPUs:
// amd_cpu (AMD), amd_avx512 (AMD with AVX-512: Zen 4 and later). Read once.
bool amd_cpu() {
#if defined(KDA_HAVE_X86_ISAS)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return yes;
#else
  return false;
#endif
}

bool amd_avx512() {
#if defined(KDA_HAVE_X86_ISAS)
  static const bool yes = amd_cpu() && __builtin_cpu_supports("avx512f") != 0;
  return yes;
#else
  return false;
#endif
}

// Whether a decode call writes its fresh fp32 final state `dst` with non-temporal stores (no read
// of each destination line first: a third of the traffic). When the state bytes a call reads and
// writes exceed what stays cached, the written lines are evicted before the next call reads them
// anyway; below that, plain stores leave the state cached for the next call. The bound is the
// last-level cache, at most 48 MB: a VM's share of a large shared L3 is less than sysconf reports
// (the 16-core Xeon guest reports 300 MB, yet streaming ran 1.4-1.7x faster there at 64 MB of
// state traffic, B16 H32; the AVX2 box's 32 MB L3: faster from 64 MB, slower at 4-32 MB when the
// next call reads the state, K-first; docs/benchmarks.md "Decode against ggml, third round").
// Traffic of exactly the cache's size (B8 H32 at K = V = 128 against a 32 MB L3) streams on AMD
// CPUs with AVX-512 only: on the Zen 4 box streaming ran it 1.2-1.4x faster at one thread when
// the next call reads the state (a cyclic pattern as large as the cache keeps none of it) and
// 1.5-2x faster when every call reads the same initial state (sessions 26 and 29); the Zen 3
// box's chained loops, whose L3 is as large, ran 1.3-2.5x slower ("Decode: the last-level cache
// from sysfs", "Streaming at the cache's size"). Slower at B4 on every box.
// Needs 64-byte alignment of dst and of its rows. TORCH_KDA_DECODE_STREAM=0 / 1 overrides the
// size rule (benchmarks and tests compare the two side by side; the values written are the same).
bool stream_final_state(const Config& cfg, const Dims& d, const ServingPlan& plan,
                        const at::Tensor& src, const at::Tensor& dst) {
  if (!dst.defined() || dst.scalar_type() != at::kFloat || !plan.snap.empty()) return false;
  if (src.defined() && dst.is_alias_of(src)) return false;  // the pool in place: keep it cached
  const int64_t row = cfg.state_v_first ? d.K : d.V;
  if (row % 16 != 0 || reinterpret_cast<uintptr_t>(dst.data_ptr()) % 64 != 0) return false;
  if (const char* forced = env_knob("TORCH_KDA_DECODE_STREAM", {"0", "1"})) return *forced == '1';
  const int64_t traffic = 2 * static_cast<int64_t>(dst.nbytes());
  return amd_avx512() ? traffic >= cacheable_bytes() : traffic > cacheable_bytes();
}

// Whether a V-first decode reads each head's rows before writing them (ServingArgs::
// vfirst_two_pass), on AMD CPUs, for a fresh final state written with plain stores (not streamed,
// not the pool in place) whose read + written bytes exceed a third of the cached bytes
// (cacheable_bytes): the state then comes from memory while the written lines still allocate in
// the cache. There, on the Zen 4 box (32 MB L3, H32, 1 thread), reading a head's 64 KB before
// writing it ran 1.05-1.2x faster than writing each 16-row block right after its read (B4 and
// B8: 16.8 and 33.6 MB; B8 now streams there, stream_final_state). Everywhere else the
// interleaved order, whose write re-reads the rows from L1, ran as fast or faster: on the Zen 4
// box 1.2x at B1 and B2 (cached), up to 1.25x at B16 (streamed), 1.05x in a pool updated in
// place; on the 16-core Xeon host (Intel) 1.01-1.1x at B4 and B8 and 1.25x at B16 and B64
// (docs/benchmarks.md, "V-first decode from memory: two passes over a head"). The values
// written are the same either way.
bool vfirst_two_pass(const Config& cfg, const Dims& d, const at::Tensor& src,
                     const at::Tensor& dst, bool streamed) {
  if (!cfg.state_v_first || !dst.defined() || streamed) return false;
  if (src.defined() && dst.is_alias_of(src)) return false;
  if (!amd_cpu()) return false;
  const int64_t bytes = 2 * d.N * d.HV * d.K * d.V * static_cast<int64_t>(dst.element_size());
  return bytes > cacheable_bytes() / 3;
}

// t itself when it already is contiguous in the compute dtype (the usual decode call: no
// dispatcher round trips, a few microseconds of a B1 call), else a converted contiguous copy.
at::Tensor compute_view(const at::Tensor& t, at::ScalarType ct) {
  if (t.scalar_type() == ct && t.is_contiguous()) return t;
  return t.to(ct).contiguous();
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}
}  // namespace

int64_t parse_cache_size(const std::string& text) {
  const char* s = text.c_str();
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(s, &end, 10);
  if (end == s || errno != 0 || n <= 0 || n > (1LL << 40)) return -1;
  const std::string unit(end);
  const int64_t scale = unit.empty() ? 1 : unit == "K" ? 1 << 10 : unit == "M" ? 1 << 20 : -1;
  return scale < 0 ? -1 : static_cast<int64_t>(n) * scale;
}

ServingPlan plain_plan(const Inputs& in, const Dims& d) {
  ServingPlan p;
  const Sequences s = make_sequences(in, d);
  p.seq_start = s.start;
  p.seq_end = s.end;
  p.src_row.resize(d.N);
  p.dst_row.resize(d.N);
  p.pad.assign(d.N, 0);
  for (int64_t n = 0; n < d.N; ++n) {
    p.src_row[n] = in.initial_state ? n : -1;
    p.dst_row[n] = n;
  }
  return p;
}

bool is_short_call(const Inputs& in, const Dims& d) {
  if (d.T == 0) return false;
  if (d.B * d.T * d.HV * d.K * d.V <= kShortCallWork) return true;
  if (!d.varlen) return d.T == 1;  // decode
  const auto cu = in.cu_seqlens->to(at::kLong).contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  for (int64_t n = 0; n < d.N; ++n) {
    if (c[n + 1] - c[n] > 1) return false;
  }
  return true;  // decode: no sequence has more than one token
}

namespace {
// The first index of p[0, n) where bad(p[i]) (NaN compares false: never bad), or -1. Blocks of
// 64 are tested without a branch per element; the block that has one is searched.
template <typename T, typename Bad>
int64_t first_where(const T* p, int64_t n, Bad bad) {
  constexpr int64_t kBlock = 64;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    bool any = false;
    for (int64_t i = i0; i < i1; ++i) any |= bad(p[i]);
    if (!any) continue;
    for (int64_t i = i0; i < i1; ++i) {
      if (bad(p[i])) return i;
    }
  }
  return -1;
}

template <typename T>
void scan_domain(const at::Tensor& g, const at::Tensor& beta, FirstBad& bad) {
  if (g.defined()) {
    bad.g = first_where(g.data_ptr<T>(), g.numel(), [](T x) { return x > T(0); });
  }
  if (beta.defined()) {
    bad.beta = first_where(beta.data_ptr<T>(), beta.numel(),
                           [](T x) { return x < T(0) || x > T(2); });
  }
}
}  // namespace

void check_domain(const Inputs& in, const Config& cfg, const Dims& d) {
  if (cfg.use_gate_in_kernel && cfg.use_beta_sigmoid_in_kernel) return;
  const auto ct = compute_dtype(in.q);
  // In the compute dtype, as the kernels read them (bf16 / fp16 widen exactly).
  const at::Tensor g = cfg.use_gate_in_kernel ? at::Tensor() : compute_view(in.g, ct);
  const at::Tensor beta = cfg.use_beta_sigmoid_in_kernel ? at::Tensor() : compute_view(in.beta, ct);
  FirstBad bad;
  if (ct == at::kDouble) {
    scan_domain<double>(g, beta, bad);
  } else {
    scan_domain<float>(g, beta, bad);
  }
  report_domain(bad, in, cfg, d);
}

namespace {
template <typename T>
void run(const Inputs& in, const Config& cfg, const Dims& d, const ServingPlan& plan,
         const at::Tensor& src, const at::Tensor& dst, const at::Tensor& o) {
  const auto ct = o.scalar_type();
  const at::Tensor q = compute_view(in.q, ct), k = compute_view(in.k, ct),
                   v = compute_view(in.v, ct), g = compute_view(in.g, ct),
                   beta = compute_view(in.beta, ct);
  const GateParams gate = gate_params(in, cfg, ct);

  kernels::ServingArgs<T> A;
  A.H = d.H;
  A.HV = d.HV;
  A.K = d.K;
  A.V = d.V;
  A.v_first = cfg.state_v_first;
  A.scale = static_cast<T>(cfg.scale);
  A.l2norm = cfg.use_qk_l2norm_in_kernel;
  A.gate = !cfg.use_gate_in_kernel ? kernels::GateMode::kNone
           : cfg.lower_bound       ? kernels::GateMode::kBounded
                                   : kernels::GateMode::kSoftplus;
  A.lower_bound = static_cast<T>(cfg.lower_bound.value_or(0.0));
  A.beta_sigmoid = cfg.use_beta_sigmoid_in_kernel;
  A.beta_mult = cfg.allow_neg_eigval ? 2 : 1;
  A.beta_headwise = in.beta.dim() == 4;
  A.q = q.data_ptr<T>();
  A.k = k.data_ptr<T>();
  A.v = v.data_ptr<T>();
  A.g = g.data_ptr<T>();
  A.beta = beta.data_ptr<T>();
  A.expA = ptr_or_null<T>(gate.expA);
  A.A_log = ptr_or_null<T>(gate.A_log);
  A.dt_bias = ptr_or_null<T>(gate.bias);
  A.o = o.data_ptr<T>();
  A.seq_start = plan.seq_start.data();
  A.seq_end = plan.seq_end.data();
  A.src_row = plan.src_row.data();
  A.pad = plan.pad.data();
  A.dst_row = plan.dst_row.data();
  A.snap = plan.snap.empty() ? nullptr : plan.snap.data();
  A.snap_ld = plan.snap_ld;
  if (src.defined()) {
    A.src = src.data_ptr();
    A.src_type = state_type(src);
    A.src_stride = src.stride(0);
  }
  if (dst.defined()) {
    A.dst = dst.data_ptr();
    A.dst_type = state_type(dst);
    A.dst_stride = dst.stride(0);
    A.stream_dst = std::is_same_v<T, float> && stream_final_state(cfg, d, plan, src, dst);
    A.vfirst_two_pass = vfirst_two_pass(cfg, d, src, dst, A.stream_dst);
  }
  const auto& tab = kernels::serving_table();
  auto fn = [&]() {
    if constexpr (std::is_same_v<T, float>) {
      return tab.unit_f32;
    } else {
      return tab.unit_f64;
    }
  }();
  // Units: (sequence, value head, group of 16-column blocks). With many heads one group per head
  // (the decode shapes: B x 32 heads), so the per-token pre-processing runs once per head; with
  // few heads the columns are split so every thread has work. Each column is computed the same
  // way whatever the grouping, so the result does not depend on it (nor on the thread count).
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (d.V + kBlock - 1) / kBlock;
  const int64_t heads = std::max<int64_t>(1, d.N * d.HV);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t groups = std::max<int64_t>(1, std::min(blocks, (2 * threads + heads - 1) / heads));
  const int64_t units = d.N * d.HV * groups;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t gi = u % groups;
      const int64_t hv = (u / groups) % d.HV;
      const int64_t n = u / (groups * d.HV);
      const int64_t c0 = std::min(d.V, gi * blocks / groups * kBlock);
      const int64_t c1 = std::min(d.V, (gi + 1) * blocks / groups * kBlock);
      // The thread's next unit is head hv + 1 of the same sequence (a decode unit prefetches it).
      const bool next_head = groups == 1 && u + 1 < end && hv + 1 < d.HV;
      if (c1 > c0) fn(A, n, hv, c0, c1, next_head);
    }
  });
}
}  // namespace

void serving_cpu(const Inputs& in, const Config& cfg, const Dims& d, const ServingPlan& plan,
                 const at::Tensor& src, const at::Tensor& dst, const at::Tensor& out) {
  const auto ct = compute_dtype(in.q);
  // The kernels write o in the compute dtype: straight into `out` when it is contiguous and of
  // that dtype, else into a temporary copied over once.
  const bool direct = out.scalar_type() == ct && out.is_contiguous();
  at::Tensor o = direct ? out : empty_output({d.B, d.T, d.HV, d.V}, in.q.options().dtype(ct));
  const at::Tensor s = kernel_state(src, ct);
  if (d.B * d.T > 0 || d.N > 0) {
    if (ct == at::kDouble) {
      run<double>(in, cfg, d, plan, s, dst, o);
    } else {
      run<float>(in, cfg, d, plan, s, dst, o);
    }
  }
  if (!direct) out.copy_(o);
}

}  // namespace detail
}  // namespace kda
