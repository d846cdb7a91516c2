"""Per-call costs of the native CPU op: time, CPU time, kernel (system) share, page faults.

For each shape, thread count and dtype, the forward and the forward + backward run interleaved
(every case once per repetition, medians over repetitions), and each call is measured with
``getrusage`` around it: user and system CPU time and minor page faults of the process. The fp32
GEMM rate (``torch.mm`` 2048^2) is measured in the same run at each thread count, so the kernels'
rate is reported as a share of it (FLOPs per token from ``benchmark.Shape.flops``).

``--ops`` picks the functional call: ``recurrent`` (``fused_recurrent_kda``) and / or ``chunk``
(``chunk_kda``), both with ``backend="native"``. ``--grads FILE`` saves the gradients of one more
forward + backward of every case (``torch.save``), and ``--compare-grads A B`` tells whether two
such files (two builds) hold the same bits (``torch.equal``), case by case.

Usage (outside the repository root, so the installed package is imported)::

    cd /tmp && python /path/to/benchmarks/cpu_costs.py --threads 1 2 --heads 4 16 --seq-lens 4096
    python cpu_costs.py --threads 1 16 --heads 4 16 32 --seq-lens 8192 --dtypes fp32 bf16 --json F
    python cpu_costs.py --ops recurrent chunk --modes fwd+bwd --dtypes fp32 bf16 --grads new.pt

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


OPS = {"recurrent": torch_kda.fused_recurrent_kda, "chunk": torch_kda.chunk_kda}


def _case(shape: benchmark.Shape, dtype: torch.dtype, mode: str, op: str = "recurrent"):
    """The call of one case (no arguments); for fwd+bwd it returns the gradients."""
    t, flags = benchmark.make_inputs(shape, dtype, requires_grad=mode == "fwd+bwd")
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    kw = dict(flags, A_log=t["A_log"], dt_bias=t["dt_bias"], output_final_state=True,
              backend="native")
    fn = OPS[op]
    if mode == "fwd":
        def call():
            with torch.no_grad():
                fn(*args, **kw)
        return call
    ins = list(t.values())
    # Cotangents as a loss would give them (dense, fresh values; not the expanded ones of .sum()).
    with torch.no_grad():
        o, s = fn(*args, **kw)
    gen = torch.Generator().manual_seed(1)
    d_o = torch.randn(o.shape, generator=gen).to(o.dtype)
    d_s = torch.randn(s.shape, generator=gen).to(s.dtype)

    def call_bwd():
        o, s = fn(*args, **kw)
        return torch.autograd.grad((o, s), ins, (d_o, d_s))
    return call_bwd


def run(seq_lens: Sequence[int], heads: Sequence[int], threads: Sequence[int],
        dtypes: Sequence[str], modes: Sequence[str], reps: int, batch: int = 1,
        ops: Sequence[str] = ("recurrent",), grads: Optional[str] = None) -> List[dict]:
    before = torch.get_num_threads()
    cases = []
    for T in seq_lens:
        for H in heads:
            shape = benchmark.Shape(B=batch, T=T, H=H, HV=H)
            for op in ops:
                for dt in dtypes:
                    for mode in modes:
                        cases.append((shape, dt, (op, mode), _case(shape, DTYPES[dt], mode, op)))
    if grads:
        torch.save({f"{op} {mode} {dt} B{s.B} T{s.T} H{s.H}": fn()
                    for s, dt, (op, mode), fn in cases if mode == "fwd+bwd"}, grads)
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
    for (shape, dt, (op, mode), th), ss in samples.items():
        med = {k: statistics.median(s[k] for s in ss) for k in ss[0]}
        tokens = shape.B * shape.T
        fl = shape.flops(mode)
        cpu = med["user"] + med["sys"]
        rows.append(dict(T=shape.T, H=shape.H, B=shape.B, op=op, dtype=dt, mode=mode, threads=th,
                         wall_s=med["wall"], tokens_per_s=tokens / med["wall"],
                         sys_share=med["sys"] / cpu if cpu > 0 else 0.0,
                         faults=int(med["faults"]), gemm_gflops=gemm[th],
                         gemm_share=fl / med["wall"] / 1e9 / gemm[th]))
    return rows


def format_rows(rows: List[dict]) -> str:
    out = ["| shape | op | mode | dtype | thr | tokens/s | vs 1 thread | vs fp32 | % of fp32 GEMM "
           "| system share | minor faults/call |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def find(**kw) -> Optional[dict]:
        return next((r for r in rows if all(r[k] == v for k, v in kw.items())), None)
    for r in rows:
        same = dict(T=r["T"], H=r["H"], B=r["B"], op=r["op"], mode=r["mode"])
        one = find(**same, dtype=r["dtype"], threads=1)
        f32 = find(**same, dtype="fp32", threads=r["threads"])
        sc = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}×" if one and r["threads"] != 1 else ""
        vs = f"{r['tokens_per_s'] / f32['tokens_per_s']:.2f}×" if f32 and r["dtype"] != "fp32" else ""
        out.append(f"| B{r['B']} T{r['T']} H{r['H']} | {r['op']} | {r['mode']} | {r['dtype']} | {r['threads']} "
                   f"| {r['tokens_per_s'] / 1e3:,.1f}K | {sc} | {vs} | {100 * r['gemm_share']:.0f}% "
                   f"| {100 * r['sys_share']:.1f}% | {r['faults']:,} |")
    gem = sorted({(r["threads"], r["gemm_gflops"]) for r in rows})
    out.append("")
    out.append("fp32 GEMM (torch.mm 2048²): " +
               ", ".join(f"{g:.0f} GFLOP/s at {th} thread(s)" for th, g in gem))
    return "\n".join(out)


def compare_grads(a: str, b: str) -> List[str]:
    """One line per case of two ``--grads`` files: same bits (torch.equal) or not, and the cases
    only one of them has."""
    ga, gb = torch.load(a), torch.load(b)
    lines = []
    for name in sorted(set(ga) | set(gb)):
        if name not in ga or name not in gb:
            lines.append(f"{name}: only in {a if name in ga else b}")
            continue
        same = [torch.equal(x, y) for x, y in zip(ga[name], gb[name])]
        lines.append(f"{name}: {'same bits' if all(same) else 'DIFFERENT'} "
                     f"({sum(same)} of {len(same)} gradients equal)")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[4096])
    p.add_argument("--heads", nargs="+", type=int, default=[4, 16])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ops", nargs="+", default=["recurrent"], choices=list(OPS))
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--grads", metavar="FILE", help="save the fwd+bwd cases' gradients here")
    p.add_argument("--compare-grads", nargs=2, metavar=("A", "B"),
                   help="compare two --grads files and exit")
    a = p.parse_args(argv)
    if a.compare_grads:
        lines = compare_grads(*a.compare_grads)
        print("\n".join(lines))
        return 0 if all("same bits" in x for x in lines) else 1
    rows = run(a.seq_lens, a.heads, a.threads, a.dtypes, a.modes, a.reps, a.batch, a.ops, a.grads)
    print(format_rows(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
