"""Numerics over long sequences and at the edges of the gates, in every backend.

- T = 65536 in float32 with bounded (lower-bound) gates stays within 1e-5 relative of float64;
- the strongest decays each gate form allows (bounded gate saturated at ``lower_bound``, with and
  without ``safe_gate``; softplus gate with a large ``A_log`` and large inputs) give finite and
  correct outputs, states and gradients in the native op, the reference recurrence and the
  reference chunkwise form;
- decays near 1 (g ~ -1e-4, nothing forgotten) over 16K steps stay accurate in float32;
- NaN or Inf in one sequence of a packed batch leaves the other sequences' outputs, states and
  gradients bitwise unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

import torch_kda
from kda_testing import make_problem, rel_err
from oracle import oracle_kda
from torch_kda import reference

needs_native = pytest.mark.native  # documents the requirement; conftest.py fails fast without it


def _run_native(p, dtype=None):
    x = p.to(dtype) if dtype is not None else p
    return torch_kda.chunk_kda(*x.args, **x.kwargs, backend="native")


BACKENDS = {
    "native": lambda p: torch_kda.chunk_kda(*p.args, **p.kwargs, backend="native"),
    "reference_recurrent": lambda p: torch_kda.fused_recurrent_kda(*p.args, **p.kwargs,
                                                                   backend="reference"),
    # chunk_size 16: several chunk boundaries inside these short problems (and a cheaper run)
    "reference_chunk": lambda p: torch_kda.chunk_kda(*p.args, **p.kwargs, backend="reference",
                                                     chunk_size=16),
}


# ---- long sequences ----------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("lower_bound,safe_gate", [(-5.0, True), (-1.0, True), (-0.25, False)])
def test_65536_tokens_float32_bounded_gate_within_1e5_of_float64(lower_bound, safe_gate):
    T = 65536
    p = make_problem(B=1, T=T, H=1, HV=2, K=16, V=16, gate="bounded", lower_bound=lower_bound,
                     seed=65536 + int(-4 * lower_bound))
    p.kwargs["safe_gate"] = safe_gate
    o64, s64 = _run_native(p)  # the float64 run of the same kernel (checked against the reference below)
    o32, s32 = _run_native(p, torch.float32)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert rel_err(o32, o64) <= 1e-5 and rel_err(s32, s64) <= 1e-5
    # the error does not grow with T: the last 1K tokens are as accurate as the whole
    assert rel_err(o32[:, -1024:], o64[:, -1024:]) <= 1e-5
    # and the float64 run is the float64 reference recurrence on a prefix that crosses many of
    # the native op's 64-token checkpoints (the reference is a Python loop: 1K tokens)
    head = p.to(torch.float64)
    head.q, head.k, head.v, head.g, head.beta = (t[:, :1024] for t in head.args)
    o_ref, s_ref = reference.fused_recurrent_kda(*head.args, **{k: v for k, v in head.kwargs.items()
                                                               if k != "safe_gate"})
    oh, sh = _run_native(head)
    assert rel_err(oh, o_ref) <= 1e-10 and rel_err(sh, s_ref) <= 1e-10
    assert torch.equal(oh, o64[:, :1024])  # a prefix of the long run (causal, same arithmetic)


@needs_native
@pytest.mark.parametrize("gate", ["none", "softplus"])
def test_decay_near_one_over_16k_steps(gate):
    """g ~ -1e-4: the state remembers ~10^4 tokens; float32 must not drift from float64."""
    T = 16384
    p = make_problem(B=1, T=T, H=1, HV=2, K=16, V=16, gate=gate, seed=16384)
    gen = torch.Generator().manual_seed(16385)
    if gate == "none":
        p.g = -1e-4 * (1.0 + 0.5 * torch.rand(p.g.shape, generator=gen, dtype=torch.float64))
    else:  # -exp(A_log) * softplus(z) with softplus(z) ~ 1e-4: z ~ -9.2, A_log = 0
        p.g = -9.2 + 0.2 * torch.randn(p.g.shape, generator=gen, dtype=torch.float64)
        p.kwargs["A_log"] = torch.zeros_like(p.kwargs["A_log"])
        p.kwargs["dt_bias"] = torch.zeros_like(p.kwargs["dt_bias"])
    g_eff = p.g if gate == "none" else torch_kda.kda_gate(p.g, p.kwargs["A_log"],
                                                          p.kwargs["dt_bias"])
    assert -1e-3 < g_eff.min() and g_eff.max() < -1e-5  # the regime under test
    o64, s64 = _run_native(p)
    o32, s32 = _run_native(p, torch.float32)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert rel_err(o32, o64) <= 1e-5 and rel_err(s32, s64) <= 1e-5
    assert rel_err(o32[:, -1024:], o64[:, -1024:]) <= 1e-5  # no drift at the end
    # the float64 run is the float64 reference recurrence (a Python loop: checked on 2K tokens)
    head = p.to(torch.float64)
    head.q, head.k, head.v, head.g, head.beta = (t[:, :2048] for t in head.args)
    o_ref, s_ref = reference.fused_recurrent_kda(*head.args, **head.kwargs)
    oh, sh = _run_native(head)
    assert rel_err(oh, o_ref) <= 1e-10 and rel_err(sh, s_ref) <= 1e-10
    assert torch.equal(oh, o64[:, :2048])


# ---- the strongest decays each gate form allows ------------------------------------------------

def _strongest(form: str, seed: int):
    """A problem whose gate sits at its strongest decay, and the expected per-step log-decay."""
    p = make_problem(B=2, T=100, H=1, HV=2, K=6, V=5, gate="softplus" if form == "softplus" else
                     "bounded", seed=seed, neg_eigval=True)
    gen = torch.Generator().manual_seed(seed + 1)
    p.g = 40.0 + 10.0 * torch.rand(p.g.shape, generator=gen, dtype=torch.float64)  # large inputs
    if form == "softplus":  # -exp(10) * softplus(~50) ~ -1e6 per step
        p.kwargs["A_log"] = torch.full_like(p.kwargs["A_log"], 10.0)
    elif form == "bounded_safe":  # saturated at the safe_gate limit
        p.kwargs.update(lower_bound=-5.0, safe_gate=True)
        p.kwargs["A_log"] = torch.full_like(p.kwargs["A_log"], 8.0)
    elif form == "bounded_huge":  # no safe_gate: any finite lower bound
        p.kwargs.update(lower_bound=-1e4)
        p.kwargs["A_log"] = torch.full_like(p.kwargs["A_log"], 30.0)  # exp(30) * z: 0 * inf trap
    else:
        raise ValueError(form)
    return p


FORMS = ["softplus", "bounded_safe", "bounded_huge"]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("form", FORMS)
def test_strongest_decay_finite_and_correct(form, backend):
    p = _strongest(form, seed=FORMS.index(form) * 10 + 1)
    g_eff = torch_kda.kda_gate(p.g, p.kwargs["A_log"], p.kwargs["dt_bias"],
                               p.kwargs.get("lower_bound"))
    if form == "softplus":
        assert g_eff.max() < -1e5
    else:  # saturated: every step decays by exactly lower_bound
        assert torch.equal(g_eff, torch.full_like(g_eff, p.kwargs["lower_bound"]))
    kw = {k: v for k, v in p.kwargs.items() if k != "safe_gate"}
    o_ref, s_ref = oracle_kda(*p.args, **kw)
    fn = BACKENDS[backend]
    if backend == "reference_recurrent":
        p.kwargs.pop("safe_gate", None)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        x = p.to(dtype, requires_grad=True)
        o, s = fn(x)
        assert torch.isfinite(o).all() and torch.isfinite(s).all(), dtype
        assert rel_err(o, o_ref) <= tol and rel_err(s, s_ref) <= tol, dtype
        gen = torch.Generator().manual_seed(7)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum() \
            + (s * torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)).sum()
        grads = torch.autograd.grad(loss, list(x.tensors().values()))
        for name, gr in zip(x.tensors(), grads):
            assert torch.isfinite(gr).all(), f"d{name} not finite ({dtype})"
    # gradients in float64 agree with the reference recurrence's autograd
    if backend != "reference_recurrent":
        def grads_of(f):
            x = p.to(torch.float64, requires_grad=True)
            o, s = f(x)
            loss = (o.square()).sum() + s.sum()
            return torch.autograd.grad(loss, list(x.tensors().values()))

        ref = grads_of(lambda x: reference.fused_recurrent_kda(
            *x.args, **{k: v for k, v in x.kwargs.items() if k != "safe_gate"}))
        for name, a, b in zip(p.tensors(), grads_of(fn), ref):
            assert rel_err(a, b) <= 1e-8 or (a - b).abs().max() <= 1e-12, name


def test_strongest_softplus_decay_forgets_everything():
    """exp(-1e6) == 0: each step's state is exactly its own write, so o_t = scale (q.k) beta v_t."""
    p = _strongest("softplus", seed=99)
    o, s = torch_kda.chunk_kda(*p.args, **p.kwargs, backend="reference")
    q = reference.l2norm(p.q) * p.q.shape[-1] ** -0.5
    k = reference.l2norm(p.k)
    beta = 2 * torch.sigmoid(p.beta)  # neg_eigval
    expected = (q * k).sum(-1).repeat_interleave(2, dim=2)[..., None] * beta[..., None] * p.v
    assert rel_err(o, expected) <= 1e-12
    for name, fn in BACKENDS.items():
        o32, _ = fn(p.to(torch.float32))
        assert rel_err(o32, expected) <= 1e-6, name


# ---- NaN / Inf stay in their sequence ----------------------------------------------------------

SEQLENS = (6, 70, 1, 0, 9)  # the poisoned one (index 1) crosses a 64-token checkpoint boundary
POISONED = 1


def _poison(p, where: str, value: float):
    """A copy of p with ``value`` in one element of ``where``, inside sequence POISONED."""
    q = p.to(p.q.dtype)
    start = SEQLENS[0]
    t = start + 40
    if where == "initial_state":
        h = q.kwargs["initial_state"].clone()
        h[POISONED, 0, 0, 0] = value
        q.kwargs["initial_state"] = h
    else:
        x = getattr(q, where).clone()
        x[0, t, 0] = value
        setattr(q, where, x)
    return q


def _others(x: torch.Tensor) -> torch.Tensor:
    """The tokens of every sequence but the poisoned one ([B=1, T, ...] -> [1, T', ...])."""
    a, b = SEQLENS[0], SEQLENS[0] + SEQLENS[1]
    return torch.cat([x[:, :a], x[:, b:]], dim=1)


POISONS = [("q", math.nan), ("k", math.nan), ("v", math.inf), ("g", math.nan), ("beta", math.nan),
           ("initial_state", math.nan)]
# every poison in the native op and the reference recurrence; the slow reference chunkwise form
# gets the two that travel furthest (through the decay and through the state)
NAN_CASES = [(b, w, v) for b in ("native", "reference_recurrent") for w, v in POISONS] + \
    [("reference_chunk", "g", math.nan), ("reference_chunk", "initial_state", math.nan)]


@pytest.mark.parametrize("backend,where,value", NAN_CASES)
def test_nan_in_one_packed_sequence_leaves_others_unchanged(backend, where, value):
    fn = BACKENDS[backend]
    p = make_problem(seqlens=SEQLENS, H=1, HV=2, K=5, V=4, gate="bounded", seed=31,
                     dtype=torch.float32)
    bad = _poison(p, where, value)
    others = [n for n in range(len(SEQLENS)) if n != POISONED]

    def run(x):
        x = x.to(torch.float32, requires_grad=True)
        o, s = fn(x)
        gen = torch.Generator().manual_seed(5)
        wo = torch.randn(o.shape, generator=gen)
        ws = torch.randn(s.shape, generator=gen)
        # the loss reads only the healthy sequences' outputs and states
        loss = (_others(o * wo)).sum() + (s[others] * ws[others]).sum()
        names = ["q", "k", "v", "g", "beta", "initial_state"]
        ts = x.tensors()
        grads = torch.autograd.grad(loss, [ts[n] for n in names])
        return o, s, dict(zip(names, grads))

    o_clean, s_clean, g_clean = run(p)
    o_bad, s_bad, g_bad = run(bad)
    assert not torch.isfinite(o_bad[:, SEQLENS[0]:SEQLENS[0] + SEQLENS[1]]).all()
    if where != "q":  # q is only read: a NaN there reaches one output, never the state
        assert not torch.isfinite(s_bad[POISONED]).all()
    assert torch.equal(_others(o_bad), _others(o_clean))
    assert torch.equal(s_bad[others], s_clean[others])
    for name in g_clean:  # token gradients of the healthy sequences, and their state gradients
        if name == "initial_state":
            a, b = g_bad[name][others], g_clean[name][others]
        else:
            a, b = _others(g_bad[name]), _others(g_clean[name])
        assert torch.equal(a, b), name
