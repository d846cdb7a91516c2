"""torch-kda side by side with the two other C++ CPU implementations of the KDA recurrence.

- **ggml** (llama.cpp): the op ``GGML_OP_GATED_DELTA_NET`` with a per-channel gate, run through
  our small driver ``benchmarks/peers/ggml_gdn_driver.c`` (loaded here with :mod:`ctypes`), which
  builds a one-op graph over our buffers once and times ``ggml_graph_compute`` (its best case).
- **ExecuTorch**: ``torch.ops.llama.gated_delta_rule`` from the ``executorch`` wheel, loaded with
  ``torch.ops.load_library`` in a worker process that runs in ExecuTorch's own virtual environment
  (its op library links against that environment's torch) and times each call itself.

``benchmarks/peers/setup.sh DIR`` builds both into ``DIR``; ``python -m torch_kda bench --peers DIR``
runs :func:`bench_peers`.

All three get the same inputs, each in its own layout and conventions, converted outside the timed
region: q and k L2-normalised, the log decay ``g`` (``<= 0``, per key channel), ``beta`` in (0, 1),
an initial state, ``scale = K**-0.5``, fp32, K = V (128 unless ``--head-dim`` says otherwise).

- torch-kda: ``fused_recurrent_kda(q, k, v, g, beta, initial_state, output_final_state=True)``,
  ``[B, T, H, *]``, state ``[B, H, K, V]`` or, with ``state_v_first=True``, ``[B, H, V, K]``.
- ggml: the same ``[B, T, H, *]`` arrays, state V-first ``[B, H, V, K]``; it scales q by
  ``1/sqrt(V)`` itself (equal to ``K**-0.5`` here).
- ExecuTorch: ``[B, H, T, *]``, ``decay = exp(g)``, q not scaled by the op (we pass ``scale * q``),
  state ``[B, H, K, V]``.

Before timing, every peer's output and final state are compared with torch-kda's (relative error:
max |difference| / max |torch-kda|). Timing: in each repetition every (implementation, thread
count) runs once before the next repetition starts, so load from other processes hits all alike
(decode shapes and short prefills: ``decode_calls`` calls back to back, :func:`calls_per_rep`);
medians are reported, with the load average at start and end.
Ratios are peer time / torch-kda time (> 1: torch-kda is faster). Decode shapes also time
``copy_`` of a tensor of the state's bytes in the same repetitions (:class:`Copy`): a decode call
reads and writes its state once, so its state bytes per second as a share of the copy's is how
close it runs to the machine's memory speed.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import torch_kda
from torch_kda import reference
from torch_kda.benchmark import (Shape, _find, gemm_gflops, head_dims, header_line, machine_info,
                                 publish)

__all__ = ["PREFILL_SHAPES", "DECODE_SHAPES", "peer_inputs", "peer_shapes", "calls_per_rep", "Ggml",
           "ExecuTorch", "run_peers", "format_peers", "bench_peers"]

PREFILL_SHAPES = (Shape(1, 4096, 4, 4), Shape(1, 4096, 16, 16))
DECODE_SHAPES = tuple(Shape(B, 1, 32, 32, decode=True) for B in (1, 8, 64))
DRIVER_NAME = "libkda_ggml_gdn.so"
#: Forward FLOPs (``Shape.flops("fwd")``) a repetition of a prefill shape holds at least: about a
#: millisecond at one core's fp32 GEMM rate.
MIN_REP_FLOPS = 1e8
VENV_NAME = "et-venv"
# A peer whose output differs from torch-kda's by more than this (relative) is reported as a mismatch.
AGREE_TOL = 1e-3


def peer_inputs(shape: Shape, seed: int = 0) -> Dict[str, torch.Tensor]:
    """fp32 inputs in torch-kda's layout, pre-processed as all three implementations take them.

    Returns ``q, k [B,T,H,K]`` (L2-normalised), ``v [B,T,H,V]``, ``g [B,T,H,K]`` (log decay from
    the softplus gate of docs/math.md with random ``A_log``, ``dt_bias``), ``beta [B,T,H]``
    (sigmoid of random logits) and ``h0 [B,H,K,V]``.
    """
    if shape.H != shape.HV or shape.K != shape.V:
        raise ValueError(f"shape: the peers need H == HV and K == V, got {shape}")
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = shape.B, shape.T, shape.H, shape.K, shape.V

    def r(*s):
        return torch.randn(*s, generator=gen)

    A_log = torch.rand(H, generator=gen) * 2.7
    dt_bias = r(H * K) * 0.5
    return dict(q=reference.l2norm(r(B, T, H, K)), k=reference.l2norm(r(B, T, H, K)), v=r(B, T, H, V),
                g=reference.kda_gate(r(B, T, H, K), A_log, dt_bias).float().contiguous(),
                beta=torch.sigmoid(r(B, T, H)), h0=r(B, H, K, V) * 0.1)


def peer_shapes(seq_lens: Optional[Sequence[int]] = None, heads: Optional[Sequence[int]] = None,
                head_dim: Optional[int] = None, decode_batches: Optional[Sequence[int]] = None,
                decode: bool = True) -> List[Shape]:
    """The shapes of a peers run: ``PREFILL_SHAPES`` and ``DECODE_SHAPES`` unless a grid is given.

    Prefill: B = 1, every T of ``seq_lens`` (default 4096) x every H = HV of ``heads`` (default 4,
    16); decode: B of ``decode_batches`` (default 1, 8, 64) at H = 32, dropped when ``decode`` is
    False. K = V = ``head_dim`` (default 128) in both.
    """
    K = head_dim or 128
    shapes = list(PREFILL_SHAPES)
    if seq_lens or heads or head_dim:
        shapes = [Shape(1, T, H, H, K, K) for H in (heads or [4, 16]) for T in (seq_lens or [4096])]
    if decode:
        shapes += [Shape(B, 1, 32, 32, K, K, decode=True) for B in (decode_batches or [1, 8, 64])]
    return shapes


def calls_per_rep(shape: Shape, most: int) -> int:
    """Calls of each implementation per repetition: ``most`` for a decode shape; for a prefill shape
    enough to hold ``MIN_REP_FLOPS`` (at least 1, at most ``most``).

    One call of a short prefill (B1 T2 H1 K32: ~16 KFLOP, microseconds) is dominated by what ran
    before it: timed alone right after the other implementations, torch-kda's call read 4-5x its
    warm time and ggml's 2x. Back-to-back calls time each implementation warm, as a model that
    calls it layer after layer would.
    """
    if shape.decode:
        return most
    return int(min(most, max(1, -(-MIN_REP_FLOPS // shape.flops("fwd")))))


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Ours:
    """torch-kda's native op on ``peer_inputs`` (state K-first, or V-first with ``state_v_first``)."""

    def __init__(self, inp: Dict[str, torch.Tensor], state_v_first: bool = False):
        self.v_first = state_v_first
        self.usage: Dict[int, List[Tuple[float, float, int]]] = {}
        h0 = inp["h0"].transpose(-1, -2).contiguous() if state_v_first else inp["h0"]
        self.args = dict(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], initial_state=h0,
                         output_final_state=True, state_v_first=state_v_first)

    def outputs(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(o [B,T,H,V], final state [B,H,K,V])."""
        with torch.no_grad():
            o, ht = torch_kda.fused_recurrent_kda(**self.args, backend="native")
        return o, (ht.transpose(-1, -2) if self.v_first else ht)

    def time(self, threads: int) -> float:
        """Seconds of one call; also records the process's user / system CPU seconds and minor
        page faults of the call in ``self.usage[threads]`` (getrusage before and after)."""
        torch.set_num_threads(threads)
        with torch.no_grad():
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            torch_kda.fused_recurrent_kda(**self.args, backend="native")
            el = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
        self.usage.setdefault(threads, []).append(
            (r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt))
        return el


class Copy:
    """The machine's copy bandwidth for a decode shape: ``dst.copy_(src)`` of fp32 tensors of the
    state's size, which moves what a decode call must move at least (the state read once and
    written once); timed in the same repetitions as the implementations."""

    def __init__(self, inp: Dict[str, torch.Tensor]):
        self.src = torch.randn(inp["h0"].shape)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # mapped before timing

    @property
    def bytes(self) -> int:
        """Bytes read plus bytes written by one copy."""
        return 2 * self.src.numel() * self.src.element_size()

    def time(self, threads: int) -> float:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


class Ggml:
    """ggml's op through our driver library (``DIR/libkda_ggml_gdn.so``); one graph per thread count."""

    def __init__(self, lib_path: str, inp: Dict[str, torch.Tensor], threads: Sequence[int]):
        lib = ctypes.CDLL(lib_path)
        lib.kda_ggml_create.restype = ctypes.c_void_p
        lib.kda_ggml_create.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 7 + [ctypes.c_int]
        lib.kda_ggml_compute.restype = ctypes.c_double
        lib.kda_ggml_compute.argtypes = [ctypes.c_void_p]
        lib.kda_ggml_free.argtypes = [ctypes.c_void_p]
        self.lib = lib
        B, T, H, K = inp["q"].shape
        V = inp["v"].shape[-1]
        self.shape = (B, T, H, K, V)
        # ggml's layouts: the [B,T,H,*] arrays as they are, the state V-first.
        self.bufs = [inp[n].contiguous() for n in ("q", "k", "v", "g", "beta")]
        self.bufs.append(inp["h0"].transpose(-1, -2).contiguous())
        self.out = torch.empty(B * T * H * V + B * H * V * K)
        self.handles: Dict[int, int] = {}
        for n in threads:
            h = lib.kda_ggml_create(B, T, H, K, V, *[b.data_ptr() for b in self.bufs], self.out.data_ptr(), n)
            if not h:
                raise RuntimeError("kda_ggml_create failed")
            self.handles[n] = h

    def outputs(self) -> Tuple[torch.Tensor, torch.Tensor]:
        B, T, H, K, V = self.shape
        self.time(min(self.handles))
        o = self.out[: B * T * H * V].view(B, T, H, V).clone()
        s = self.out[B * T * H * V:].view(B, H, V, K).transpose(-1, -2).clone()
        return o, s

    def time(self, threads: int) -> float:
        t = self.lib.kda_ggml_compute(self.handles[threads])
        if t < 0:
            raise RuntimeError("ggml_graph_compute failed")
        return t

    def close(self) -> None:
        for h in self.handles.values():
            self.lib.kda_ggml_free(h)
        self.handles = {}


# The ExecuTorch worker: runs with ExecuTorch's venv python, imports only torch and executorch.
_WORKER = r"""
import ctypes, glob, json, os, sys, time
import torch, executorch
root = list(executorch.__path__)[0]
torch.ops.load_library(os.path.join(root, "extension", "llm", "custom_ops", "libcustom_ops_aot_lib.so"))
op = torch.ops.llama.gated_delta_rule.default
# ExecuTorch's own thread pool (libexecutorch_threadpool.so) sizes itself from the core count;
# the op's parallel prefill runs on it, so it is resized to the thread count being measured.
tp = ctypes.CDLL(glob.glob(os.path.join(root, "lib", "libexecutorch_threadpool.so"))[0])
get_pool = tp._ZN10executorch9extension10threadpool14get_threadpoolEv
get_pool.restype = ctypes.c_void_p
reset = tp._ZN10executorch9extension10threadpool10ThreadPool24_unsafe_reset_threadpoolEj
reset.argtypes = [ctypes.c_void_p, ctypes.c_uint]
count = tp._ZNK10executorch9extension10threadpool10ThreadPool16get_thread_countEv
count.argtypes = [ctypes.c_void_p]
count.restype = ctypes.c_size_t
args, cur = None, None
for line in sys.stdin:
    c = json.loads(line)
    if c["cmd"] == "load":
        args = torch.load(c["path"])
        args = [args[n] for n in ("q", "k", "v", "decay", "beta", "state")]
        reply = {}
    elif c["cmd"] == "threads":
        if c["n"] != cur:
            torch.set_num_threads(c["n"])
            reset(get_pool(), c["n"])
            cur = c["n"]
        reply = {"pool": int(count(get_pool()))}
    elif c["cmd"] == "time":
        ts = []
        for _ in range(c["calls"]):
            t0 = time.perf_counter()
            op(*args)
            ts.append(time.perf_counter() - t0)
        reply = {"times": ts}
    elif c["cmd"] == "outputs":
        o, s = op(*args)
        torch.save({"o": o, "state": s}, c["path"])
        reply = {}
    else:
        break
    print(json.dumps(reply), flush=True)
"""


class ExecuTorch:
    """``llama::gated_delta_rule`` in a worker process of ExecuTorch's venv (``DIR/et-venv``)."""

    def __init__(self, python: str, inp: Dict[str, torch.Tensor], scale: float):
        self.tmp = tempfile.TemporaryDirectory(prefix="kda_peers_")
        path = os.path.join(self.tmp.name, "inputs.pt")
        t = lambda x: x.transpose(1, 2).contiguous()  # [B,T,H,*] -> [B,H,T,*]
        torch.save(dict(q=t(inp["q"] * scale), k=t(inp["k"]), v=t(inp["v"]), decay=t(inp["g"].exp()),
                        beta=inp["beta"].transpose(1, 2).contiguous(), state=inp["h0"].contiguous()), path)
        env = dict(os.environ, PYTHONPATH="")
        self.proc = subprocess.Popen([python, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        self._ask(cmd="load", path=path)
        self.pool: Dict[int, int] = {}

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the ExecuTorch worker exited (code {self.proc.poll()})")
        return json.loads(line)

    def outputs(self) -> Tuple[torch.Tensor, torch.Tensor]:
        path = os.path.join(self.tmp.name, "out.pt")
        self._ask(cmd="outputs", path=path)
        r = torch.load(path)
        return r["o"].transpose(1, 2), r["state"]

    def times(self, threads: int, calls: int) -> List[float]:
        self.pool[threads] = self._ask(cmd="threads", n=threads)["pool"]
        return self._ask(cmd="time", calls=calls)["times"]

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.SubprocessError):
            self.proc.kill()
        self.tmp.cleanup()


def find_peers(peers_dir: str) -> Dict[str, Optional[str]]:
    """Paths of the ggml driver and ExecuTorch's python in ``peers_dir`` (None where missing).

    Raises:
        FileNotFoundError: neither peer is built in ``peers_dir`` (the message names
            benchmarks/peers/setup.sh).
    """
    lib = os.path.join(peers_dir, DRIVER_NAME)
    py = os.path.join(peers_dir, VENV_NAME, "bin", "python")
    found = dict(ggml=lib if os.path.exists(lib) else None, executorch=py if os.path.exists(py) else None)
    if not any(found.values()):
        raise FileNotFoundError(f"peers_dir: no peer built in {peers_dir!r} (expected {DRIVER_NAME} and/or "
                                f"{VENV_NAME}/); run benchmarks/peers/setup.sh {peers_dir}")
    return found


def run_peers(peers_dir: str, shapes: Sequence[Shape] = PREFILL_SHAPES + DECODE_SHAPES,
              threads: Sequence[int] = (1, 2), reps: int = 5, decode_calls: int = 20,
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> List[dict]:
    """Measure torch-kda (both state layouts) and the peers found in ``peers_dir`` on ``shapes``.

    Returns dicts: ``kind="time"`` (``impl`` in ``ours``, ``ours_vfirst``, ``ggml``, ``executorch``;
    shape fields, ``threads``, ``seconds`` median, ``times``), ``kind="agree"`` (``impl``, shape,
    ``o_rel_err``, ``state_rel_err``) and ``kind="gemm"`` (``threads``, ``gflops`` median).

    Raises:
        FileNotFoundError: neither peer is built in ``peers_dir`` (run benchmarks/peers/setup.sh).
    """
    found = find_peers(peers_dir)
    for name, path in found.items():
        if path is None:
            log(f"{name}: not built in {peers_dir}, skipped")
    saved = torch.get_num_threads()
    results: List[dict] = []
    gemm: Dict[int, List[float]] = {n: [] for n in threads}
    try:
        for shape in shapes:
            sd = dict(B=shape.B, T=shape.T, H=shape.H, K=shape.K, V=shape.V, decode=shape.decode)
            inp = peer_inputs(shape)
            impls: Dict[str, object] = {"ours": Ours(inp)}
            if shape.decode:  # the state layout matters when the state is read and written per token
                impls["ours_vfirst"] = Ours(inp, state_v_first=True)
            if found["ggml"]:
                impls["ggml"] = Ggml(found["ggml"], inp, threads)
            if found["executorch"]:
                impls["executorch"] = ExecuTorch(found["executorch"], inp, shape.K ** -0.5)
            if shape.decode:  # memory-bound: measured against the copy bandwidth, in the same reps
                impls["copy"] = Copy(inp)
            try:
                torch.set_num_threads(min(threads))
                o_ref, s_ref = impls["ours"].outputs()
                for name, impl in impls.items():
                    if name in ("ours", "copy"):
                        continue
                    o, s = impl.outputs()
                    results.append(dict(kind="agree", impl=name, **sd, o_rel_err=_rel_err(o, o_ref),
                                        state_rel_err=_rel_err(s, s_ref)))
                for n in threads:
                    torch.set_num_threads(n)
                    gemm[n].append(gemm_gflops())
                calls = calls_per_rep(shape, decode_calls)
                times: Dict[Tuple[str, int], List[float]] = {(m, n): [] for m in impls for n in threads}
                log(f"{shape.name}: {len(times)} measurements x {reps} reps")
                for rep in range(reps + 1):  # repetition 0 warms every configuration up
                    for n in threads:
                        for name, impl in impls.items():
                            if name == "executorch":
                                ts = impl.times(n, calls)
                            else:
                                ts = [impl.time(n) for _ in range(calls)]
                            if rep > 0:
                                times[(name, n)].extend(ts)
                for (name, n), ts in times.items():
                    extra = {}
                    if name == "executorch":
                        extra["pool_threads"] = impls[name].pool.get(n)
                    if name == "copy":
                        extra["bytes"] = impls[name].bytes
                    if name.startswith("ours"):
                        use = impls[name].usage.get(n, [])[calls:]  # without the warm-up
                        user, sys_ = sum(u[0] for u in use), sum(u[1] for u in use)
                        extra["sys_share"] = sys_ / (user + sys_) if user + sys_ > 0 else None
                        extra["faults_per_call"] = sum(u[2] for u in use) / max(1, len(use))
                    results.append(dict(kind="time", impl=name, **sd, threads=n, seconds=statistics.median(ts),
                                        times=ts, **extra))
            finally:
                for impl in impls.values():
                    if hasattr(impl, "close"):
                        impl.close()
        for n in threads:
            results.append(dict(kind="gemm", threads=n, gflops=statistics.median(gemm[n]), samples=gemm[n]))
    finally:
        torch.set_num_threads(saved)
    return results


def _row_name(r: dict) -> str:
    """A result's shape as the small tables name it: ``B1 T4096 H4``, head sizes when not 128."""
    return f"B{r['B']} T{r['T']} H{r['H']}{head_dims(r['K'], r['V'])}"


def format_peers(results: List[dict]) -> str:
    """Markdown: the peer table (prefill tokens/s, decode µs/call) with ratios, then agreement."""
    timed = [r for r in results if r["kind"] == "time"]
    threads = sorted({r["threads"] for r in timed})
    shapes = []
    for r in timed:
        key = (r["B"], r["T"], r["H"], r["K"], r["V"], r["decode"])
        if key not in shapes:
            shapes.append(key)
    gemm = {r["threads"]: r["gflops"] for r in results if r["kind"] == "gemm"}
    out = ["| case (fp32) | thr | torch-kda | ggml | ExecuTorch | vs ggml | vs ExecuTorch | "
           "torch-kda % of GEMM (prefill) / state bytes per s, % of copy (decode) |",
           "|---|---|---|---|---|---|---|---|"]
    for B, T, H, K, V, dec in shapes:
        sd = dict(B=B, T=T, H=H, K=K, V=V, decode=dec)
        for ours in ("ours", "ours_vfirst"):
            if not dec and ours == "ours_vfirst":
                continue
            for n in threads:
                get = {m: _find(timed, impl=m, threads=n, **sd) for m in (ours, "ggml", "executorch")}
                if get[ours] is None:
                    continue
                dims = head_dims(K, V)
                if dec:
                    case = f"decode B{B} H{H}{dims}" + (", state V-first" if ours == "ours_vfirst" else
                                                        ", state K-first") + ", µs/call"
                    cell = lambda r: f"{r['seconds'] * 1e6:,.0f}" if r else "–"
                else:
                    tk = f"{T // 1024}K" if T % 1024 == 0 else str(T)
                    case = f"prefill B{B} T{tk} H{H}{dims}, tokens/s"
                    cell = lambda r: f"{B * T / r['seconds'] / 1e3:,.1f}K" if r else "–"
                ratio = lambda r: f"{r['seconds'] / get[ours]['seconds']:.2f}×" if r else "–"
                pct = ""
                if not dec and n in gemm:
                    pct = f"{8 * K * V * H * B * T / get[ours]['seconds'] / 1e9 / gemm[n] * 100:.0f}%"
                copy = _find(timed, impl="copy", threads=n, **sd) if dec else None
                if copy is not None:  # the state read and written once, as the copy moves it
                    rate = copy["bytes"] / get[ours]["seconds"]
                    pct = f"{rate / 1e9:.1f} GB/s, {100 * copy['seconds'] / get[ours]['seconds']:.0f}% of copy " \
                          f"({copy['bytes'] / copy['seconds'] / 1e9:.1f} GB/s)"
                out.append(f"| {case} | {n} | {cell(get[ours])} | {cell(get['ggml'])} | {cell(get['executorch'])} | "
                           f"{ratio(get['ggml'])} | {ratio(get['executorch'])} | {pct} |")
    out.append("")
    out.append("Ratios: peer time / torch-kda time (> 1: torch-kda is faster). "
               + ", ".join(f"fp32 GEMM {g:,.0f} GFLOP/s at {n} thread(s)" for n, g in sorted(gemm.items())) + ".")
    out.append("")
    ours = [r for r in timed if r["impl"] == "ours" and r.get("sys_share") is not None]
    if ours:
        out.append("| torch-kda (state K-first) | thr | system (kernel) share of its CPU time | minor page faults per call |")
        out.append("|---|---|---|---|")
        for r in ours:
            out.append(f"| {_row_name(r)} | {r['threads']} | {100 * r['sys_share']:.1f}% | "
                       f"{r['faults_per_call']:,.0f} |")
        out.append("")
    agree = [r for r in results if r["kind"] == "agree"]
    if agree:
        out.append("| agreement with torch-kda (max rel. error) | o | final state | |")
        out.append("|---|---|---|---|")
        for r in agree:
            ok = "ok" if max(r["o_rel_err"], r["state_rel_err"]) <= AGREE_TOL else "MISMATCH"
            out.append(f"| {r['impl']} {_row_name(r)} | {r['o_rel_err']:.1e} | "
                       f"{r['state_rel_err']:.1e} | {ok} |")
        out.append("")
    return "\n".join(out)


def bench_peers(peers_dir: str, command: str, threads: Sequence[int] = (1, 2), reps: int = 5,
                shapes: Sequence[Shape] = PREFILL_SHAPES + DECODE_SHAPES, out_md: Optional[str] = None,
                out_json: Optional[str] = None) -> List[dict]:
    """:func:`run_peers`, then print (and write) a header line and :func:`format_peers`."""
    info = machine_info()
    t0 = time.perf_counter()
    results = run_peers(peers_dir, shapes=shapes, threads=threads, reps=reps)
    wall = time.perf_counter() - t0
    publish(header_line(command, info, wall) + "\n\n" + format_peers(results), out_md, out_json,
            dict(machine=info, command=command, wall_s=wall, results=results))
    return results
