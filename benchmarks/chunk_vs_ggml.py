"""The native chunk op against llama.cpp's ggml op (issue 15's "3x ggml's fp32 op"), side by side.

Inputs: ``torch_kda.peers.peer_inputs`` (B1, K = V = 128, fp32, pre-processed as every
implementation takes them: L2-normalised q and k, log decays from the softplus gate, sigmoid
beta, an initial state). Timed, interleaved, one call each per repetition: ggml's
``GGML_OP_GATED_DELTA_NET`` on the fp32 inputs (``DIR/libkda_ggml_gdn.so`` from
benchmarks/peers/setup.sh), torch-kda's chunk op (``chunk_kda(backend="native")``) and its
recurrent op (``fused_recurrent_kda(backend="native")``) on the same inputs in fp32 and rounded
to bf16 (state fp32), final state returned. Prints medians (ms) and each of ours as a speed ratio
over ggml, per thread count. Outputs are checked against ggml's first (relative max error, fp32
inputs). Run from outside the source tree::

    cd /tmp && python /path/to/benchmarks/chunk_vs_ggml.py /tmp/peers --heads 16 --threads 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_kda
from torch_kda.benchmark import Shape
from torch_kda.peers import Ggml, find_peers, peer_inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("peers_dir")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    lib = find_peers(a.peers_dir)["ggml"]  # (raises when neither peer is built)
    if lib is None:
        raise SystemExit(f"no ggml driver in {a.peers_dir}: run benchmarks/peers/setup.sh first")
    inp = peer_inputs(Shape(1, a.seq_len, a.heads, a.heads))
    ggml = Ggml(lib, inp, a.threads)
    ours = {}
    for dt_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = {n: inp[n].to(dt) for n in ("q", "k", "v", "g", "beta")}
        for op_name, op in (("chunk", torch_kda.chunk_kda), ("recurrent", torch_kda.fused_recurrent_kda)):
            ours[f"{op_name} {dt_name}"] = (lambda op=op, x=x: op(
                **x, initial_state=inp["h0"], output_final_state=True, backend="native"))
    o_g, s_g = ggml.outputs()
    with torch.no_grad():
        for name in ("chunk fp32", "recurrent fp32"):
            o, s = ours[name]()
            err = float((o - o_g).abs().max() / o_g.abs().max())
            print(f"{name}: output rel. max error vs ggml {err:.2e}")
    times = {(n, t): [] for n in ["ggml", *ours] for t in a.threads}
    with torch.no_grad():
        for fn in ours.values():
            fn()  # warm-up (output cache)
        for _ in range(a.reps):
            for t in a.threads:
                torch.set_num_threads(t)
                times[("ggml", t)].append(ggml.time(t))
                for name, fn in ours.items():
                    t0 = time.perf_counter()
                    fn()
                    times[(name, t)].append(time.perf_counter() - t0)
    ggml.close()
    for t in a.threads:
        g = statistics.median(times[("ggml", t)])
        row = [f"B1 T{a.seq_len} H{a.heads} thr{t}: ggml fp32 {g * 1e3:.1f} ms"]
        for name in ours:
            m = statistics.median(times[(name, t)])
            row.append(f"{name} {m * 1e3:.1f} ms ({g / m:.2f}x)")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
