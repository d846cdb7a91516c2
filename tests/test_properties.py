"""Property tests (hypothesis): the native op equals a float64 oracle on random problems.

Each case draws shapes (K, V in 1..160, H, HV/H, B, T from 0; or packed variable-length batches with
empty and length-1 sequences), every flag (gate form, l2 norm, sigmoid beta, negative eigenvalues,
scale, initial state, final state), layouts (``state_v_first``, non-contiguous inputs, int32
``cu_seqlens``, ``dt_bias`` as ``[HV, K]``) and a torch.Generator seed for the values, then checks

- the native forward in float64 against the float64 oracle (``tests/oracle.py``, an independent
  loop, for small problems; ``torch_kda.reference`` in float64 for larger ones), to 1e-9;
- the native forward in float32 against the same oracle, to 1e-4 relative;
- the native analytic gradients in float64 against autograd through the float64 reference.

Profiles (environment variable ``KDA_HYPOTHESIS_PROFILE``):

- ``fast`` (default, in the normal suite): a few dozen derandomised cases, well under a minute;
- ``fuzz`` (``make fuzz``): ``FUZZ_EXAMPLES`` (default 2000) cases per property, with the example
  database on so a failure replays first next time.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_kda
from kda_testing import make_problem, rel_err
from oracle import oracle_kda
from torch_kda import reference

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("fast", max_examples=30, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_SLOW, print_blob=True)
settings.register_profile("fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "2000")),
                          deadline=None, suppress_health_check=_SLOW, print_blob=True)
PROFILE = os.environ.get("KDA_HYPOTHESIS_PROFILE", "fast")
settings.load_profile(PROFILE)

GATE_FORMS = ("none", "softplus", "bounded", "bounded_no_alog")
ORACLE_BUDGET = 12_000  # loop iterations of tests/oracle.py allowed per case (else the reference)


@st.composite
def problems(draw, max_kv: int = 160, max_t: int = 80):
    """(Problem in float64, description) for one random KDA call."""
    H = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    K = draw(st.one_of(st.integers(1, 8), st.integers(1, max_kv)))
    V = draw(st.one_of(st.integers(1, 8), st.integers(1, max_kv)))
    varlen = draw(st.booleans())
    if varlen:
        short = st.one_of(st.sampled_from([0, 1]), st.integers(0, max_t // 2))
        seqlens = draw(st.lists(short, min_size=1, max_size=5))
        B, T = 1, sum(seqlens)
    else:
        seqlens = None
        B = draw(st.integers(1, 3))
        T = draw(st.one_of(st.sampled_from([0, 1, 63, 64, 65]), st.integers(0, max_t)))
    gate = draw(st.sampled_from(GATE_FORMS))
    l2norm = draw(st.booleans())
    beta_sigmoid = draw(st.booleans())
    neg_eigval = beta_sigmoid and draw(st.booleans())
    flags = dict(
        H=H, HV=H * group, K=K, V=V, gate=gate, l2norm=l2norm, beta_sigmoid=beta_sigmoid,
        neg_eigval=neg_eigval, initial_state=draw(st.booleans()),
        state_v_first=draw(st.booleans()), output_final_state=draw(st.booleans()),
        lower_bound=draw(st.sampled_from([-5.0, -1.0, -0.1])) if gate.startswith("bounded") else -5.0,
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    if seqlens is None:
        p = make_problem(B=B, T=T, **flags)
    else:
        p = make_problem(seqlens=seqlens, **flags)
    if not l2norm:
        # Keep |k_t| <= 1 so that I - beta k k^T (beta < 2) has eigenvalues in [-1, 1]: the
        # recurrence stays bounded for every drawn size (an exploding state is no test of rounding).
        p.k = p.k / p.k.norm(dim=-1, keepdim=True).clamp_min(1.0)
    layout = dict(
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        non_contiguous=draw(st.booleans()),
        cu_int32=varlen and draw(st.booleans()),
        dt_bias_2d=gate != "none" and draw(st.booleans()),
    )
    if layout["scale"] is not None:
        p.kwargs["scale"] = layout["scale"]
    if layout["cu_int32"]:
        p.kwargs["cu_seqlens"] = p.kwargs["cu_seqlens"].int()
    if layout["dt_bias_2d"]:
        p.kwargs["dt_bias"] = p.kwargs["dt_bias"].reshape(H * group, K)
    desc = dict(flags, B=B, T=T, seqlens=seqlens, **layout)
    return p, desc


def _non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values in a strided (non-contiguous) view: every other element of a wider buffer."""
    buf = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    view = buf[..., ::2]
    view.copy_(x)
    return view


def _oracle(p) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """float64 (o, final_state): the loop oracle when cheap enough, else the float64 reference."""
    B, T, HV, K = p.g.shape
    if B * T * HV * (K + 8) <= ORACLE_BUDGET:
        return oracle_kda(*p.args, **p.kwargs)
    return reference.fused_recurrent_kda(*p.args, **p.kwargs)


def _native_run(p, dtype: torch.dtype, non_contiguous: bool):
    x = p.to(dtype)
    args = [_non_contiguous(t) for t in x.args] if non_contiguous else list(x.args)
    if non_contiguous:
        assert not any(a.is_contiguous() for a in args if a.numel() > 1)
    before = [t.clone() for t in args]
    o, s = torch_kda.fused_recurrent_kda(*args, **x.kwargs, backend="native")
    assert all(torch.equal(a, b) for a, b in zip(args, before)), "an input was modified"
    return o, s


def _check_close(name: str, actual, expected, tol: float, desc: Dict) -> None:
    if expected is None:
        assert actual is None, f"{name}: expected None ({desc})"
        return
    assert actual.shape == expected.shape, f"{name}: {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values ({desc})"
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:g} ({desc})"


@given(problems())
def test_native_forward_matches_float64_oracle(case):
    p, desc = case
    o_ref, s_ref = _oracle(p)
    o64, s64 = _native_run(p, torch.float64, desc["non_contiguous"])
    assert o64.dtype == torch.float64
    _check_close("o (float64)", o64, o_ref, 1e-9, desc)
    _check_close("final_state (float64)", s64, s_ref, 1e-9, desc)
    o32, s32 = _native_run(p, torch.float32, desc["non_contiguous"])
    assert o32.dtype == torch.float32 and (s32 is None or s32.dtype == torch.float32)
    _check_close("o (float32)", o32, o_ref, 1e-4, desc)
    _check_close("final_state (float32)", s32, s_ref, 1e-4, desc)


GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _grads(fn, p, seed: int):
    """Gradients of a random projection of (o, final_state) w.r.t. every tensor input."""
    x = p.to(torch.float64, requires_grad=True)
    x.kwargs["output_final_state"] = True
    ts = x.tensors()
    o, s = fn(x)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() \
        + (s * torch.randn(s.shape, generator=gen, dtype=torch.float64)).sum()
    names = list(ts)
    if not loss.requires_grad:  # nothing depends on the inputs (T = 0 and no initial state)
        return dict.fromkeys(names)
    return dict(zip(names, torch.autograd.grad(loss, [ts[n] for n in names], allow_unused=True)))


@settings(max_examples=max(5, settings().max_examples // 3))
@given(problems(max_kv=40, max_t=40))
def test_native_gradients_match_float64_reference(case):
    p, desc = case
    g_nat = _grads(lambda x: torch_kda.fused_recurrent_kda(*x.args, **x.kwargs, backend="native"),
                   p, desc["seed"])
    g_ref = _grads(lambda x: reference.fused_recurrent_kda(*x.args, **x.kwargs), p, desc["seed"])
    for name, expected in g_ref.items():
        actual = g_nat[name]
        if expected is None:  # an input the output does not depend on (e.g. T = 0)
            assert actual is None or not actual.any(), name
            continue
        assert actual is not None, f"d{name} missing ({desc})"
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        err = rel_err(actual, expected)
        assert err <= 1e-8 or (actual - expected).abs().max() <= 1e-12, \
            f"d{name}: relative error {err:.3g} ({desc})"
