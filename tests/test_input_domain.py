"""Values outside the domain where the recurrence is defined are named, never computed into garbage.

docs/bad_inputs.md, "Values outside the domain": a log-decay ``g > 0`` (without the in-op gate)
and a precomputed ``beta`` outside ``[0, 2]`` (without the in-op sigmoid) raise a ValueError that
names the argument, the value, where it is and the flag that fixes it, in every backend and both
functions, eager and compiled, and in the native op called directly. Keys whose write strength
``beta * ||k||^2`` exceeds 2 (possible only without the l2 norm) give a warning that names
``use_qk_l2norm_in_kernel``. Valid inputs give neither.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import torch_kda
from kda_testing import make_problem

FUNCS = {"chunk_kda": torch_kda.chunk_kda, "fused_recurrent_kda": torch_kda.fused_recurrent_kda}
BACKENDS = ("native", "reference")


def _problem(T=200, K=16, V=8, **kw):
    """An issue-sized problem with a precomputed log-decay and precomputed beta."""
    return make_problem(B=1, T=T, H=1, K=K, V=V, gate="none", beta_sigmoid=False, seed=31,
                        dtype=torch.float32, **kw)


def _call(fn, p, backend, **changes):
    args = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    args.update(changes)
    return fn(**args, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", FUNCS.values(), ids=FUNCS.keys())
def test_linear_space_decay_is_rejected_with_its_index(fn, backend):
    # A decay given in (0, 1) instead of its log: every g = +0.9 (the first offender is [0, 0, 0, 0]).
    p = _problem()
    with pytest.raises(ValueError, match=r"g must be a log-decay <= 0 .*g\[0, 0, 0, 0\] = 0\.9"):
        _call(fn, p, backend, g=torch.full_like(p.g, 0.9))
    # One g = +30 among valid values: named with its place.
    g = p.g.clone()
    g[0, 123, 0, 5] = 30.0
    with pytest.raises(ValueError, match=r"g\[0, 123, 0, 5\] = 30.*use_gate_in_kernel=True"):
        _call(fn, p, backend, g=g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_positive_log_decay_in_a_packed_batch_names_the_flat_token(backend):
    p = make_problem(H=2, HV=4, K=5, V=3, gate="none", beta_sigmoid=False, seqlens=(3, 0, 9),
                     seed=32, dtype=torch.float32)
    g = p.g.clone()
    g[0, 7, 3, 4] = 1e-3
    with pytest.raises(ValueError, match=r"g\[0, 7, 3, 4\]"):
        _call(torch_kda.chunk_kda, p, backend, g=g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", FUNCS.values(), ids=FUNCS.keys())
def test_beta_outside_its_range_without_sigmoid_is_rejected(fn, backend):
    p = _problem()
    # precomputed beta = 3 (not a write strength; allow_neg_eigval's range is [0, 2])
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\].*beta\[0, 0, 0\] = 3.*"
                                         r"use_beta_sigmoid_in_kernel=True"):
        _call(fn, p, backend, beta=torch.full_like(p.beta, 3.0))
    # raw logits passed as strength: negative entries
    logits = torch.randn(p.beta.shape, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\].*use_beta_sigmoid_in_kernel"):
        _call(fn, p, backend, beta=logits)
    # the same logits with the flag that fixes it: accepted
    o, _ = _call(fn, p, backend, beta=logits, use_beta_sigmoid_in_kernel=True)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", FUNCS.values(), ids=FUNCS.keys())
def test_unnormalised_keys_warn_and_name_the_l2norm_flag(fn, backend):
    # randn q/k of dim 128 without the l2 norm: beta ||k||^2 ~ 64 >> 2
    gen = torch.Generator().manual_seed(5)
    B, T, H, K, V = 1, 16, 1, 128, 8
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.1
    beta = torch.rand(B, T, H, generator=gen) * 0.5 + 0.5
    with pytest.warns(UserWarning, match=r"beta \* \|\|k\|\|\^2 = .* > 2 .*use_qk_l2norm_in_kernel=True"):
        fn(q, k, v, g, beta, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, _ = fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend=backend)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("headwise", [False, True])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("check", ["native op", "aten ops"])
def test_unstable_write_warning_names_the_value_head_with_grouped_heads(monkeypatch, backend,
                                                                        headwise, T, check):
    if check == "aten ops":  # the path of CUDA tensors and of builds without the native library
        monkeypatch.setattr(torch_kda._checks, "_native_unstable_write", lambda: None)
    else:
        assert torch_kda._checks._native_unstable_write() is not None
    # H = 2 key heads, HV = 4 value heads: value head 3 reads key head 1. Only (b=1, t=T-1, hv=3)
    # (and, head-wise, its value column 4) has beta * ||k||^2 > 2; its key head's neighbour hv=2
    # has the same ||k||^2 = 3 but beta = 0.5.
    gen = torch.Generator().manual_seed(41)
    B, H, HV, K, V = 2, 2, 4, 8, 6
    k = torch.randn(B, T, H, K, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True) * 0.5 ** 0.5  # ||k||^2 = 0.5
    k[1, T - 1, 1] *= 6 ** 0.5  # ||k||^2 = 3
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, HV, V, generator=gen)
    g = -torch.rand(B, T, HV, K, generator=gen) * 0.1
    beta = torch.full((B, T, HV, V) if headwise else (B, T, HV), 0.5)
    where = (1, T - 1, 3, 4) if headwise else (1, T - 1, 3)
    beta[where] = 0.9
    at = re.escape(str(list(where)))
    with pytest.warns(UserWarning, match=rf"beta \* \|\|k\|\|\^2 = 2\.7 > 2 at {at} \(beta = 0\.9, "):
        with torch.no_grad():
            torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend=backend)
    beta[where] = 0.6  # 0.6 * 3 = 1.8: stable everywhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", ["native op", "aten ops"])
def test_beta_two_with_keys_normalised_by_the_caller_gives_no_warning(monkeypatch, backend, check):
    # beta = 2 is valid (docs/bad_inputs.md); keys normalised by the caller in fp32 have ||k||^2 =
    # 1 + a few ulp, which read "beta * ||k||^2 = 2 > 2". Beyond rounding it still warns.
    if check == "aten ops":
        monkeypatch.setattr(torch_kda._checks, "_native_unstable_write", lambda: None)
    gen = torch.Generator().manual_seed(44)
    B, T, H, K, V = 2, 6, 2, 128, 8
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    n2 = k.square().sum(-1)
    assert (n2 > 1).any()  # rounding above 1 somewhere: the case at hand
    g = -torch.rand(B, T, H, K, generator=gen) * 0.1
    beta = torch.full((B, T, H), 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend=backend)
            # keys normalised in their own 16-bit dtype: ||k||^2 up to ~1e-3 above 1
            for dt in (torch.bfloat16, torch.float16):
                k16 = torch.nn.functional.normalize(k.to(dt), dim=-1)
                torch_kda.fused_recurrent_kda(q.to(dt), k16, v.to(dt), g.to(dt), beta.to(dt),
                                              backend=backend)
    k[1, 3, 1] *= 1.0005  # ||k||^2 = 1.001: beyond rounding
    with pytest.warns(UserWarning, match=r"beta \* \|\|k\|\|\^2 = 2\.00\d* > 2 at \[1, 3, 1\]"):
        with torch.no_grad():
            torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", ["none", "softplus", "bounded"])
@pytest.mark.parametrize("l2norm,beta_sigmoid,neg", [(True, True, True), (True, False, False),
                                                     (False, True, False), (False, False, False)])
def test_valid_inputs_give_no_error_and_no_warning(backend, gate, l2norm, beta_sigmoid, neg):
    p = make_problem(B=2, T=9, H=2, HV=4, K=6, V=3, gate=gate, l2norm=l2norm,
                     beta_sigmoid=beta_sigmoid, neg_eigval=neg, seed=33, dtype=torch.float32)
    if not l2norm:
        p.k = p.k / p.k.norm(dim=-1, keepdim=True).clamp_min(1.0)  # ||k|| <= 1: stable
    if not beta_sigmoid:  # the whole precomputed range [0, 2] is valid, ends included
        p.beta[0, 0, 0], p.beta[1, 8, 3] = 0.0, 2.0 if l2norm else 1.0
    if gate == "none":
        p.g[0, 1, 1, 2] = 0.0  # no decay at all: the boundary is valid
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fn in FUNCS.values():
            o, _ = _call(fn, p, backend)
            assert torch.isfinite(o).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_log_decay_propagates_instead_of_raising(backend):
    p = _problem(T=12)
    g = p.g.clone()
    g[0, 4, 0, 1] = float("nan")
    o, _ = _call(torch_kda.fused_recurrent_kda, p, backend, g=g)
    assert torch.isnan(o[0, 4:]).any() and torch.isfinite(o[0, :4]).all()


@pytest.mark.parametrize("T", [1, 2, 5])  # the decode kernels up to 4 tokens, the general ones past
@pytest.mark.parametrize("source", ["A_log", "dt_bias", "g", "log decay", "q", "k", "v", "beta"])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("initial", ["none", "zeros"])
def test_nan_reaches_the_same_outputs_as_in_the_reference(T, source, v_first, initial):
    # A NaN in any input reaches the same entries of o and of the final state in the native op
    # as in the reference, also from no initial state, where the decode kernels skip the products
    # with the zero state in which the NaN would have met a zero (it once stayed out of a
    # one-token call's results there).
    B, H, HV, K, V = 2, 2, 4, 16, 24
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v, beta = torch.randn(B, T, HV, V, generator=gen), torch.randn(B, T, HV, generator=gen)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True,
              state_v_first=v_first)
    if source == "log decay":  # g given as a log decay, no gate in the op
        g = -torch.rand(B, T, HV, K, generator=gen)
    else:
        g = torch.randn(B, T, HV, K, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=torch.rand(HV, generator=gen),
                  dt_bias=torch.randn(HV * K, generator=gen) * 0.1)
    if source == "A_log":
        kw["A_log"][1] = float("nan")
    elif source == "dt_bias":
        kw["dt_bias"][HV * K // 2 + 3] = float("nan")
    else:
        x = {"g": g, "log decay": g, "q": q, "k": k, "v": v, "beta": beta}[source]
        x[1, 0, 1] = float("nan")  # sequence 1, token 0, head 1 (all of its channels)
    if initial == "zeros":
        kw["initial_state"] = torch.zeros(B, HV, V, K) if v_first else torch.zeros(B, HV, K, V)
    with torch.no_grad():
        o, s = torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend="native", **kw)
        o_ref, s_ref = torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend="reference", **kw)
    assert o_ref.isnan().any()
    if source not in ("A_log", "dt_bias"):  # (those two are every sequence's)
        assert torch.isfinite(o_ref[0]).all()  # it reached sequence 1 only
    assert torch.equal(o.isnan(), o_ref.isnan()) and torch.equal(s.isnan(), s_ref.isnan())


@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("source", ["q", "k", "v", "initial_state"])
@pytest.mark.parametrize("v_first", [False, True])
def test_inf_makes_the_same_entries_non_finite_as_in_the_reference(T, source, v_first):
    # docs/bad_inputs.md "Values outside the domain": an infinite input makes the same entries of
    # o and of the final state non-finite as in the reference; the decode kernels may give +-inf
    # where the reference's sums give NaN (inf - inf), so only finiteness is compared.
    B, H, HV, K, V = 2, 2, 4, 16, 24
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v, beta = torch.randn(B, T, HV, V, generator=gen), torch.rand(B, T, HV, generator=gen)
    g = -torch.rand(B, T, HV, K, generator=gen)
    h0 = torch.randn(B, HV, *((V, K) if v_first else (K, V)), generator=gen)
    x = {"q": q, "k": k, "v": v, "initial_state": h0}[source]
    x[1, 0, 1, 3] = float("inf")  # sequence 1 (token 0, head 1; the state: value head 1)
    kw = dict(initial_state=h0, output_final_state=True, state_v_first=v_first,
              use_qk_l2norm_in_kernel=source not in ("q", "k"))
    with torch.no_grad():
        o, s = torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend="native", **kw)
        o_ref, s_ref = torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend="reference", **kw)
    assert not torch.isfinite(o_ref).all() and torch.isfinite(o_ref[0]).all()
    assert torch.equal(torch.isfinite(o), torch.isfinite(o_ref))
    assert torch.equal(torch.isfinite(s), torch.isfinite(s_ref))


def _op_args(p, **changes):
    names = ("scale", "initial_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
             "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "state_v_first",
             "cu_seqlens", "A_log", "dt_bias")
    call = dict(zip(("q", "k", "v", "g", "beta"), p.args))
    call.update({n: p.kwargs.get(n, False) for n in names})
    call.update(scale=p.q.shape[-1] ** -0.5, lower_bound=None, cu_seqlens=None, A_log=None,
                dt_bias=None)
    call.update(changes)
    return list(call.values())


def test_native_ops_called_directly_raise_value_error():
    p = _problem(T=70)
    g = p.g.clone()
    g[0, 66, 0, 3] = 0.5
    with pytest.raises(ValueError, match=r"kda::fused_recurrent: g must be a log-decay <= 0.*"
                                         r"g\[0, 66, 0, 3\] = 0\.5"):
        torch.ops.kda.fused_recurrent(*_op_args(p, g=g))
    with pytest.raises(ValueError,
                       match=r"kda::fused_recurrent_fwd: beta.*beta\[0, 2, 0\] = -0\.25"):
        beta = p.beta.clone()
        beta[0, 2, 0] = -0.25
        torch.ops.kda.fused_recurrent_fwd(*_op_args(p, beta=beta))
    # the backward op alone (its pre-processing pass runs the same checks)
    o, s, ck = torch.ops.kda.fused_recurrent_fwd(*_op_args(p))
    with pytest.raises(ValueError, match=r"kda::fused_recurrent_bwd: g.*g\[0, 66, 0, 3\]"):
        torch.ops.kda.fused_recurrent_bwd(torch.randn_like(o), None, ck, *_op_args(p, g=g))


# Each op's messages name that op (the checks and the pre-processing pass are shared): the same
# offending g through every forward and backward op, and through the public functions, whose
# native backend calls kda::chunk / kda::fused_recurrent without autograd and the _fwd ops with it.
@pytest.mark.parametrize("family", ["fused_recurrent", "chunk"])
def test_each_native_op_names_itself_in_domain_errors(family):
    p = _problem(T=70)
    g = p.g.clone()
    g[0, 66, 0, 3] = 0.5
    where = r"g must be a log-decay <= 0.*g\[0, 66, 0, 3\] = 0\.5"
    for op in (family, family + "_fwd"):
        with pytest.raises(ValueError, match=rf"^kda::{op}: {where}"):
            getattr(torch.ops.kda, op)(*_op_args(p, g=g))
    o, s, ck = torch.ops.kda.fused_recurrent_fwd(*_op_args(p))
    with pytest.raises(ValueError, match=rf"^kda::{family}_bwd: {where}"):
        getattr(torch.ops.kda, family + "_bwd")(torch.randn_like(o), None, ck, *_op_args(p, g=g))
    fn = torch_kda.chunk_kda if family == "chunk" else torch_kda.fused_recurrent_kda
    with pytest.raises(ValueError, match=rf"^kda::{family}: {where}"):
        _call(fn, p, "native", g=g)
    q = p.q.clone().requires_grad_()
    with pytest.raises(ValueError, match=rf"^kda::{family}_fwd: {where}"):
        _call(fn, p, "native", q=q, g=g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_domain_errors_are_the_same_under_torch_compile(backend):
    p = _problem(T=8, K=4, V=3)
    g = p.g.clone()
    g[0, 5, 0, 2] = 0.75

    def f(q, k, v, g, beta):
        return torch_kda.chunk_kda(q, k, v, g, beta, output_final_state=True, backend=backend)

    compiled = torch.compile(f, backend="eager")
    with pytest.raises(ValueError, match=r"g\[0, 5, 0, 2\] = 0\.75"):
        compiled(p.q, p.k, p.v, g, p.beta)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
        compiled(p.q, p.k, p.v, p.g, p.beta + 2.5)


def test_positive_log_decay_in_a_later_token_block_of_the_native_forward():
    # T = 5000 with tiny heads: the native forward pre-processes 4096-token blocks; an offender in
    # the second block is found (and named by its global token index) as well.
    p = make_problem(B=1, T=5000, H=1, K=4, V=4, gate="none", beta_sigmoid=False, seed=34,
                     initial_state=False, dtype=torch.float32)
    g = p.g.clone()
    g[0, 4500, 0, 1] = 0.25
    with pytest.raises(ValueError, match=r"g\[0, 4500, 0, 1\] = 0\.25"):
        _call(torch_kda.chunk_kda, p, "native", g=g)
    beta = p.beta.clone()
    beta[0, 4999, 0] = 2.5
    with pytest.raises(ValueError, match=r"beta\[0, 4999, 0\] = 2\.5"):
        _call(torch_kda.fused_recurrent_kda, p, "native", beta=beta)


@pytest.mark.parametrize("backend", BACKENDS)
def test_serving_calls_reject_out_of_domain_values_before_touching_the_pool(backend):
    # The decode path with a state pool has its own kernels: the same checks, and a rejected call
    # leaves the pool bitwise unchanged.
    p = make_problem(B=3, T=1, H=2, HV=4, K=8, V=8, gate="none", beta_sigmoid=False, seed=35,
                     initial_state=False, output_final_state=False, dtype=torch.float32)
    p.kwargs.pop("state_v_first")
    pool = torch.randn(5, 4, 8, 8, generator=torch.Generator().manual_seed(36))
    before = pool.clone()
    idx = torch.tensor([4, 0, 2])
    g = p.g.clone()
    g[2, 0, 1, 3] = 0.5
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"g\[2, 0, 1, 3\] = 0\.5"):
            _call(torch_kda.fused_recurrent_kda, p, backend, g=g, initial_state=pool,
                  ssm_state_indices=idx, inplace_final_state=True)
        with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
            _call(torch_kda.fused_recurrent_kda, p, backend, beta=p.beta + 3, initial_state=pool,
                  ssm_state_indices=idx, inplace_final_state=True)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("beta_sigmoid,mult", [(False, 1.0), (True, 1.0), (True, 2.0)])
@pytest.mark.parametrize("headwise", [False, True])
def test_native_unstable_write_finds_the_first_flat_index(dtype, beta_sigmoid, mult, headwise):
    # kda::_unstable_write (csrc/cpu/unstable_writes.cpp) against the rule written out in float64:
    # the first flat index of beta [B, T, HV(, V)] with beta' * ||k[b, t, hv // (HV / H)]||^2 > 2.
    gen = torch.Generator().manual_seed(43)
    B, T, H, HV, K, V = 2, 300, 2, 4, 9, 3  # T * H = 600 rows: several chunks of the parallel loop
    k = (torch.randn(B, T, H, K, generator=gen) * 0.15).to(dtype)  # ||k||^2 ~ 0.2: all stable
    shape = (B, T, HV, V) if headwise else (B, T, HV)
    beta = (torch.randn(shape, generator=gen) if beta_sigmoid else torch.rand(shape, generator=gen)
            ).to(dtype)
    op = torch.ops.kda._unstable_write

    def expected():
        kn2 = k.double().pow(2).sum(-1).repeat_interleave(HV // H, dim=2)
        b = beta.double()
        b = torch.sigmoid(b) * mult if beta_sigmoid else b
        bad = (b * (kn2.unsqueeze(-1) if headwise else kn2)).flatten() > 2
        return int(bad.nonzero()[0]) if bool(bad.any()) else -1

    assert op(k, beta, beta_sigmoid, mult) == expected() == -1
    k[1, 200, 1] *= 8.0  # ||k||^2 ~ 13: unstable where beta' > 0.15 (value heads 2, 3 of key head 1)
    k[1, 250, 0] *= 8.0
    got = op(k, beta, beta_sigmoid, mult)
    assert got == expected() and got >= 0
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert op(k, beta, beta_sigmoid, mult) == got
    finally:
        torch.set_num_threads(old)


def test_native_unstable_write_rejects_inconsistent_shapes():
    op = torch.ops.kda._unstable_write
    k = torch.randn(2, 3, 2, 8)
    with pytest.raises(ValueError, match=r"kda::_unstable_write: beta must be"):
        op(k, torch.rand(2, 3, 3), False, 1.0)  # HV = 3 not a multiple of H = 2
    with pytest.raises(ValueError, match=r"kda::_unstable_write: k must be 4-D"):
        op(k[0], torch.rand(2, 3, 2), False, 1.0)
    with pytest.raises(TypeError, match=r"kda::_unstable_write: k and beta must be floating"):
        op(k.long(), torch.rand(2, 3, 2), False, 1.0)


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("call", ["api", "op"])
def test_decode_calls_check_the_domain_too(call, state_v_first):
    # One token per sequence (a decode step) runs the op's serving kernels, which pre-process
    # inside their units; the op scans g and beta first (csrc/cpu/serving.cpp, check_domain).
    # Before that scan a decode call with g > 0 or beta = 3 returned numbers without a word.
    p = make_problem(B=3, T=1, H=2, HV=4, K=8, V=8, gate="none", beta_sigmoid=False, l2norm=False,
                     seed=37, state_v_first=state_v_first, dtype=torch.float32)
    if call == "api":
        run = lambda **ch: _call(torch_kda.fused_recurrent_kda, p, "native", **ch)  # noqa: E731
    else:
        def run(**ch):
            a = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
            a.update(ch)
            return torch.ops.kda.fused_recurrent(
                a["q"], a["k"], a["v"], a["g"], a["beta"], 8 ** -0.5, a["initial_state"], False,
                False, False, False, None, state_v_first, None, None, None)
    g = p.g.clone()
    g[2, 0, 1, 3] = 0.5
    g[2, 0, 3, 0] = 0.7  # a later offender: the first one is named
    with pytest.raises(ValueError, match=r"kda::fused_recurrent: g must be a log-decay <= 0 .*"
                                         r"g\[2, 0, 1, 3\] = 0\.5"):
        run(g=g)
    beta = p.beta.clone()
    beta[1, 0, 2] = 3.0
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\] .*beta\[1, 0, 2\] = 3"):
        run(beta=beta)
    beta[1, 0, 2] = -0.25
    with pytest.raises(ValueError, match=r"beta\[1, 0, 2\] = -0\.25"):
        run(beta=beta)
    # the ends of the ranges, g = 0 and beta = 0 or 2, are valid; NaN is not rejected (by policy)
    g[2, 0, 1, 3], g[2, 0, 3, 0] = 0.0, float("nan")
    beta[1, 0, 2], beta[0, 0, 0] = 2.0, 0.0
    o = run(g=g, beta=beta)[0]
    assert torch.isfinite(o[:2]).all() and torch.isnan(o[2]).any()


def test_head_wise_beta_outside_its_range_is_named_with_its_column():
    # Serving with a head-wise beta [B, T, HV, V] (one strength per value column): the native op
    # names the column, as the reference does, and leaves the pool unchanged.
    p = make_problem(B=2, T=1, H=1, HV=2, K=8, V=4, gate="none", beta_sigmoid=False, seed=38,
                     initial_state=False, output_final_state=False, dtype=torch.float32)
    p.kwargs.pop("state_v_first")
    pool = torch.randn(3, 2, 8, 4, generator=torch.Generator().manual_seed(39))
    before = pool.clone()
    beta = torch.rand(2, 1, 2, 4, generator=torch.Generator().manual_seed(40))
    beta[1, 0, 1, 2] = 2.5
    for backend in BACKENDS:
        with torch.no_grad(), pytest.raises(
                ValueError, match=r"beta must lie in \[0, 2\] .*beta\[1, 0, 1, 2\] = 2\.5"):
            _call(torch_kda.fused_recurrent_kda, p, backend, beta=beta, initial_state=pool,
                  ssm_state_indices=torch.tensor([2, 0]), inplace_final_state=True)
        assert torch.equal(pool, before)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_fused_recurrent_checked_is_the_op_and_the_place_of_the_warning(requires_grad):
    # kda::_fused_recurrent_checked (the API's one call on the native path, csrc/ops.cpp) returns
    # exactly kda::fused_recurrent's outputs (and gradients) plus kda::_unstable_write's index.
    p = make_problem(B=2, T=5, H=2, HV=4, K=8, V=6, gate="none", beta_sigmoid=False, l2norm=False,
                     seed=42, dtype=torch.float32)
    q, k, v, g, beta = (t.detach().clone() for t in p.args)
    k[1, 3, 1] *= 4.0  # ||k||^2 > 2 / beta there: value heads 2 and 3 of key head 1
    h0 = p.kwargs["initial_state"].detach().clone()
    leaves = (q, k, v, g, beta, h0)

    def args(l2norm):
        return (q, k, v, g, beta, 0.3, h0, l2norm, False, False, False, None, False, None, None,
                None)

    outs = {}
    for name in ("_fused_recurrent_checked", "fused_recurrent"):
        for t in leaves:
            t.grad = None
            t.requires_grad_(requires_grad)
        r = getattr(torch.ops.kda, name)(*args(False))
        grads = None
        if requires_grad:
            (r[0].square().sum() + r[1].sum()).backward()
            grads = [t.grad.clone() for t in leaves]
        outs[name] = (r, grads)
    (o, s, first), grads = outs["_fused_recurrent_checked"]
    (o_ref, s_ref), grads_ref = outs["fused_recurrent"]
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    assert first == torch.ops.kda._unstable_write(k.detach(), beta.detach(), False, 1.0)
    assert first == ((1 * 5 + 3) * 4 + 2)  # beta [B, T, HV] flat index of (1, 3, 2)
    if requires_grad:
        assert o.requires_grad and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    with torch.no_grad():  # the in-op l2 norm rules the warning out: not computed
        assert torch.ops.kda._fused_recurrent_checked(*args(True))[2] == -1
