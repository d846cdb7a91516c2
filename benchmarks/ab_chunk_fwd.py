"""Two builds of the native library side by side: the chunk forward against the recurrent forward.

Each call of this script loads ONE ``libkda.so`` by path (``torch.ops.load_library``; the
``torch_kda`` package is not imported, so its installed library does not clash) and times the
forward of ``kda::chunk`` and of ``kda::fused_recurrent`` under ``torch.no_grad()``, interleaved,
on the inputs of ``python -m torch_kda.benchmark chunk`` (B = 1, K = V = 128, q/k L2 norm,
softplus gate with ``A_log``/``dt_bias`` and sigmoid beta in the op; ``A_log`` uniform in
[0, 2.7), i.e. exp(A_log) up to 15, or ``--a-log X`` for every head, e.g. 0 for weak decays).
One thread: process CPU time (``time.process_time``: time lost to other processes on a shared
box is not counted); more threads: wall time. Alternate the builds between calls, e.g.::

    for r in 1 2; do for lib in /tmp/base/libkda.so /tmp/new/libkda.so; do
      python benchmarks/ab_chunk_fwd.py $lib --dtype bf16; done; done

Prints one line per call: medians over ``--reps`` (ms) and chunk / recurrent as a speed ratio
(recurrent time over chunk time; docs/benchmarks.md, issue 15).
"""

from __future__ import annotations

import statistics
import time

import torch

from ab_libs import build_parser  # this folder is the script's sys.path[0]


def chunk_problem(description: str, add_arguments=None):
    """Parses the A/B arguments (ab_libs.build_parser plus --dtype, --a-log), loads ``a.lib``, sets
    the thread count and makes the inputs. Returns the parsed arguments, the operator arguments
    (``q, k, v, g, beta, scale, ...`` in the schema order of ``kda::chunk``), ``rnd(*shape)`` for
    further random tensors from the same generator, and the input dtype; also used by
    benchmarks/ab_chunk_bwd.py. ``add_arguments(parser)``, if given, adds a caller's own options."""
    p = build_parser(description)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--a-log", type=float, default=None)
    if add_arguments:
        add_arguments(p)
    a = p.parse_args()
    torch.ops.load_library(a.lib)
    torch.set_num_threads(a.threads)
    H, T, K = a.heads, a.seq_len, 128
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)

    def rnd(*s: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*s, generator=gen) * scale

    q, k, v, g = (rnd(1, T, H, K).to(dt) for _ in range(4))
    beta = rnd(1, T, H).to(dt)
    A_log = torch.rand(H, generator=gen) * 2.7
    dt_bias = rnd(H * K, scale=0.5)
    if a.a_log is not None:
        A_log.fill_(a.a_log)
    op_args = (q, k, v, g, beta, K ** -0.5, None, True, True, True, False, None, False, None,
               A_log, dt_bias)
    return a, op_args, rnd, dt


def main() -> None:
    a, op_args, _, _ = chunk_problem(__doc__.split("\n\n")[0])
    H, T = a.heads, a.seq_len
    clock = time.process_time if a.threads == 1 else time.perf_counter

    def call(op):
        def run() -> float:
            with torch.no_grad():
                t0 = clock()
                op(*op_args)
                return clock() - t0
        return run

    ops = {"recurrent": call(torch.ops.kda.fused_recurrent), "chunk": call(torch.ops.kda.chunk)}
    for fn in ops.values():
        fn()  # warm-up
    times = {name: [] for name in ops}
    for _ in range(a.reps):
        for name, fn in ops.items():
            times[name].append(fn())
    rec, chk = (statistics.median(times[n]) for n in ("recurrent", "chunk"))
    print(f"{a.lib} {a.dtype} H{H} T{T} thr{a.threads} A_log={'rand*2.7' if a.a_log is None else a.a_log} "
          f"recurrent={rec * 1e3:.1f} ms chunk={chk * 1e3:.1f} ms chunk/recurrent={rec / chk:.2f}x",
          flush=True)


if __name__ == "__main__":
    main()
