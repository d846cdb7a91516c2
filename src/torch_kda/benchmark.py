"""The CPU benchmark engine: the native C++ op vs the PyTorch baselines, side by side.

One engine for both front ends: ``benchmarks/bench_cpu.py`` (the full protocol, the numbers in
docs/benchmarks.md) and ``python -m torch_kda bench`` (the same measurements, standard or
``--quick`` shapes, from the installed package). Implements the measurement protocol of
docs/benchmarks.md ("CPU: how the numbers are made") and checks the targets of issue 3. In ONE run, interleaved (every repetition times every
backend and thread count before the next repetition starts, so a burst of load from other processes
hits all of them alike; medians are reported):

- ``native``: ``torch_kda.fused_recurrent_kda(..., backend="native")`` (the C++ op).
- ``reference``: ``torch_kda.reference.fused_recurrent_kda`` (pure PyTorch, a Python loop over T).
- ``compiled``: ``torch.compile`` of the reference's per-token step (the loop body of the reference
  recurrence: decay, read, rank-1 write, output), called from a Python loop over T; the gate,
  L2 norm and sigmoid run eagerly before the loop. Compiling the WHOLE reference unrolls the loop
  over T into one graph (minutes to compile at T = 64 on 2 cores); it is opt-in with
  ``--compile-full-max-T`` and then appears as ``compiled_full``.
- ``fla_naive``: flash-linear-attention's ``naive_recurrent_kda`` (fla/ops/kda/naive.py, loaded by
  path because ``import fla`` needs Triton). It takes precomputed gates, so it is fed the
  pre-processed inputs (softplus gate, q/k L2 norm, beta sigmoid computed with the public helpers
  ``torch_kda.reference.kda_gate`` / ``l2norm`` and ``torch.sigmoid``); that pre-processing is
  inside the timed region, so all backends do the same work.

Modes: ``fwd`` (forward under ``torch.no_grad()``) and ``fwd_bwd`` (forward + ``backward`` of a
random output gradient under autograd, gradients of every input incl. ``A_log`` and ``dt_bias``).
Rates: tokens/s = B*T / median seconds; FLOP rate with 8*K*V FLOPs per token per value head for
the forward and 32*K*V for forward+backward (forward, recomputation, backward: docs/math.md),
as a percentage of the box's own fp32 GEMM rate, ``torch.mm`` of 2048 x 2048 matrices, sampled at
every configuration with the same thread count (median of the samples).

Peak memory of forward+backward: each (backend, shape) runs in a fresh subprocess, which warms the
backend up at T = 64, resets the kernel's RSS high-water mark (``/proc/self/clear_refs``), runs one
forward+backward and reports ``VmHWM - VmRSS(before)``: every byte the process touched, ATen
tensors, the C++ op's own scratch and the autograd graph alike (tracemalloc would see none of the
ATen allocations).

Decoding shapes (T = 1, B in {1, 8}, H = 32, with an initial state and the final state returned):
per-call latency, forward only.

The reference backends are slow at long T (a Python loop; the autograd graph keeps every state):
they run at T <= ``--baseline-max-T``, their forward+backward only where T*HV <= 16384 (the
reference's graph holds several K x V states per token: ~3 GB at T*HV = 16384), and each
(baseline, shape, mode, threads) stops taking repetitions once it has used ``--baseline-budget``
seconds (at least one run). Where a baseline is skipped the table says so.

Functions: :func:`settings` (the keyword arguments of the standard or quick run), :func:`run`
(measure, returns a list of result dicts), :func:`format_table` (markdown), :func:`check_targets` /
:func:`format_targets` (issue 3 targets), :func:`report` (header + tables + targets), :func:`plot`
(PNG), :func:`bench` (all of these, printing and writing the files), :func:`machine_info`.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import torch_kda
from torch_kda import reference

__all__ = ["Shape", "STANDARD_SHAPES", "DECODE_SHAPES", "QUICK_SHAPES", "TARGET_SHAPE", "BACKENDS", "DTYPES",
           "settings", "run", "format_table", "check_targets", "format_targets", "report", "plot", "bench",
           "machine_info"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BACKENDS = ("native", "reference", "compiled", "fla_naive")
GEMM_N = 2048


def head_dims(K: int, V: int) -> str:
    """The head sizes as shape names give them: ``" K32 V32"``, or ``""`` for K = V = 128."""
    return "" if (K, V) == (128, 128) else f" K{K} V{V}"


@dataclass(frozen=True)
class Shape:
    """One problem size; ``decode`` shapes run forward only, with a state in and out."""
    B: int
    T: int
    H: int
    HV: int
    K: int = 128
    V: int = 128
    decode: bool = False

    @property
    def name(self) -> str:
        t = f"{self.T // 1024}K" if self.T >= 1024 and self.T % 1024 == 0 else str(self.T)
        return f"B{self.B} T{t} H{self.H}" + (f" HV{self.HV}" if self.HV != self.H else "") + \
            head_dims(self.K, self.V)

    def flops(self, mode: str) -> float:
        per = 8 if mode == "fwd" else 32
        return float(per * self.K * self.V * self.HV * self.B * self.T)


STANDARD_SHAPES = tuple(Shape(1, T, H, H) for H in (4, 16) for T in (1024, 4096, 16384))
DECODE_SHAPES = (Shape(1, 1, 32, 32, decode=True), Shape(8, 1, 32, 32, decode=True))
TARGET_SHAPE = Shape(1, 4096, 4, 4)
QUICK_SHAPES = (Shape(1, 1024, 4, 4), TARGET_SHAPE, Shape(1, 1, 32, 32, decode=True))
# The reference's autograd graph holds a few K x V fp32 states per token and head.
BASELINE_FWD_BWD_MAX_THV = 16384


# ---------------------------------------------------------------------------------------------
# inputs and backends
def make_inputs(shape: Shape, dtype: torch.dtype, seed: int = 0, requires_grad: bool = False
                ) -> Tuple[Dict[str, torch.Tensor], Dict[str, object]]:
    """Random inputs in FLA's layout with the softplus gate, q/k L2 norm and beta sigmoid in the op.

    Returns (tensors, flags): raw ``q, k [B,T,H,K]``, ``v [B,T,HV,V]``, raw gate ``g [B,T,HV,K]``,
    beta logits ``[B,T,HV]`` in ``dtype``, fp32 ``A_log [HV]`` and ``dt_bias [HV*K]`` (leaves with
    ``requires_grad`` if asked); decode shapes add an fp32 ``initial_state [B,HV,K,V]``.
    """
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V

    def r(*s, dt=dtype, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dt)

    t = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=torch.rand(HV, generator=gen) * 2.7, dt_bias=r(HV * K, dt=torch.float32, scale=0.5))
    if requires_grad:
        t = {n: x.requires_grad_(True) for n, x in t.items()}
    flags: Dict[str, object] = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True)
    if shape.decode:
        t["initial_state"] = r(B, HV, K, V, dt=torch.float32, scale=0.1)
        flags["output_final_state"] = True
    return t, flags


def load_fla_naive():
    """FLA's ``fla/ops/kda/naive.py`` loaded by path (``import fla`` would need Triton), or None."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    if not os.path.exists(path):
        return None
    mspec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(module)
    return module


def _preprocess(t: Dict[str, torch.Tensor]):
    """The in-op pre-processing done in PyTorch for the baselines that take precomputed gates:
    fp32 l2norm(q), l2norm(k), softplus gate (docs/math.md "Gates"), sigmoid(beta)."""
    q = reference.l2norm(t["q"].float())
    k = reference.l2norm(t["k"].float())
    g = reference.kda_gate(t["g"], t["A_log"], t["dt_bias"])
    beta = torch.sigmoid(t["beta"].float())
    return q, k, t["v"].float(), g, beta


def _ref_step(S, q_t, k_t, v_t, g_t, b_t):
    """One token of the reference recurrence (same ops as torch_kda.reference's loop body)."""
    S = S * g_t.exp().unsqueeze(-1)                                  # S' = Diag(a_t) S
    r = v_t - torch.einsum("nhk,nhkv->nhv", k_t, S)                  # delta-rule error
    u = b_t.unsqueeze(-1) * r
    S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)                     # rank-1 write
    return S, torch.einsum("nhk,nhkv->nhv", q_t, S)                  # read after the write


_COMPILED_STEP = None


def _compiled_step():
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        _COMPILED_STEP = torch.compile(_ref_step, dynamic=False)
    return _COMPILED_STEP


def backend_fn(name: str, fla=None) -> Callable[..., torch.Tensor]:
    """A callable ``f(tensors, flags) -> o`` (plus the final state for decode shapes, discarded)."""
    if name == "native":
        return lambda t, f: torch_kda.fused_recurrent_kda(**t, **f, backend="native")[0]
    if name == "reference":
        return lambda t, f: reference.fused_recurrent_kda(**t, **f)[0]
    if name == "compiled_full":
        fn = torch.compile(reference.fused_recurrent_kda, dynamic=False)
        return lambda t, f: fn(**t, **f)[0]
    if name == "compiled":
        def compiled(t, f):
            step = _compiled_step()
            q, k, v, g, beta = _preprocess(t)
            group = v.shape[2] // q.shape[2]
            if group > 1:
                q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
            q = q * (q.shape[-1] ** -0.5)
            B, T, HV, V = v.shape
            S = t["initial_state"].float() if "initial_state" in t else v.new_zeros(B, HV, q.shape[-1], V)
            outs = []
            for i in range(T):
                S, o = step(S, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
                outs.append(o)
            return torch.stack(outs, 1).to(t["q"].dtype)
        return compiled
    if name == "fla_naive":
        if fla is None:
            raise RuntimeError("fla-core is not installed (pip install --no-deps fla-core einops)")

        def fla_naive(t, f):
            q, k, v, g, beta = _preprocess(t)
            o, _ = fla.naive_recurrent_kda(q, k, v, g, beta, initial_state=t.get("initial_state"),
                                           output_final_state=bool(f.get("output_final_state")))
            return o.to(t["q"].dtype)
        return fla_naive
    raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS + ('compiled_full',)}")


def _time_call(fn, shape: Shape, dtype: torch.dtype, mode: str, cache: dict) -> float:
    """Seconds of one call (``fwd`` no_grad, or forward + backward); inputs cached per shape."""
    key = (shape, dtype, mode)
    if key not in cache:
        t, f = make_inputs(shape, dtype, requires_grad=(mode == "fwd_bwd"))
        do = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=torch.Generator().manual_seed(1)
                         ).to(dtype)
        cache[key] = (t, f, do)
    t, f, do = cache[key]
    if mode == "fwd":
        with torch.no_grad():
            start = time.perf_counter()
            fn(t, f)
            return time.perf_counter() - start
    start = time.perf_counter()
    o = fn(t, f)
    o.backward(do)
    el = time.perf_counter() - start
    for x in t.values():
        x.grad = None
    return el


def gemm_gflops(n: int = GEMM_N, dtype: torch.dtype = torch.float32) -> float:
    """One sample of the ``torch.mm`` rate (GFLOP/s) in ``dtype`` (fp32 by default; bf16 for the
    chunk section) at the current thread count."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    start = time.perf_counter()
    torch.mm(a, b)
    return 2.0 * n ** 3 / (time.perf_counter() - start) / 1e9


# ---------------------------------------------------------------------------------------------
# peak memory (fresh subprocess per configuration)
def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(backend: str, shape: Shape, dtype_name: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    dtype = DTYPES[dtype_name]
    fla = load_fla_naive() if backend == "fla_naive" else None
    fn = backend_fn(backend, fla)
    cache: dict = {}
    _time_call(fn, Shape(shape.B, 64, shape.H, shape.HV, shape.K, shape.V), dtype, "fwd_bwd", cache)  # warm up
    cache.clear()
    t, f = make_inputs(shape, dtype, requires_grad=True)
    do = torch.randn(shape.B, shape.T, shape.HV, shape.V).to(dtype)
    gc.collect()
    before = _rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:  # reset the peak RSS (VmHWM) to the current RSS
        fh.write("5")
    o = fn(t, f)
    o.backward(do)
    peak = _rss_kb("VmHWM")
    inputs = sum(x.numel() * x.element_size() for x in t.values())
    return dict(kind="memory", backend=backend, **_shape_dict(shape), dtype=dtype_name, threads=threads,
                peak_bytes=(peak - before) * 1024, input_bytes=inputs)


# The child imports the torch_kda this process imported (the first sys.path entry is the package's
# parent), not one that the working directory may shadow.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(torch_kda.__file__)))
_MEMORY_CHILD = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
                 "from torch_kda.benchmark import _memory_child_main; _memory_child_main(sys.argv[2])")


def _memory_child_main(arg: str) -> None:
    c = json.loads(arg)
    print(json.dumps(_memory_child(c["backend"], Shape(**c["shape"]), c["dtype"], c["threads"])))


def measure_peak_memory(backend: str, shape: Shape, dtype_name: str = "fp32", threads: int = 1,
                        timeout: float = 600.0) -> dict:
    """Peak extra RSS of one forward+backward, in a fresh Python process (see the module doc)."""
    arg = json.dumps(dict(backend=backend, shape=asdict(shape), dtype=dtype_name, threads=threads))
    try:
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, _PACKAGE_PARENT, arg],
                             capture_output=True, text=True, timeout=timeout, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        err = getattr(exc, "stderr", "") or ""
        return dict(kind="memory", backend=backend, **_shape_dict(shape), dtype=dtype_name, threads=threads,
                    peak_bytes=None, skipped=f"failed: {type(exc).__name__} {err.strip()[-300:]}")


# ---------------------------------------------------------------------------------------------
# the run
def _shape_dict(s: Shape) -> dict:
    return dict(B=s.B, T=s.T, H=s.H, HV=s.HV, K=s.K, V=s.V, decode=s.decode)


def _baseline_skip(backend: str, shape: Shape, mode: str, max_T: int, compile_full_max_T: int) -> Optional[str]:
    if backend == "native":
        return None
    if backend == "compiled_full":
        if shape.T > compile_full_max_T:
            return f"whole-reference compile unrolls T; only T <= {compile_full_max_T}"
        return None
    if shape.T > max_T:
        return f"Python loop over T: baselines only at T <= {max_T}"
    if mode == "fwd_bwd" and shape.T * shape.HV * shape.B > BASELINE_FWD_BWD_MAX_THV:
        gb = 3 * shape.B * shape.T * shape.HV * shape.K * shape.V * 4 / 2 ** 30
        return f"autograd graph of the loop would hold ~{gb:.0f} GB"
    return None


def run(shapes: Sequence[Shape] = STANDARD_SHAPES + DECODE_SHAPES,
        backends: Sequence[str] = BACKENDS,
        dtypes: Sequence[str] = ("fp32", "bf16"),
        threads: Sequence[int] = (1, 2),
        reps: int = 5,
        min_reps: int = 3,
        native_budget: float = 6.0,
        baseline_max_call: float = 30.0,
        modes: Sequence[str] = ("fwd", "fwd_bwd"),
        baseline_dtypes: Sequence[str] = ("fp32",),
        baseline_max_T: int = 4096,
        baseline_budget: float = 8.0,
        compile_full_max_T: int = 0,
        memory: str = "target",
        decode_reps: int = 30,
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> List[dict]:
    """Measure every (shape, dtype) configuration; returns a list of result dicts.

    Args:
        shapes: problem sizes (:class:`Shape`); decode shapes are timed forward only, per call.
        backends: any of ``native``, ``reference``, ``compiled``, ``fla_naive``, ``compiled_full``.
        dtypes: input dtypes (``fp32``, ``bf16``); the baselines only run in ``baseline_dtypes``
            (they compute in fp32 whatever the input dtype, as native does).
        threads: ``torch.set_num_threads`` values, interleaved within each repetition.
        reps: repetitions of each measurement (median reported). Native stops after ``min_reps``
            once one (shape, mode, threads) has used ``native_budget`` seconds; a baseline after
            one repetition once it has used ``baseline_budget`` seconds, and is skipped where its
            T = 64 warm-up extrapolates to more than ``baseline_max_call`` seconds per call.
        memory: ``"none"``, ``"target"`` (every backend at TARGET_SHAPE plus native at every fp32
            non-decode shape) or ``"all"`` (every timed fp32 fwd_bwd configuration).

    Returns:
        dicts with ``kind`` = ``"time"`` (backend, mode, shape fields, dtype, threads, ``seconds``
        median, ``times``, ``tokens_per_s``, ``gflops``, ``pct_gemm``, or ``skipped`` with the
        reason), ``"gemm"`` (threads, ``gflops`` median, ``samples``) and ``"memory"``
        (``peak_bytes`` of forward+backward).
    """
    # shapes may also be given as Shape(...) keyword dicts or (B, T, H, HV[, K, V, decode]) tuples
    shapes = [s if isinstance(s, Shape) else (Shape(**s) if isinstance(s, dict) else Shape(*s)) for s in shapes]
    fla = load_fla_naive() if "fla_naive" in backends else None
    fns = {}
    results: List[dict] = []
    for b in backends:
        if b == "fla_naive" and fla is None:
            log("fla_naive: fla-core not installed, skipped")
            continue
        fns[b] = backend_fn(b, fla)
    gemm: Dict[int, List[float]] = {n: [] for n in threads}
    saved_threads = torch.get_num_threads()
    t_start = time.perf_counter()
    try:
        for shape in shapes:
            for dname in dtypes:
                dtype = DTYPES[dname]
                cfg_modes = ("fwd",) if shape.decode else tuple(modes)
                # (backend, mode, threads) -> list of times / skip reason
                times: Dict[Tuple[str, str, int], List[float]] = {}
                skip: Dict[Tuple[str, str, int], str] = {}
                for b in fns:
                    for m in cfg_modes:
                        for n in threads:
                            why = None
                            if b != "native" and dname not in baseline_dtypes:
                                why = f"baselines only in {', '.join(baseline_dtypes)}"
                            elif not shape.decode:
                                why = _baseline_skip(b, shape, m, baseline_max_T, compile_full_max_T)
                            elif b == "compiled_full":
                                why = None
                            if why:
                                skip[(b, m, n)] = why
                            else:
                                times[(b, m, n)] = []
                for n in threads:
                    torch.set_num_threads(n)
                    gemm[n].append(gemm_gflops())
                log(f"[{time.perf_counter() - t_start:6.0f}s] {shape.name} {dname}: "
                    f"{len(times)} measurements")
                cache: dict = {}
                calls = decode_reps if shape.decode else 1
                # Warm-up: every (backend, mode, threads) once; the baselines at T = 64 (same code
                # paths), and a baseline whose T = 64 time extrapolates (linearly in T: a loop over
                # tokens) to more than baseline_max_call seconds per call is skipped.
                for key in list(times):
                    b, m, n = key
                    torch.set_num_threads(n)
                    if b == "native" or shape.T <= 64:
                        _time_call(fns[b], shape, dtype, m, cache)
                        continue
                    warm = Shape(shape.B, 64, shape.H, shape.HV, shape.K, shape.V, shape.decode)
                    _time_call(fns[b], warm, dtype, m, cache)
                    # forward+backward of the baselines grows faster than T (the graph's memory)
                    est = _time_call(fns[b], warm, dtype, m, cache) * shape.T / 64 * (1.5 if m == "fwd_bwd" else 1)
                    if est > baseline_max_call:
                        del times[key]
                        skip[key] = (f"a T=64 run extrapolates to {est:.0f} s per call at this shape and "
                                     f"thread count (limit {baseline_max_call:g} s)")
                for k in [k for k in cache if k[0].T != shape.T]:
                    del cache[k]
                for rep in range(reps):
                    for m in cfg_modes:
                        for n in threads:
                            torch.set_num_threads(n)
                            for b in fns:
                                key = (b, m, n)
                                if key not in times:
                                    continue
                                budget = native_budget if b == "native" else baseline_budget
                                if rep >= (min_reps if b == "native" else 1) and sum(times[key]) >= budget:
                                    continue
                                ts = [_time_call(fns[b], shape, dtype, m, cache) for _ in range(calls)]
                                times[key].extend(ts)
                for key, why in skip.items():
                    b, m, n = key
                    results.append(dict(kind="time", backend=b, mode=m, **_shape_dict(shape), dtype=dname,
                                        threads=n, skipped=why))
                for key, ts in times.items():
                    b, m, n = key
                    sec = statistics.median(ts)
                    results.append(dict(kind="time", backend=b, mode=m, **_shape_dict(shape), dtype=dname,
                                        threads=n, seconds=sec, times=ts, reps=len(ts),
                                        tokens_per_s=shape.B * shape.T / sec,
                                        gflops=shape.flops(m) / sec / 1e9))
                cache.clear()
        for n in threads:
            results.append(dict(kind="gemm", threads=n, n=GEMM_N, gflops=statistics.median(gemm[n]),
                                samples=gemm[n]))
        for r in results:
            if r["kind"] == "time" and "gflops" in r:
                r["pct_gemm"] = 100.0 * r["gflops"] / statistics.median(gemm[r["threads"]])
        # peak memory, fresh subprocess each
        mem_cfgs = []
        if memory != "none":
            for shape in shapes:
                if shape.decode or "fp32" not in dtypes:
                    continue
                for b in fns:
                    if _baseline_skip(b, shape, "fwd_bwd", baseline_max_T, compile_full_max_T):
                        continue
                    if memory == "all" or (memory == "target" and (b == "native" or shape == TARGET_SHAPE)):
                        mem_cfgs.append((b, shape))
        for b, shape in mem_cfgs:
            log(f"[{time.perf_counter() - t_start:6.0f}s] peak memory {b} {shape.name}")
            results.append(measure_peak_memory(b, shape, "fp32", threads=min(threads)))
    finally:
        torch.set_num_threads(saved_threads)
    log(f"[{time.perf_counter() - t_start:6.0f}s] done")
    return results


# ---------------------------------------------------------------------------------------------
# reporting
def _find(results, **kw) -> Optional[dict]:
    for r in results:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def _shape_from(r: dict) -> Shape:
    return Shape(r["B"], r["T"], r["H"], r["HV"], r["K"], r["V"], r["decode"])


def format_table(results: List[dict]) -> str:
    """Markdown: GEMM rates, one throughput table per (mode, dtype), decoding latency, peak memory."""
    out: List[str] = []
    gemms = [r for r in results if r["kind"] == "gemm"]
    if gemms:
        out.append(f"fp32 GEMM (`torch.mm`, {GEMM_N}^3), median of per-configuration samples: " + ", ".join(
            f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}: {r['gflops']:.1f} GFLOP/s "
            f"(min {min(r['samples']):.1f}, max {max(r['samples']):.1f})" for r in gemms))
        out.append("")
    timed = [r for r in results if r["kind"] == "time"]
    backends = [b for b in BACKENDS + ("compiled_full",) if any(r["backend"] == b for r in timed)]
    threads = sorted({r["threads"] for r in timed})
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in timed)]
    notes: Dict[str, int] = {}

    def cell(r: Optional[dict], val: Callable[[dict], str]) -> str:
        if r is None:
            return ""
        if "skipped" in r:
            i = notes.setdefault(r["skipped"], len(notes) + 1)
            return f"–[^{i}]"
        return val(r)

    for mode, title in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
        for d in dtypes:
            rows = [r for r in timed if r["mode"] == mode and r["dtype"] == d and not r["decode"]]
            if not rows:
                continue
            shapes = sorted({_shape_from(r) for r in rows}, key=lambda s: (s.H, s.HV, s.T, s.B))
            out.append(f"**{title}, {d}**: tokens/s (median), native's % of the fp32 GEMM rate at the same "
                       f"thread count, native's speed-up over each baseline")
            out.append("")
            hdr = ["shape", "thr"] + [f"{b} tok/s" for b in backends] + ["native % GEMM"] + \
                  [f"× {b}" for b in backends if b != "native"]
            out.append("| " + " | ".join(hdr) + " |")
            out.append("|" + "---|" * len(hdr))
            for s in shapes:
                for n in threads:
                    get = {b: _find(rows, backend=b, threads=n, **_shape_dict(s)) for b in backends}
                    if all(v is None for v in get.values()):
                        continue
                    nat = get.get("native")
                    line = [s.name, str(n)]
                    line += [cell(get[b], lambda r: _fmt_rate(r["tokens_per_s"])) for b in backends]
                    line.append(cell(nat, lambda r: f"{r['pct_gemm']:.1f}%" if "pct_gemm" in r else ""))
                    for b in backends:
                        if b == "native":
                            continue
                        if nat and "seconds" in nat and get[b] and "seconds" in get[b]:
                            line.append(f"{get[b]['seconds'] / nat['seconds']:,.1f}×")
                        else:
                            line.append(cell(get[b], lambda r: ""))
                    out.append("| " + " | ".join(line) + " |")
            out.append("")
    if any(r.get("pct_gemm", 0) > 100 for r in timed):
        out.append("(A \"% GEMM\" above 100%: this CPU's `torch.mm` runs well below its FMA peak, "
                   "so it is no ceiling here; docs/benchmarks.md, \"The 2-core Zen 5 box, session 9\".)")
        out.append("")
    dec = [r for r in timed if r["decode"]]
    if dec:
        out.append("**decoding** (T = 1, state in and out, forward): median latency per call, µs")
        out.append("")
        hdr = ["shape", "dtype", "thr"] + backends
        out.append("| " + " | ".join(hdr) + " |")
        out.append("|" + "---|" * len(hdr))
        for s in sorted({_shape_from(r) for r in dec}, key=lambda s: (s.B, s.H)):
            for d in dtypes:
                for n in threads:
                    get = {b: _find(dec, backend=b, threads=n, dtype=d, **_shape_dict(s)) for b in backends}
                    if all(v is None for v in get.values()):
                        continue
                    out.append("| " + " | ".join([s.name, d, str(n)] + [
                        cell(get[b], lambda r: f"{r['seconds'] * 1e6:,.0f}") for b in backends]) + " |")
        out.append("")
    mem = [r for r in results if r["kind"] == "memory"]
    if mem:
        out.append("**peak memory of one forward + backward** (fp32; extra RSS high-water over the "
                   "pre-call RSS, fresh process; inputs and their gradients included)")
        out.append("")
        out.append("| shape | backend | peak MB | inputs MB |")
        out.append("|---|---|---|---|")
        for r in mem:
            pk = f"{r['peak_bytes'] / 2 ** 20:,.1f}" if r.get("peak_bytes") is not None else r.get("skipped", "")
            out.append(f"| {_shape_from(r).name} | {r['backend']} | {pk} | "
                       f"{r.get('input_bytes', 0) / 2 ** 20:,.1f} |")
        out.append("")
    if notes:
        for why, i in notes.items():
            out.append(f"[^{i}]: not run: {why}.")
        out.append("")
    return "\n".join(out)


def check_targets(results: List[dict], shape: Shape = TARGET_SHAPE) -> List[dict]:
    """The issue 3 targets at ``shape`` (fp32), one dict per (target, thread count) with
    ``name``, ``threads``, ``value``, ``target``, ``passed`` (None where not measured)."""
    rows: List[dict] = []
    sd = _shape_dict(shape)
    threads = sorted({r["threads"] for r in results if r["kind"] == "time"})

    def t(b, m, n):
        return _find(results, kind="time", backend=b, mode=m, dtype="fp32", threads=n, **sd)

    def add(name, n, value, target, higher=True, unit="×"):
        passed = None if value is None else (value >= target if higher else value <= target)
        rows.append(dict(name=name, threads=n, value=value, target=target, higher=higher, unit=unit,
                         passed=passed))

    for n in threads:
        for m, label in (("fwd", "forward"), ("fwd_bwd", "forward+backward (autograd)")):
            nat, ref = t("native", m, n), t("reference", m, n)
            v = ref["seconds"] / nat["seconds"] if nat and ref and "seconds" in nat and "seconds" in ref else None
            add(f"{label} speed-up vs reference", n, v, 30.0)
        for m, label, tgt in (("fwd", "forward % of GEMM rate", 50.0),
                              ("fwd_bwd", "forward+backward % of GEMM rate", 30.0)):
            nat = t("native", m, n)
            add(label, n, nat.get("pct_gemm") if nat else None, tgt, unit="%")
    mn = _find(results, kind="memory", backend="native", **sd)
    mr = _find(results, kind="memory", backend="reference", **sd)
    v = (mn["peak_bytes"] / mr["peak_bytes"]) if mn and mr and mn.get("peak_bytes") and mr.get("peak_bytes") else None
    add("backward peak memory, native / reference", min(threads) if threads else 1, v, 0.1, higher=False,
        unit="")
    if 1 in threads and 2 in threads:
        for m, label in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
            a, b = t("native", m, 1), t("native", m, 2)
            add(f"{label}: 2 threads vs 1", 2, a["seconds"] / b["seconds"] if a and b else None, 1.7)
    return rows


def format_targets(rows: List[dict], shape: Shape = TARGET_SHAPE, verdicts: bool = True) -> str:
    """Markdown table of :func:`check_targets`' rows. ``verdicts=False`` (what ``python -m torch_kda
    bench`` prints) gives the measured ratios only, as a summary, without the project's targets."""
    if not verdicts:
        out = [f"**summary** at {shape.name}, K=V={shape.K}, fp32, gate + L2 norm + sigmoid in the op: "
               "native's speed-up over the reference and its ratio to this machine's fp32 GEMM rate", "",
               "| measure | threads | measured |", "|---|---|---|"]
        for r in rows:
            if r["value"] is not None:
                val = f"{r['value']:.1f}{r['unit']}" if r["unit"] else f"{r['value']:.3f}"
                out.append(f"| {r['name']} | {r['threads']} | {val} |")
        return "\n".join(out) + "\n"
    out = [f"**issue 3 targets** at {shape.name}, K=V={shape.K}, fp32, gate + L2 norm + sigmoid in the op", "",
           "| target | threads | measured | required | result |", "|---|---|---|---|---|"]
    for r in rows:
        val = "not measured" if r["value"] is None else (
            f"{r['value']:.1f}{r['unit']}" if r["unit"] else f"{r['value']:.3f}")
        req = ("≥ " if r["higher"] else "≤ ") + (f"{r['target']:g}{r['unit']}" if r["unit"] else f"{r['target']:g}")
        res = "–" if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")
        out.append(f"| {r['name']} | {r['threads']} | {val} | {req} | {res} |")
    return "\n".join(out) + "\n"


def plot(results: List[dict], path: str, dtype: str = "fp32", threads: Optional[int] = None) -> None:
    """PNG of tokens/s by T per backend (one panel per mode, a line style per H, up to four), at ``threads``
    (default: the smallest thread count measured, the least disturbed on a shared machine)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if r["kind"] == "time" and "seconds" in r and not r["decode"]
             and r["dtype"] == dtype]
    if not timed:
        return
    n = threads if threads is not None else min(r["threads"] for r in timed)
    colors = {"native": "tab:green", "reference": "tab:blue", "compiled": "tab:orange",
              "fla_naive": "tab:red", "compiled_full": "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110, sharey=True)
    for ax, (mode, title) in zip(axes, (("fwd", "forward"), ("fwd_bwd", "forward + backward"))):
        for H, style in zip(sorted({r["H"] for r in timed}), ("o-", "s--", "^:", "d-.")):
            for b in colors:
                pts = sorted((r["T"], r["tokens_per_s"]) for r in timed
                             if r["backend"] == b and r["mode"] == mode and r["H"] == H and r["threads"] == n)
                if pts:
                    ax.plot(*zip(*pts), style, color=colors[b], lw=1.5, ms=4, label=f"{b} H={H}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_title(f"{title}, {dtype}, {n} thread(s), B=1, K=V={timed[0]['K']}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("tokens / s")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def machine_info(source_dir: Optional[str] = None) -> dict:
    """CPU model, logical CPUs, versions, load average, and the git commit measured: that of
    ``source_dir``'s checkout (the scripts pass their own folder), overridden by the environment
    variable ``TORCH_KDA_COMMIT`` (the commit the installed package was built from)."""
    model = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    commit = None
    if source_dir:
        try:
            commit = subprocess.run(["git", "-C", source_dir, "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip() or None
        except OSError:
            pass
    commit = os.environ.get("TORCH_KDA_COMMIT", commit)
    return dict(cpu=model, logical_cpus=os.cpu_count(), torch=torch.__version__,
                torch_kda=getattr(torch_kda, "__version__", None), python=platform.python_version(),
                commit=commit, load_avg=os.getloadavg(), torch_kda_path=os.path.dirname(torch_kda.__file__))


def default_threads() -> List[int]:
    """1 and 2 threads (the issue 3 scaling target), or 1 on a one-core machine."""
    return [1, 2] if (os.cpu_count() or 1) >= 2 else [1]


def settings(quick: bool = False, *, seq_lens: Optional[Sequence[int]] = None,
             heads: Optional[Sequence[int]] = None, head_dim: Optional[int] = None, decode: bool = True,
             **overrides: Any) -> Dict[str, Any]:
    """The keyword arguments of :func:`run` for the standard run or the ``quick`` subset.

    Standard: :data:`STANDARD_SHAPES` (+ :data:`DECODE_SHAPES`), fp32 and bf16, 5 repetitions,
    baselines at T <= 4096, peak memory at the target shape. Quick (about a minute on 2 cores):
    T = 1K and the target shape (+ one decoding shape), fp32, 3 repetitions, baselines at T = 1K
    only, no memory. ``seq_lens`` / ``heads`` / ``head_dim`` replace the shapes by the grid
    B = 1, T x (H = HV), K = V = ``head_dim`` (default 128), and the decoding shapes (B = 1 and 8,
    H = 32) take that K and V too; ``decode=False`` drops the decoding shapes; ``overrides`` (any
    :func:`run` argument, None meaning "the default") win over both.
    """
    if seq_lens or heads or head_dim:
        d = head_dim or 128
        shapes = [Shape(1, T, H, H, d, d) for H in (heads or [4, 16]) for T in (seq_lens or [1024, 4096, 16384])]
        shapes += [replace(s, K=d, V=d) for s in DECODE_SHAPES] if decode else []
    elif quick:
        shapes = list(QUICK_SHAPES[:2]) + ([QUICK_SHAPES[2]] if decode else [])
    else:
        shapes = list(STANDARD_SHAPES) + (list(DECODE_SHAPES) if decode else [])
    kw: Dict[str, Any] = dict(
        shapes=shapes, backends=list(BACKENDS), dtypes=["fp32"] if quick else ["fp32", "bf16"],
        threads=default_threads(), reps=3 if quick else 5, native_budget=2.0 if quick else 6.0,
        baseline_max_T=1024 if quick else 4096, baseline_budget=3.0 if quick else 8.0,
        baseline_max_call=5.0 if quick else 30.0, compile_full_max_T=0,
        memory="none" if quick else "target", decode_reps=10 if quick else 30)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return kw


def header_line(command: str, info: dict, wall_s: float) -> str:
    """The first line of a report: the command, the machine (:func:`machine_info`), the commit where
    known, the load average at the start (from ``info``) and now, and the wall time in seconds."""
    commit = f"commit {info['commit']}, " if info.get("commit") else ""
    return (f"`{command.strip()}` — {info['cpu']}, {info['logical_cpus']} logical CPUs, torch {info['torch']}, "
            f"{commit}load average {info['load_avg'][0]:.1f} at start, {os.getloadavg()[0]:.1f} at end, "
            f"wall {wall_s:.0f} s")


def output_file(text: str) -> str:
    """argparse type of an output file (``--json``): not a folder, in a folder that exists, so
    that a bad path stops the command before its minutes of measurements, not after them."""
    import argparse

    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file path, got the folder {text!r}")
    if not os.path.isdir(os.path.dirname(text) or "."):
        raise argparse.ArgumentTypeError(f"the folder of {text!r} does not exist")
    return text


def publish(text: str, out_md: Optional[str] = None, out_json: Optional[str] = None,
            payload: Optional[dict] = None) -> None:
    """Print a report's markdown ``text``; write it to ``out_md`` and ``payload`` as JSON to
    ``out_json`` where those paths are given."""
    print(text, flush=True)
    if out_md:
        with open(out_md, "w") as fh:
            fh.write(text)
    if out_json:
        with open(out_json, "w") as fh:
            json.dump(payload, fh, indent=1)


def report(results: List[dict], info: dict, command: str, wall_s: float, verdicts: bool = True) -> str:
    """Markdown: a header line (command, machine, commit where known, load average at start and end,
    wall time), :func:`format_table`, and the issue 3 targets where the target shape was measured in
    fp32 (``verdicts=False``: the measured ratios only, see :func:`format_targets`)."""
    out = header_line(command, info, wall_s) + "\n\n" + format_table(results)
    if _find(results, kind="time", backend="native", dtype="fp32", **_shape_dict(TARGET_SHAPE)):
        out += "\n" + format_targets(check_targets(results), verdicts=verdicts)
    return out


def bench(kw: Dict[str, Any], command: str, info: Optional[dict] = None, out_md: Optional[str] = None,
          out_json: Optional[str] = None, out_png: Optional[str] = None,
          log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
          verdicts: bool = True) -> List[dict]:
    """Run :func:`run` with ``kw`` (see :func:`settings`), print :func:`report` (``verdicts``: see
    :func:`format_targets`), and write it (``out_md``), the machine info + arguments + results
    (``out_json``) and :func:`plot` (``out_png``).

    Returns:
        the result dicts of :func:`run`.
    """
    info = info or machine_info()
    t0 = time.perf_counter()
    results = run(**kw, log=log)
    wall = time.perf_counter() - t0
    args = {k: [asdict(s) if isinstance(s, Shape) else s for s in v] if k == "shapes" else v
            for k, v in kw.items()}
    publish(report(results, info, command, wall, verdicts=verdicts), out_md, out_json,
            dict(machine=info, args=args, wall_s=wall, results=results))
    if out_png:
        plot(results, out_png)
    return results


# ---------------------------------------------------------------------------------------------
# serving / decode rows (docs/benchmarks.md "Decode and serving"): one token per sequence, H = 32,
# K = V = 128, gates / norms / sigmoid in the op. Memory-bound, so every row is reported as bytes
# of state moved (read + written) per second over the box's copy bandwidth, measured in the same
# run with ``copy_`` of a tensor of the same bytes. Variants of a row are timed interleaved
# (a, b, c, a, b, c, ...) and summarised by medians: the box is shared and noisy.
# Run: python -m torch_kda.benchmark serving [--threads 1 2] [--reps 40]

# llama.cpp's ggml GATED_DELTA_NET decode on this 2-core box as quoted in issue 13 (us/call, fp32,
# K = V = 128, H = 32): (B, threads) -> us. Not measured here; benchmarks/peers/ runs it.
GGML_DECODE_US = {(1, 1): 230.0, (8, 1): 2745.0, (8, 2): 1448.0}


def _interleaved_medians(fns: Dict[str, Callable[[], Any]], reps: int, warmup: int = 3
                         ) -> Dict[str, Tuple[float, float]]:
    """name -> (median wall seconds, median process CPU seconds) over interleaved repetitions.

    The CPU time (all threads of this process) is kept beside the wall time because on a shared
    box the wall time of a memory-bound call also measures the other tenants; at one thread the
    ratio of two CPU times is the cleaner comparison."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    cpu: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            c0 = time.process_time()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - c0)
    return {name: (statistics.median(times[name]), statistics.median(cpu[name])) for name in fns}


def _serving_inputs(B: int, H: int, K: int, seed: int = 0):
    t, f = make_inputs(Shape(B, 1, H, H, K, K, decode=True), torch.float32, seed=seed)
    f = {k_: v_ for k_, v_ in f.items() if k_ != "output_final_state"}
    return t, f


def serving_rows(batches: Sequence[int] = (1, 8, 64), threads: Sequence[int] = (1, 2),
                 H: int = 32, K: int = 128, reps: int = 40, spec_drafts: int = 4,
                 spec_batch: int = 8) -> List[dict]:
    """Decode and serving timings; one dict per (row, B, threads) with seconds and GB/s.

    Rows: ``plain`` (the functional call, state in and out, K-first and V-first), ``recurrent``
    (the same call on the general recurrent kernels, ``TORCH_KDA_DECODE_KERNEL=recurrent``: the
    decode path before the serving kernels), ``pool_fp32`` / ``pool_bf16`` (state pool updated in
    place by slot index, both layouts), ``copy`` (``copy_`` of the fp32 / bf16 state bytes), and
    ``spec_verify`` vs ``spec_sequential`` (N = spec_batch sequences x spec_drafts tokens with
    per-token snapshots, vs the same tokens as spec_drafts decode calls).
    """
    rows: List[dict] = []
    old_threads = torch.get_num_threads()
    try:
        for th in threads:
            torch.set_num_threads(th)
            for B in batches:
                t, f = _serving_inputs(B, H, K)
                h0 = t.pop("initial_state")
                h0_v = h0.transpose(-1, -2).contiguous()
                slots = 2 * B  # a pool with free slots; the batch uses every other one
                gen = torch.Generator().manual_seed(1)
                pool32 = torch.randn(slots, H, K, K, generator=gen) * 0.1
                pool32_v = pool32.transpose(-1, -2).contiguous()
                pool16, pool16_v = pool32.bfloat16(), pool32_v.bfloat16()
                idx = torch.randperm(slots, generator=gen)[:B]
                out = torch.empty(B, 1, H, K)
                state_bytes = B * H * K * K * 4
                src32, dst32 = torch.randn(state_bytes // 4), torch.empty(state_bytes // 4)
                src16, dst16 = torch.randn(state_bytes // 4).bfloat16(), torch.empty(state_bytes // 4, dtype=torch.bfloat16)

                def plain(vf):
                    s = h0_v if vf else h0
                    return lambda: torch_kda.fused_recurrent_kda(**t, **f, initial_state=s, state_v_first=vf,
                                                                 output_final_state=True, backend="native")

                def recurrent():
                    os.environ["TORCH_KDA_DECODE_KERNEL"] = "recurrent"
                    try:
                        torch_kda.fused_recurrent_kda(**t, **f, initial_state=h0, output_final_state=True,
                                                      backend="native")
                    finally:
                        del os.environ["TORCH_KDA_DECODE_KERNEL"]

                def pooled(pool, vf):
                    return lambda: torch_kda.fused_recurrent_kda(
                        **t, **f, initial_state=pool, state_v_first=vf, ssm_state_indices=idx,
                        inplace_final_state=True, out=out, backend="native")

                fns = {"plain_k": plain(False), "plain_v": plain(True), "recurrent": recurrent,
                       "pool_fp32_k": pooled(pool32, False), "pool_fp32_v": pooled(pool32_v, True),
                       "pool_bf16_k": pooled(pool16, False), "pool_bf16_v": pooled(pool16_v, True),
                       "copy_fp32": lambda: dst32.copy_(src32), "copy_bf16": lambda: dst16.copy_(src16)}
                with torch.no_grad():
                    med = _interleaved_medians(fns, reps)
                for name, (sec, cpu) in med.items():
                    nbytes = 2 * state_bytes // (2 if "bf16" in name else 1)
                    rows.append(dict(row=name, B=B, H=H, K=K, threads=th, seconds=sec,
                                     cpu_seconds=cpu, gbps=nbytes / sec / 1e9,
                                     cpu_gbps=nbytes / max(cpu, 1e-9) / 1e9))
            # speculative verify: N x drafts tokens in one call vs drafts decode calls
            N, D = spec_batch, spec_drafts
            t, f = make_inputs(Shape(N, D, H, H, K, K), torch.float32, seed=2)
            pool = torch.randn(N * (D + 1), H, K, K) * 0.1
            idx2 = torch.arange(N * D).reshape(N, D)
            nat = torch.ones(N, dtype=torch.long)
            idx1 = torch.arange(N * D, N * D + N)
            steps = [{k_: v_[:, i:i + 1] for k_, v_ in t.items() if v_.dim() >= 3} for i in range(D)]
            side = {k_: v_ for k_, v_ in t.items() if v_.dim() < 3}

            def verify():
                torch_kda.fused_recurrent_kda(**t, **f, initial_state=pool, ssm_state_indices=idx2,
                                              num_accepted_tokens=nat, inplace_final_state=True,
                                              backend="native")

            def sequential():
                for s in steps:
                    torch_kda.fused_recurrent_kda(**s, **side, **f, initial_state=pool,
                                                  ssm_state_indices=idx1, inplace_final_state=True,
                                                  backend="native")
            with torch.no_grad():
                med = _interleaved_medians({"spec_verify": verify, "spec_sequential": sequential}, reps)
            for name, (sec, cpu) in med.items():
                rows.append(dict(row=name, B=N, H=H, K=K, threads=th, seconds=sec, drafts=D,
                                 cpu_seconds=cpu, gbps=float("nan"), cpu_gbps=float("nan")))
    finally:
        torch.set_num_threads(old_threads)
    return rows


def format_serving(rows: List[dict]) -> str:
    """Markdown tables of :func:`serving_rows` (us/call, GB/s, % of copy bandwidth, ratios)."""
    def get(name, B, th):
        return _find(rows, row=name, B=B, threads=th)

    lines = ["| B | thr | copy GB/s | plain K-first | plain V-first | V/K | recurrent kernel | "
             "pool fp32 K / V | pool bf16 K / V | fp32 pool vs recurrent | bf16 vs fp32 pool | ggml (quoted, not this run) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["B"], r["threads"]) for r in rows if r["row"] == "copy_fp32"})
    for B, th in keys:
        c32, c16 = get("copy_fp32", B, th), get("copy_bf16", B, th)

        def cell(name, copy):
            r = get(name, B, th)
            return f"{r['seconds'] * 1e6:,.0f} us ({100 * r['gbps'] / copy['gbps']:.0f}%)"
        pk, pv, rec = get("plain_k", B, th), get("plain_v", B, th), get("recurrent", B, th)
        p32k = get("pool_fp32_k", B, th)
        p16k = get("pool_bf16_k", B, th)
        ggml = GGML_DECODE_US.get((B, th))
        lines.append(
            f"| {B} | {th} | {c32['gbps']:.1f} | {cell('plain_k', c32)} | {cell('plain_v', c32)} | "
            f"{pv['seconds'] / pk['seconds']:.2f} | {cell('recurrent', c32)} | "
            f"{cell('pool_fp32_k', c32)} / {cell('pool_fp32_v', c32)} | "
            f"{cell('pool_bf16_k', c16)} / {cell('pool_bf16_v', c16)} | "
            f"{rec['seconds'] / p32k['seconds']:.2f}x | {p32k['seconds'] / p16k['seconds']:.2f}x | "
            + (f"{ggml:,.0f} us (plain K {ggml / (pk['seconds'] * 1e6):.2f}x, V {ggml / (pv['seconds'] * 1e6):.2f}x)"
               if ggml else "") + " |")
    lines += ["", "Process CPU time (all threads), the same calls: % of copy_'s bytes per CPU-second",
              "", "| B | thr | plain K / V | recurrent | pool fp32 K / V | pool bf16 K / V | fp32 pool vs recurrent | bf16 vs fp32 pool |",
              "|---|---|---|---|---|---|---|---|"]
    for B, th in keys:
        c32, c16 = get("copy_fp32", B, th), get("copy_bf16", B, th)

        def pc(name, copy):
            return f"{100 * get(name, B, th)['cpu_gbps'] / copy['cpu_gbps']:.0f}%"
        lines.append(
            f"| {B} | {th} | {pc('plain_k', c32)} / {pc('plain_v', c32)} | {pc('recurrent', c32)} | "
            f"{pc('pool_fp32_k', c32)} / {pc('pool_fp32_v', c32)} | {pc('pool_bf16_k', c16)} / {pc('pool_bf16_v', c16)} | "
            f"{get('recurrent', B, th)['cpu_seconds'] / get('pool_fp32_k', B, th)['cpu_seconds']:.2f}x | "
            f"{get('pool_fp32_k', B, th)['cpu_seconds'] / get('pool_bf16_k', B, th)['cpu_seconds']:.2f}x |")
    lines += ["", "| speculative verify | thr | one call (N x drafts) | drafts sequential calls | ratio (wall) | ratio (CPU) |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r["row"] == "spec_verify":
            s = get("spec_sequential", r["B"], r["threads"])
            lines.append(f"| N={r['B']} x {r['drafts']} drafts | {r['threads']} | {r['seconds'] * 1e6:,.0f} us | "
                         f"{s['seconds'] * 1e6:,.0f} us | {s['seconds'] / r['seconds']:.2f}x | "
                         f"{s['cpu_seconds'] / r['cpu_seconds']:.2f}x |")
    return "\n".join(lines)


def serving_main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m torch_kda.benchmark serving",
                                description="decode / serving rows vs the copy bandwidth")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)
    load = os.getloadavg()
    rows = serving_rows(args.batches, args.threads, reps=args.reps)
    print(f"chunk state products: TORCH_KDA_CHUNK_PRODUCTS="
          f"{os.environ.get('TORCH_KDA_CHUNK_PRODUCTS') or 'auto'} (docs/math.md 'Chunkwise form')")
    print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(format_serving(rows))


# ---------------------------------------------------------------------------------------------
# the Python layer's cost per decode call (docs/benchmarks.md "Decode: the Python layer, fourth round")
# Run: python -m torch_kda.benchmark overhead [--threads 1 2] [--batches 1 8] [--blocks 60]

def _paired_blocks(pairs: Dict[str, Tuple[Callable[[], Any], Callable[[], Any]]], blocks: int,
                   calls: int, warmup: int = 20) -> Dict[str, dict]:
    """name -> CPU and wall microseconds per call of (api, raw) and the median paired difference.

    Each block times ``calls`` calls of the API, then as many of the raw op (the order flips every
    block), with ``time.process_time`` (this process's CPU time, all threads: robust to other
    processes' load) and ``time.perf_counter``; the overhead is the median over blocks of the
    per-block difference, so a slow phase of the box hits both sides of a pair."""
    for api, raw in pairs.values():
        for _ in range(warmup):
            api()
            raw()

    def block(fn):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.process_time() - c0) / calls * 1e6, (time.perf_counter() - w0) / calls * 1e6

    samples: Dict[str, List[Tuple[float, float, float, float]]] = {name: [] for name in pairs}
    for i in range(blocks):
        for name, (api, raw) in pairs.items():
            if i % 2:
                r, a = block(raw), block(api)
            else:
                a, r = block(api), block(raw)
            samples[name].append((a[0], r[0], a[1], r[1]))
    out = {}
    for name, rows in samples.items():
        diff = sorted(a - r for a, r, _, _ in rows)
        out[name] = dict(api_cpu_us=statistics.median(a for a, _, _, _ in rows),
                         raw_cpu_us=statistics.median(r for _, r, _, _ in rows),
                         api_wall_us=statistics.median(w for _, _, w, _ in rows),
                         raw_wall_us=statistics.median(w for _, _, _, w in rows),
                         overhead_cpu_us=statistics.median(diff),
                         overhead_q1_us=diff[len(diff) // 4], overhead_q3_us=diff[(3 * len(diff)) // 4],
                         overhead_wall_us=statistics.median(sorted(a - r for _, _, a, r in rows)))
    return out


def overhead_rows(batches: Sequence[int] = (1, 8), threads: Sequence[int] = (1, 2), H: int = 32,
                  K: int = 128, blocks: int = 60, calls: int = 40) -> List[dict]:
    """The functional API's cost beyond the raw op, per decode call, side by side in one process.

    fp32, T = 1, ``H`` heads, K = V = ``K``, the peer benchmark's call (q and k L2-normalised
    outside, a precomputed log-decay and beta, so the unstable-write check runs; an initial state
    in, the final state out, no pool; ``python -m torch_kda bench --peers``), under
    ``torch.no_grad()``. Pairs (API call vs the raw op on the same inputs):

    - ``plain_k`` / ``plain_v``: ``fused_recurrent_kda(..., backend="native")`` (K-first /
      V-first state) vs ``torch.ops.kda.fused_recurrent(...)``;
    - ``auto_k``: the same with the default ``backend="auto"``;
    - ``layer_k``: the layer's flags (gate, q/k l2 norm and beta sigmoid in the op, ``A_log`` and
      ``dt_bias``) vs the raw op with them;
    - ``pool_k``: the serving decode (an fp32 state pool of 2B slots updated in place through
      ``ssm_state_indices``, ``out=``) vs ``torch.ops.kda.fused_recurrent_serving(...)``.

    Returns one dict per (pair, B, threads) with the fields of :func:`_paired_blocks`.
    """
    rows: List[dict] = []
    old_threads = torch.get_num_threads()
    ops = torch.ops.kda
    try:
        for th in threads:
            torch.set_num_threads(th)
            for B in batches:
                gen = torch.Generator().manual_seed(B)

                def r(*shape, scale=1.0):
                    return torch.randn(*shape, generator=gen) * scale

                q = torch.nn.functional.normalize(r(B, 1, H, K), dim=-1)
                k = torch.nn.functional.normalize(r(B, 1, H, K), dim=-1)
                v, g = r(B, 1, H, K), -torch.rand(B, 1, H, K, generator=gen) * 0.1
                beta = torch.rand(B, 1, H, generator=gen)
                h0 = r(B, H, K, K, scale=0.1)
                h0_v = h0.transpose(-1, -2).contiguous()
                graw, blog = r(B, 1, H, K), r(B, 1, H)
                A_log, dt_bias = torch.rand(H, generator=gen) * 2.7, r(H * K, scale=0.5)
                pool = r(2 * B, H, K, K, scale=0.1)
                idx = torch.randperm(2 * B, generator=gen)[:B]
                out = torch.empty(B, 1, H, K)
                scale = K ** -0.5
                api = torch_kda.fused_recurrent_kda

                def plain(vf):
                    s = h0_v if vf else h0
                    return (lambda: api(q, k, v, g, beta, initial_state=s, output_final_state=True,
                                        state_v_first=vf, backend="native"),
                            lambda: ops.fused_recurrent(q, k, v, g, beta, scale, s, False, False, False,
                                                        False, None, vf, None, None, None))

                pairs = {
                    "plain_k": plain(False), "plain_v": plain(True),
                    "auto_k": (lambda: api(q, k, v, g, beta, initial_state=h0, output_final_state=True),
                               plain(False)[1]),
                    "layer_k": (lambda: api(q, k, v, graw, blog, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                            use_beta_sigmoid_in_kernel=True, A_log=A_log,
                                            dt_bias=dt_bias, backend="native"),
                                lambda: ops.fused_recurrent(q, k, v, graw, blog, scale, h0, True, True,
                                                            True, False, None, False, None, A_log,
                                                            dt_bias)),
                    "pool_k": (lambda: api(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx,
                                           inplace_final_state=True, out=out, backend="native"),
                               lambda: ops.fused_recurrent_serving(
                                   q, k, v, g, beta, scale, pool, idx, None, out, None, -1, True,
                                   False, False, False, False, None, False, None, None, None)),
                }
                with torch.no_grad():
                    res = _paired_blocks(pairs, blocks, calls)
                for name, m in res.items():
                    rows.append(dict(row=name, B=B, H=H, K=K, threads=th, **m))
    finally:
        torch.set_num_threads(old_threads)
    return rows


def format_overhead(rows: List[dict]) -> str:
    """Markdown table of :func:`overhead_rows` (CPU microseconds per call)."""
    lines = ["| pair | B | thr | API us (CPU) | raw op us (CPU) | overhead us (CPU), median [IQR] | overhead us (wall) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['B']} | {r['threads']} | {r['api_cpu_us']:,.1f} | {r['raw_cpu_us']:,.1f} | "
                     f"{r['overhead_cpu_us']:.1f} [{r['overhead_q1_us']:.1f}, {r['overhead_q3_us']:.1f}] | "
                     f"{r['overhead_wall_us']:.1f} |")
    return "\n".join(lines)


def overhead_main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m torch_kda.benchmark overhead",
                                description="the functional API's cost beyond the raw op per decode call")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--blocks", type=int, default=60, help="paired blocks (default 60)")
    p.add_argument("--calls", type=int, default=40, help="calls per block (default 40)")
    p.add_argument("--json", metavar="PATH", type=output_file, default=None,
                   help="also write the rows as JSON")
    args = p.parse_args(argv)
    info = machine_info()
    start = time.perf_counter()
    rows = overhead_rows(args.batches, args.threads, H=args.heads, blocks=args.blocks, calls=args.calls)
    command = " ".join(["python -m torch_kda.benchmark overhead", *(argv if argv is not None else sys.argv[2:])])
    publish(header_line(command, info, time.perf_counter() - start) + f"; torch_kda from "
            f"{os.path.dirname(torch_kda.__file__)}\n\n" + format_overhead(rows), out_json=args.json,
            payload=dict(machine=info, rows=rows))


# ---------------------------------------------------------------------------------------------
# chunkwise vs recurrent native kernels
# Run: python -m torch_kda.benchmark chunk [--quick] [--threads 1 2] [--heads 4] [--seq-lens ...]

CHUNK_SEQ_LENS = (256, 1024, 4096, 16384, 65536)
CHUNK_QUICK_SEQ_LENS = (1024, 8192)


def chunk_rows(seq_lens: Sequence[int] = CHUNK_SEQ_LENS, heads: Sequence[int] = (4,),
               threads: Sequence[int] = (1, 2), dtypes: Sequence[str] = ("fp32", "bf16"),
               modes: Sequence[str] = ("fwd", "fwd_bwd"), reps: int = 5,
               batch: int = 1, head_dim: int = 128) -> List[dict]:
    """The native chunkwise op (``torch.ops.kda.chunk``) vs the native recurrent op, side by side.

    Per (dtype, H, T, threads, mode): both ops interleaved (:func:`_interleaved_medians`), the
    softplus gate, q/k L2 norm and beta sigmoid in the op, K = V = ``head_dim``, B = ``batch``.
    ``fwd`` is the forward under ``torch.no_grad()``; ``fwd_bwd`` the forward plus the backward of a random
    output gradient (the chunk op's backward is kda::chunk_bwd where registered, else the
    recurrent backward; both read the same checkpoints). Rates count the recurrent form's FLOPs
    (8*K*V per token and value head forward, 32*K*V forward+backward, docs/math.md) for both ops,
    so the rates compare like tokens/s; they are given as % of this box's fp32 and bf16
    ``torch.mm`` rates (2048 x 2048, sampled at each thread count).
    """
    rows: List[dict] = []
    before = torch.get_num_threads()
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            # bf16 torch.mm runs at ~1 GFLOP/s on CPUs without bf16 instructions (AVX2): one
            # 1024^3 sample there; three 2048^3 samples where bf16 is fast.
            gemm = {"fp32": statistics.median(gemm_gflops() for _ in range(3))}
            bf16 = gemm_gflops(1024, torch.bfloat16)
            gemm["bf16"] = bf16 if bf16 < 20 else statistics.median(
                gemm_gflops(dtype=torch.bfloat16) for _ in range(3))
            for dtype_name in dtypes:
                for H in heads:
                    for T in seq_lens:
                        shape = Shape(batch, T, H, H, head_dim, head_dim)
                        for mode in modes:
                            rows.append(_chunk_row(shape, dtype_name, n_threads, mode, reps, gemm))
    finally:
        torch.set_num_threads(before)
    return rows


def _chunk_row(shape: Shape, dtype_name: str, n_threads: int, mode: str, reps: int,
               gemm: Dict[str, float]) -> dict:
    dtype = DTYPES[dtype_name]
    t, f = make_inputs(shape, dtype, requires_grad=(mode == "fwd_bwd"))
    do = torch.randn(shape.B, shape.T, shape.HV, shape.V,
                     generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = shape.K ** -0.5

    def call(op):
        def run_once():
            with torch.set_grad_enabled(mode == "fwd_bwd"):
                o, _ = op(t["q"], t["k"], t["v"], t["g"], t["beta"], scale, None, True, True, True,
                          False, None, False, None, t["A_log"], t["dt_bias"])
                if mode == "fwd_bwd":
                    o.backward(do)
                    for x in t.values():
                        x.grad = None
        return run_once

    med = _interleaved_medians({"recurrent": call(torch.ops.kda.fused_recurrent),
                                "chunk": call(torch.ops.kda.chunk)}, reps=reps, warmup=1)
    flops = shape.flops(mode)
    row = dict(shape=shape.name, T=shape.T, H=shape.H, dtype=dtype_name, threads=n_threads,
               mode=mode, gemm_fp32=gemm["fp32"], gemm_bf16=gemm["bf16"])
    for name, (wall, cpu) in med.items():
        row[name] = dict(seconds=wall, cpu_seconds=cpu, tokens_per_s=shape.B * shape.T / wall,
                         gflops=flops / wall / 1e9)
    row["speedup"] = med["recurrent"][0] / med["chunk"][0]
    return row


def format_chunk(rows: List[dict]) -> str:
    """Markdown table of :func:`chunk_rows`."""
    lines = ["| dtype | shape | threads | mode | recurrent tok/s | chunk tok/s | chunk / recurrent | "
             "chunk % fp32 GEMM | chunk % bf16 GEMM | recurrent % fp32 GEMM |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, rc = r["chunk"], r["recurrent"]
        lines.append(f"| {r['dtype']} | {r['shape']} | {r['threads']} | {r['mode']} | "
                     f"{_fmt_rate(rc['tokens_per_s'])} | {_fmt_rate(c['tokens_per_s'])} | "
                     f"**{r['speedup']:.2f}x** | {100 * c['gflops'] / r['gemm_fp32']:.0f}% | "
                     f"{100 * c['gflops'] / r['gemm_bf16']:.0f}% | "
                     f"{100 * rc['gflops'] / r['gemm_fp32']:.0f}% |")
    gem = sorted({(r["threads"], r["gemm_fp32"], r["gemm_bf16"]) for r in rows})
    lines.append("")
    lines.append("torch.mm 2048 x 2048 (GFLOP/s): " + "; ".join(
        f"{t} thread(s): fp32 {a:,.0f}, bf16 {b:,.1f}" for t, a, b in gem))
    return "\n".join(lines)


def chunk_main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m torch_kda.benchmark chunk",
                                description="native chunkwise vs recurrent op, side by side")
    p.add_argument("--quick", action="store_true",
                   help="T in {1K, 8K}, 3 repetitions (default: T from 256 to 64K, 5 repetitions)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None)
    p.add_argument("--heads", type=int, nargs="+", default=[4])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128, help="K = V (default 128)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--modes", nargs="+", choices=["fwd", "fwd_bwd"], default=["fwd", "fwd_bwd"])
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--json", metavar="PATH", type=output_file, default=None,
                   help="also write the rows as JSON")
    args = p.parse_args(argv)
    seq_lens = args.seq_lens or (CHUNK_QUICK_SEQ_LENS if args.quick else CHUNK_SEQ_LENS)
    reps = args.reps or (3 if args.quick else 5)
    load = os.getloadavg()
    info = machine_info()
    rows = chunk_rows(seq_lens, args.heads, args.threads, args.dtypes, args.modes, reps, args.batch,
                      args.head_dim)
    print(f"machine: {info['cpu']} ({info['logical_cpus']} logical CPUs); torch {info['torch']}; "
          f"commit {info['commit']}; threads {args.threads}")
    print(f"chunk state products: TORCH_KDA_CHUNK_PRODUCTS="
          f"{os.environ.get('TORCH_KDA_CHUNK_PRODUCTS') or 'auto'} (docs/math.md 'Chunkwise form')")
    print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    publish(format_chunk(rows), out_json=args.json, payload=dict(machine=info, rows=rows))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "serving":
    serving_main(sys.argv[2:])
if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "chunk":
    chunk_main(sys.argv[2:])
if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "overhead":
    overhead_main(sys.argv[2:])
