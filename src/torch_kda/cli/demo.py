"""``python -m torch_kda demo``: train a small byte-level KDA language model on real text, on CPU.

Steps, each printed as it happens:

1. read the corpus (the standard library's ``.py`` sources, or ``--text FILE``), hold out whole
   files, and print the unigram (byte-frequency) entropy of the held-out bytes: the loss of the
   best model that ignores context, the baseline to beat;
2. build :class:`~torch_kda.cli.model.ByteLM` (KDA blocks) on the chosen backend;
3. at the first step, compare the parameter gradients of the native backend with those of the
   reference backend on that batch (relative error), or say why native cannot run;
4. train with AdamW under a tqdm bar (loss, tokens/s), evaluating the held-out loss on the way;
5. report the final held-out loss against the baseline and write the loss curve (PNG);
6. sample a continuation with the decoding cache and check that the cached logits equal those
   of one full forward over the same bytes (maximum relative difference).

Everything is deterministic for a given ``--seed`` and backend (up to thread scheduling of the
reference backend's matmuls).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from ..api import available_backends
from .common import (UsageError, busy_machine_threads, int_at_least, output_dir,
                     oversubscribed_threads, positive_float, positive_int, require_extra)
from .data import Corpus, bits, load_corpus, unigram_entropy
from .model import ByteLM, ByteLMConfig

__all__ = ["add_arguments", "run", "DemoError"]

#: Gradient check: relative error of native vs reference parameter gradients that counts as a pass.
GRAD_TOL = 1e-3
#: Default number of training steps per backend: about 2 minutes of compute on 2 idle cores.
DEFAULT_STEPS = {"native": 500, "reference": 150}
#: Cached decoding vs full forward: maximum relative logit difference that counts as a pass.
CACHE_TOL = 1e-4


class DemoError(UsageError):
    """An argument is inconsistent with the data (e.g. ``--seq-len`` longer than the held-out
    text); the CLI reports it argparse-style (exit status 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``demo`` options to ``p``."""
    p.add_argument("--text", metavar="FILE", default=None,
                   help="train on this text file (default: the .py sources of Python's standard library)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help=f"training steps (default: {DEFAULT_STEPS['native']} on the native backend, "
                        f"{DEFAULT_STEPS['reference']} on the ~4x slower reference: about 2 minutes on 2 idle cores, "
                        "longer on a busy machine)")
    p.add_argument("--seq-len", type=positive_int, default=256,
                   help="bytes per training sequence (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--backend", choices=("auto", "native", "reference"), default="auto",
                   help="KDA backend for training: auto = native when built, else reference (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--out", metavar="DIR", default="out",
                   help="directory for the loss plot and metrics (default: ./%(default)s)")
    p.add_argument("--dim", type=positive_int, default=128, help="model width (default: %(default)s)")
    p.add_argument("--layers", type=positive_int, default=2, help="number of KDA blocks (default: %(default)s)")
    p.add_argument("--heads", type=positive_int, default=2, help="KDA heads per block (default: %(default)s)")
    p.add_argument("--head-dim", type=int_at_least(2, "at 1 the q/k L2 norm is a sign function, whose "
                                                    "slope of 1000 at 0 fails the checks' fp32 comparisons"),
                   default=64, help="KDA head size, at least 2 (default: %(default)s)")
    p.add_argument("--eval-every", type=positive_int, default=None,
                   help="held-out evaluation interval in steps (default: steps / 10)")
    p.add_argument("--gen-len", type=positive_int, default=160,
                   help="bytes to generate at the end (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help=f"torch threads (default: torch's choice, {torch.get_num_threads()} here)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs and tests)")


# ----------------------------------------------------------------------------------------------
def _resolve_backend(requested: str) -> tuple:
    """(training backend, native available?, reason native is not)."""
    status = available_backends()["native"]
    if requested == "native" and not status.available:
        raise DemoError(f"--backend native: the native backend is unavailable here: {status.reason}")
    if requested == "auto":
        return ("native" if status.available else "reference"), status.available, status.reason
    return requested, status.available, status.reason


def _batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` int64 random windows of ``data``."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    return data[idx].long()


def _eval_windows(data: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """``[m, seq_len + 1]`` evenly spaced windows of ``data`` (m <= n; deterministic)."""
    span = data.numel() - seq_len - 1
    n = max(1, min(n, span // max(seq_len, 1) + 1))
    starts = torch.linspace(0, span, n).long()
    return data[starts[:, None] + torch.arange(seq_len + 1)].long()


def _loss(model: ByteLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def _evaluate(model: ByteLM, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-byte cross-entropy (nats) over ``windows``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size]
        total += _loss(model, w).item() * w.shape[0]
        count += w.shape[0]
    model.train(was_training)
    return total / count


def _grad_check(model: ByteLM, cfg: ByteLMConfig, batch: torch.Tensor, train_backend: str) -> Dict:
    """Parameter gradients of the native backend vs the reference backend on ``batch``.

    The training model (on ``train_backend``) and a copy with the same weights on the other
    backend each run forward + backward; returns the relative error over all gradients together
    and the worst single parameter. Leaves ``model``'s gradients zeroed.
    """
    other = "reference" if train_backend == "native" else "native"
    twin = ByteLM(ByteLMConfig(**{**cfg.to_dict(), "backend": other}))
    twin.load_state_dict(model.state_dict(), strict=True)
    grads = {}
    for name, m in ((train_backend, model), (other, twin)):
        m.zero_grad(set_to_none=True)
        loss = _loss(m, batch)
        loss.backward()
        grads[name] = {n: p.grad.detach().double().clone() for n, p in m.named_parameters()}
        grads[name + "_loss"] = loss.item()
    model.zero_grad(set_to_none=True)
    nat, ref = grads["native"], grads["reference"]
    num = math.sqrt(sum(float((nat[n] - ref[n]).pow(2).sum()) for n in ref))
    den = math.sqrt(sum(float(ref[n].pow(2).sum()) for n in ref))
    per = {n: float((nat[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref}
    worst = max(per, key=per.get)
    return {"rel_err": num / den, "worst_param": worst, "worst_rel_err": per[worst],
            "loss_native": grads["native_loss"], "loss_reference": grads["reference_loss"]}


def _prompt(text: torch.Tensor, length: int) -> torch.Tensor:
    """``[1, P]`` a held-out prompt: from the first line starting with ``def`` (else a line start)."""
    raw = bytes(text[: min(text.numel(), 1 << 20)].tolist())
    for marker in (b"\n    def ", b"\ndef ", b"\n"):
        pos = raw.find(marker)
        if pos >= 0 and pos + 1 + length <= len(raw):
            start = pos + 1
            break
    else:
        start = 0
    return text[start:start + min(length, text.numel() - start)].long()[None]


def _printable(raw: bytes) -> str:
    """Decode generated bytes for the terminal: invalid UTF-8 and control characters become \ufffd."""
    out = raw.decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in out)


def _plot(path: Path, steps: List[int], losses: List[float], val_steps: List[int], val_losses: List[float],
          baseline: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="training loss (per step)")
    if len(losses) >= 5:
        w = max(1, len(losses) // 25)
        kernel = torch.ones(w) / w
        smooth = F.conv1d(torch.tensor(losses)[None, None], kernel[None, None]).flatten().tolist()
        ax.plot(steps[w - 1:], smooth, color="tab:blue", lw=1.6, label=f"training loss ({w}-step mean)")
    ax.plot(val_steps, val_losses, "o-", color="tab:orange", lw=1.6, ms=4, label="held-out loss")
    ax.axhline(baseline, color="tab:red", ls="--", lw=1.2, label=f"unigram entropy {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    top = max(baseline * 1.25, min(max(losses[:3] + val_losses[:1]), math.log(256)) + 0.1)
    ax.set_ylim(0, top)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Run the demo; torch's thread count is restored afterwards (see :func:`_run`)."""
    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    """Run the demo with parsed ``args`` (see :func:`add_arguments`); prints as it goes.

    Returns:
        0 when the gradient check (if native is available) and the cached-decoding check pass,
        1 otherwise.

    Raises:
        CorpusError: the text is missing, empty or too short (the CLI exits with status 2).
        DemoError: ``--backend native`` without a native build, or ``--seq-len`` too long for
            the held-out text (exit status 2).
        UsageError: ``--out`` is a file or a folder that cannot be written (exit status 2).
        MissingExtra: tqdm or matplotlib is not installed (exit status 1).
    """
    t_start = time.perf_counter()
    # Everything that can fail without training fails first: missing packages, the output folder.
    require_extra("demo", "tqdm", "matplotlib")
    out = output_dir(args.out)
    for name in ("demo_loss.png", "demo_metrics.json"):
        if (out / name).is_dir():
            raise UsageError(f"--out: {out / name} is a folder; the demo writes a file of that name")
    threads_note = ""
    if args.threads:
        torch.set_num_threads(args.threads)
        threads_note = oversubscribed_threads(args.threads)
    else:
        threads_note = busy_machine_threads()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    train_backend, native_ok, native_reason = _resolve_backend(args.backend)
    default_steps = args.steps is None
    if default_steps:
        args.steps = DEFAULT_STEPS[train_backend]

    corpus: Corpus = load_corpus(args.text)
    if corpus.val.numel() < args.seq_len + 2 or corpus.train.numel() < args.seq_len + 2:
        raise DemoError(f"--seq-len: expected at most {min(corpus.val.numel(), corpus.train.numel()) - 2} "
                        f"for this text ({corpus.train.numel()} training / {corpus.val.numel()} held-out "
                        f"bytes), got {args.seq_len}")
    baseline = unigram_entropy(corpus.val)
    print("torch-kda demo: a byte-level KDA language model trained on CPU on real text")
    print(f"  corpus    {corpus.source}")
    held_out = "unseen files" if corpus.n_files > 1 else "the file's tail"
    print(f"            {corpus.train.numel():,} training bytes, {corpus.val.numel():,} held-out bytes ({held_out})")
    print(f"  baseline  unigram (byte-frequency) entropy of the held-out bytes: {baseline:.4f} nats/byte "
          f"({bits(baseline):.3f} bits/byte)")

    cfg = ByteLMConfig(dim=args.dim, n_layers=args.layers, num_heads=args.heads, head_dim=args.head_dim,
                       backend=train_backend)
    model = ByteLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"  model     {cfg.n_layers} x [KimiDeltaAttention({cfg.num_heads} heads x {cfg.head_dim}) + SwiGLU MLP], "
          f"width {cfg.dim}, {n_params / 1e6:.2f}M parameters")
    print(f"  training  {args.steps} steps{' (the default on ' + repr(train_backend) + ')' if default_steps else ''} "
          f"x {args.batch_size} x {args.seq_len} bytes, AdamW lr {args.lr:g}, seed {args.seed}, "
          f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}, backend '{train_backend}'"
          + (" (auto)" if args.backend == "auto" else ""))
    if threads_note:
        print(f"  NOTE      {threads_note}")
    if not native_ok:
        print(f"  NOTE      the native backend is unavailable: {native_reason}")
        print("            -> continuing on the reference backend (pure PyTorch); no native gradient check")

    eval_windows = _eval_windows(corpus.val, 8, args.seq_len)
    final_windows = _eval_windows(corpus.val, 48, args.seq_len)
    eval_every = args.eval_every or max(1, args.steps // 10)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.dim() < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, min(30, args.steps // 10))

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    ok = True
    metrics: Dict = {"backend": train_backend, "native_available": native_ok, "unigram_entropy": baseline,
                     "steps": args.steps, "seq_len": args.seq_len, "batch_size": args.batch_size,
                     "seed": args.seed, "params": n_params}
    steps: List[int] = []
    losses: List[float] = []
    val_steps: List[int] = [0]
    val_losses: List[float] = [_evaluate(model, eval_windows, args.batch_size)]

    first_batch = _batch(corpus.train, args.batch_size, args.seq_len, gen)
    if native_ok:
        g = _grad_check(model, cfg, first_batch, train_backend)
        metrics["grad_check"] = g
        passed = g["rel_err"] < GRAD_TOL
        ok &= passed
        print(f"gradient check (step 1, on its batch): native vs reference parameter gradients: relative error "
              f"{g['rel_err']:.2e} (worst parameter {g['worst_param']}: {g['worst_rel_err']:.2e}); "
              f"loss {g['loss_native']:.6f} vs {g['loss_reference']:.6f} -> {'PASS' if passed else 'FAIL'} "
              f"(tolerance {GRAD_TOL:g})")
    else:
        print("gradient check skipped: the native backend is unavailable (see NOTE above)")
    sys.stdout.flush()

    from tqdm.auto import tqdm

    bar = tqdm(range(1, args.steps + 1), desc="training", unit="step", disable=args.no_progress,
               dynamic_ncols=True, file=sys.stdout)
    t_train = time.perf_counter()
    tokens = 0
    ema: Optional[float] = None
    for step in bar:
        batch = first_batch if step == 1 else _batch(corpus.train, args.batch_size, args.seq_len, gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1)
        loss = _loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        if not math.isfinite(value):
            bar.close()
            print(f"ERROR: the training loss is {value} at step {step}")
            return 1
        steps.append(step)
        losses.append(value)
        tokens += batch.shape[0] * args.seq_len
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tokens / (time.perf_counter() - t_train):,.0f}", refresh=False)
        if step % eval_every == 0 and step != args.steps:
            val_steps.append(step)
            val_losses.append(_evaluate(model, eval_windows, args.batch_size))
    bar.close()
    train_time = time.perf_counter() - t_train

    final = _evaluate(model, final_windows, args.batch_size)
    val_steps.append(args.steps)
    val_losses.append(final)
    n_eval = final_windows.shape[0] * args.seq_len
    below = final < baseline
    print(f"trained {args.steps} steps ({tokens:,} tokens) in {train_time:.1f} s: "
          f"{tokens / train_time:,.0f} tokens/s on backend '{train_backend}'")
    print(f"held-out loss  {final:.4f} nats/byte ({bits(final):.3f} bits/byte) on {n_eval:,} unseen bytes")
    print(f"unigram        {baseline:.4f} nats/byte ({bits(baseline):.3f} bits/byte)  -> "
          + (f"{baseline - final:.3f} nats/byte BELOW the baseline ({100 * (1 - final / baseline):.0f}% lower)"
             if below else "NOT below the baseline (train longer: --steps)"))
    metrics.update(final_val_loss=final, train_time_s=train_time, tokens=tokens,
                   train_losses=losses, val_steps=val_steps, val_losses=val_losses)

    png = out / "demo_loss.png"
    title = (f"byte-level KDA LM ({n_params / 1e6:.2f}M params, backend {train_backend}) on "
             f"{'Python stdlib sources' if args.text is None else Path(args.text).name}")
    _plot(png, steps, losses, val_steps, val_losses, baseline, title)
    print(f"loss curve     {png.resolve()}")

    # Generation with the decoding cache, then the same bytes through one full forward.
    model.eval()
    prompt = _prompt(corpus.val, 64)
    sample_gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        seq, cached_logits = model.generate(prompt, args.gen_len, generator=sample_gen)
        full_logits = model(seq[:, :-1])
    diff = (cached_logits - full_logits).norm(dim=-1) / full_logits.norm(dim=-1).clamp_min(1e-30)
    max_rel = float(diff.max())
    cache_ok = max_rel < CACHE_TOL
    ok &= cache_ok
    prompt_text = _printable(bytes(prompt[0].tolist()))
    cont_text = _printable(bytes(seq[0, prompt.shape[1]:].tolist()))
    print(f"generation     {args.gen_len} bytes after a {prompt.shape[1]}-byte held-out prompt "
          f"(decoding cache, temperature 0.8, top-k 40):")
    print("----- prompt -----")
    print(prompt_text)
    print("----- continuation -----")
    print(cont_text)
    print("------------------------")
    print(f"cached decoding vs full forward over the same {seq.shape[1] - 1} bytes: max relative logit "
          f"difference {max_rel:.2e} -> {'PASS' if cache_ok else 'FAIL'} (tolerance {CACHE_TOL:g})")
    metrics.update(cache_max_rel_diff=max_rel, generated=cont_text, wall_time_s=time.perf_counter() - t_start)
    with open(out / "demo_metrics.json", "w") as f:
        json.dump(metrics, f, indent=1)
    print(f"metrics        {(out / 'demo_metrics.json').resolve()}")
    print(f"done in {time.perf_counter() - t_start:.1f} s: " + ("all checks passed" if ok else "A CHECK FAILED"))
    return 0 if ok else 1
