"""Per-call costs of the native CPU op: time, CPU time, kernel (system) share, page faults.

For each shape, thread count and dtype, the forward and the forward + backward run interleaved
(every case once per repetition, medians over repetitions), and each call is measured with
``getrusage`` around it: user and system CPU time and minor page faults of the process. The fp32
GEMM rate (``torch.mm`` 2048^2) is measured in the same run at each thread count, so the kernels'
rate is reported as a share of it (FLOPs per token from ``benchmark.Shape.flops``).

Usage (outside the repository root, so the installed package is imported)::

    cd /tmp && python /path/to/benchmarks/cpu_costs.py --threads 1 2 --heads 4 16 --seq-lens 4096
    python cpu_costs.py --threads 1 16 --heads 4 16 32 --seq-lens 8192 --dtypes fp32 bf16 --json F

Prints one markdown table (and writes the rows as JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

import torch_kda
from torch_kda import benchmark

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _measure(fn) -> Dict[str, float]:
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return dict(wall=wall, user=r1.ru_utime - r0.ru_utime, sys=r1.ru_stime - r0.ru_stime,
                faults=r1.ru_minflt - r0.ru_minflt)


def _case(shape: benchmark.Shape, dtype: torch.dtype, mode: str):
    t, flags = benchmark.make_inputs(shape, dtype, requires_grad=mode == "fwd+bwd")
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    kw = dict(flags, A_log=t["A_log"], dt_bias=t["dt_bias"], output_final_state=True,
              backend="native")
    if mode == "fwd":
        def call():
            with torch.no_grad():
                torch_kda.fused_recurrent_kda(*args, **kw)
        return call
    ins = list(t.values())
    # Cotangents as a loss would give them (dense, fresh values; not the expanded ones of .sum()).
    with torch.no_grad():
        o, s = torch_kda.fused_recurrent_kda(*args, **kw)
    gen = torch.Generator().manual_seed(1)
    d_o = torch.randn(o.shape, generator=gen).to(o.dtype)
    d_s = torch.randn(s.shape, generator=gen).to(s.dtype)

    def call_bwd():
        o, s = torch_kda.fused_recurrent_kda(*args, **kw)
        torch.autograd.grad((o, s), ins, (d_o, d_s))
    return call_bwd


def run(seq_lens: Sequence[int], heads: Sequence[int], threads: Sequence[int],
        dtypes: Sequence[str], modes: Sequence[str], reps: int, batch: int = 1) -> List[dict]:
    before = torch.get_num_threads()
    cases = []
    for T in seq_lens:
        for H in heads:
            shape = benchmark.Shape(B=batch, T=T, H=H, HV=H)
            for dt in dtypes:
                for mode in modes:
                    if mode == "fwd+bwd" and dt != "fp32":
                        continue
                    cases.append((shape, dt, mode, _case(shape, DTYPES[dt], mode)))
    samples: Dict[tuple, List[Dict[str, float]]] = {}
    gemm: Dict[int, float] = {}
    try:
        for th in threads:
            torch.set_num_threads(th)
            gemm[th] = benchmark.gemm_gflops()
            for _, _, _, fn in cases:  # warm-up (allocator, first-touch of the caches)
                fn()
        for _ in range(reps):
            for th in threads:
                torch.set_num_threads(th)
                for shape, dt, mode, fn in cases:
                    samples.setdefault((shape, dt, mode, th), []).append(_measure(fn))
    finally:
        torch.set_num_threads(before)
    rows = []
    for (shape, dt, mode, th), ss in samples.items():
        med = {k: statistics.median(s[k] for s in ss) for k in ss[0]}
        tokens = shape.B * shape.T
        fl = shape.flops(mode)
        cpu = med["user"] + med["sys"]
        rows.append(dict(T=shape.T, H=shape.H, B=shape.B, dtype=dt, mode=mode, threads=th,
                         wall_s=med["wall"], tokens_per_s=tokens / med["wall"],
                         sys_share=med["sys"] / cpu if cpu > 0 else 0.0,
                         faults=int(med["faults"]), gemm_gflops=gemm[th],
                         gemm_share=fl / med["wall"] / 1e9 / gemm[th]))
    return rows


def format_rows(rows: List[dict]) -> str:
    out = ["| shape | mode | dtype | thr | tokens/s | vs 1 thread | vs fp32 | % of fp32 GEMM "
           "| system share | minor faults/call |", "|---|---|---|---|---|---|---|---|---|---|"]

    def find(**kw) -> Optional[dict]:
        return next((r for r in rows if all(r[k] == v for k, v in kw.items())), None)
    for r in rows:
        one = find(T=r["T"], H=r["H"], B=r["B"], dtype=r["dtype"], mode=r["mode"], threads=1)
        f32 = find(T=r["T"], H=r["H"], B=r["B"], dtype="fp32", mode=r["mode"], threads=r["threads"])
        sc = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}×" if one and r["threads"] != 1 else ""
        vs = f"{r['tokens_per_s'] / f32['tokens_per_s']:.2f}×" if f32 and r["dtype"] != "fp32" else ""
        out.append(f"| B{r['B']} T{r['T']} H{r['H']} | {r['mode']} | {r['dtype']} | {r['threads']} "
                   f"| {r['tokens_per_s'] / 1e3:,.1f}K | {sc} | {vs} | {100 * r['gemm_share']:.0f}% "
                   f"| {100 * r['sys_share']:.1f}% | {r['faults']:,} |")
    gem = sorted({(r["threads"], r["gemm_gflops"]) for r in rows})
    out.append("")
    out.append("fp32 GEMM (torch.mm 2048²): " +
               ", ".join(f"{g:.0f} GFLOP/s at {th} thread(s)" for th, g in gem))
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[4096])
    p.add_argument("--heads", nargs="+", type=int, default=[4, 16])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    rows = run(a.seq_lens, a.heads, a.threads, a.dtypes, a.modes, a.reps, a.batch)
    print(format_rows(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
