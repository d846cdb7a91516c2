"""K-first vs V-first decode, side by side: the raw op and the API, per thread count and batch.

    python benchmarks/decode_layouts.py [THREADS ...]      # default: 1 2 4 8 16
    H=8 BS="1 16" CPU_TIME=1 python benchmarks/decode_layouts.py 1
    K=48 BS="1 8" python benchmarks/decode_layouts.py 1

One token per sequence, H heads (default 32), K = V (default 128), fp32, a state in and out (no
pool).
Per (threads, batch) it times four calls in interleaved blocks (11 blocks, alternating order):
`torch.ops.kda.fused_recurrent` with a K-first and a V-first state ("raw_k", "raw_v") and
`fused_recurrent_kda(backend="native")` ("api_k", "api_v"), and prints the median and minimum
microseconds per call and the V-first / K-first ratios. BS: batch sizes (default "1 16 64");
CPU_TIME=1: process CPU time instead of wall time (for one thread on a loaded machine).
"""
import os, statistics, sys, time, torch, torch_kda
ops = torch.ops.kda
TIMER = time.process_time if os.environ.get("CPU_TIME") else time.perf_counter
K = int(os.environ.get("K", 128))
H = int(os.environ.get("H", 32))
for th in [int(x) for x in (sys.argv[1:] or ["1", "2", "4", "8", "16"])]:
    torch.set_num_threads(th)
    for B in [int(x) for x in os.environ.get("BS", "1 16 64").split()]:
        g = torch.Generator().manual_seed(B)
        r = lambda *s, sc=1.0: torch.randn(*s, generator=g) * sc
        q = torch.nn.functional.normalize(r(B, 1, H, K), dim=-1)
        k = torch.nn.functional.normalize(r(B, 1, H, K), dim=-1)
        v, gg = r(B, 1, H, K), -torch.rand(B, 1, H, K, generator=g) * 0.1
        beta = torch.rand(B, 1, H, generator=g)
        h0 = r(B, H, K, K, sc=0.1); h0v = h0.transpose(-1, -2).contiguous()
        calls = max(4, 300 // B)
        fns = {
            "raw_k": lambda: ops.fused_recurrent(q, k, v, gg, beta, K**-0.5, h0, False, False, False, False, None, False, None, None, None),
            "raw_v": lambda: ops.fused_recurrent(q, k, v, gg, beta, K**-0.5, h0v, False, False, False, False, None, True, None, None, None),
            "api_k": lambda: torch_kda.fused_recurrent_kda(q, k, v, gg, beta, initial_state=h0, output_final_state=True, state_v_first=False, backend="native"),
            "api_v": lambda: torch_kda.fused_recurrent_kda(q, k, v, gg, beta, initial_state=h0v, output_final_state=True, state_v_first=True, backend="native"),
        }
        t = {n: [] for n in fns}
        with torch.no_grad():
            for n, f in fns.items():
                for _ in range(5): f()
            for rnd in range(11):
                for n, f in (fns.items() if rnd % 2 == 0 else reversed(list(fns.items()))):
                    t0 = TIMER()
                    for _ in range(calls): f()
                    t[n].append((TIMER() - t0) / calls * 1e6)
        med = {n: statistics.median(x) for n, x in t.items()}
        mn = {n: min(x) for n, x in t.items()}
        print(f"thr {th:2d} B{B:2d}: " + "  ".join(f"{n} {med[n]:8.1f} (min {mn[n]:8.1f})" for n in fns)
              + f"  V/K raw {med['raw_v']/med['raw_k']:.2f} api {med['api_v']/med['api_k']:.2f}", flush=True)
