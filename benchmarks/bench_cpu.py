"""CPU benchmark of the fused recurrent KDA: native C++ op vs the PyTorch baselines, side by side.

The command-line front end of :mod:`torch_kda.benchmark` (the engine: backends, timing, GEMM
rate, peak memory, tables, issue 3 targets, plot; its docstring says what is measured and how).
``python -m torch_kda bench`` is the other front end, on the same engine.

Usage (from outside the repository root, so the installed package with its native library is
imported, not the source tree)::

    cd /tmp && python REPO/benchmarks/bench_cpu.py [--quick] [--json F] [--out F.md] [--plot F.png]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch_kda
from torch_kda import benchmark


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="T=1K and the target shape, fp32, 3 reps, baselines at T=1K only, no memory (~1-2 min)")
    p.add_argument("--backends", nargs="+", default=None,
                   choices=list(benchmark.BACKENDS) + ["compiled_full"])
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(benchmark.DTYPES))
    p.add_argument("--threads", nargs="+", type=int, default=None, help="thread counts (default 1 2)")
    p.add_argument("--reps", type=int, default=None, help="native repetitions (default 5, quick 3)")
    p.add_argument("--seq-lens", nargs="+", type=int, default=None, help="T values (default 1024 4096 16384)")
    p.add_argument("--heads", nargs="+", type=int, default=None, help="H = HV values (default 4 16)")
    p.add_argument("--no-decode", action="store_true", help="skip the decoding shapes")
    p.add_argument("--baseline-max-T", type=int, default=None,
                   help="run the baselines only at T <= this (default 4096, quick 1024)")
    p.add_argument("--baseline-budget", type=float, default=None,
                   help="seconds per baseline measurement before it stops repeating (default 8, quick 3)")
    p.add_argument("--baseline-max-call", type=float, default=None,
                   help="skip a baseline whose T=64 run extrapolates to more seconds per call (default 30, quick 5)")
    p.add_argument("--compile-full-max-T", type=int, default=None,
                   help="also torch.compile the whole reference at T <= this (minutes per shape)")
    p.add_argument("--memory", choices=("none", "target", "all"), default=None,
                   help="peak-memory subprocesses (default target; quick none)")
    p.add_argument("--json", metavar="FILE", help="write machine info and every result as JSON")
    p.add_argument("--out", metavar="FILE", help="write the markdown report")
    p.add_argument("--plot", metavar="PNG", help="write tokens/s by T per backend")
    a = p.parse_args(argv)
    backends = a.backends or list(benchmark.BACKENDS)
    if "native" in backends and torch_kda.available_backends()["native"].available is False:
        print("native backend unavailable: " + torch_kda.available_backends()["native"].reason, file=sys.stderr)
        return 2
    kw = benchmark.settings(a.quick, seq_lens=a.seq_lens, heads=a.heads, decode=not a.no_decode,
                            backends=backends, dtypes=a.dtypes, threads=a.threads, reps=a.reps,
                            baseline_max_T=a.baseline_max_T, baseline_budget=a.baseline_budget,
                            baseline_max_call=a.baseline_max_call, compile_full_max_T=a.compile_full_max_T,
                            memory=a.memory)
    cmd = "python benchmarks/bench_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    info = benchmark.machine_info(source_dir=os.path.dirname(os.path.abspath(__file__)))
    benchmark.bench(kw, cmd, info, out_md=a.out, out_json=a.json, out_png=a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
