"""The functional API: argument checking, backend dispatch, input hygiene."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_kda
from kda_testing import make_problem, rel_err
from oracle import oracle_kda


def _base():
    return make_problem(B=1, T=6, H=2, HV=4, K=4, V=3, seed=0, dtype=torch.float32,
                        output_final_state=True)


def _mutate(**changes):
    """A call with some arguments replaced; ``p`` is the base problem."""
    def build():
        p = _base()
        call = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
        for name, fn in changes.items():
            call[name] = fn(call) if callable(fn) else fn
        return call
    return build


# (case id, call builder, exception type, words the message must contain)
BAD_INPUTS = [
    ("q_not_tensor", _mutate(q=lambda c: c["q"].tolist()), TypeError, ["q", "torch.Tensor"]),
    ("q_int_dtype", _mutate(q=lambda c: c["q"].long()), TypeError, ["q", "dtype"]),
    ("q_3d", _mutate(q=lambda c: c["q"][0]), ValueError, ["q", "4-D"]),
    ("k_shape", _mutate(k=lambda c: c["k"][:, :, :1]), ValueError, ["k", "[B, T, H, K]"]),
    ("qkv_dtypes", _mutate(v=lambda c: c["v"].double()), TypeError, ["q, k and v", "float64"]),
    ("v_time", _mutate(v=lambda c: c["v"][:, :3]), ValueError, ["v", "[B, T, HV, V]"]),
    ("hv_not_multiple", _mutate(v=lambda c: c["v"][:, :, :3], g=lambda c: c["g"][:, :, :3],
                                beta=lambda c: c["beta"][:, :, :3]), ValueError, ["HV", "H"]),
    ("g_shape", _mutate(g=lambda c: c["g"][..., :2]), ValueError, ["g", "[B, T, HV, K]"]),
    ("beta_shape", _mutate(beta=lambda c: c["beta"][..., :1]), ValueError, ["beta", "[B, T, HV]"]),
    ("state_shape", _mutate(initial_state=lambda c: c["initial_state"][..., :2]), ValueError,
     ["initial_state", "[N, HV, K, V]"]),
    ("state_layout", _mutate(state_v_first=True), ValueError, ["initial_state", "state_v_first"]),
    ("cu_not_zero", _mutate(cu_seqlens=torch.tensor([1, 6])), ValueError, ["cu_seqlens[0]", "0"]),
    ("cu_decreasing", _mutate(cu_seqlens=torch.tensor([0, 4, 2, 6]),
                              initial_state=lambda c: c["initial_state"].repeat(3, 1, 1, 1)),
     ValueError, ["non-decreasing"]),
    ("cu_last", _mutate(cu_seqlens=torch.tensor([0, 5])), ValueError, ["cu_seqlens[-1]", "T = 6"]),
    ("cu_float", _mutate(cu_seqlens=torch.tensor([0.0, 6.0])), TypeError, ["cu_seqlens", "dtype"]),
    ("cu_2d", _mutate(cu_seqlens=torch.tensor([[0, 6]])), ValueError, ["cu_seqlens", "1-D"]),
    ("cu_batch", _mutate(q=lambda c: c["q"].repeat(2, 1, 1, 1), k=lambda c: c["k"].repeat(2, 1, 1, 1),
                         v=lambda c: c["v"].repeat(2, 1, 1, 1), g=lambda c: c["g"].repeat(2, 1, 1, 1),
                         beta=lambda c: c["beta"].repeat(2, 1, 1), cu_seqlens=torch.tensor([0, 6])),
     ValueError, ["B must be 1", "B=2"]),
    ("gate_no_params", _mutate(A_log=None, lower_bound=None), ValueError, ["A_log", "lower_bound"]),
    ("alog_shape", _mutate(A_log=lambda c: c["A_log"][:2]), ValueError, ["A_log", "[HV]"]),
    ("dt_bias_shape", _mutate(dt_bias=lambda c: c["dt_bias"][:5]), ValueError, ["dt_bias", "[HV * K]"]),
    ("lower_bound_positive", _mutate(lower_bound=0.5), ValueError, ["lower_bound", "0.5"]),
    ("lower_bound_type", _mutate(lower_bound="x"), TypeError, ["lower_bound"]),
    ("safe_gate_range", _mutate(safe_gate=True, lower_bound=-6.0), ValueError,
     ["safe_gate", "-5 <= lower_bound", "-6.0"]),
    ("safe_gate_none", _mutate(safe_gate=True, lower_bound=None), ValueError, ["safe_gate", "None"]),
    ("neg_eigval_without_sigmoid", _mutate(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False),
     ValueError, ["allow_neg_eigval", "use_beta_sigmoid_in_kernel"]),
    ("gate_params_without_gate", _mutate(use_gate_in_kernel=False), ValueError,
     ["A_log", "use_gate_in_kernel"]),
    ("chunk_size", _mutate(chunk_size=0), ValueError, ["chunk_size", "0"]),
    ("scale_type", _mutate(scale="big"), TypeError, ["scale"]),
    ("backend_name", _mutate(backend="cuda"), ValueError, ["backend", "'cuda'"]),
]


_CHUNK_ONLY = {"safe_gate_range", "safe_gate_none", "chunk_size"}  # fused_recurrent_kda lacks these
_CALLS = [(fn, *case) for fn in ("chunk_kda", "fused_recurrent_kda") for case in BAD_INPUTS
          if fn == "chunk_kda" or case[0] not in _CHUNK_ONLY]


@pytest.mark.parametrize("fn_name,case,build,exc,words", _CALLS,
                         ids=[f"{c[0]}-{c[1]}" for c in _CALLS])
def test_bad_input_raises_named_error(fn_name, case, build, exc, words):
    call = build()
    for backend in ("reference", "auto"):
        kwargs = dict(call)
        kwargs.setdefault("backend", backend)
        with pytest.raises(exc) as info:
            getattr(torch_kda, fn_name)(**kwargs)
        for word in words:
            assert word in str(info.value), f"{word!r} not in {info.value}"


def test_kda_gate_bad_inputs():
    g = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="A_log"):
        torch_kda.kda_gate(g, None)
    with pytest.raises(ValueError, match=r"A_log must have shape \[HV\]"):
        torch_kda.kda_gate(g, torch.randn(4))
    with pytest.raises(ValueError, match="lower_bound"):
        torch_kda.kda_gate(g, None, lower_bound=1.0)


def test_available_backends_reports_reasons():
    status = torch_kda.available_backends()
    assert set(status) == {"native", "reference", "fla"}
    assert status["reference"].available
    for name, st in status.items():
        assert st.available == (st.reason == ""), name
    # This CPU-only suite has no CUDA: FLA must say why it cannot run.
    assert not status["fla"].available and status["fla"].reason


def test_fla_backend_on_cpu_raises_runtime_error():
    p = _base()
    with pytest.raises(RuntimeError, match="CUDA"):
        torch_kda.chunk_kda(*p.args, **p.kwargs, backend="fla")


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_inputs_are_not_modified_and_noncontiguous_inputs_work(backend):
    p = make_problem(B=2, T=9, H=2, HV=4, K=5, V=3, seed=3, dtype=torch.float32)
    # Non-contiguous views: transpose a larger tensor back into shape.
    args = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in p.args]
    assert not any(a.is_contiguous() for a in args[:4])
    before = [t.clone() for t in list(args) + [v for v in p.kwargs.values() if isinstance(v, torch.Tensor)]]
    o, s = torch_kda.chunk_kda(*args, **p.kwargs, backend=backend)
    after = list(args) + [v for v in p.kwargs.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_dt_bias_accepts_both_shapes():
    p = make_problem(seed=4)
    o1, _ = torch_kda.chunk_kda(*p.args, **p.kwargs, backend="reference")
    kw = dict(p.kwargs, dt_bias=p.kwargs["dt_bias"].reshape(p.v.shape[2], -1))
    o2, _ = torch_kda.chunk_kda(*p.args, **kw, backend="reference")
    assert torch.equal(o1, o2)


def test_output_final_state_false_returns_none():
    p = make_problem(seed=5, output_final_state=False)
    for fn in (torch_kda.chunk_kda, torch_kda.fused_recurrent_kda):
        o, s = fn(*p.args, **p.kwargs)
        assert s is None and o.shape == p.v.shape


def test_nan_in_one_sequence_stays_in_that_sequence():
    p = make_problem(seqlens=(6, 5, 7), H=1, HV=2, seed=6, dtype=torch.float32)
    q = p.q.clone()
    q[0, 7, 0, 0] = float("nan")  # inside the second sequence
    o, s = torch_kda.chunk_kda(q, *p.args[1:], **p.kwargs, backend="reference")
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    assert torch.isnan(o[:, 6:11]).any()
    assert rel_err(o[:, :6], o_ref[:, :6]) < 1e-5 and rel_err(o[:, 11:], o_ref[:, 11:]) < 1e-5
    assert rel_err(s[[0, 2]], s_ref[[0, 2]]) < 1e-5


@pytest.mark.parametrize("form, backend, first_nan", [
    ("chunk", "native", 64), ("chunk", "reference", 64), ("recurrent", "native", 70)])
def test_nan_reaches_back_to_its_chunk_start_in_the_chunk_form_only(form, backend, first_nan):
    # docs/bad_inputs.md, "Values outside the domain": a NaN in k at token 70 reaches the outputs
    # from 70 on in the recurrent form, from its 64-token chunk's start (64) in the chunk form;
    # the outputs before that are those of the clean inputs.
    p = make_problem(B=1, T=160, H=2, seed=7, dtype=torch.float32)
    fn = torch_kda.chunk_kda if form == "chunk" else torch_kda.fused_recurrent_kda
    k = p.k.clone()
    k[0, 70, 1, 3] = float("nan")
    clean, _ = fn(*p.args, **p.kwargs, backend=backend)
    o, _ = fn(p.q, k, *p.args[2:], **p.kwargs, backend=backend)
    nan_tokens = torch.isnan(o[0]).flatten(1).any(-1).nonzero().flatten()
    assert nan_tokens.min().item() == first_nan
    assert torch.equal(o[:, :first_nan], clean[:, :first_nan])


def test_env_var_forces_reference_backend():
    code = ("import torch, torch_kda, torch_kda.api as api;"
            "x = torch.randn(1, 2, 1, 2); "
            "from torch_kda._checks import check_kda_inputs;"
            "c = check_kda_inputs(x, x, x, -x.abs(), x[..., 0].sigmoid(), None, None, False, False, False,"
            " False, False, False, None, False, None, None, None);"
            "print(api._resolve_backend('auto', c))")
    env = dict(os.environ, TORCH_KDA_BACKEND="reference")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "reference"


@pytest.mark.parametrize("fn", [torch_kda.fused_recurrent_kda, torch_kda.chunk_kda])
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_no_tokens_keeps_outputs_in_the_graph_on_every_backend(fn, backend):
    # T = 0 computes nothing, but o and the final state stay in the autograd graph (zero, empty
    # gradients) on every backend: the reference's were detached and loss.backward() raised there.
    p = make_problem(B=2, T=0, H=1, HV=2, K=5, V=3, gate="none", initial_state=False, seed=5)
    x = p.to(torch.float32, requires_grad=True)
    o, s = fn(*x.args, **x.kwargs, backend=backend)
    (o.sum() + s.sum()).backward()
    assert torch.equal(s, torch.zeros(2, 2, 5, 3))
    for name, t in x.tensors().items():
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any(), name
    s_only = fn(*x.args, **x.kwargs, backend=backend)[1]
    s_only.sum().backward()  # the state alone too


def test_numpy_integers_work_where_ints_do():
    # pad_slot_id=np.int64(-1) once raised "pad_slot_id must be an int, got int64"; chunk_size,
    # max_num_seqs and the layer's list of cu_seqlens took no NumPy integer either.
    import numpy as np  # (installed with the test requirements)
    from torch_kda.nn import KimiDeltaAttention

    p = make_problem(B=1, T=9, H=2, K=8, V=6, seed=3, dtype=torch.float32, seqlens=[4, 5])
    call = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    pool = torch.randn(4, 2, 8, 6)
    serving = dict(call, initial_state=None, output_final_state=False, inplace_final_state=True,
                   ssm_state_indices=torch.tensor([2, -1]))
    for fn in (torch_kda.fused_recurrent_kda, torch_kda.chunk_kda):
        o_int, pool_int = fn(**dict(serving, initial_state=pool.clone(), pad_slot_id=-1))
        o_np, pool_np = fn(**dict(serving, initial_state=pool.clone(), pad_slot_id=np.int64(-1)))
        assert torch.equal(o_int, o_np) and torch.equal(pool_int, pool_np)
    ref = dict(call, backend="reference")
    o_int, _ = torch_kda.chunk_kda(**ref, chunk_size=4)
    o_np, _ = torch_kda.chunk_kda(**ref, chunk_size=np.int32(4), use_graph=True,
                                  max_num_seqs=np.int64(2))
    assert torch.equal(o_int, o_np)
    layer = KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=8)
    x = torch.randn(1, 9, 16)
    with torch.no_grad():
        y_np = layer(x, cu_seqlens=list(np.array([0, 4, 9])))
        assert torch.equal(layer(x, cu_seqlens=[0, 4, 9]), y_np)
