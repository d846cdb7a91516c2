"""``python -m torch_kda hf``: a Hugging Face Kimi-Linear model, transformers' own KDA vs torch-kda.

Builds a small random ``KimiLinearForCausalLM`` from a config (no network; ``--model DIR`` loads
one saved with ``save_pretrained`` instead, ``--save DIR`` writes the built one), then runs the
same prompt through the same weights twice, interleaved: with transformers' own pure-PyTorch KDA
functions (what transformers runs on a CPU without FLA) and with torch-kda
(:func:`torch_kda.integrations.transformers.use_torch_kda`). It prints the greedy tokens' agreement,
the largest relative difference of the prefill logits (per position, ``||a - b|| / ||a||``), prefill
tokens/s and decode ms/token of both, and the speed-ups. Exit status 1 when the greedy tokens
differ or the logits differ by more than 1e-4 (fp32).

``--bench``: the benchmark of docs/benchmarks.md instead (hidden 1024, 4 layers with 4 KDA heads of
128, fp32 by default): prefill T=2048, decode, one training step (forward + backward), each end to
end and with the time of the KDA calls inside the model measured separately, and the Amdahl limit
(the model's time without its KDA calls). Medians of ``--reps`` interleaved repetitions; the
shared 2-core box is noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch

from .common import (MissingExtra, UsageError, busy_machine_threads, int_at_least, output_dir,
                     oversubscribed_threads, positive_int)

__all__ = ["add_arguments", "run", "build_model"]

IMPLS = ("transformers", "torch_kda")
LABELS = {"transformers": "transformers", "torch_kda": "torch-kda"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``hf`` options to ``p``."""
    p.add_argument("--model", metavar="DIR", default=None,
                   help="load a KimiLinearForCausalLM saved with save_pretrained from DIR (no network)")
    p.add_argument("--save", metavar="DIR", default=None, help="save the built model to DIR (reload with --model DIR)")
    p.add_argument("--prompt-len", type=positive_int, default=None,
                   help="prompt tokens T of the prefill (default 512; --bench 2048)")
    p.add_argument("--new-tokens", type=positive_int, default=32, help="greedy tokens to generate (default 32)")
    p.add_argument("--hidden-size", type=positive_int, default=None, help="model width (default 512; --bench 1024)")
    p.add_argument("--layers", type=int_at_least(2, "one KDA layer besides the full-attention one"), default=4,
                   help="decoder layers, at least 2; every 4th (the last if fewer than 4) is full attention (MLA), "
                        "the rest KDA (default 4)")
    p.add_argument("--kda-heads", type=positive_int, default=4, help="KDA heads (default 4)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="KDA head size K = V (default 128)")
    p.add_argument("--vocab-size", type=int_at_least(4, "ids 0-2 are the special tokens"), default=4096,
                   help="vocabulary, at least 4 (default 4096)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="model dtype (default fp32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt (default 0)")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="interleaved repetitions, medians reported (default 2; --bench 3)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--bench", action="store_true",
                   help="the benchmark: hidden 1024, 4 layers, T=2048 prefill, decode, a training step, "
                        "KDA time inside the model and the Amdahl limit")


def build_model(hidden_size: int = 512, layers: int = 4, kda_heads: int = 4, head_dim: int = 128,
                vocab_size: int = 4096, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``KimiLinearForCausalLM``: every 4th layer (the last one if fewer than 4) full
    attention (MLA), the rest KDA,
    dense MLPs (``4 * hidden`` wide), ``kda_heads`` heads of ``head_dim``; built from a config."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    heads = max(1, hidden_size // 128)
    cfg = KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        kv_lora_rank=max(16, hidden_size // 4), qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        linear_num_heads=kda_heads, linear_head_dim=head_dim,
        # Kimi Linear's 3:1 mix; at least one attention layer, since transformers 5.24's cache cannot
        # count the tokens seen with KDA layers only.
        layer_types=["full_attention" if i % 4 == 3 or (layers < 4 and i == layers - 1) else "linear_attention"
                     for i in range(layers)],
        mlp_layer_types=["dense"] * layers,
        # A larger init than the released model's 0.02 so that a random model's greedy tokens vary.
        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return KimiLinearForCausalLM(cfg).to(dtype).eval()


def _describe(model) -> str:
    c = model.config
    kda = sum(t == "linear_attention" for t in c.layer_types)
    n = sum(p.numel() for p in model.parameters())
    return (f"KimiLinearForCausalLM: hidden {c.hidden_size}, {c.num_hidden_layers} layers ({kda} KDA with "
            f"{c.linear_num_heads} heads of {c.linear_head_dim}, {c.num_hidden_layers - kda} MLA), vocab "
            f"{c.vocab_size}, {n / 1e6:.1f}M parameters, {next(model.parameters()).dtype}")


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------

def _prefill(model, ids: torch.Tensor):
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, position_ids=torch.arange(ids.shape[1]).unsqueeze(0))
        return out.logits, out.cache, time.perf_counter() - t0


def _decode(model, cache, logits: torch.Tensor, n: int) -> Tuple[List[int], List[float]]:
    tokens, steps = [], []
    token = logits[:, -1:].argmax(-1)
    with torch.no_grad():
        for i in range(n):
            tokens.append(int(token))
            # Explicit positions: a cache of KDA layers only cannot count the tokens seen (transformers 5.24).
            position = torch.tensor([[logits.shape[1] + i]])
            t0 = time.perf_counter()
            out = model(token, cache=cache, use_cache=True, position_ids=position)
            steps.append(time.perf_counter() - t0)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    return tokens, steps


def _max_rel_logit_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)).max())


def _route(model, impl: str):
    from ..integrations.transformers import use_torch_kda

    return use_torch_kda(model, impl)


def _load_or_build(args: argparse.Namespace, hidden: int):
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    # --save's folder made and checked before the model is built (an existing file or an
    # unwritable place is a usage error, not a "saved" that did not happen)
    save_dir = output_dir(args.save, "--save") if args.save else None
    if args.model:
        from transformers import KimiLinearForCausalLM

        if not os.path.isdir(args.model):
            raise UsageError(f"--model: expected a directory written by save_pretrained, got {args.model!r}")
        try:
            model = KimiLinearForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        except (OSError, ValueError) as exc:
            raise UsageError(f"--model {args.model}: cannot load a KimiLinearForCausalLM: {exc}") from exc
        if "linear_attention" not in (getattr(model.config, "layer_types", None) or ()):
            raise UsageError(f"--model {args.model}: the model has no KDA (linear_attention) layer to compare")
    else:
        model = build_model(hidden, args.layers, args.kda_heads, args.head_dim, args.vocab_size, args.seed, dtype)
    if args.save:
        model.save_pretrained(save_dir)
        print(f"saved the model to {args.save} (reload with --model {args.save})")
    return model


def _header(model, threads: int) -> None:
    import transformers

    from .. import __version__

    print(_describe(model))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, torch-kda {__version__}, "
          f"{threads} thread(s), load average {os.getloadavg()[0]:.1f} (a shared box: timings are noisy)")


def run(args: argparse.Namespace) -> int:
    """Compare transformers' own KDA path with torch-kda on one model; 0 if they agree, else 1.

    Raises:
        MissingExtra: transformers is not installed (exit status 1).
        UsageError: a bad ``--model`` (not loadable, or without a KDA layer) or ``--save`` (an
            existing file, or a folder that cannot be written) (exit status 2).
    """
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise MissingExtra("error: `hf` needs transformers, which is not installed; "
                           "pip install transformers==5.24.0 (the version tested)") from None
    previous_threads = torch.get_num_threads()
    note = ""
    if args.threads:
        torch.set_num_threads(args.threads)
        note = oversubscribed_threads(args.threads)
    else:
        note = busy_machine_threads()
    if note:
        print(note)
    try:
        return _bench(args) if args.bench else _compare(args)
    finally:
        torch.set_num_threads(previous_threads)


def _compare(args: argparse.Namespace) -> int:
    from ..integrations.transformers import kda_clock

    model = _load_or_build(args, args.hidden_size or 512)
    T, reps = args.prompt_len or 512, args.reps or 2
    _header(model, torch.get_num_threads())
    ids = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(args.seed + 1))

    prefill_s: Dict[str, List[float]] = {i: [] for i in IMPLS}
    decode_s: Dict[str, List[float]] = {i: [] for i in IMPLS}
    kda_s: Dict[str, List[float]] = {i: [] for i in IMPLS}
    logits, tokens = {}, {}
    for _ in range(reps):  # interleaved, so that load changes hit both alike
        for impl in IMPLS:
            _route(model, impl)
            with kda_clock() as clock:
                lg, cache, sec = _prefill(model, ids)
            prefill_s[impl].append(sec)
            kda_s[impl].append(clock[0])
            toks, steps = _decode(model, cache, lg, args.new_tokens)
            decode_s[impl].extend(steps[1:] if len(steps) > 1 else steps)  # the first step warms caches
            logits[impl], tokens[impl] = lg, toks
    same = sum(a == b for a, b in zip(tokens["transformers"], tokens["torch_kda"]))
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens["transformers"], tokens["torch_kda"])) if a != b), None)
    diff = _max_rel_logit_diff(logits["transformers"], logits["torch_kda"])
    pf = {i: T / statistics.median(prefill_s[i]) for i in IMPLS}
    dm = {i: 1e3 * statistics.median(decode_s[i]) for i in IMPLS}

    print(f"prompt {T} tokens, {args.new_tokens} greedy tokens, medians of {reps} interleaved runs")
    print(f"{'':14}{'transformers':>14}{'torch-kda':>14}{'speed-up':>10}")
    print(f"{'prefill tok/s':14}{pf['transformers']:>14.0f}{pf['torch_kda']:>14.0f}{pf['torch_kda'] / pf['transformers']:>9.1f}x")
    print(f"{'decode ms/tok':14}{dm['transformers']:>14.2f}{dm['torch_kda']:>14.2f}{dm['transformers'] / dm['torch_kda']:>9.1f}x")
    ka, kb = (statistics.median(kda_s[i]) for i in IMPLS)
    rest = statistics.median(prefill_s["transformers"]) - ka
    print(f"KDA calls inside the prefill: transformers {ka:.3f} s, torch-kda {kb:.3f} s ({ka / max(kb, 1e-12):.0f}x); "
          f"the rest of the model {rest:.3f} s, so no KDA kernel could make this prefill more than "
          f"{statistics.median(prefill_s['transformers']) / max(rest, 1e-12):.1f}x faster (Amdahl)")
    print(f"greedy tokens identical: {same}/{args.new_tokens}"
          + ("" if first_diff is None else f" (first difference at token {first_diff})"))
    print(f"max relative logit difference (prefill, per position): {diff:.2e}")
    print("torch-kda tokens: " + " ".join(map(str, tokens["torch_kda"][:16])) + (" ..." if args.new_tokens > 16 else ""))
    tol = 1e-4 if args.dtype == "fp32" else 5e-2
    ok = same == args.new_tokens and diff <= tol
    if not ok:
        print(f"FAILED: the two paths disagree (tokens {same}/{args.new_tokens}, logits {diff:.2e} > {tol:g}?)",
              file=sys.stderr)
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------
# --bench: end to end, KDA inside the model, Amdahl limit
# --------------------------------------------------------------------------------------------

def _bench(args: argparse.Namespace) -> int:
    from ..integrations.transformers import kda_clock

    model = _load_or_build(args, args.hidden_size or 1024)
    T, reps, n_new = args.prompt_len or 2048, args.reps or 3, min(args.new_tokens, 16)
    _header(model, torch.get_num_threads())
    ids = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(args.seed + 1))
    rows = ("prefill", "decode", "train")
    total: Dict[Tuple[str, str], List[float]] = {(r, i): [] for r in rows for i in IMPLS}
    kda: Dict[Tuple[str, str], List[float]] = {(r, i): [] for r in rows for i in IMPLS}
    for rep in range(reps):
        for impl in IMPLS:
            _route(model, impl)
            with kda_clock() as clock:
                lg, cache, sec = _prefill(model, ids)
            total["prefill", impl].append(sec)
            kda["prefill", impl].append(clock[0])
            with kda_clock() as clock:
                _, steps = _decode(model, cache, lg, n_new + 1)
            total["decode", impl].append(statistics.median(steps[1:]))
            kda["decode", impl].append(clock[0] / len(steps))  # mean per step (the clock sums them)
            model.train()
            model.zero_grad(set_to_none=True)
            with kda_clock() as clock:
                t0 = time.perf_counter()
                model(ids, labels=ids).loss.backward()
                sec = time.perf_counter() - t0
            model.eval()
            total["train", impl].append(sec)
            kda["train", impl].append(clock[0] + clock[1])
            print(f"  rep {rep + 1}/{reps} {LABELS[impl]}: prefill {total['prefill', impl][-1]:.2f} s, "
                  f"decode {1e3 * total['decode', impl][-1]:.1f} ms/token, train step {sec:.2f} s", flush=True)
    med = {key: statistics.median(v) for key, v in total.items()}
    kmed = {key: statistics.median(v) for key, v in kda.items()}
    print()
    print(f"T={T} prefill, {n_new} decode steps after it, one training step (forward + backward, T={T}); "
          f"medians of {reps} interleaved runs")
    print("| | transformers | torch-kda | speed-up | KDA calls: transformers | KDA calls: torch-kda | KDA speed-up "
          "| rest of the model: transformers run / torch-kda run | Amdahl limit | torch-kda / its limit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = med[r, "transformers"], med[r, "torch_kda"]
        ka, kb = kmed[r, "transformers"], kmed[r, "torch_kda"]
        # The model without its KDA calls: Amdahl's limit for any KDA kernel. Measured in both runs
        # (the box's load moves it); the last column compares torch-kda with its own run's rest.
        rest_a, rest_b = max(a - ka, 1e-12), max(b - kb, 1e-12)
        unit, scale = ("ms/token", 1e3) if r == "decode" else ("s", 1.0)
        extra = f" ({T / a:.0f} / {T / b:.0f} tok/s)" if r == "prefill" else ""
        print(f"| {r} ({unit}){extra} | {scale * a:.3f} | {scale * b:.3f} | {a / b:.1f}x | {scale * ka:.3f} | "
              f"{scale * kb:.4f} | {ka / max(kb, 1e-12):.0f}x | {scale * rest_a:.3f} / {scale * rest_b:.3f} | "
              f"{a / rest_a:.1f}x | {b / rest_b:.3f} |")
    print("Amdahl limit: transformers' time over its model-without-KDA time (the speed-up if the KDA calls took "
          "no time); torch-kda / its limit: torch-kda's time over the same model-without-KDA time of its own run "
          "(1.000 = at the limit). KDA backward time runs from autograd reaching the call's output to all its "
          "input gradients (an upper bound). Decode: the KDA columns are per step.")
    return 0
