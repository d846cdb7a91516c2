"""The pure-PyTorch reference (recurrent and chunkwise) against the float64 oracle."""

from __future__ import annotations

import itertools

import pytest
import torch

from kda_testing import GATES, make_problem, rel_err, stable_seed
from oracle import oracle_kda
from torch_kda import reference

FLAG_SETS = [  # (l2norm, beta_sigmoid, neg_eigval)
    (True, True, False),
    (False, False, False),
    (True, True, True),
]
CASES = list(itertools.product(GATES, (1, 2), (False, True), (False, True), FLAG_SETS))


def _both(p, chunk_size=4):
    rec = reference.fused_recurrent_kda(*p.args, **p.kwargs)
    chk = reference.chunk_kda(*p.args, **p.kwargs, chunk_size=chunk_size)
    return rec, chk


@pytest.mark.parametrize("gate,group,varlen,state_v_first,flags", CASES)
def test_reference_matches_oracle_every_feature(gate, group, varlen, state_v_first, flags):
    l2, sig, neg = flags
    p = make_problem(B=2, T=11, H=2, HV=2 * group, K=6, V=5, gate=gate, l2norm=l2, beta_sigmoid=sig,
                     neg_eigval=neg, state_v_first=state_v_first,
                     seqlens=(4, 0, 1, 9) if varlen else None, seed=stable_seed(gate, group, varlen))
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    (o_rec, s_rec), (o_chk, s_chk) = _both(p)
    assert rel_err(o_rec, o_ref) < 1e-12 and rel_err(s_rec, s_ref) < 1e-12
    assert rel_err(o_chk, o_ref) < 1e-12 and rel_err(s_chk, s_ref) < 1e-12


@pytest.mark.parametrize("T,chunk_size", [(1, 64), (63, 64), (64, 64), (65, 64), (40, 16), (17, 1)])
def test_chunk_takes_any_length(T, chunk_size):
    p = make_problem(B=1, T=T, H=1, HV=2, K=5, V=4, seed=T)
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    o, s = reference.chunk_kda(*p.args, **p.kwargs, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(s, s_ref) < 1e-12


def test_non_power_of_two_and_k_ne_v():
    p = make_problem(B=1, T=9, H=3, HV=6, K=13, V=3, seed=5)
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    for method in (reference.fused_recurrent_kda, reference.chunk_kda):
        o, s = method(*p.args, **p.kwargs)
        assert rel_err(o, o_ref) < 1e-12 and rel_err(s, s_ref) < 1e-12


def test_scale_is_used():
    p = make_problem(seed=3)
    o_ref, _ = oracle_kda(*p.args, **p.kwargs, scale=0.37)
    o, _ = reference.chunk_kda(*p.args, **p.kwargs, scale=0.37)
    assert rel_err(o, o_ref) < 1e-12
    o_default, _ = reference.chunk_kda(*p.args, **p.kwargs)
    assert rel_err(o_default, o) > 1e-3


@pytest.mark.parametrize("method", ["fused_recurrent_kda", "chunk_kda"])
def test_varlen_matches_per_sequence(method):
    fn = getattr(reference, method)
    lens = (5, 0, 1, 12)
    p = make_problem(seqlens=lens, H=1, HV=2, seed=11)
    o, s = fn(*p.args, **p.kwargs)
    cu = p.kwargs["cu_seqlens"].tolist()
    for i in range(len(lens)):
        sl = slice(cu[i], cu[i + 1])
        kw = dict(p.kwargs, cu_seqlens=None, initial_state=p.kwargs["initial_state"][i:i + 1])
        o_i, s_i = fn(*(t[:, sl] for t in p.args), **kw)
        assert o_i.shape == o[:, sl].shape
        if lens[i]:
            assert rel_err(o[:, sl], o_i) < 1e-13
        assert rel_err(s[i:i + 1], s_i) < 1e-13


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("method", ["fused_recurrent_kda", "chunk_kda"])
def test_split_sequence_with_carried_state_equals_one_call(method, state_v_first):
    fn = getattr(reference, method)
    p = make_problem(B=2, T=23, HV=4, seed=7, state_v_first=state_v_first)
    o, s = fn(*p.args, **p.kwargs)
    cut = 10
    o1, s1 = fn(*(t[:, :cut] for t in p.args), **p.kwargs)
    o2, s2 = fn(*(t[:, cut:] for t in p.args), **dict(p.kwargs, initial_state=s1))
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-13
    assert rel_err(s2, s) < 1e-13


@pytest.mark.parametrize("method", ["fused_recurrent_kda", "chunk_kda"])
def test_empty_input_passes_state_through(method):
    fn = getattr(reference, method)
    p = make_problem(B=2, T=0, HV=2, seed=1)
    o, s = fn(*p.args, **p.kwargs)
    assert o.shape == (2, 0, 2, 5)
    assert torch.equal(s, p.kwargs["initial_state"])


@pytest.mark.parametrize("gate", GATES)
def test_gradcheck_all_inputs(gate):
    p = make_problem(B=1, T=5, H=1, HV=2, K=3, V=2, gate=gate, seed=2, seqlens=None).to(
        torch.float64, requires_grad=True)
    names = list(p.tensors())

    def f(*tensors):
        kw = dict(p.kwargs, **{n: t for n, t in zip(names, tensors) if n not in "q k v g beta".split()})
        d = dict(zip(names, tensors))
        o, s = reference.chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], chunk_size=2, **kw)
        return o, s

    assert torch.autograd.gradcheck(f, tuple(p.tensors().values()))


def test_gradgradcheck_small():
    p = make_problem(B=1, T=3, H=1, HV=1, K=2, V=2, seed=4).to(torch.float64, requires_grad=True)
    fixed = {n: t for n, t in p.kwargs.items() if n not in ("initial_state",)}

    def f(q, k, v, g, beta, h0):
        o, s = reference.chunk_kda(q, k, v, g, beta, chunk_size=2, **dict(fixed, initial_state=h0))
        return o, s

    inputs = (*p.args, p.kwargs["initial_state"])
    assert torch.autograd.gradgradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(
        lambda *t: reference.fused_recurrent_kda(*t[:5], **dict(fixed, initial_state=t[5])), inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["fused_recurrent_kda", "chunk_kda"])
def test_low_precision_inputs_are_accurate(dtype, method):
    """Inputs rounded to bf16/fp16, arithmetic in fp32: the error is the input rounding's, no more."""
    fn = getattr(reference, method)
    p = make_problem(B=1, T=40, H=2, HV=2, K=16, V=16, seed=9)
    o_ref, s_ref = oracle_kda(*p.to(dtype).to(torch.float64).args, **p.kwargs)
    o, s = fn(*p.to(dtype).args, **p.to(dtype).kwargs)
    assert o.dtype == dtype and s.dtype == torch.float32
    # Only the output cast rounds: about one unit of the dtype's precision.
    tol = 2 * (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)
    assert rel_err(o, o_ref) < tol
    assert rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("method", ["fused_recurrent_kda", "chunk_kda"])
def test_arithmetic_stays_fp32_under_autocast(method):
    """torch.autocast("cpu", bfloat16) would run the reference's einsums and products in bf16
    (3e-3 relative error): the reference turns it off, as the other backends ignore it."""
    import torch_kda
    p = make_problem(B=1, T=40, H=2, HV=4, K=16, V=8, seed=47).to(torch.float32)
    o_ref, s_ref = oracle_kda(*p.to(torch.float64).args, **p.to(torch.float64).kwargs)
    fn = getattr(reference, method)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = fn(*p.args, **p.kwargs)
        o_api, s_api = getattr(torch_kda, method)(*p.args, **p.kwargs, backend="reference")
    assert o.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    assert torch.equal(o_api, o) and torch.equal(s_api, s)
    # the serving path (a pool addressed by slots) too
    pool = torch.randn(3, 4, 16, 8, generator=torch.Generator().manual_seed(48))
    kw = {n: v for n, v in p.kwargs.items() if n != "initial_state"}
    idx = torch.tensor([2])
    plain = torch_kda.fused_recurrent_kda(*p.args, **kw, initial_state=pool, ssm_state_indices=idx,
                                          backend="reference")[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = torch_kda.fused_recurrent_kda(*p.args, **kw, initial_state=pool, ssm_state_indices=idx,
                                             backend="reference")[0]
    assert torch.equal(auto, plain)


@pytest.mark.parametrize("gate", ["none", "softplus"])
@pytest.mark.parametrize("method", ["fused_recurrent_kda", "chunk_kda"])
def test_wider_g_than_qkv_computes_in_the_qkv_dtype(gate, method):
    """fp32 q/k/v with an fp64 g (raw gate input or log-decay): fp32 arithmetic, fp32 outputs (the
    recurrent scan once promoted its state to fp64 through the gate and failed in einsum)."""
    p = make_problem(B=1, T=20, H=1, HV=2, K=8, V=4, gate=gate, seed=13)
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    p32 = p.to(torch.float32)
    o, s = getattr(reference, method)(*p32.args[:3], p.g, p32.beta, **p32.kwargs)
    assert o.dtype == s.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_chunk_is_causal_in_outputs_and_gradients():
    p = make_problem(B=1, T=20, H=1, HV=1, K=4, V=3, gate="bounded", seed=12).to(
        torch.float64, requires_grad=True)
    o, _ = reference.chunk_kda(*p.args, **p.kwargs, chunk_size=8)
    o[:, :10].sum().backward()
    grads = [t.grad.clone() for t in p.args]
    g2 = p.g.detach().clone()
    g2[:, 10:] = torch.randn(g2[:, 10:].shape, dtype=torch.float64) * 50  # change later gates
    p2 = make_problem(B=1, T=20, H=1, HV=1, K=4, V=3, gate="bounded", seed=12).to(
        torch.float64, requires_grad=True)
    p2.g = g2.requires_grad_(True)
    o2, _ = reference.chunk_kda(*p2.args, **p2.kwargs, chunk_size=8)
    o2[:, :10].sum().backward()
    assert torch.equal(o[:, :10], o2[:, :10])
    for a, b in zip(grads, [t.grad for t in p2.args]):
        assert torch.equal(a[:, :10], b[:, :10])
        assert torch.isfinite(b).all()


@pytest.mark.parametrize("gate,extreme,tol", [("bounded", 40.0, 1e-5), ("softplus", 8.0, 2e-4)])
def test_chunk_finite_under_strongest_decay(gate, extreme, tol):
    """Saturated bounded gate (-5 per step, -320 per 64-chunk) and a huge softplus gate stay accurate.

    The softplus case reaches in-chunk log-decay sums near -1e4: forming G_i - G_j from fp32
    cumulative sums cancels digits, hence its looser (still fp32-level) tolerance.
    """
    p = make_problem(B=1, T=130, H=1, HV=2, K=4, V=3, gate=gate, seed=13, dtype=torch.float32)
    p.g = p.g * extreme
    if gate == "softplus":
        p.kwargs["A_log"] = p.kwargs["A_log"] + 3.0
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    args = [t.detach().requires_grad_(True) for t in p.args]
    o, s = reference.chunk_kda(*args, **p.kwargs, chunk_size=64)
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert all(torch.isfinite(t.grad).all() for t in args)
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol


def test_kda_gate_forms():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 4, 2, 5, generator=gen, dtype=torch.float64)
    A = torch.randn(2, generator=gen, dtype=torch.float64)
    dt = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    soft = reference.kda_gate(g, A, dt)
    z = g + dt
    assert rel_err(soft, -A.exp()[:, None] * torch.log1p(z.exp())) < 1e-14
    bounded = reference.kda_gate(g, A, dt.reshape(-1), lower_bound=-3.0)
    assert rel_err(bounded, -3.0 * torch.sigmoid(A.exp()[:, None] * z)) < 1e-14
    assert (bounded >= -3.0).all() and (bounded < 0).all()
    assert reference.kda_gate(g.float(), A.float(), None, -1.0).dtype == torch.float32
    assert reference.kda_gate(g.bfloat16(), A.float(), None, -1.0).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunk_full_forget_matches_recurrence(dtype):
    """An infinite log-decay (exp(g) = 0, a full forget) stays finite and exact in the chunk form."""
    p = make_problem(B=1, T=20, H=1, HV=2, K=4, V=3, gate="none", seed=14, seqlens=(8, 12), dtype=dtype)
    p.g = p.g.clone()
    p.g[0, 12, 0, 1] = -float("inf")
    p.g[0, 3, 1, :] = -1e30
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    o, s = reference.chunk_kda(*p.args, **p.kwargs, chunk_size=8)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol
