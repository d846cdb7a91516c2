"""Shared test helpers: random KDA problems and relative-error comparison against float64.

Every helper draws fresh random values from an explicit ``torch.Generator`` seed (never zeros);
tests compare by relative error, ``||a - b|| / ||b||``, against a float64 oracle.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

GATES = ("none", "softplus", "bounded", "bounded_no_alog")


def stable_seed(*parts) -> int:
    """A seed in [0, 10000) from a test's parameters, the same in every process: crc32 of their
    repr (Python's hash() of a string is salted per process, so hash-derived seeds drew new
    inputs on every run and a failure could not be reproduced)."""
    return zlib.crc32(repr(parts).encode()) % 10_000


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ``||actual - expected|| / ||expected||`` computed in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    denom = e.norm().item()
    num = (a - e).norm().item()
    return num / denom if denom > 0 else num


@dataclass
class Problem:
    """A random KDA problem: positional tensors plus keyword arguments for chunk_kda & co."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    kwargs: Dict = field(default_factory=dict)

    @property
    def args(self):
        return (self.q, self.k, self.v, self.g, self.beta)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """All differentiable tensors by argument name."""
        out = dict(q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta)
        for name in ("initial_state", "A_log", "dt_bias"):
            if self.kwargs.get(name) is not None:
                out[name] = self.kwargs[name]
        return out

    def to(self, dtype: torch.dtype, requires_grad: bool = False) -> "Problem":
        """A copy in ``dtype`` (q/k/v/g/beta; states and gate parameters stay fp32 or fp64)."""
        side = torch.float64 if dtype == torch.float64 else torch.float32

        def conv(x, d):
            return x.detach().to(d).requires_grad_(requires_grad)

        kwargs = dict(self.kwargs)
        for name in ("initial_state", "A_log", "dt_bias"):
            if kwargs.get(name) is not None:
                kwargs[name] = conv(kwargs[name], side)
        return Problem(*(conv(t, dtype) for t in self.args), kwargs=kwargs)


def make_problem(
    B: int = 2, T: int = 19, H: int = 2, HV: Optional[int] = None, K: int = 7, V: int = 5, *,
    seed: int = 0, dtype: torch.dtype = torch.float64, gate: str = "softplus", l2norm: bool = True,
    beta_sigmoid: bool = True, neg_eigval: bool = False, initial_state: bool = True,
    state_v_first: bool = False, seqlens: Optional[Sequence[int]] = None,
    output_final_state: bool = True, lower_bound: float = -5.0,
) -> Problem:
    """Random inputs in float64 for every KDA feature (then ``.to(dtype)``).

    ``gate``: ``"none"`` (g is a log-decay in [-1, 0)), ``"softplus"`` (raw input + A_log/dt_bias),
    ``"bounded"`` (lower_bound with A_log), ``"bounded_no_alog"``. ``seqlens`` packs sequences of
    those lengths into ``B = 1`` with ``cu_seqlens``.
    """
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    if seqlens is not None:
        B, T = 1, int(sum(seqlens))

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    v = rnd(B, T, HV, V)
    if not l2norm:  # keep the un-normalised recurrence stable: |q| ~ 1 and |k| <= 1, so that
        q, k = q / K ** 0.5, k / K ** 0.5  # beta * |k|^2 <= 2 (docs/math.md "Domain of the inputs")
        k = k / k.norm(dim=-1, keepdim=True).clamp(min=1.0)
    kwargs: Dict = dict(use_qk_l2norm_in_kernel=l2norm, output_final_state=output_final_state,
                        state_v_first=state_v_first)
    if gate == "none":
        g = -torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * 0.9 - 0.05
    else:
        g = rnd(B, T, HV, K)
        kwargs["use_gate_in_kernel"] = True
        kwargs["dt_bias"] = rnd(HV * K, scale=0.5)
        if gate == "softplus":
            kwargs["A_log"] = rnd(HV, scale=0.5)
        elif gate == "bounded":
            kwargs["A_log"] = rnd(HV, scale=0.5)
            kwargs["lower_bound"] = lower_bound
        elif gate == "bounded_no_alog":
            kwargs["lower_bound"] = lower_bound
        else:
            raise ValueError(f"unknown gate {gate!r}")
    if beta_sigmoid:
        beta = rnd(B, T, HV)
        kwargs["use_beta_sigmoid_in_kernel"] = True
        kwargs["allow_neg_eigval"] = neg_eigval
    else:
        beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    N = len(seqlens) if seqlens is not None else B
    if initial_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        kwargs["initial_state"] = rnd(*shape, scale=0.5)
    if seqlens is not None:
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(list(seqlens), dtype=torch.int64).cumsum(0)
        kwargs["cu_seqlens"] = cu
    return Problem(q, k, v, g, beta, kwargs).to(dtype)


OP_ARGS = ("scale", "initial_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
           "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "state_v_first",
           "cu_seqlens", "A_log", "dt_bias")


def op_args(p: Problem, scale: Optional[float] = None):
    """Positional arguments of torch.ops.kda.fused_recurrent (and kda.chunk) for a Problem."""
    kw = dict(p.kwargs)
    kw["scale"] = scale if scale is not None else p.q.shape[-1] ** -0.5
    defaults = dict(initial_state=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                    state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None)
    return (*p.args, *(kw.get(n, defaults.get(n)) for n in OP_ARGS))


def grads(fn, p: Problem, seed: int = 123) -> Dict[str, Optional[torch.Tensor]]:
    """Gradients of a random projection of ``fn(p) = (o, final_state)`` w.r.t. every tensor."""
    ts = p.tensors()
    o, s = fn(p)
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ws = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    loss = (o * wo).sum() + (s * ws).sum()
    names = list(ts)
    gs = torch.autograd.grad(loss, [ts[n] for n in names], allow_unused=True)
    return dict(zip(names, gs))


def per_thread_count(fn, counts: Sequence[int] = (1, 2, 3)) -> list:
    """``[fn() run with torch.set_num_threads(n) for n in counts]``; the thread count is restored.

    For the bitwise-determinism tests: the native ops must give the same bits for any count."""
    before = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(before)


def assert_compiled_grads_match(f, ins: Sequence[torch.Tensor]) -> None:
    """``f(*ins)`` (a scalar loss) and its gradients w.r.t. ``ins`` under
    ``torch.compile(fullgraph=True, backend="aot_eager")`` equal the eager ones (rtol 1e-6 for the
    loss, 1e-5 / atol 1e-6 for the gradients): the ops' Meta kernels and autograd formulas trace."""
    eager = f(*ins)
    eager_grads = torch.autograd.grad(eager, ins)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(*ins)
    compiled_grads = torch.autograd.grad(loss, ins)
    assert torch.allclose(loss, eager, rtol=1e-6)
    for a, b in zip(compiled_grads, eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
