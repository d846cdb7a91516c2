"""The demo's text corpus: bytes of real text, split by file into training and held-out parts.

By default the corpus is the ``.py`` source of the Python standard library found on this machine
(``sysconfig.get_paths()["stdlib"]``, without ``site-packages``/``dist-packages`` and the test
suites): text nobody on this project wrote, present on every Python install. ``--text FILE`` uses
one file instead, split at a byte offset.
"""

from __future__ import annotations

import math
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from .common import UsageError

__all__ = ["Corpus", "CorpusError", "stdlib_files", "load_corpus", "unigram_entropy"]

#: Directory names skipped when walking the standard library.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


class CorpusError(UsageError):
    """The text cannot be used (missing, unreadable, empty or too short); the CLI exits with 2."""


@dataclass
class Corpus:
    """Training and held-out bytes of one text source.

    Attributes:
        train: ``[N_train]`` uint8 tensor.
        val: ``[N_val]`` uint8 tensor (whole files never seen in training, for the stdlib corpus).
        source: human-readable description (path, number of files).
        n_files: number of files read (1 for ``--text``).
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str
    n_files: int


def stdlib_files(root: Optional[str] = None) -> List[Path]:
    """The standard library's ``.py`` files under ``root`` (default: this interpreter's stdlib),
    sorted, without third-party packages, caches and test suites."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found: List[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return found


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy in nats of the byte-frequency (unigram) distribution of ``data`` (uint8, any shape).

    This is the cross-entropy of the best order-0 byte model fitted to ``data`` itself, so a
    language model whose loss on ``data`` is below it has learned context.

    Raises:
        ValueError: ``data`` is empty.
    """
    if data.numel() == 0:
        raise ValueError("unigram_entropy: expected non-empty data, got 0 bytes")
    counts = torch.bincount(data.reshape(-1).long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def load_corpus(text: Optional[str] = None, max_bytes: int = 8_000_000, val_fraction: float = 0.05,
                min_bytes: int = 4096) -> Corpus:
    """Read the corpus and split it into training and held-out bytes.

    Args:
        text: path of a text file, or None for the Python standard library's sources.
        max_bytes: read at most this many bytes (the stdlib files are taken in a fixed shuffled
            order, so the sample mixes all packages and is the same on every run).
        val_fraction: share of the bytes held out. For the stdlib, whole files are held out (the
            last files of the shuffled order); for a single file, its tail.
        min_bytes: fewer bytes than this is an error (too little to train and evaluate on).

    Returns:
        a :class:`Corpus`.

    Raises:
        CorpusError: the file is missing, unreadable, a directory, empty or shorter than
            ``min_bytes``; no stdlib sources were found.
    """
    if text is not None:
        path = Path(text)
        if not path.exists():
            raise CorpusError(f"--text: file not found: {text}")
        if not path.is_file():
            raise CorpusError(f"--text: not a regular file: {text}")
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes)
        except OSError as exc:
            raise CorpusError(f"--text: cannot read {text}: {exc}") from exc
        if len(data) == 0:
            raise CorpusError(f"--text: the file is empty: {text}")
        if len(data) < min_bytes:
            raise CorpusError(f"--text: expected at least {min_bytes} bytes of text, got {len(data)} in {text}")
        n_val = max(int(len(data) * val_fraction), min_bytes // 4)
        all_bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return Corpus(all_bytes[:-n_val].clone(), all_bytes[-n_val:].clone(), str(path), 1)

    files = stdlib_files()
    if not files:
        raise CorpusError(f"no .py files found under the stdlib directory {sysconfig.get_paths()['stdlib']}; "
                          "pass --text FILE")
    random.Random(0).shuffle(files)
    chunks: List[bytes] = []
    total = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < min_bytes:
        raise CorpusError(f"the stdlib sources hold only {total} bytes (expected >= {min_bytes}); pass --text FILE")
    # Hold out whole files from the end of the shuffled order.
    n_val_target = max(int(total * val_fraction), min_bytes // 4)
    val_chunks: List[bytes] = []
    while chunks and sum(map(len, val_chunks)) < n_val_target and len(chunks) > 1:
        val_chunks.insert(0, chunks.pop())
    train = b"".join(chunks)
    val = b"".join(val_chunks)
    return Corpus(torch.frombuffer(bytearray(train), dtype=torch.uint8).clone(),
                  torch.frombuffer(bytearray(val), dtype=torch.uint8).clone(),
                  f"{len(chunks) + len(val_chunks)} .py files of the Python standard library "
                  f"({sysconfig.get_paths()['stdlib']})", len(chunks) + len(val_chunks))


def bits(nats: float) -> float:
    """Nats to bits."""
    return nats / math.log(2)
