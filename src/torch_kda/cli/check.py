"""``python -m torch_kda check``: validate the installed backends on small random problems.

Every available CPU backend (``native``; ``reference`` in its chunkwise and recurrent forms) runs
small random KDA problems in float32, forward and backward, and is compared with a float64 run of
the reference recurrence (the definition, docs/math.md "Forward recurrence"): the output, the final
state and the gradients of every input, each by relative error ``||x - x64|| / ||x64||``. The
native backend is also compared with the float32 reference directly. The cases cover grouped value
heads (GVA), packed variable-length sequences (``cu_seqlens``, with an empty one), both in-op gate
forms (softplus and bounded), a precomputed log-decay, both state layouts and ``allow_neg_eigval``.

Prints a pass/fail table; the exit status is 1 when any comparison fails.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import reference
from ..api import available_backends, chunk_kda, fused_recurrent_kda
from .common import positive_float

__all__ = ["add_arguments", "run", "CASES", "make_inputs", "check_backends"]

#: Relative-error tolerance against float64 for float32 runs (outputs, states and gradients).
TOL_FP32 = 1e-4


@dataclass
class Case:
    """One feature combination of a random problem."""

    name: str
    B: int = 2
    T: int = 23
    H: int = 2
    HV: Optional[int] = None
    K: int = 16
    V: int = 8
    gate: str = "softplus"       # "softplus" | "bounded" | "none" (precomputed log-decay)
    l2norm: bool = True
    beta_sigmoid: bool = True
    neg_eigval: bool = False
    state_v_first: bool = False
    seqlens: Optional[Sequence[int]] = None
    extra: Dict = field(default_factory=dict)


CASES: List[Case] = [
    Case("softplus gate, l2norm"),
    Case("GVA (HV = 2 H)", HV=4),
    Case("varlen (cu_seqlens, one empty)", seqlens=(9, 0, 17, 5)),
    Case("bounded gate (lower_bound=-5)", gate="bounded"),
    Case("precomputed log-decay, no l2norm", gate="none", l2norm=False, beta_sigmoid=False),
    Case("state_v_first layout", state_v_first=True),
    Case("allow_neg_eigval, GVA, varlen", HV=4, neg_eigval=True, seqlens=(13, 30), state_v_first=True),
    Case("T=1 (decoding step)", T=1, B=3),
]


def make_inputs(case: Case, seed: int) -> Tuple[Dict[str, torch.Tensor], Dict]:
    """Random float64 inputs for ``case``.

    Returns:
        ``(tensors, options)``: ``tensors`` holds the differentiable inputs by argument name
        (``q, k, v, g, beta, initial_state`` and, with an in-op gate, ``A_log, dt_bias``);
        ``options`` the remaining keyword arguments of :func:`torch_kda.chunk_kda`.
    """
    gen = torch.Generator().manual_seed(seed)
    HV = case.HV or case.H
    B, T = case.B, case.T
    if case.seqlens is not None:
        B, T = 1, int(sum(case.seqlens))

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    t: Dict[str, torch.Tensor] = {"q": rnd(B, T, case.H, case.K), "k": rnd(B, T, case.H, case.K),
                                  "v": rnd(B, T, HV, case.V)}
    if not case.l2norm:  # keep |k| ~ 1 so the un-normalised recurrence stays stable
        t["q"], t["k"] = t["q"] / case.K ** 0.5, t["k"] / case.K ** 0.5
    opts: Dict = {"use_qk_l2norm_in_kernel": case.l2norm, "output_final_state": True,
                  "state_v_first": case.state_v_first}
    if case.gate == "none":
        t["g"] = -torch.rand(B, T, HV, case.K, generator=gen, dtype=torch.float64) * 0.9 - 0.05
    else:
        t["g"] = rnd(B, T, HV, case.K)
        t["A_log"] = rnd(HV, scale=0.5)
        t["dt_bias"] = rnd(HV * case.K, scale=0.5)
        opts["use_gate_in_kernel"] = True
        if case.gate == "bounded":
            opts["lower_bound"] = -5.0
    if case.beta_sigmoid:
        t["beta"] = rnd(B, T, HV)
        opts["use_beta_sigmoid_in_kernel"] = True
        opts["allow_neg_eigval"] = case.neg_eigval
    else:
        t["beta"] = torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    N = len(case.seqlens) if case.seqlens is not None else B
    t["initial_state"] = rnd(*((N, HV, case.V, case.K) if case.state_v_first else (N, HV, case.K, case.V)),
                             scale=0.5)
    if case.seqlens is not None:
        cu = torch.zeros(len(case.seqlens) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(list(case.seqlens), dtype=torch.int64).cumsum(0)
        opts["cu_seqlens"] = cu
    return t, opts


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def _run_once(fn: Callable, tensors: Dict[str, torch.Tensor], opts: Dict, dtype: torch.dtype,
              cot: Tuple[torch.Tensor, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Forward + backward of ``fn`` in ``dtype``; returns ``o``, ``state`` and ``d<name>`` grads."""
    side = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {}
    for name, x in tensors.items():
        d = dtype if name in ("q", "k", "v", "g", "beta") else side
        leaves[name] = x.detach().to(d).requires_grad_(True)
    pos = [leaves[n] for n in ("q", "k", "v", "g", "beta")]
    kw = {n: leaves[n] for n in ("initial_state", "A_log", "dt_bias") if n in leaves}
    o, state = fn(*pos, **kw, **opts)
    loss = (o.double() * cot[0]).sum() + (state.double() * cot[1]).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    out = {"o": o.detach(), "state": state.detach()}
    for name, g in zip(leaves, grads):
        out["d" + name] = g if g is not None else torch.zeros_like(leaves[name])
    return out


def _backends() -> Dict[str, Callable]:
    runs: Dict[str, Callable] = {
        "reference (chunk)": lambda *a, **k: chunk_kda(*a, **k, backend="reference", chunk_size=8),
        "reference (recurrent)": lambda *a, **k: fused_recurrent_kda(*a, **k, backend="reference"),
    }
    if available_backends()["native"].available:
        runs["native (chunk_kda)"] = lambda *a, **k: chunk_kda(*a, **k, backend="native")
        runs["native (fused_recurrent)"] = lambda *a, **k: fused_recurrent_kda(*a, **k, backend="native")
    return runs


def check_backends(seed: int = 0, tol: float = TOL_FP32, cases: Optional[List[Case]] = None) -> List[Dict]:
    """Run every available backend on every case; one result row per (case, backend).

    Returns:
        rows with keys ``case``, ``backend``, ``fwd`` (max relative error of ``o`` and the final
        state vs float64), ``grad`` (max over the input gradients vs float64), ``worst`` (name of
        the worst tensor), ``vs_ref`` (native only: max relative difference from the float32
        reference, else None), ``passed`` (bool) and ``error`` (exception text or None).
    """
    rows = []
    runs = _backends()
    for i, case in enumerate(cases if cases is not None else CASES):
        tensors, opts = make_inputs(case, seed + i)
        with torch.no_grad():
            probe = reference.fused_recurrent_kda(*(tensors[n] for n in ("q", "k", "v", "g", "beta")),
                                                  **{n: tensors[n] for n in ("initial_state", "A_log", "dt_bias")
                                                     if n in tensors}, **opts)
        gen = torch.Generator().manual_seed(seed + 1000 + i)
        cot = (torch.randn(probe[0].shape, generator=gen, dtype=torch.float64),
               torch.randn(probe[1].shape, generator=gen, dtype=torch.float64))
        oracle = _run_once(reference.fused_recurrent_kda, tensors, opts, torch.float64, cot)
        ref32 = None
        for name, fn in runs.items():
            row: Dict = {"case": case.name, "backend": name, "fwd": float("nan"), "grad": float("nan"),
                         "worst": "", "vs_ref": None, "passed": False, "error": None}
            try:
                res = _run_once(fn, tensors, opts, torch.float32, cot)
                errs = {n: _rel(res[n], oracle[n]) for n in oracle}
                row["fwd"] = max(errs["o"], errs["state"])
                grad_errs = {n: e for n, e in errs.items() if n.startswith("d")}
                row["grad"] = max(grad_errs.values())
                row["worst"] = max(errs, key=errs.get)
                if name.startswith("reference (chunk"):
                    ref32 = res
                if name.startswith("native") and ref32 is not None:
                    row["vs_ref"] = max(_rel(res[n], ref32[n]) for n in ref32)
                finite = all(torch.isfinite(v).all() for v in res.values())
                row["passed"] = bool(finite and row["fwd"] < tol and row["grad"] < tol)
            except Exception as exc:  # a crash is a failure of that row, not of the command
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``check`` options to ``p``."""
    p.add_argument("--seed", type=int, default=0, help="random seed of the problems (default: %(default)s)")
    p.add_argument("--tol", type=positive_float, default=TOL_FP32,
                   help="relative-error tolerance vs float64 for float32 runs (default: %(default)g)")


def run(args: argparse.Namespace) -> int:
    """Print the backends' status and the pass/fail table; 0 if every row passed, else 1."""
    t0 = time.perf_counter()
    status = available_backends()
    print(f"torch-kda check: backends vs a float64 run of the reference recurrence "
          f"(fp32 inputs, relative error, tolerance {args.tol:g})")
    for name, s in status.items():
        print(f"  {name:<10} {'available' if s.available else 'unavailable: ' + s.reason}")
    rows = check_backends(seed=args.seed, tol=args.tol)
    w_case = max(len(r["case"]) for r in rows)
    w_be = max(len(r["backend"]) for r in rows)
    header = f"{'case':<{w_case}}  {'backend':<{w_be}}  {'fwd err':>8}  {'grad err':>8}  {'vs ref32':>8}  result"
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        vs = f"{r['vs_ref']:.1e}" if r["vs_ref"] is not None else "-"
        result = "PASS" if r["passed"] else ("ERROR " + r["error"] if r["error"] else f"FAIL (worst: {r['worst']})")
        print(f"{r['case']:<{w_case}}  {r['backend']:<{w_be}}  {r['fwd']:>8.1e}  {r['grad']:>8.1e}  {vs:>8}  {result}")
    n_fail = sum(not r["passed"] for r in rows)
    print()
    if not status["native"].available:
        print("note: the native backend is not installed here, so only the reference was checked")
    print(f"{len(rows) - n_fail}/{len(rows)} passed in {time.perf_counter() - t0:.1f} s"
          + ("" if n_fail == 0 else f"; {n_fail} FAILED"))
    return 0 if n_fail == 0 else 1
