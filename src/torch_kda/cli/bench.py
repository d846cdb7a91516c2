"""``python -m torch_kda bench``: the project's CPU benchmark, from the installed package.

Runs :mod:`torch_kda.benchmark`, the engine behind ``benchmarks/bench_cpu.py`` (see that module
for what is measured and how): the native C++ op vs the pure-PyTorch reference, ``torch.compile``
of the reference's step and FLA's naive KDA (where fla-core is installed), forward and forward +
backward with the gate, the q/k L2 norms and the beta sigmoid in the op, fp32, at 1 and 2 threads,
interleaved, medians. Prints the table (tokens/s, native's % of the box's fp32 GEMM rate, its
speed-up over each baseline; a summary of native's ratios where the target shape T = 4K, H = 4 ran)
and writes the PNG of tokens/s by T per backend, the markdown report and the JSON results into
``--out``.

``--chunk``: the native chunkwise op vs the native recurrent op instead (docs/benchmarks.md,
"CPU: chunkwise vs recurrent native kernels").

Default: the standard shapes (B = 1, T in {1K, 4K, 16K}, H = HV in {4, 16}, K = V = 128, fp32 and
bf16, decoding shapes, peak memory at the target shape; tens of minutes on 2 cores). ``--quick``:
T = 1K and the target shape T = 4K, H = 4, fp32, baselines at T = 1K only, no memory (about a
minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json

from .. import benchmark
from ..api import available_backends
from .common import UsageError, output_dir, positive_int, require_extra

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``p``."""
    p.add_argument("--quick", action="store_true",
                   help="T=1K and T=4K, H=4, fp32, baselines at T=1K only, no memory (about a minute on 2 cores)")
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=None, metavar="T",
                   help="sequence lengths instead of the preset's (standard: 1024 4096 16384)")
    p.add_argument("--heads", type=positive_int, nargs="+", default=None, metavar="H",
                   help="heads H = HV instead of the preset's (standard: 4 16)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="K = V (default 128)")
    p.add_argument("--no-decode", action="store_true", help="skip the decoding shapes (T = 1)")
    p.add_argument("--backends", nargs="+", choices=benchmark.BACKENDS, default=None,
                   help="backends to time (default: all; fla_naive needs fla-core)")
    p.add_argument("--threads", type=positive_int, nargs="+", default=None, metavar="N",
                   help="thread counts, interleaved (default: %s)" % " ".join(map(str, benchmark.default_threads())))
    p.add_argument("--reps", type=positive_int, default=None, help="repetitions (default 5; --quick 3)")
    p.add_argument("--peers", metavar="DIR", default=None,
                   help="instead: torch-kda vs llama.cpp's ggml and ExecuTorch, built into DIR by "
                        "benchmarks/peers/setup.sh (prefill B1 T4K H4/H16, decode B1/B8/B64 H32; peers.md, peers.json)")
    p.add_argument("--chunk", action="store_true",
                   help="instead: the native chunkwise op vs the native recurrent op, forward and "
                        "forward+backward, fp32 and bf16, T from 256 to 64K (--quick: 1K, 8K), "
                        "%% of the fp32 and bf16 GEMM rates (chunk.md, chunk.json; docs/benchmarks.md)")
    p.add_argument("--decode-batches", type=positive_int, nargs="+", default=None, metavar="B",
                   help="with --peers: decoding batch sizes (H = 32; default 1 8 64); the default "
                        "benchmark's decoding rows are B1 and B8 at H = 32 (K = V = --head-dim)")
    p.add_argument("--out", metavar="DIR", default="out",
                   help="directory for bench_tokens_per_s.png, bench.md, bench.json (default: ./%(default)s)")


# The options each mode reads (besides --out); any other option given is a mistake, never ignored.
_MODE_OPTIONS = {
    "--peers": {"seq_lens", "heads", "head_dim", "no_decode", "decode_batches", "threads", "reps"},
    "--chunk": {"quick", "seq_lens", "heads", "head_dim", "threads", "reps"},
    "the default benchmark": {"quick", "seq_lens", "heads", "head_dim", "no_decode", "backends",
                              "threads", "reps"},
}
_OPTIONS = ("peers", "chunk", "decode_batches", "quick", "seq_lens", "heads", "head_dim", "no_decode",
            "backends", "threads", "reps")


def _check_options(args: argparse.Namespace) -> None:
    """Raise UsageError for an option the chosen mode would not read (it used to run without it,
    while the report's header printed it)."""
    if args.peers and args.chunk:
        raise UsageError("--peers and --chunk are two different benchmarks: choose one")
    mode = "--peers" if args.peers else "--chunk" if args.chunk else "the default benchmark"
    for name in _OPTIONS:
        value = getattr(args, name)
        if name not in ("peers", "chunk") and value not in (None, False) \
                and name not in _MODE_OPTIONS[mode]:
            needs = [m for m, names in _MODE_OPTIONS.items() if name in names]
            raise UsageError(f"--{name.replace('_', '-')} does not apply to {mode}"
                             f" (it applies to {' and '.join(needs)})")


def _command(args: argparse.Namespace) -> str:
    """The command line that asked for this run, for the report's header."""
    words = ["python -m torch_kda bench"]
    for name in _OPTIONS:
        value = getattr(args, name)
        if value is None or value is False:
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words += [str(v) for v in (value if isinstance(value, list) else [value])]
    return " ".join(words)


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write the PNG, the report and the JSON; returns 0.

    Raises:
        UsageError: ``--backends native`` without a native build; ``--out`` is a file or a folder
            that cannot be written; an option the chosen mode does not read (``--decode-batches``
            without ``--peers``, ``--backends`` with ``--chunk``, ...), or ``--peers`` with
            ``--chunk``.
        MissingExtra: matplotlib (for the plot) is not installed.
    """
    _check_options(args)
    require_extra("bench", "matplotlib")
    status = available_backends()
    if args.peers:
        from .. import peers
        if not status["native"].available:
            raise UsageError(f"--peers: the native backend is unavailable here: {status['native'].reason}")
        try:
            peers.find_peers(args.peers)  # before --out is made: nothing to write without a peer
            out = output_dir(args.out)
            shapes = peers.peer_shapes(args.seq_lens, args.heads, args.head_dim, args.decode_batches,
                                       decode=not args.no_decode)
            peers.bench_peers(args.peers, _command(args), threads=args.threads or benchmark.default_threads(),
                              reps=args.reps or 5, shapes=shapes, out_md=str(out / "peers.md"),
                              out_json=str(out / "peers.json"))
        except FileNotFoundError as exc:
            raise UsageError(f"--peers: {exc}") from exc
        return 0
    if args.chunk:
        if not status["native"].available:
            raise UsageError(f"--chunk: the native backend is unavailable here: {status['native'].reason}")
        out = output_dir(args.out)
        seq_lens = args.seq_lens or (benchmark.CHUNK_QUICK_SEQ_LENS if args.quick
                                     else benchmark.CHUNK_SEQ_LENS)
        rows = benchmark.chunk_rows(seq_lens, args.heads or [4], args.threads or benchmark.default_threads(),
                                    reps=args.reps or (3 if args.quick else 5), head_dim=args.head_dim or 128)
        text = f"{_command(args)}\n\n{benchmark.format_chunk(rows)}\n"
        print(text)
        (out / "chunk.md").write_text(text)
        (out / "chunk.json").write_text(json.dumps(dict(machine=benchmark.machine_info(), rows=rows), indent=1))
        return 0
    backends = args.backends or [b for b in benchmark.BACKENDS if b != "native" or status["native"].available]
    if "native" in backends and not status["native"].available:
        raise UsageError(f"--backends native: unavailable here: {status['native'].reason}")
    if not status["native"].available:
        print(f"NOTE: native backend unavailable ({status['native'].reason}); timing the baselines only")
    kw = benchmark.settings(args.quick, seq_lens=args.seq_lens, heads=args.heads, head_dim=args.head_dim,
                            decode=not args.no_decode, backends=backends, threads=args.threads, reps=args.reps)
    out = output_dir(args.out)
    png = out / "bench_tokens_per_s.png"
    benchmark.bench(kw, _command(args), out_md=str(out / "bench.md"),
                    out_json=str(out / "bench.json"), out_png=str(png), verdicts=False)
    print(f"plot: {png.resolve()}")
    return 0
