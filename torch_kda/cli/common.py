"""Helpers shared by the subcommands: the usage error and argparse value types."""

from __future__ import annotations

import argparse
import math

__all__ = ["UsageError", "positive_int", "positive_float"]


class UsageError(ValueError):
    """A bad argument found after parsing (missing or empty ``--text`` file, ``--seq-len`` longer
    than the text, a backend that is not installed...). The CLI prints it argparse-style and exits
    with status 2."""


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (else ``ArgumentTypeError``, exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (else ``ArgumentTypeError``, exit status 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value
