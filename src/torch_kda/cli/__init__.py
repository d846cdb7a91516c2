"""The command line: ``python -m torch_kda demo | bench | check`` (also the ``torch-kda`` command).

- ``demo``: train a small byte-level KDA language model on real text on CPU;
- ``bench``: tokens/s of the backends by sequence length, a table and a PNG plot;
- ``check``: validate the installed backends against a float64 run; non-zero exit on failure;
- ``hf``: a Hugging Face Kimi-Linear model with transformers' own KDA vs torch-kda (agreement, speed).

Without a command the usage is printed (exit status 2). Bad arguments (non-positive sizes, a
missing or empty ``--text`` file, an ``--out`` that cannot be written, ...) end with exit status 2
and an argparse-style message, as argparse's own errors do, before any work starts. ``demo`` and
``bench`` need the ``cli`` extra (tqdm, matplotlib: ``pip install "torch-kda[cli]"``); without it
they say so and exit with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .. import __version__

__all__ = ["build_parser", "main"]

_COMMANDS = ("demo", "bench", "check", "hf")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with the ``demo``, ``bench``, ``check`` and ``hf`` subcommands."""
    from . import bench, check, demo, hf

    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    parser = argparse.ArgumentParser(
        prog="torch-kda" if script.startswith("torch-kda") else "python -m torch_kda",
        description="torch-kda: Kimi Delta Attention for PyTorch. Try `demo` first.",
    )
    parser.add_argument("--version", action="version", version=f"torch-kda {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_COMMANDS) + "}")
    p = sub.add_parser("demo", help="train a small byte-level KDA language model on real text (CPU, a few minutes)",
                       description=demo.__doc__.split("\n\n")[0].split(": ", 1)[-1])
    demo.add_arguments(p)
    p.set_defaults(run=demo.run, subparser=p)
    p = sub.add_parser("bench", help="tokens/s of the backends by sequence length (table + PNG)",
                       description=bench.__doc__.split("\n\n")[0].split(": ", 1)[-1])
    bench.add_arguments(p)
    p.set_defaults(run=bench.run, subparser=p)
    p = sub.add_parser("check", help="validate the installed backends against float64 (pass/fail table)",
                       description=check.__doc__.split("\n\n")[0].split(": ", 1)[-1])
    check.add_arguments(p)
    p.set_defaults(run=check.run, subparser=p)
    p = sub.add_parser("hf", help="a Hugging Face Kimi-Linear model: transformers' own KDA vs torch-kda "
                                  "(agreement, prefill and decode speed; --bench for the benchmark)",
                       description=hf.__doc__.split("\n\n")[0].split(": ", 1)[-1])
    hf.add_arguments(p)
    p.set_defaults(run=hf.run, subparser=p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m torch_kda`` and of the ``torch-kda`` console script.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        the exit status: 0 on success, 1 when a check failed or an optional package the command
        needs is missing, 2 for bad arguments or no command (argparse exits with 2 itself for
        malformed options).
    """
    from .common import MissingExtra, UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    if argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        parser.error(f"expected a command ({', '.join(_COMMANDS)}) before the options, got {' '.join(argv)}")
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except UsageError as exc:
        args.subparser.error(str(exc))  # exits with status 2
    except MissingExtra as exc:
        print(f"{args.subparser.prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
