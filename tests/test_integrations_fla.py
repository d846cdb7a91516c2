"""torch-kda as flash-linear-attention's CPU backend (torch_kda.integrations.fla).

FLA's own public entry points (``fla.ops.kda.chunk_kda``, ``fused_recurrent_kda`` and
``fused_recurrent_kda_fwd``) are called unmodified on CPU tensors; with the backend registered they
must equal the float64 oracle (forward) and the float64 reference (every gradient), and with the
backend switched off (``FLA_TORCH_KDA=0``) the very same call must fail inside Triton as FLA does
on a CPU machine, which proves that the backend is what ran. ``make test`` installs fla-core and
Triton (Triton imports without a GPU).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kda_testing import make_problem, rel_err
from oracle import oracle_kda
from torch_kda import reference
from torch_kda.integrations import fla as kda_fla

import fla.backends  # noqa: E402  (FLA imports after torch_kda on purpose: nothing here needs order)
from fla.ops.kda import chunk_kda as fla_chunk_kda
from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fused_recurrent_kda_fwd

FLA_CPU_FAILURE = "active drivers"  # Triton's error without a GPU driver (fla-core 0.6.0, triton 3.9.0)


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.delenv(kda_fla.ENV_VAR, raising=False)
    kda_fla.register()


def _fla_kwargs(p):
    """A problem's keyword arguments in FLA's spelling (the same names; FLA wants an fp32 state)."""
    return dict(p.kwargs)


def _grads(o, s, inputs, seed=7):
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)).sum()
    return torch.autograd.grad(loss, list(inputs.values()))


ENTRY_POINTS = {
    "chunk_kda": lambda p: fla_chunk_kda(*p.args, **_fla_kwargs(p)),
    "fused_recurrent_kda": lambda p: fla_fused_recurrent_kda(*p.args, **_fla_kwargs(p)),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("case", ["softplus_gate_gva", "varlen_v_first", "plain_gate"])
def test_fla_entry_point_on_cpu_matches_float64_oracle_and_every_gradient(entry, case):
    if case == "softplus_gate_gva":
        p = make_problem(B=2, T=37, H=2, HV=4, K=16, V=8, gate="softplus", seed=31)
    elif case == "varlen_v_first":
        p = make_problem(H=2, K=16, V=8, gate="bounded", seqlens=(9, 0, 30), state_v_first=True, seed=32)
    else:
        p = make_problem(B=2, T=29, H=2, K=8, V=16, gate="none", l2norm=False, beta_sigmoid=False, seed=33)
    if case == "varlen_v_first":
        p.kwargs["cu_seqlens_cpu"] = p.kwargs["cu_seqlens"].clone()
        if entry == "fused_recurrent_kda":
            del p.kwargs["cu_seqlens_cpu"]  # not an argument of FLA's fused_recurrent_kda
    p32 = p.to(torch.float32, requires_grad=True)
    o, s = ENTRY_POINTS[entry](p32)
    o_ref, s_ref = oracle_kda(*p.args, **{k: v for k, v in p.kwargs.items() if k != "cu_seqlens_cpu"})
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5

    inputs = p32.tensors()
    if case == "softplus_gate_gva":
        assert set(inputs) == {"q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"}
    got = _grads(o, s, inputs)
    p64 = p.to(torch.float64, requires_grad=True)
    kwargs64 = {k: v for k, v in p64.kwargs.items() if k != "cu_seqlens_cpu"}
    o64, s64 = reference.fused_recurrent_kda(*p64.args, **kwargs64)
    expected = _grads(o64, s64, p64.tensors())
    for name, a, e in zip(inputs, got, expected):
        assert a is not None and rel_err(a, e) < 1e-5, (name, rel_err(a, e))


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_without_the_backend_the_same_call_fails_inside_triton(entry, monkeypatch):
    p = make_problem(B=1, T=8, H=2, K=8, V=8, gate="softplus", seed=34).to(torch.float32)
    ENTRY_POINTS[entry](p)  # runs with torch-kda registered
    monkeypatch.setenv(kda_fla.ENV_VAR, "0")  # FLA's own switch for this backend
    with pytest.raises(RuntimeError, match=FLA_CPU_FAILURE):
        ENTRY_POINTS[entry](p)


def test_fused_recurrent_kda_fwd_defaults_update_the_state_in_place_and_fill_out():
    p = make_problem(B=3, T=5, H=2, K=8, V=8, gate="softplus", seed=35).to(torch.float32)
    pool = p.kwargs["initial_state"].clone()
    out = torch.full_like(p.v, float("nan"))
    kwargs = {k: v for k, v in p.kwargs.items() if k not in ("initial_state", "output_final_state")}
    with torch.no_grad():
        o, s = fla_fused_recurrent_kda_fwd(*p.args, initial_state=pool, out=out, **kwargs)
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    # FLA's conventions: inplace_final_state=True by default returns the pool, updated; `out` is filled.
    assert o is out and s is pool
    assert rel_err(out, o_ref) < 1e-5 and rel_err(pool, s_ref) < 1e-5


def test_fla_chunk_kda_argument_conventions():
    p = make_problem(B=1, T=12, H=2, K=8, V=8, gate="softplus", seed=36).to(torch.float32)
    # Without the in-kernel gate FLA ignores A_log / dt_bias (torch-kda's own API rejects them).
    g = -torch.rand_like(p.g) - 0.1
    kw = {k: v for k, v in p.kwargs.items() if k != "use_gate_in_kernel"}
    o, _ = fla_chunk_kda(p.q, p.k, p.v, g, p.beta, **kw)
    o_ref, _ = oracle_kda(p.q, p.k, p.v, g, p.beta, **{k: v for k, v in kw.items() if k not in ("A_log", "dt_bias")})
    assert rel_err(o, o_ref) < 1e-5
    with pytest.raises(ValueError, match="cp_context"):
        fla_chunk_kda(*p.args, cp_context=object(), **p.kwargs)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        fla_chunk_kda(*p.args, **p.kwargs, cu_seqlens=torch.tensor([0, 5, 12]),
                      cu_seqlens_cpu=torch.tensor([0, 6, 12]))
    with pytest.raises(ValueError, match="initial_state"):  # torch-kda's checks name the argument
        bad = dict(p.kwargs, initial_state=p.kwargs["initial_state"][:, :1])
        fla_chunk_kda(*p.args, **bad)
    # FLA's deprecated name of state_v_first: the same call, with FLA's warning; a bool only
    vf = {k: v for k, v in p.kwargs.items() if k != "state_v_first"}
    vf.update(initial_state=vf["initial_state"].transpose(-1, -2).contiguous(),
              output_final_state=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o_old, s_old = fla_chunk_kda(*p.args, **vf, transpose_state_layout=True)
    o_new, s_new = fla_chunk_kda(*p.args, **vf, state_v_first=True)
    assert torch.equal(o_old, o_new) and torch.equal(s_old, s_new)
    with pytest.raises(TypeError, match="transpose_state_layout must be a bool"):
        fla_chunk_kda(*p.args, **vf, transpose_state_layout="False")


def test_verifiers_decline_tensors_off_the_cpu_and_fla_keeps_its_path():
    p = make_problem(B=1, T=4, H=2, K=8, V=8, gate="softplus", seed=37).to(torch.float32)
    ok, reason = kda_fla.chunk_kda_verifier(*p.args, **p.kwargs)
    assert ok and reason is None
    meta = [t.to("meta") for t in p.args]
    ok, reason = kda_fla.chunk_kda_verifier(*meta, **p.kwargs)
    assert not ok and "meta" in reason and "q" in reason
    # one argument elsewhere is enough to decline
    ok, reason = kda_fla.fused_recurrent_kda_fwd_verifier(
        *p.args, initial_state=p.kwargs["initial_state"].to("meta"), inplace_final_state=False)
    assert not ok and "initial_state" in reason
    ok, _ = kda_fla.fused_recurrent_kda_fwd_verifier(*p.args, inplace_final_state=False)
    assert ok
    # The registered backend answers FLA's registry with the same verdicts.
    registry = fla.backends._function_registries[inspect.unwrap(fla_chunk_kda)]
    backend = registry._backends[kda_fla.BACKEND_TYPE]
    assert backend.verify("chunk_kda", *meta, **p.kwargs)[0] is False
    assert backend.verify("chunk_kda", *p.args, **p.kwargs) == (True, None)


def test_register_is_idempotent():
    kda_fla.register()
    kda_fla.register()
    assert kda_fla.is_registered()
    ops = fla.backends._operation_registries["kda"]
    assert sum(b.backend_type == kda_fla.BACKEND_TYPE for b in ops._backends.values()) == 1


def _decode_problem(seed):
    gen = torch.Generator().manual_seed(seed)
    N, T, H, K, V = 3, 1, 2, 16, 8

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rnd(N, T, H, K), rnd(N, T, H, K), rnd(N, T, H, V)
    g, beta = -torch.rand(N, T, H, K, generator=gen) - 0.05, torch.rand(N, T, H, generator=gen)
    return q, k, v, g, beta, rnd(6, H, K, V)


def test_fused_recurrent_kda_fwd_state_pool_by_slot_index_runs_torch_kda():
    q, k, v, g, beta, pool = _decode_problem(38)
    idx = torch.tensor([4, 0, 2])
    assert kda_fla.fused_recurrent_kda_fwd_verifier(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx)[0]
    o_ref, s_ref = oracle_kda(q, k, v, g, beta, initial_state=pool[idx], output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
    live = pool.clone()
    with torch.no_grad():
        o, s = fla_fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=live, ssm_state_indices=idx,
                                           use_qk_l2norm_in_kernel=True)
    assert s is live and rel_err(o, o_ref) < 1e-5 and rel_err(live[idx], s_ref) < 1e-5
    assert torch.equal(live[[1, 3, 5]], pool[[1, 3, 5]])  # slots not named are untouched


def test_fused_recurrent_kda_fwd_speculative_indices_equal_torch_kda_call():
    import torch_kda

    q, k, v, g, beta, pool = _decode_problem(39)
    q, k, v, g, beta = (t.repeat_interleave(3, dim=1) for t in (q, k, v, g, beta))  # 3 draft tokens each
    idx = torch.tensor([[0, 1, 2], [3, 4, 5], [-1, -1, -1]])  # the last sequence is a pad slot
    accepted = torch.tensor([2, 1, 1])
    via_fla, direct = pool.clone(), pool.clone()
    with torch.no_grad():
        o, _ = fla_fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=via_fla, ssm_state_indices=idx,
                                           num_accepted_tokens=accepted)
        o_direct, _ = torch_kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=direct, ssm_state_indices=idx,
                                                    num_accepted_tokens=accepted, inplace_final_state=True)
    assert torch.equal(o, o_direct) and torch.equal(via_fla, direct)
    assert not torch.equal(via_fla, pool) and torch.all(o[2] == 0)


def test_chunk_kda_return_intermediate_states_in_inference_mode():
    import torch_kda

    p = make_problem(B=1, T=70, H=2, K=8, V=8, gate="softplus", seed=40).to(torch.float32)
    with torch.inference_mode():
        o, s, h = fla_chunk_kda(*p.args, **p.kwargs, return_intermediate_states=True)
        o2, s2, h2 = torch_kda.chunk_kda(*p.args, **p.kwargs, return_intermediate_states=True)
    assert h.shape == (1, 2, 2, 8, 8) and torch.equal(h, h2) and torch.equal(o, o2)
    assert torch.equal(h[0, 0], p.kwargs["initial_state"][0])  # entry 0: the state entering chunk 0
    with pytest.raises(ValueError, match="inference"):
        fla_chunk_kda(*p.args, **p.kwargs, return_intermediate_states=True)
