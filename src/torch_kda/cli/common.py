"""Helpers shared by the subcommands: the usage error and argparse value types."""

from __future__ import annotations

import argparse
import math
import os

import torch

__all__ = ["UsageError", "positive_int", "positive_float", "busy_machine_threads", "shadowing_hint"]


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


def shadowing_hint() -> str:
    """Why the native op may be missing although it is installed, or ``""``.

    ``python -m torch_kda`` run from a source checkout imports the checkout's ``torch_kda`` (the
    current directory comes first on ``sys.path``), which has no built library, while ``pip
    install .`` put one into site-packages. Returns a sentence saying so and what to run instead.
    """
    from importlib import metadata
    from pathlib import Path

    import torch_kda

    here = Path(torch_kda.__file__).resolve().parent
    try:
        files = metadata.distribution("torch-kda").files or []
    except metadata.PackageNotFoundError:
        return ""
    for f in files:
        if f.name.startswith("libkda.") or (f.name.startswith("kda.") and f.name.endswith(".dll")):
            lib = Path(f.locate()).resolve()
            if lib.exists() and lib.parent != here:
                return (f"this process imported torch_kda from {here} (the current directory shadows the "
                        f"installed package, which has the native op in {lib.parent}); run `torch-kda ...` "
                        f"or `python -m torch_kda` from another directory")
    return ""


def busy_machine_threads() -> str:
    """On an oversubscribed machine, drop to one thread; returns a note saying so, or ``""``.

    Thread pools spin at their barriers: when other processes already keep every core busy (load
    average above the core count), two threads of this process were measured 4x slower per step
    than one (and burned 6x the CPU time). ``--threads`` overrides this.
    """
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ""
    cores = os.cpu_count() or 1
    if torch.get_num_threads() > 1 and load > cores + 0.5:
        torch.set_num_threads(1)
        return (f"the machine is busy (load average {load:.1f} on {cores} cores): using 1 thread, "
                f"since contended threads spin at their barriers and run slower (--threads N to override)")
    return ""
