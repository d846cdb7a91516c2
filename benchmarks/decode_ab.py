"""Two builds of the native library side by side: one decode call, state in and state out.

Each call of this script loads ONE ``libkda.so`` by path (``torch.ops.load_library``; the
``torch_kda`` package is not imported) and times ``kda::fused_recurrent`` with one token per
sequence: ``B`` sequences, ``H = HV`` heads, K = V = 128, fp32, q and k L2-normalised outside the op,
an initial state in, a fresh final state out (the functional API's decode call), K-first or V-first.

Where the state lives between calls (``--state``):

- ``cold``: a copy of ``--junk-mb`` MB runs before every call, so the state comes from memory, as
  in a model, where the other layers run between two decode steps of one layer (use more than the
  last-level cache: 96 MB on a 32 MB L3, 640 MB on the 16-core host's 300 MB);
- ``loop``: each call's final state is the next call's initial state and nothing runs in between
  (one layer decoding alone: the state stays in the caches when it fits).

Prints the median and first quartile of the calls' wall times (µs) after 5 warm-up calls, and
the sums of the first call's outputs (equal sums: the builds computed the same values).
Alternate the builds between calls, e.g.::

    for r in 1 2; do for lib in /tmp/base/libkda.so /tmp/new/libkda.so; do
      python benchmarks/decode_ab.py $lib --batch 8 --threads 1 --state cold; done; done

(docs/benchmarks.md, "Decode from memory: the next head's state prefetched").
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lib")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layout", choices=("k-first", "v-first"), default="k-first")
    p.add_argument("--state", choices=("cold", "loop"), default="cold")
    p.add_argument("--junk-mb", type=int, default=96, help="MB copied before each call (cold)")
    p.add_argument("--calls", type=int, default=45)
    a = p.parse_args()
    torch.ops.load_library(a.lib)
    torch.set_num_threads(a.threads)
    B, H, K = a.batch, a.heads, 128
    v_first = a.layout == "v-first"
    gen = torch.Generator().manual_seed(1)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)

    q, k, v = unit(rnd(B, 1, H, K)), unit(rnd(B, 1, H, K)), rnd(B, 1, H, K)
    g, beta = -torch.rand(B, 1, H, K, generator=gen), torch.rand(B, 1, H, generator=gen)
    h = rnd(B, H, K, K)
    junk = torch.randn(a.junk_mb << 18)
    junk_dst = torch.empty_like(junk)
    times = []
    for i in range(a.calls + 5):
        if a.state == "cold":
            junk_dst.copy_(junk)
        t0 = time.perf_counter()
        o, ht = torch.ops.kda.fused_recurrent(q, k, v, g, beta, K ** -0.5, h, False, False, False,
                                              False, None, v_first, None, None, None)
        if i >= 5:
            times.append(time.perf_counter() - t0)
        if i == 0:
            sums = f"sums {float(o.double().sum()):.9e} {float(ht.double().sum()):.9e}"
        if a.state == "loop":
            h = ht
    times.sort()
    print(f"{a.lib} B{B} H{H} {a.layout} {a.state} threads={a.threads}: "
          f"median {times[len(times) // 2] * 1e6:.0f} us, p25 {times[len(times) // 4] * 1e6:.0f} us; {sums}")


if __name__ == "__main__":
    main()
