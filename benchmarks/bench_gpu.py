"""GPU interop check and timing: torch_kda's ``"fla"`` backend vs the native CPU op, and its overhead.

On a CUDA machine with flash-linear-attention (``fla-core``) and torch-kda (native op built)
installed, one run does:

1. **Parity** (``--parts parity``): ``torch_kda.chunk_kda(backend="fla")`` on the GPU and the layer
   ``torch_kda.nn.KimiDeltaAttention(backend="fla")`` against this library's native CPU op / CPU
   layer on the same inputs and weights, in fp32 and bf16, forward and every gradient. Each tensor
   gets three relative errors ``||a - b|| / ||b||``: GPU vs truth, CPU vs truth, GPU vs CPU, where
   the truth is the native CPU run in float64 on the same (rounded) inputs. Also
   ``torch_kda.compat.flash_kda.fwd`` on CUDA (FLA underneath) vs on CPU.
2. **Timing** (``--parts time``): at FLA's benchmark shapes (bf16, K = V = 128, gate, L2 norm and
   beta sigmoid in the kernel, ``safe_gate``, ``lower_bound=-5``, V-first state), forward and
   forward+backward medians (CUDA events) of FLA's ``chunk_kda`` called directly, of
   ``torch_kda.chunk_kda(backend="fla")`` with identical arguments, of the layer with
   ``backend="fla"`` vs the same layer calling FLA's op directly, and of the ``"reference"``
   backend on CUDA for scale. Triton's autotuning runs in an untimed warm-up first.
3. Writes ``results.json`` and ``results.md`` into ``--out`` after every section and prints the
   markdown tables.

``--dry-run`` exercises every code path on the CPU: the ``"reference"`` backend stands in for
``"fla"`` (and ``torch_kda.reference.chunk_kda`` for FLA's own op), tiny shapes, wall-clock timing.

Run from outside the source tree (or as ``python benchmarks/bench_gpu.py``) so that the installed
package, with its native library, is imported. On a fresh GPU machine FLA's Triton autotuning takes
~4 minutes per set of autotune keys (head count, dtype, ...): ``--parts warm --shapes ...`` does it in
separate processes (in parallel with each other and with the native build) and leaves the results in
Triton's on-disk autotune cache (``FLA_CACHE_RESULTS=1``) for the timing process. The exact commands
and results of the H200 run are in ``benchmarks/results_gpu/`` and ``docs/benchmarks_gpu.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

# torch_kda is imported in main(), after the argument parsing: ``--parts warm`` runs without it
# (it warms FLA's Triton autotuning while the native op is still being built and installed).
torch_kda = kda_nn = compat_fk = None

T0 = time.time()
LOWER_BOUND = -5.0
TIMED_SHAPES = {"B1-T8192-H16": (1, 8192, 16), "B1-T8192-H96": (1, 8192, 96), "B4-T2048-H16": (4, 2048, 16)}


# ---------------------------------------------------------------------------------------------
# helpers
def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 on the CPU (NaN if either has a non-finite value)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    d = b.norm().item()
    return (a - b).norm().item() / d if d > 0 else (a - b).norm().item()


class Env:
    """What runs where: in a real run ``gpu_backend="fla"`` on CUDA, in a dry run the reference on CPU."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = torch.device("cpu") if dry_run else torch.device("cuda")
        self.gpu_backend = "reference" if dry_run else "fla"
        nat = torch_kda.available_backends()["native"]
        self.cpu_backend = "native" if nat.available else "reference"
        self.native_reason = nat.reason
        if dry_run:
            self.direct_op = torch_kda.reference.chunk_kda
        else:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
            self.direct_op = fla_chunk_kda

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


@contextlib.contextmanager
def fast_autotune(enabled: bool):
    """Let Triton's autotuner try ONE config per kernel (the smallest: fewest stages, smallest blocks).

    Used for the parity shapes only (their autotune keys differ from the timed shapes'), so that the
    correctness checks do not pay ~5 minutes of autotuning per dtype; any config computes the same
    function. No-op when disabled or when Triton is absent.
    """
    if not enabled:
        yield False
        return
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:  # noqa: BLE001 (no Triton: nothing to patch)
        yield False
        return
    original = Autotuner.prune_configs

    def size(cfg):
        blocks = 1
        for v in cfg.kwargs.values():
            if isinstance(v, int) and not isinstance(v, bool):
                blocks *= max(v, 1)
        return (cfg.num_stages or 0, blocks, cfg.num_warps or 0)

    def one_config(self, kwargs, *args, **kw):
        pruned = original(self, kwargs, *args, **kw)
        return [min(pruned, key=size)] if len(pruned) > 1 else pruned

    Autotuner.prune_configs = one_config
    try:
        yield True
    finally:
        Autotuner.prune_configs = original


# ---------------------------------------------------------------------------------------------
# parity: the functional op
def op_inputs(B, T, H, K, seed):
    """Master fp64 CPU tensors: raw q/k/v/g/beta, fp32-class gate parameters, state, cotangents."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: torch.randn(*s, generator=gen, dtype=torch.float64) * sc  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, K), g=r(B, T, H, K), beta=r(B, T, H),
                A_log=r(H, sc=0.5), dt_bias=r(H * K, sc=0.5), initial_state=r(B, H, K, K, sc=0.5),
                do=r(B, T, H, K), dht=r(B, H, K, K))


def run_op(m, dtype, device, backend):
    """chunk_kda forward + backward of ``sum(o*do) + sum(ht*dht)``; returns CPU fp64 tensors."""
    side = torch.float64 if dtype == torch.float64 else torch.float32
    leaf = {}
    for n in ("q", "k", "v", "g", "beta"):
        # round on the CPU first, so every run sees the same values
        leaf[n] = m[n].detach().to(dtype).to(device).clone().requires_grad_(True)
    for n in ("A_log", "dt_bias", "initial_state"):
        leaf[n] = m[n].detach().to(side).to(device).clone().requires_grad_(True)
    o, ht = torch_kda.chunk_kda(
        leaf["q"], leaf["k"], leaf["v"], leaf["g"], leaf["beta"], initial_state=leaf["initial_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, state_v_first=True,
        A_log=leaf["A_log"], dt_bias=leaf["dt_bias"], backend=backend)
    loss = (o.to(side) * m["do"].to(side).to(device)).sum() + (ht * m["dht"].to(side).to(device)).sum()
    loss.backward()
    out = {"o": o, "final_state": ht}
    out.update({f"d{n}": _grad(x) for n, x in leaf.items()})
    return {n: x.detach().double().cpu() for n, x in out.items()}


def _grad(x: torch.Tensor) -> torch.Tensor:
    """The gradient, or NaNs when the backend returned none (so the check fails loudly)."""
    return x.grad if x.grad is not None else torch.full_like(x, float("nan"))


def compare(gpu: Dict, cpu: Dict, truth: Dict) -> Dict[str, Dict[str, float]]:
    return {n: {"gpu_vs_truth": rel_err(gpu[n], truth[n]), "cpu_vs_truth": rel_err(cpu[n], truth[n]),
                "gpu_vs_cpu": rel_err(gpu[n], cpu[n])} for n in truth}


def verdict(errs: Dict[str, Dict[str, float]], dtype: torch.dtype) -> str:
    """ok when every GPU error is within max(2 x the CPU error, the dtype's floor) (NaN fails)."""
    floor = {torch.float32: 5e-3, torch.bfloat16: 3e-2}[dtype]
    bad = [n for n, e in errs.items()
           if not (e["gpu_vs_truth"] <= max(2 * e["cpu_vs_truth"], floor))]
    return "ok" if not bad else "CHECK: " + ", ".join(bad)


def parity_op(env: Env, dtype, shape, seed) -> Dict:
    B, T, H, K = shape
    m = op_inputs(B, T, H, K, seed)
    truth = run_op({n: (x.to(dtype).double() if n in ("q", "k", "v", "g", "beta") else x) for n, x in m.items()},
                   torch.float64, torch.device("cpu"), env.cpu_backend)
    cpu = run_op(m, dtype, torch.device("cpu"), env.cpu_backend)
    gpu = run_op(m, dtype, env.device, env.gpu_backend)
    errs = compare(gpu, cpu, truth)
    return {"what": "chunk_kda", "dtype": str(dtype).replace("torch.", ""), "shape": f"B{B} T{T} H{H} K=V={K}",
            "errors": errs, "verdict": verdict(errs, dtype)}


# ---------------------------------------------------------------------------------------------
# parity: the layer
def run_layer(layer, x_master, do_master, dtype, device):
    layer = layer.to(device).train()
    layer.zero_grad(set_to_none=True)
    x = x_master.detach().to(dtype).to(device).clone().requires_grad_(True)
    y = layer(x)
    side = torch.float64 if dtype == torch.float64 else torch.float32
    (y.to(side) * do_master.to(side).to(device)).sum().backward()
    out = {"y": y, "dx": _grad(x)}
    out.update({f"d.{n}": _grad(p) for n, p in layer.named_parameters()})
    return {n: t.detach().double().cpu() for n, t in out.items()}


def parity_layer(env: Env, dtype, shape, seed) -> Dict:
    B, T, H, K = shape
    M = H * K
    torch.manual_seed(seed)
    kw = dict(hidden_size=M, num_heads=H, head_dim=K, safe_gate=True, lower_bound=LOWER_BOUND)
    cpu_layer = kda_nn.KimiDeltaAttention(**kw, backend=env.cpu_backend)
    with torch.no_grad():  # fresh random values for every parameter (A_log is 0 at init with safe_gate)
        for p in cpu_layer.parameters():
            p.add_(torch.randn_like(p) * 0.1 * (p.detach().std() if p.numel() > 1 and p.std() > 0 else 1.0))
    gpu_layer = kda_nn.KimiDeltaAttention(**kw, backend=env.gpu_backend)
    gpu_layer.load_state_dict(cpu_layer.state_dict(), strict=True)
    truth_layer = copy.deepcopy(cpu_layer).double()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, T, M, generator=gen, dtype=torch.float64)
    do = torch.randn(B, T, M, generator=gen, dtype=torch.float64)
    truth = run_layer(truth_layer, x.to(dtype).double(), do, torch.float64, torch.device("cpu"))
    cpu = run_layer(cpu_layer, x, do, dtype, torch.device("cpu"))
    gpu = run_layer(gpu_layer, x, do, dtype, env.device)
    errs = compare(gpu, cpu, truth)
    return {"what": "KimiDeltaAttention", "dtype": str(dtype).replace("torch.", ""),
            "shape": f"B{B} T{T} M{M} H{H} K=V={K} (fp32 params)", "errors": errs,
            "verdict": verdict(errs, dtype)}


def parity_compat(env: Env, shape, seed) -> Dict:
    """torch_kda.compat.flash_kda.fwd on the GPU device (FLA there) vs on the CPU (native)."""
    B, T, H, K = shape
    m = op_inputs(B, T, H, K, seed)

    def run(device, dtype, backend):
        a = {n: m[n].to(torch.bfloat16).to(dtype).to(device) for n in ("q", "k", "v", "g", "beta")}
        side = torch.float64 if dtype == torch.float64 else torch.float32
        out = torch.empty_like(a["q"])
        fs = torch.empty(B, H, K, K, dtype=side, device=device)
        compat_fk.fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], K ** -0.5, out,
                      m["A_log"].to(side).to(device), m["dt_bias"].reshape(H, K).to(side).to(device),
                      LOWER_BOUND, m["initial_state"].to(side).to(device), fs, backend=backend)
        return {"out": out.double().cpu(), "final_state": fs.double().cpu()}

    truth = run(torch.device("cpu"), torch.float64, env.cpu_backend)
    cpu = run(torch.device("cpu"), torch.bfloat16, env.cpu_backend)
    gpu = run(env.device, torch.bfloat16, "auto")
    errs = compare(gpu, cpu, truth)
    return {"what": "compat.flash_kda.fwd", "dtype": "bfloat16", "shape": f"B{B} T{T} H{H} D={K}",
            "errors": errs, "verdict": verdict(errs, torch.bfloat16)}


# ---------------------------------------------------------------------------------------------
# timing
def warm_fla(shapes: List[str], head_dim: int) -> Dict[str, float]:
    """Run FLA's chunk_kda once forward (no grad) and once forward+backward at each timed shape, with
    exactly the arguments the timing uses, so that Triton autotunes and compiles every kernel and
    caches the result on disk (FLA_CACHE_RESULTS=1, Triton's autotune disk cache). A later process
    then times without autotuning. Needs only torch and fla."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    secs = {}
    dev = torch.device("cuda")
    for name in shapes:
        B, T, H = TIMED_SHAPES[name]
        K = head_dim
        t1 = time.time()
        for grad in (False, True):
            gen = torch.Generator(device=dev).manual_seed(0)
            r = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.float32)  # noqa: E731
            t = {n: r(B, T, H, K).to(torch.bfloat16).requires_grad_(grad) for n in ("q", "k", "v", "g")}
            t["beta"] = r(B, T, H).to(torch.bfloat16).requires_grad_(grad)
            t["A_log"] = (r(H) * 0.5).requires_grad_(grad)
            t["dt_bias"] = (r(H * K) * 0.5).requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                o, _ = fla_chunk_kda(*[t[n] for n in ("q", "k", "v", "g", "beta")], **op_kwargs(t))
                if grad:
                    o.backward(torch.randn_like(o))
            torch.cuda.synchronize()
        secs[name] = time.time() - t1
        log(f"warm {name}: {secs[name]:.0f} s")
    return secs


def time_fn(env: Env, fn: Callable[[], None], reps: int) -> List[float]:
    """Per-call times in ms: CUDA events on CUDA, perf_counter on the CPU (after one warm call)."""
    times = []
    for _ in range(reps):
        if env.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return times


def interleaved(env: Env, fns: Dict[str, Callable[[], None]], rounds: int, reps: int) -> Dict[str, Dict]:
    """Time each variant in alternating rounds; median and a noise figure (half-vs-half medians)."""
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            samples[n].extend(time_fn(env, fn, reps))
    out = {}
    for n, s in samples.items():
        h = len(s) // 2
        out[n] = {"median_ms": statistics.median(s), "min_ms": min(s), "n": len(s),
                  "half_spread_pct": 100 * abs(statistics.median(s[:h]) - statistics.median(s[h:]))
                  / statistics.median(s) if h else 0.0}
    return out


def op_timing_inputs(env: Env, B, T, H, K, dtype, seed=0, requires_grad=False):
    gen = torch.Generator(device=env.device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=env.device, dtype=torch.float32)  # noqa: E731
    t = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, K), g=r(B, T, H, K), beta=r(B, T, H))
    t = {n: x.to(dtype).requires_grad_(requires_grad) for n, x in t.items()}
    t["A_log"] = (r(H) * 0.5).requires_grad_(requires_grad)
    t["dt_bias"] = (r(H * K) * 0.5).requires_grad_(requires_grad)
    return t


def op_kwargs(t):
    return dict(scale=t["q"].shape[-1] ** -0.5, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                safe_gate=True, lower_bound=LOWER_BOUND, state_v_first=True, A_log=t["A_log"],
                dt_bias=t["dt_bias"], chunk_size=64)


def time_op(env: Env, name: str, shape, args) -> Dict:
    B, T, H = shape
    K = args.head_dim
    res = {"shape": name, "B": B, "T": T, "H": H, "K": K, "V": K, "dtype": "bfloat16"}
    dtype = torch.bfloat16
    direct, ours = env.direct_op, torch_kda.chunk_kda
    gb = env.gpu_backend

    # forward (inference: no autograd graph)
    t = op_timing_inputs(env, B, T, H, K, dtype)
    pos = [t[n] for n in ("q", "k", "v", "g", "beta")]
    kw = op_kwargs(t)
    t_dk = t["dt_bias"].reshape(H, K)
    out = torch.empty_like(t["q"])

    def f_direct():
        with torch.no_grad():
            direct(*pos, **kw)

    def f_ours():
        with torch.no_grad():
            ours(*pos, **kw, backend=gb)

    def f_compat():
        compat_fk.fwd(*pos, kw["scale"], out, t["A_log"], t_dk, LOWER_BOUND,
                      backend="auto" if not env.dry_run else "reference")

    t1 = time.time()
    f_direct()
    env.sync()
    res["fwd_warmup_s"] = time.time() - t1  # Triton autotuning and compilation of the forward
    f_ours(), f_compat()
    env.sync()
    res["fwd"] = interleaved(env, {"fla_direct": f_direct, "torch_kda_fla": f_ours, "compat_fwd": f_compat},
                             args.rounds, args.reps)
    log(f"  {name} fwd: " + ", ".join(f"{n} {v['median_ms']:.3f} ms" for n, v in res["fwd"].items()))
    del out

    # forward + backward
    tg = op_timing_inputs(env, B, T, H, K, dtype, requires_grad=True)
    posg = [tg[n] for n in ("q", "k", "v", "g", "beta")]
    kwg = op_kwargs(tg)
    do = torch.randn(B, T, H, K, device=env.device, dtype=dtype)

    def b_direct():
        o, _ = direct(*posg, **kwg)
        o.backward(do)

    def b_ours():
        o, _ = ours(*posg, **kwg, backend=gb)
        o.backward(do)

    t1 = time.time()
    b_direct()
    env.sync()
    res["fwdbwd_warmup_s"] = time.time() - t1
    b_ours()
    env.sync()
    res["fwdbwd"] = interleaved(env, {"fla_direct": b_direct, "torch_kda_fla": b_ours}, args.rounds, args.reps)
    log(f"  {name} fwd+bwd: " + ", ".join(f"{n} {v['median_ms']:.3f} ms" for n, v in res["fwdbwd"].items()))
    for mode in ("fwd", "fwdbwd"):
        d = res[mode]
        res[f"{mode}_overhead_pct"] = 100 * (d["torch_kda_fla"]["median_ms"] / d["fla_direct"]["median_ms"] - 1)
    res["fwd_compat_overhead_pct"] = 100 * (res["fwd"]["compat_fwd"]["median_ms"] / res["fwd"]["fla_direct"]["median_ms"] - 1)
    return res


def time_reference(env: Env, name: str, shape, args) -> Dict:
    """The pure-PyTorch reference backend on the same device, for scale (few reps: it is slow)."""
    B, T, H = shape
    K = args.head_dim
    res = {"shape": name}
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        t = op_timing_inputs(env, B, T, H, K, torch.bfloat16)
        pos = [t[n] for n in ("q", "k", "v", "g", "beta")]
        kw = op_kwargs(t)

        def f():
            with torch.no_grad():
                torch_kda.chunk_kda(*pos, **kw, backend="reference")

        f()
        env.sync()
        res["fwd"] = interleaved(env, {"reference": f}, 1, args.ref_reps)["reference"]
        if H <= args.ref_bwd_max_heads:
            tg = op_timing_inputs(env, B, T, H, K, torch.bfloat16, requires_grad=True)
            posg = [tg[n] for n in ("q", "k", "v", "g", "beta")]
            kwg = op_kwargs(tg)
            do = torch.randn(B, T, H, K, device=env.device, dtype=torch.bfloat16)

            def b():
                o, _ = torch_kda.chunk_kda(*posg, **kwg, backend="reference")
                o.backward(do)

            b()
            env.sync()
            res["fwdbwd"] = interleaved(env, {"reference": b}, 1, args.ref_reps)["reference"]
        else:
            res["fwdbwd"] = f"skipped (H > {args.ref_bwd_max_heads}: autograd memory of the reference)"
        if env.device.type == "cuda":
            res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    except torch.cuda.OutOfMemoryError as exc:  # pragma: no cover (GPU only)
        res["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    finally:
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return res


class _DirectFLA:
    """Stands in for ``torch_kda`` inside the layer module: calls FLA's op directly, no checks."""

    def __init__(self, env: Env):
        self.env = env

    def chunk_kda(self, backend=None, **kw):
        return self.env.direct_op(**kw)

    def fused_recurrent_kda(self, backend=None, **kw):  # not reached in these timings
        raise RuntimeError("the timed layer runs only the chunk op")


@contextlib.contextmanager
def layer_calls_fla_directly(env: Env):
    import torch_kda.nn.layer as layer_mod
    saved = layer_mod._kda
    layer_mod._kda = _DirectFLA(env)
    try:
        yield
    finally:
        layer_mod._kda = saved


def time_layer(env: Env, name: str, shape, args) -> Dict:
    B, T, H = shape
    K = args.head_dim
    M = H * K
    res = {"shape": name, "hidden_size": M, "dtype": "bf16 activations, fp32 parameters"}
    torch.manual_seed(0)
    layer = kda_nn.KimiDeltaAttention(hidden_size=M, num_heads=H, head_dim=K, safe_gate=True,
                                      lower_bound=LOWER_BOUND, backend=env.gpu_backend).to(env.device)
    x = torch.randn(B, T, M, device=env.device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn_like(x)

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwdbwd():
        layer(xg).backward(dy)

    def direct(fn):
        def run():
            with layer_calls_fla_directly(env):
                fn()
        return run

    for mode, fn, train in (("fwd", fwd, False), ("fwdbwd", fwdbwd, True)):
        layer.train(train)
        t1 = time.time()
        fn()
        direct(fn)()
        env.sync()
        res[f"{mode}_warmup_s"] = time.time() - t1
        res[mode] = interleaved(env, {"layer_fla_direct": direct(fn), "layer_torch_kda_fla": fn},
                                args.rounds, args.reps)
        d = res[mode]
        res[f"{mode}_overhead_pct"] = 100 * (d["layer_torch_kda_fla"]["median_ms"] / d["layer_fla_direct"]["median_ms"] - 1)
        log(f"  layer {name} {mode}: " + ", ".join(f"{n} {v['median_ms']:.3f} ms" for n, v in d.items()))
    return res


# ---------------------------------------------------------------------------------------------
# reporting
def environment(env: Env, args) -> Dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "torch_kda": torch_kda.__version__,
            "cpu_backend": env.cpu_backend, "native_reason": env.native_reason, "gpu_backend": env.gpu_backend,
            "cpu_threads": torch.get_num_threads(), "commit": args.commit, "argv": sys.argv,
            "dry_run": env.dry_run, "host": platform.node()}
    if not env.dry_run:
        import triton
        import fla
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / 2 ** 30, 1),
                    capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda, triton=triton.__version__,
                    fla=getattr(fla, "__version__", "?"))
        with contextlib.suppress(Exception):
            import subprocess
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm",
                                             "--format=csv,noheader"], capture_output=True, text=True,
                                            timeout=20).stdout.strip()
    return info


def fmt(x) -> str:
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.2e}"
    return str(x)


def markdown(results: Dict) -> str:
    lines = []
    e = results["env"]
    lines.append(f"Device: {e.get('gpu', 'cpu (dry run)')}; torch {e['torch']}, triton {e.get('triton', '-')}, "
                 f"fla {e.get('fla', '-')}, CUDA {e.get('cuda', '-')}, driver {e.get('driver', '-')}; "
                 f"CPU side: backend {e['cpu_backend']!r}, {e['cpu_threads']} threads; commit {e['commit']}.")
    if results.get("parity"):
        lines += ["", "### Parity: GPU (`backend=%r`) vs this library's CPU op (`%r`); truth = CPU float64"
                  % (e["gpu_backend"], e["cpu_backend"]), "",
                  "| what | dtype | shape | tensor | GPU vs truth | CPU vs truth | GPU vs CPU |",
                  "|---|---|---|---|---|---|---|"]
        for p in results["parity"]:
            if "error" in p:
                lines.append(f"| {p['what']} | {p['dtype']} | {p.get('shape', '')} | ERROR | {p['error']} | | |")
                continue
            errs = p["errors"]
            names = list(errs)
            if p["what"] == "KimiDeltaAttention":  # summarise the parameter gradients by their worst
                params = [n for n in names if n.startswith("d.")]
                worst = max(params, key=lambda n: errs[n]["gpu_vs_truth"]
                            if not math.isnan(errs[n]["gpu_vs_truth"]) else float("inf"))
                names = [n for n in names if not n.startswith("d.")] + [worst]
            for n in names:
                r = errs[n]
                label = f"{n} (worst param grad)" if n.startswith("d.") else n
                lines.append(f"| {p['what']} | {p['dtype']} | {p['shape']} | {label} | {fmt(r['gpu_vs_truth'])} | "
                             f"{fmt(r['cpu_vs_truth'])} | {fmt(r['gpu_vs_cpu'])} |")
            lines.append(f"| | | | **verdict** | {p['verdict']} | | |")
    if results.get("timing"):
        lines += ["", "### Timing (bf16, median ms; overhead = torch_kda / direct − 1)", "",
                  "| shape | level | mode | FLA direct | torch_kda `fla` | overhead | noise (half vs half) | warm-up s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results["timing"]:
            if "error" in r:
                lines.append(f"| {r['shape']} | | | ERROR: {r['error']} | | | | |")
                continue
            for level, a, b in (("op", "fla_direct", "torch_kda_fla"), ("layer", "layer_fla_direct", "layer_torch_kda_fla")):
                src = r.get(level)
                if not src:
                    continue
                for mode in ("fwd", "fwdbwd"):
                    if mode not in src:
                        continue
                    d = src[mode]
                    noise = max(d[a]["half_spread_pct"], d[b]["half_spread_pct"])
                    lines.append(f"| {r['shape']} | {level} | {mode} | {d[a]['median_ms']:.3f} | {d[b]['median_ms']:.3f} | "
                                 f"{src[mode + '_overhead_pct']:+.1f}% | {noise:.1f}% | {src.get(mode + '_warmup_s', 0):.0f} |")
                if level == "op" and "compat_fwd" in src["fwd"]:
                    lines.append(f"| {r['shape']} | compat.flash_kda.fwd | fwd | {src['fwd']['fla_direct']['median_ms']:.3f} | "
                                 f"{src['fwd']['compat_fwd']['median_ms']:.3f} | {src['fwd_compat_overhead_pct']:+.1f}% | | |")
        refs = [r for r in results["timing"] if r.get("reference")]
        if refs:
            lines += ["", "| shape | reference fwd ms | reference fwd+bwd ms | FLA fwd ms | FLA fwd+bwd ms | peak GiB |",
                      "|---|---|---|---|---|---|"]
            for r in refs:
                ref, op = r["reference"], r.get("op", {})
                if "error" in ref:
                    lines.append(f"| {r['shape']} | {ref['error']} | | | | |")
                    continue
                fb = ref["fwdbwd"]
                fb = f"{fb['median_ms']:.1f}" if isinstance(fb, dict) else fb
                fla_f = f"{op['fwd']['fla_direct']['median_ms']:.3f}" if op else "-"
                fla_b = f"{op['fwdbwd']['fla_direct']['median_ms']:.3f}" if op else "-"
                lines.append(f"| {r['shape']} | {ref['fwd']['median_ms']:.1f} | {fb} | {fla_f} | {fla_b} | "
                             f"{ref.get('peak_mem_gib', float('nan')):.1f} |")
    return "\n".join(lines) + "\n"


def save(results: Dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))


# ---------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/bench_gpu", help="directory for results.json / results.md")
    ap.add_argument("--parts", default="parity,time", help="comma list of: parity, time; or warm alone (FLA autotuning only, no torch_kda)")
    ap.add_argument("--shapes", default=",".join(TIMED_SHAPES), help=f"timed shapes among {list(TIMED_SHAPES)}")
    ap.add_argument("--layer-shapes", default="B1-T8192-H16,B4-T2048-H16", help="timed shapes for the layer")
    ap.add_argument("--ref-shapes", default="B1-T8192-H16,B4-T2048-H16,B1-T8192-H96",
                    help="timed shapes for the reference backend")
    ap.add_argument("--ref-bwd-max-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per variant")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per round")
    ap.add_argument("--ref-reps", type=int, default=3)
    ap.add_argument("--parity-shape", default="2,300,4,128", help="B,T,H,K of the parity problems")
    ap.add_argument("--no-fast-tune-parity", action="store_true",
                    help="autotune the parity shapes fully (default: one Triton config per kernel)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip remaining timed shapes past this wall time")
    ap.add_argument("--commit", default=os.environ.get("TORCH_KDA_COMMIT", "?"))
    ap.add_argument("--dry-run", action="store_true", help="CPU only, reference backend as the GPU stand-in, tiny shapes")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts == {"warm"}:
        if args.dry_run or not torch.cuda.is_available():
            print("--parts warm needs CUDA and fla", file=sys.stderr)
            return 2
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        secs = warm_fla(args.shapes.split(","), args.head_dim)
        (out / f"warm_{'_'.join(args.shapes.split(','))}.json").write_text(json.dumps(secs))
        return 0
    global torch_kda, kda_nn, compat_fk
    import torch_kda  # noqa: F811
    import torch_kda.nn as kda_nn  # noqa: F811
    from torch_kda.compat import flash_kda as compat_fk  # noqa: F811

    if args.dry_run:
        args.head_dim = 16
        TIMED_SHAPES.update({"B1-T8192-H16": (1, 96, 2), "B1-T8192-H96": (1, 96, 3), "B4-T2048-H16": (2, 80, 2)})
        if args.parity_shape == ap.get_default("parity_shape"):
            args.parity_shape = "2,40,2,16"
        args.rounds, args.reps, args.ref_reps = 2, 2, 2
    elif not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on a CPU machine", file=sys.stderr)
        return 2

    env = Env(args.dry_run)
    out = Path(args.out)
    results: Dict = {"env": environment(env, args), "parity": [], "timing": []}
    log(f"env: {json.dumps(results['env'], default=str)}")
    ps = tuple(int(v) for v in args.parity_shape.split(","))

    if "parity" in parts:
        with fast_autotune(not args.no_fast_tune_parity and not args.dry_run) as fast:
            results["env"]["parity_fast_autotune"] = fast
            jobs = [("op", torch.float32), ("op", torch.bfloat16), ("layer", torch.float32),
                    ("layer", torch.bfloat16), ("compat", torch.bfloat16)]
            for i, (what, dtype) in enumerate(jobs):
                t1 = time.time()
                try:
                    if what == "op":
                        r = parity_op(env, dtype, ps, seed=10 + i)
                    elif what == "layer":
                        r = parity_layer(env, dtype, (ps[0], min(ps[1], 256), ps[2], ps[3]), seed=20 + i)
                    else:
                        r = parity_compat(env, ps, seed=30 + i)
                except Exception as exc:  # noqa: BLE001 (record and go on: the run is expensive)
                    traceback.print_exc()
                    r = {"what": what, "dtype": str(dtype), "error": f"{type(exc).__name__}: {exc}"}
                r["seconds"] = time.time() - t1
                results["parity"].append(r)
                log(f"parity {what} {dtype}: {r.get('verdict', r.get('error'))} ({r['seconds']:.0f} s)")
                save(results, out)

    if "time" in parts:
        layer_shapes = set(args.layer_shapes.split(","))
        ref_shapes = set(args.ref_shapes.split(","))
        for name in args.shapes.split(","):
            if time.time() - T0 > args.budget_s:
                results["timing"].append({"shape": name, "error": "skipped: over --budget-s"})
                log(f"skip {name}: over budget")
                continue
            shape = TIMED_SHAPES[name]
            entry = {"shape": name}
            try:
                log(f"timing {name} (op)")
                entry["op"] = time_op(env, name, shape, args)
                if name in layer_shapes:
                    log(f"timing {name} (layer)")
                    entry["layer"] = time_layer(env, name, shape, args)
                if name in ref_shapes:
                    log(f"timing {name} (reference)")
                    entry["reference"] = time_reference(env, name, shape, args)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                entry["error"] = f"{type(exc).__name__}: {exc}"
            results["timing"].append(entry)
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
            save(results, out)

    results["env"]["wall_s"] = time.time() - T0
    save(results, out)
    print()
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
