"""Page faults and time per prefill call through the functional API, as a user calls it.

    python benchmarks/prefill_faults.py --threads 2 --seq-len 1024 --heads 4
    python benchmarks/prefill_faults.py --op chunk --dtype bf16 --threads 2 --seq-len 1024 --heads 4

B = 1, K = V = 128, q/k l2 norm in the op, a precomputed log-decay, the final state returned;
``fused_recurrent_kda`` or ``chunk_kda`` with ``backend="native"``, under ``torch.no_grad()``.
After 5 warm-up calls, ``--calls`` calls: the median wall time (ms) and the minor page faults per
call (``getrusage``: every fresh page the process touched, Python's own included). Alternate two
installs or two builds between runs to compare them (docs/benchmarks.md, "Page faults under 1 MB").
Run from outside the source tree so the installed package is imported.
"""
import argparse
import resource
import statistics
import time

import torch

import torch_kda


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("recurrent", "chunk"), default="recurrent")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--calls", type=int, default=31)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    shape = (1, a.seq_len, a.heads, 128)
    q, k, v = (torch.randn(*shape, generator=gen).to(dt) for _ in range(3))
    g = (-torch.rand(*shape, generator=gen)).to(dt)
    beta = torch.rand(*shape[:3], generator=gen).to(dt)
    fn = torch_kda.chunk_kda if a.op == "chunk" else torch_kda.fused_recurrent_kda

    def call():
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True,
                  backend="native")

    with torch.no_grad():
        for _ in range(5):
            call()
        times = []
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(a.calls):
            t0 = time.perf_counter()
            out = call()
            times.append(time.perf_counter() - t0)
            del out
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(f"{a.op} {a.dtype} B1 T{a.seq_len} H{a.heads} threads {a.threads}: "
          f"median {statistics.median(times) * 1e3:.2f} ms, {(f1 - f0) / a.calls:.1f} faults per call")


if __name__ == "__main__":
    main()
