"""``python -m torch_kda bench``: tokens/s of the KDA backends on CPU by sequence length.

For each available CPU backend (``native``, and the ``reference`` in its chunkwise form, the one
training uses) and each sequence length T, times the functional op :func:`torch_kda.chunk_kda`
with the gate, the q/k L2 norms and the beta sigmoid in the op (the layer's configuration), B = 1,
H = HV heads of K = V, fp32: forward alone (no autograd), and forward + backward. Each time is the
best of several runs after a warm-up (the least disturbed by other processes). Prints a table
(tokens/s and native's speed-up) and writes a PNG of tokens/s by T per backend. ``--quick`` is a subset that runs in under a minute on 2 cores.

The full measured comparison of the project (FLA's naive reference, ``torch.compile``, % of GEMM
peak, memory) is ``benchmarks/bench_cpu.py`` in the source tree; this command is the quick look an
installed package can take.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ..api import available_backends, chunk_kda
from .common import UsageError, busy_machine_threads, positive_int, shadowing_hint

__all__ = ["add_arguments", "run", "time_backend", "make_bench_inputs"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``p``."""
    p.add_argument("--quick", action="store_true",
                   help="small subset, under a minute on 2 cores (T in 128..2048, H=2, K=V=64)")
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=None, metavar="T",
                   help="sequence lengths (default: 256 1024 4096; --quick: 128 256 512 1024 2048)")
    p.add_argument("--heads", type=positive_int, default=None, help="heads H = HV (default 4; --quick 2)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="K = V (default 128; --quick 64)")
    p.add_argument("--backends", nargs="+", choices=("native", "reference"), default=None,
                   help="backends to time (default: every available one)")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds of timed runs per measurement (default 1.0; --quick 0.5)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's default, %d here)" % torch.get_num_threads())
    p.add_argument("--out", metavar="DIR", default="out", help="directory for the PNG (default: ./%(default)s)")


def make_bench_inputs(T: int, H: int, K: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random fp32 inputs of :func:`torch_kda.chunk_kda` at B = 1, HV = H, V = K, with the gate,
    the L2 norms and the beta sigmoid in the op; returns keyword arguments (tensors + flags)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, K), g=r(1, T, H, K), beta=r(1, T, H),
                A_log=torch.zeros(H).uniform_(0, 2.7, generator=gen), dt_bias=r(H * K) * 0.5,
                use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _best_time(fn: Callable[[], None], min_time: float, max_reps: int = 50) -> float:
    fn()  # warm-up
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)  # the least disturbed run: robust on a shared machine


def time_backend(backend: str, T: int, H: int, K: int, min_time: float) -> Dict[str, float]:
    """Tokens/s of ``chunk_kda(..., backend=backend)`` at one shape.

    Returns:
        ``{"fwd": tokens/s of the forward without autograd, "fwd_bwd": tokens/s of forward +
        backward (gradients of q, k, v, g, beta, A_log, dt_bias)}``.
    """
    inp = make_bench_inputs(T, H, K)
    tensors = {n: v for n, v in inp.items() if isinstance(v, torch.Tensor)}
    flags = {n: v for n, v in inp.items() if not isinstance(v, torch.Tensor)}
    extra = {"chunk_size": 32} if backend == "reference" else {}

    def fwd() -> None:
        with torch.no_grad():
            chunk_kda(**tensors, **flags, **extra, backend=backend)

    leaves = {n: v.clone().requires_grad_(True) for n, v in tensors.items()}
    do = torch.randn(1, T, H, K)

    def fwd_bwd() -> None:
        o, _ = chunk_kda(**leaves, **flags, **extra, backend=backend)
        o.backward(do)
        for v in leaves.values():
            v.grad = None

    return {"fwd": T / _best_time(fwd, min_time), "fwd_bwd": T / _best_time(fwd_bwd, min_time)}


def _plot(path: Path, seq_lens: List[int], results: Dict[str, Dict[int, Dict[str, float]]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    colors = {"native": "tab:green", "reference": "tab:blue"}
    for backend, per_t in results.items():
        ts = [t for t in seq_lens if t in per_t]
        for kind, style in (("fwd", "o-"), ("fwd_bwd", "s--")):
            ax.plot(ts, [per_t[t][kind] for t in ts], style, color=colors.get(backend), lw=1.6, ms=5,
                    label=f"{backend}: {'forward' if kind == 'fwd' else 'forward + backward'}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Time the backends; torch's thread count is restored afterwards (see :func:`_run`)."""
    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    """Time the backends, print the table, write the PNG; returns 0.

    Raises:
        UsageError: ``--backends native`` without a native build, or a non-positive ``--min-time``.
    """
    quick = args.quick
    seq_lens = sorted(set(args.seq_lens or ([128, 256, 512, 1024, 2048] if quick else [256, 1024, 4096])))
    H = args.heads or (2 if quick else 4)
    K = args.head_dim or (64 if quick else 128)
    min_time = args.min_time if args.min_time is not None else (0.5 if quick else 1.0)
    if not min_time > 0:
        raise UsageError(f"--min-time: expected a positive number of seconds, got {min_time}")
    status = available_backends()
    backends = args.backends or [b for b in ("native", "reference") if status[b].available]
    for b in backends:
        if not status[b].available:
            raise UsageError(f"--backends {b}: unavailable here: {status[b].reason}")
    note = ""
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        note = busy_machine_threads()
    print(f"torch-kda bench: chunk_kda tokens/s on CPU, B=1, H=HV={H}, K=V={K}, fp32, gate + l2norm + "
          f"beta sigmoid in the op, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}"
          f"{' (--quick)' if quick else ''}")
    if note:
        print(f"  NOTE: {note}")
    if not status["native"].available:
        print(f"  native backend unavailable: {status['native'].reason}")
        hint = shadowing_hint()
        if hint:
            print(f"  {hint}")
    t0 = time.perf_counter()
    results: Dict[str, Dict[int, Dict[str, float]]] = {b: {} for b in backends}
    for T in seq_lens:
        for b in backends:
            results[b][T] = time_backend(b, T, H, K, min_time)
    header = f"{'T':>6}  " + "  ".join(f"{b + ' fwd':>14}  {b + ' fwd+bwd':>18}" for b in backends)
    if "native" in backends and "reference" in backends:
        header += f"  {'speed-up fwd':>12}  {'speed-up f+b':>12}"
    print()
    print("tokens/s")
    print(header)
    print("-" * len(header))
    for T in seq_lens:
        line = f"{T:>6}  " + "  ".join(f"{results[b][T]['fwd']:>14,.0f}  {results[b][T]['fwd_bwd']:>18,.0f}"
                                       for b in backends)
        if "native" in backends and "reference" in backends:
            n, r = results["native"][T], results["reference"][T]
            line += f"  {n['fwd'] / r['fwd']:>11.1f}x  {n['fwd_bwd'] / r['fwd_bwd']:>11.1f}x"
        print(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "bench_tokens_per_s.png"
    _plot(png, seq_lens, results, f"KDA chunk_kda on CPU ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}), "
                     f"H={H}, K=V={K}, fp32")
    print()
    print(f"plot: {png.resolve()}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
