"""The native chunkwise backward (kda::chunk_bwd) beside the recurrent one, op by op.

Per dtype and gate strength: the medians of interleaved repetitions of the four native kernels
(recurrent forward with checkpoints, recurrent backward, chunk forward, chunk backward) on the
same inputs, their ratios, and the chunk backward's gradients against the recurrent backward's
(relative error per gradient). Inputs: torch_kda.benchmark.make_inputs (softplus gate, q/k L2
norm and beta sigmoid in the op, K = V = 128); "bench" keeps its gate rates (exp(A_log) up to
15: strong decays), "weak" sets A_log = -3 (rates 0.05: the factored diagonal blocks).
Run from outside the source tree:  cd /tmp && python /path/to/benchmarks/chunk_bwd_breakdown.py
``--cpu-time`` times with the process's CPU time (``time.process_time``) instead of wall time:
with one thread on a shared, loaded box it leaves out the time other processes take.
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_kda  # noqa: F401  (loads torch.ops.kda)
from torch_kda.benchmark import Shape, make_inputs

OPS = ("rec_fwd", "rec_bwd", "chunk_fwd", "chunk_bwd")


def measure(T: int, H: int, dtype: torch.dtype, gates: str, reps: int,
            clock=time.perf_counter) -> str:
    t, _ = make_inputs(Shape(1, T, H, H), dtype)
    A_log = t["A_log"] if gates == "bench" else torch.full_like(t["A_log"], -3.0)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], 128 ** -0.5, None, True, True, True, False,
            None, False, None, A_log, t["dt_bias"])
    o, _, ck = torch.ops.kda.fused_recurrent_fwd(*args)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    kda = torch.ops.kda
    fns = {"rec_fwd": lambda: kda.fused_recurrent_fwd(*args),
           "rec_bwd": lambda: kda.fused_recurrent_bwd(do, None, ck, *args),
           "chunk_fwd": lambda: kda.chunk_fwd(*args),
           "chunk_bwd": lambda: kda.chunk_bwd(do, None, ck, *args)}
    times = {k: [] for k in OPS}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k in OPS:
            t0 = clock()
            fns[k]()
            times[k].append(clock() - t0)
    m = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    rel = [((x.double() - y.double()).norm() / y.double().norm()).item()
           for x, y in zip(fns["chunk_bwd"](), fns["rec_bwd"]()) if x.numel()]
    fb = (m["rec_fwd"] + m["rec_bwd"]) / (m["chunk_fwd"] + m["chunk_bwd"])
    return (f"| {gates} | {str(dtype)[6:]} | {m['rec_fwd']:.1f} | {m['rec_bwd']:.1f} | "
            f"{m['chunk_fwd']:.1f} | {m['chunk_bwd']:.1f} | {m['rec_bwd'] / m['chunk_bwd']:.2f}x | "
            f"{fb:.2f}x | {max(rel):.1e} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cpu-time", action="store_true",
                   help="process CPU time instead of wall time (one thread, shared box)")
    args = p.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    print(f"B1 T{args.seq_len} H{args.heads} K=V=128, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}; medians (ms, "
          f"{'process CPU' if args.cpu_time else 'wall'} time)")
    print("| gates | dtype | rec fwd | rec bwd | chunk fwd | chunk bwd | bwd: rec / chunk | "
          "fwd+bwd: rec / chunk | max rel. diff chunk vs rec grads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gates in ("bench", "weak"):
        for dtype in (torch.bfloat16, torch.float32):
            print(measure(args.seq_len, args.heads, dtype, gates, args.reps, clock), flush=True)


if __name__ == "__main__":
    main()
