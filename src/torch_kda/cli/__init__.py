"""The command line: ``python -m torch_kda demo | bench | check`` (also the ``torch-kda`` command).

- ``demo`` (the default): train a small byte-level KDA language model on real text on CPU;
- ``bench``: tokens/s of the backends by sequence length, a table and a PNG plot;
- ``check``: validate the installed backends against a float64 run; non-zero exit on failure.

Bad arguments (non-positive sizes, a missing or empty ``--text`` file, ...) end with exit status 2
and an argparse-style message, as argparse's own errors do.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .. import __version__

__all__ = ["build_parser", "main"]

_COMMANDS = ("demo", "bench", "check")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with the ``demo``, ``bench`` and ``check`` subcommands."""
    from . import bench, check, demo

    parser = argparse.ArgumentParser(
        prog="python -m torch_kda",
        description="torch-kda: Kimi Delta Attention for PyTorch. Without a command, runs `demo`.",
    )
    parser.add_argument("--version", action="version", version=f"torch-kda {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench,check}")
    p = sub.add_parser("demo", help="train a small byte-level KDA language model on real text (CPU, ~3 min)",
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
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m torch_kda`` and of the ``torch-kda`` console script.

    Args:
        argv: the arguments (default ``sys.argv[1:]``). With no command (nothing, or options
            only), ``demo`` runs.

    Returns:
        the exit status: 0 on success, 1 when a check failed, 2 for bad arguments (argparse
        exits with 2 itself for malformed options).
    """
    from .common import UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["demo"] + argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except UsageError as exc:
        args.subparser.error(str(exc))  # exits with status 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
