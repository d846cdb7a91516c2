"""Two builds of the native library side by side: forward and backward of the recurrent op.

Each call of this script loads ONE ``libkda.so`` by path (``torch.ops.load_library``; the
``torch_kda`` package is not imported, so its installed library does not clash) and times
``kda::fused_recurrent`` (the forward of inference and ``torch.no_grad()``: no checkpoints),
``kda::fused_recurrent_fwd`` and ``kda::fused_recurrent_bwd`` (q/k L2 norm, softplus gate with
``A_log``/``dt_bias`` and sigmoid beta in the op; dense random cotangents) at B = 1, K = V = 128,
fp32 (``--dtype bf16``: bf16 q, k, v, g, beta and grad_o; ``--bwd chunk``: ``kda::chunk_bwd`` on
the same checkpoints as the backward), with the fp32 GEMM rate (``torch.mm`` 2048^2) measured in the same process before each
repetition. One thread: process CPU time (``time.process_time``: time lost to other processes on
a shared box is not counted); more threads: wall time. FLOPs as ``benchmark.Shape.flops``
(8·K·V per token and value head forward, 32·K·V forward + backward). Alternate the builds
between calls, e.g.::

    for r in 1 2; do for lib in /tmp/base/libkda.so /tmp/new/libkda.so; do
      python benchmarks/ab_libs.py $lib --heads 4 --threads 1; done; done

Prints one line per call: medians over ``--reps`` of inf, fwd and bwd (ms) and their % of the GEMM
rate (docs/benchmarks.md, "Training: forward + backward vs the GEMM rate"), the backward's
minor page faults and system-time share (``getrusage``, medians), the output cache's mapped
blocks and the peak resident size at the end.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch


def build_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every A/B script of two libkda.so builds takes (also benchmarks/ab_chunk_fwd.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("lib")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    return p


def main() -> None:
    p = build_parser(__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--bwd", choices=("recurrent", "chunk"), default="recurrent")
    a = p.parse_args()
    torch.ops.load_library(a.lib)
    torch.set_num_threads(a.threads)
    H, T, K = a.heads, a.seq_len, 128
    gen = torch.Generator().manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    q, k, v, g, beta = (x.to(dt) for x in (rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K),
                                           rnd(1, T, H, K), rnd(1, T, H)))
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=torch.rand(H, generator=gen) * 2.7, dt_bias=rnd(H * K) * 0.5)
    args = (q, k, v, g, beta, K ** -0.5)
    o, s, ckpt = torch.ops.kda.fused_recurrent_fwd(*args, **kw)
    d_o, d_s = rnd(*o.shape).to(o.dtype), rnd(*s.shape)
    bwd_op = torch.ops.kda.chunk_bwd if a.bwd == "chunk" else torch.ops.kda.fused_recurrent_bwd
    clock = time.process_time if a.threads == 1 else time.perf_counter

    def seconds(fn) -> float:
        t0 = clock()
        fn()
        return clock() - t0

    mm_a, mm_b = rnd(2048, 2048), rnd(2048, 2048)
    torch.mm(mm_a, mm_b)
    bwd_op(d_o, d_s, ckpt, *args, **kw)  # warm-up (output cache)
    gemm, inf, fwd, bwd, faults, sys_share = [], [], [], [], [], []
    for _ in range(a.reps):
        gemm.append(max(2 * 2048 ** 3 / seconds(lambda: torch.mm(mm_a, mm_b)) / 1e9 for _ in range(2)))
        inf.append(seconds(lambda: torch.ops.kda.fused_recurrent(*args, **kw)))
        fwd.append(seconds(lambda: torch.ops.kda.fused_recurrent_fwd(*args, **kw)))
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        bwd.append(seconds(lambda: bwd_op(d_o, d_s, ckpt, *args, **kw)))
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(r1.ru_minflt - r0.ru_minflt)
        used = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        sys_share.append((r1.ru_stime - r0.ru_stime) / used if used > 0 else 0.0)
    G, I, F, B = (statistics.median(x) for x in (gemm, inf, fwd, bwd))
    # Memory: the output cache's blocks (held free + in use: what its calls keep mapped; the
    # largest working set of the three ops) and the process's peak resident size.
    _, held, in_use, *_ = torch.ops.kda._output_cache_stats()
    cache_mb = (held + in_use) / 2 ** 20
    maxrss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    fl = 8 * K * K * H * T  # forward FLOPs; the backward counts 3x
    print(f"{a.lib} H{H} T{T} thr{a.threads} gemm={G:.0f} GFLOP/s inf={I * 1e3:.1f} ms "
          f"inf={100 * fl / I / 1e9 / G:.1f}% fwd={F * 1e3:.1f} ms "
          f"bwd={B * 1e3:.1f} ms fwd={100 * fl / F / 1e9 / G:.1f}% bwd={100 * 3 * fl / B / 1e9 / G:.1f}% "
          f"fwd+bwd={100 * 4 * fl / (F + B) / 1e9 / G:.1f}% of GEMM {a.dtype} bwd={a.bwd}: "
          f"faults={statistics.median(faults):.0f} sys={100 * statistics.median(sys_share):.1f}% "
          f"cache={cache_mb:.0f} MB maxrss={maxrss_mb:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
