"""Prefill into a state pool on CPU: chunk_kda's native chunkwise path vs the token-by-token
serving kernel (the path before it), side by side in one run (docs/benchmarks.md, "Prefill into
the pool").

Each round times, interleaved: ``chunk_kda(..., backend="native")`` with ``ssm_state_indices`` and
``inplace_final_state=True`` (the chunk kernel), the same call through the serving kernel
(``fused_recurrent_kda``, which ``chunk_kda`` ran before), the chunk kernel on a plain call
(states in and out, no pool: what the pool costs), and, with ``--intermediate``, the
intermediate states (every 64 tokens) from the chunk kernel vs the chunkwise reference (their path
before). Prints medians and ratios. Run from outside the source tree:

    cd /tmp && python /path/to/benchmarks/prefill_pool_cpu.py --threads 1 --T 4096 --H 4
"""

import argparse
import statistics
import time

import torch

import torch_kda


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[4096], help="prompt lengths, packed")
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=128, help="K = V")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--pool-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--v-first", action="store_true")
    ap.add_argument("--intermediate", action="store_true",
                    help="also time return_intermediate_states (native vs the chunkwise reference)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    dt, pdt = getattr(torch, a.dtype), getattr(torch, a.pool_dtype)
    H, D, T = a.H, a.D, sum(a.T)
    q, k, v, g = (torch.randn(1, T, H, D, generator=gen).to(dt) for _ in range(4))
    beta = torch.randn(1, T, H, generator=gen).to(dt)
    cu = torch.tensor([0] + a.T).cumsum(0)
    N = len(a.T)
    kw = dict(A_log=torch.rand(H, generator=gen), dt_bias=torch.randn(H * D, generator=gen) * 0.5,
              use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, cu_seqlens=cu, state_v_first=a.v_first)
    pool = (torch.randn(2 * N, H, D, D, generator=gen) * 0.1).to(pdt)
    idx = torch.arange(N) * 2 + 1
    serve = dict(initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
    h0 = pool[idx].float()
    calls = {
        "chunk kernel": lambda: torch_kda.chunk_kda(q, k, v, g, beta, **kw, **serve,
                                                    backend="native"),
        "serving kernel": lambda: torch_kda.fused_recurrent_kda(q, k, v, g, beta, **kw, **serve,
                                                                backend="native"),
        # the pool's cost: the same chunk kernel on a plain call (states in, states out)
        "chunk kernel, no pool": lambda: torch_kda.chunk_kda(
            q, k, v, g, beta, **kw, initial_state=h0, output_final_state=True, backend="native"),
    }
    if a.intermediate:
        for name, backend in (("h: chunk kernel", "native"), ("h: chunkwise reference", "reference")):
            calls[name] = (lambda b=backend: torch_kda.chunk_kda(
                q, k, v, g, beta, **kw, **serve, return_intermediate_states=True, backend=b))
    times = {name: [] for name in calls}
    with torch.inference_mode():
        for fn in calls.values():  # warm-up
            fn()
        for _ in range(a.reps):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"# prefill into a {a.pool_dtype} pool ({'V' if a.v_first else 'K'}-first), "
          f"{a.dtype} inputs, T = {a.T}, H = {H}, K = V = {D}, {a.threads} thread(s), "
          f"median of {a.reps}, torch {torch.__version__}")
    base = med["serving kernel"]
    for name, m in med.items():
        ref = med["h: chunkwise reference"] if name.startswith("h:") else base
        print(f"{name:24s} {m * 1e3:10.1f} ms  {T / m / 1e3:8.1f}K tok/s  {ref / m:6.2f}x")


if __name__ == "__main__":
    main()
