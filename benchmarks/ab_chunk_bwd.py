"""Two builds of the native library side by side: the chunk backward against the recurrent one.

Each call of this script loads ONE ``libkda.so`` by path (``torch.ops.load_library``; the
``torch_kda`` package is not imported, so its installed library does not clash) and times
``kda::chunk_fwd`` / ``kda::chunk_bwd`` and ``kda::fused_recurrent_fwd`` /
``kda::fused_recurrent_bwd``, interleaved, on the inputs of ``benchmarks/ab_chunk_fwd.py``
(B = 1, K = V = 128, q/k L2 norm, softplus gate with ``A_log``/``dt_bias`` and sigmoid beta in
the op; ``A_log`` uniform in [0, 2.7) or ``--a-log X``), a dense random cotangent of o, the
backwards reading the recurrent forward's checkpoints. One thread: process CPU time; more
threads: wall time. Alternate the builds between calls, e.g.::

    for r in 1 2; do for lib in /tmp/base/libkda.so /tmp/new/libkda.so; do
      python benchmarks/ab_chunk_bwd.py $lib --dtype bf16; done; done

``--profile SECONDS`` runs only the chunk backward, call after call, for that long after its
warm-up, for a profiler to sample (docs/benchmarks.md, "The backward takes the forward's
products")::

    perf record -D 5000 python benchmarks/ab_chunk_bwd.py LIB --dtype fp32 --heads 4 --seq-len 4096 --profile 6

Prints one line per call: medians over ``--reps`` (ms), the backward's and forward + backward's
recurrent / chunk speed ratios, and a digest of the chunk backward's gradients (equal digests:
bitwise equal gradients; the products' precision follows TORCH_KDA_CHUNK_PRODUCTS).
"""

from __future__ import annotations

import hashlib
import statistics
import time

import torch

from ab_chunk_fwd import chunk_problem  # this folder is the script's sys.path[0]


def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        if t.numel():
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def main() -> None:
    a, args, rnd, dt = chunk_problem(
        __doc__.split("\n\n")[0],
        lambda p: p.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                                 help="run only the chunk backward for this long"))
    H, T = a.heads, a.seq_len
    kda = torch.ops.kda
    o, _, ckpt = kda.fused_recurrent_fwd(*args)
    d_o = rnd(*o.shape).to(dt)
    clock = time.process_time if a.threads == 1 else time.perf_counter
    fns = {"rec_fwd": lambda: kda.fused_recurrent_fwd(*args),
           "rec_bwd": lambda: kda.fused_recurrent_bwd(d_o, None, ckpt, *args),
           "chunk_fwd": lambda: kda.chunk_fwd(*args),
           "chunk_bwd": lambda: kda.chunk_bwd(d_o, None, ckpt, *args)}
    for fn in fns.values():
        fn()  # warm-up (output cache)
    if a.profile > 0:
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.profile:
            fns["chunk_bwd"]()
            calls += 1
        print(f"chunk_bwd: {calls} calls, {(time.perf_counter() - t0) / calls * 1e3:.1f} ms each")
        return
    times = {name: [] for name in fns}
    for _ in range(a.reps):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    m = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    fb = (m["rec_fwd"] + m["rec_bwd"]) / (m["chunk_fwd"] + m["chunk_bwd"])
    print(f"{a.lib} {a.dtype} H{H} T{T} thr{a.threads} "
          f"A_log={'rand*2.7' if a.a_log is None else a.a_log} "
          f"rec fwd/bwd={m['rec_fwd']:.1f}/{m['rec_bwd']:.1f} ms "
          f"chunk fwd/bwd={m['chunk_fwd']:.1f}/{m['chunk_bwd']:.1f} ms "
          f"bwd rec/chunk={m['rec_bwd'] / m['chunk_bwd']:.2f}x fwd+bwd rec/chunk={fb:.2f}x "
          f"grads {digest(fns['chunk_bwd']())}", flush=True)


if __name__ == "__main__":
    main()
