"""Helpers shared by the subcommands: the usage errors, argparse value types, output folders."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import tempfile
from pathlib import Path

import torch

__all__ = ["UsageError", "MissingExtra", "positive_int", "int_at_least", "positive_float", "require_extra",
           "output_dir", "busy_machine_threads", "oversubscribed_threads"]


class UsageError(ValueError):
    """A bad argument found after parsing (missing or empty ``--text`` file, ``--seq-len`` longer
    than the text, a backend that is not installed...). The CLI prints it argparse-style and exits
    with status 2."""


class MissingExtra(RuntimeError):
    """A package of the optional ``cli`` extra (tqdm, matplotlib) that a command needs is not
    installed; the CLI prints the message (which names the install command) and exits with 1."""


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (else ``ArgumentTypeError``, exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def int_at_least(low: int, why: str):
    """argparse type: an integer >= ``low`` (else ``ArgumentTypeError`` naming ``why``, exit
    status 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low} ({why}), got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (else ``ArgumentTypeError``, exit status 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def require_extra(command: str, *modules: str) -> None:
    """Raise :class:`MissingExtra` naming the install command when a module of the ``cli`` extra
    (``tqdm``, ``matplotlib``) that ``command`` needs is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(f"error: `{command}` needs {' and '.join(missing)}, which "
                           f"{'is' if len(missing) == 1 else 'are'} not installed: run "
                           f"`pip install \"torch-kda[cli]\"` (or `pip install {' '.join(missing)}`)")


def output_dir(path: str, option: str = "--out") -> Path:
    """Create the output folder ``path`` now, before any work, and check that files can be
    written into it; returns it as a :class:`~pathlib.Path`.

    Raises:
        UsageError: ``path`` is an existing file, or a folder that cannot be created or written
            to (the message names ``option`` and the path).
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{option}: expected a folder, got an existing file: {out}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        # A real write (not os.access, which says yes to root on any folder of a writable mount).
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise UsageError(f"{option}: cannot create or write into the folder {out}: "
                         f"{exc.strerror or exc}") from None
    return out


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


def oversubscribed_threads(threads: int) -> str:
    """A note when ``threads`` (a ``--threads N``) exceeds the CPUs this process may run on, or
    ``""``: the threads then take turns on the cores and spin at their barriers (``--threads
    1000`` on 2 cores made one demo step ~20x slower). A note, not an error: more threads than
    cores is a legitimate experiment."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if threads <= cpus:
        return ""
    return (f"--threads {threads} is more than the {cpus} CPU(s) this process may use: the threads "
            f"take turns and wait at their barriers, so expect it to run slower than with {cpus}")
