"""The rows of docs/bad_inputs.md that tests/test_api.py (BAD_INPUTS) and tests/test_native.py do
not already pin down: Python-API rejections and native-op rejections seen from Python.

Each case names its row in the table (``row``). Nothing here may crash the process: every call
raises a Python exception whose message names the argument.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import torch_kda
from kda_testing import make_problem

OP_ARGS = ("scale", "initial_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
           "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "state_v_first",
           "cu_seqlens", "A_log", "dt_bias")


def _call(**changes):
    p = make_problem(B=1, T=6, H=2, HV=4, K=4, V=3, seed=21, dtype=torch.float32)
    call = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    for name, fn in changes.items():
        call[name] = fn(call) if callable(fn) else fn
    return call


def _empty_dim(dim: int, names):
    """Changes that give the named tensors size 0 along ``dim``."""
    return {n: (lambda c, n=n: c[n].narrow(dim, 0, 0)) for n in names}


# only the zero-sized dimension is wrong in the zero-dim rows
_NO_GATE = dict(initial_state=None, A_log=None, dt_bias=None, use_gate_in_kernel=False)

# (row in docs/bad_inputs.md, changes, exception, words the message must contain)
PY_CASES = [
    ("beta-ndim", dict(beta=lambda c: c["beta"][..., None]), ValueError, ["beta", "3-D"]),
    ("v-ndim", dict(v=lambda c: c["v"][0]), ValueError, ["v", "4-D"]),
    ("float-dtype", dict(beta=lambda c: c["beta"].int()), TypeError, ["beta", "dtype"]),
    ("float-dtype", dict(g=lambda c: c["g"].long()), TypeError, ["g", "dtype"]),
    ("device", dict(k=lambda c: c["k"].to("meta")), ValueError, ["k", "same device as q", "meta"]),
    ("device", dict(initial_state=lambda c: c["initial_state"].to("meta")), ValueError,
     ["initial_state", "device"]),
    ("device", dict(A_log=lambda c: c["A_log"].to("meta")), ValueError, ["A_log", "device"]),
    ("cu-device", dict(cu_seqlens=torch.tensor([0, 6], device="meta")), ValueError,
     ["cu_seqlens", "device"]),
    ("cu-count", dict(cu_seqlens=torch.tensor([0])), ValueError, ["cu_seqlens", "N + 1 >= 2"]),
    ("state-dtype", dict(initial_state=lambda c: c["initial_state"].long()), TypeError,
     ["initial_state", "dtype"]),
    ("state-ndim", dict(initial_state=lambda c: c["initial_state"][0]), ValueError,
     ["initial_state", "4-D"]),
    ("gate-param-dtype", dict(A_log=lambda c: c["A_log"].long()), TypeError, ["A_log", "dtype"]),
    ("gate-param-dtype", dict(dt_bias=lambda c: c["dt_bias"].int()), TypeError,
     ["dt_bias", "dtype"]),
    ("lower-bound-value", dict(lower_bound=-math.inf), ValueError, ["lower_bound", "-inf"]),
    ("lower-bound-value", dict(lower_bound=math.nan), ValueError, ["lower_bound", "nan"]),
    ("lower-bound-value", dict(lower_bound=0.0), ValueError, ["lower_bound", "0.0"]),
    ("scale", dict(scale=math.inf), ValueError, ["scale must be finite", "inf"]),
    ("scale", dict(scale=math.nan), ValueError, ["scale must be finite", "nan"]),
    # finite as a Python float, infinite in float32 (every output was NaN)
    ("scale", dict(scale=1e300), ValueError, ["scale must be finite", "float32", "1e+300"]),
    ("lower-bound-value", dict(lower_bound=-1e300), ValueError, ["lower_bound", "float32"]),
    ("scale", dict(scale=True), TypeError, ["scale"]),
    # flags read by their truth value made "False" mean True
    *[("flag-type", {flag: bad}, TypeError, [flag, "must be a bool"])
      for flag in ("output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                   "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first")
      for bad in ("False", torch.tensor(True), 1)],
    ("heads", _empty_dim(2, ("q", "k")), ValueError, ["H", "HV"]),
    # Zero-sized K, V or HV: the native op rejects them; the Python checks must too (a clean
    # ValueError in every backend). Known bugs when written, see docs/bad_inputs.md.
    ("zero-dim", dict(_empty_dim(3, ("q", "k", "g")), scale=1.0, **_NO_GATE), ValueError, ["K"]),
    ("zero-dim", dict(_empty_dim(3, ("q", "k", "g")), **_NO_GATE), ValueError, ["K"]),  # K ** -0.5
    ("zero-dim", dict(_empty_dim(3, ("v",)), **_NO_GATE), ValueError, ["V"]),
    ("zero-dim", dict(_empty_dim(2, ("v", "g", "beta")), **_NO_GATE), ValueError, ["HV"]),
]


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("row,changes,exc,words", PY_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(PY_CASES)])
def test_python_api_rejects(row, changes, exc, words, backend):
    for fn in (torch_kda.chunk_kda, torch_kda.fused_recurrent_kda):
        with pytest.raises(exc) as info:
            fn(**_call(**changes), backend=backend)
        for word in words:
            assert word in str(info.value), f"{row}: {word!r} not in {info.value}"


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("bad", ["False", torch.tensor(True), 1])
def test_chunk_kda_rejects_a_safe_gate_that_is_not_a_bool(bad, backend):  # row "flag-type"
    with pytest.raises(TypeError, match="safe_gate must be a bool"):
        torch_kda.chunk_kda(**_call(), safe_gate=bad, backend=backend)


def test_native_backend_rejects_non_cpu_tensors():  # row "native-device"
    # (No other device here: the rule itself, on checked inputs moved to the meta device.)
    from torch_kda import api
    from torch_kda._checks import check_kda_inputs
    p = make_problem(B=1, T=4, H=1, K=3, V=2, seed=22, dtype=torch.float32)
    x = check_kda_inputs(*p.args, scale=None, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                         use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                         safe_gate=False, lower_bound=None, state_v_first=False,
                         cu_seqlens=None, A_log=None, dt_bias=None)
    x.q = x.q.to("meta")
    with pytest.raises(ValueError, match="backend='native' runs on CPU tensors"):
        api._resolve_backend("native", x)


# Row "meta": every backend reads values; the meta device has none (was PyTorch's ".item() cannot
# be called on meta tensors" from a value check under reference / auto, and under native the
# advice to use the reference).
@pytest.mark.parametrize("backend", ["auto", "reference", "native", "fla"])
@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_kda"])
def test_meta_tensors_are_a_named_error_on_every_backend(fn, backend):
    p = make_problem(B=1, T=4, H=1, K=3, V=2, seed=22, dtype=torch.float32)
    args = [t.to("meta") for t in p.args]
    kw = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in p.kwargs.items()}
    with pytest.raises(ValueError, match="q is on the meta device, which holds no values"):
        getattr(torch_kda, fn)(*args, **kw, backend=backend)


def test_unknown_backend_in_environment(monkeypatch):  # row "backend"
    monkeypatch.setenv("TORCH_KDA_BACKEND", "gpu")
    p = make_problem(B=1, T=4, H=1, K=3, V=2, seed=23, dtype=torch.float32)
    with pytest.raises(ValueError, match="TORCH_KDA_BACKEND must be one of"):
        torch_kda.chunk_kda(*p.args, **p.kwargs)


def test_kda_gate_rejects_bad_g():  # row "kda_gate"
    with pytest.raises(TypeError, match="g must be a torch.Tensor"):
        torch_kda.kda_gate([1.0, 2.0], torch.zeros(2))
    with pytest.raises(ValueError, match=r"g must have at least 2 dims"):
        torch_kda.kda_gate(torch.randn(4), torch.zeros(4))
    with pytest.raises(ValueError, match=r"dt_bias must have shape"):
        torch_kda.kda_gate(torch.randn(3, 2, 4), torch.zeros(2), torch.zeros(7))


# ---- the native op called directly (torch.ops.kda.*): C++ checks seen from Python -------------

needs_native = pytest.mark.native  # documents the requirement; conftest.py fails fast without it


def _op_args(p, **changes):
    kw = dict(p.kwargs, scale=p.q.shape[-1] ** -0.5)
    defaults = dict(initial_state=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                    state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None)
    args = dict(zip(("q", "k", "v", "g", "beta"), p.args))
    args.update({n: kw.get(n, defaults.get(n)) for n in OP_ARGS})
    args.update(changes)
    return list(args.values())


def _op_problem(**kw):
    return make_problem(**{**dict(B=2, T=70, H=2, HV=4, K=5, V=3, gate="softplus", seed=24), **kw}
                        ).to(torch.float32)


OP_CASES = [
    ("zero-dim", lambda p: dict(q=p.q[..., :0], k=p.k[..., :0], g=p.g[..., :0], scale=1.0),
     "K = q.size(3) must be > 0"),
    ("zero-dim", lambda p: dict(v=p.v[..., :0], initial_state=None), "V = v.size(3) must be > 0"),
    ("zero-dim", lambda p: dict(v=p.v[:, :, :0], g=p.g[:, :, :0], beta=p.beta[:, :, :0],
                                initial_state=None, A_log=p.kwargs["A_log"][:0],
                                dt_bias=p.kwargs["dt_bias"][:0]), "got HV = 0"),
    ("heads", lambda p: dict(q=p.q[:, :, :0], k=p.k[:, :, :0]), "at least one head"),
    ("v-ndim", lambda p: dict(v=p.v[0]), "v must be 4-D"),
    ("beta-dtype", lambda p: dict(beta=p.beta.int()), "beta must be a floating tensor"),
    ("gate-param-dtype", lambda p: dict(A_log=p.kwargs["A_log"].long()),
     "A_log must be a floating tensor"),
    ("state-dtype", lambda p: dict(initial_state=p.kwargs["initial_state"].int()),
     "initial_state must be a floating tensor"),
    ("lower-bound-value", lambda p: dict(lower_bound=math.nan), "lower_bound must be a finite negative number"),
    ("lower-bound-value", lambda p: dict(lower_bound=-1e39), "float32 unless q is float64"),
    ("scale-range", lambda p: dict(scale=-1e39), "scale must be finite"),
    ("cu-count", lambda p: dict(cu_seqlens=torch.tensor([], dtype=torch.long)), "1-D"),
    ("state-layout", lambda p: dict(state_v_first=True), "initial_state must have shape"),
    # A meta tensor among CPU tensors selects the op's Meta kernel (higher dispatch priority),
    # which must check devices too (before 3b6d11c it returned an uninitialised CPU tensor).
    ("op-device", lambda p: dict(k=p.k.to("meta")), "k must be on the device of q"),
    ("op-device", lambda p: dict(cu_seqlens=torch.tensor([0, 70], device="meta"), q=p.q[:1],
                                 k=p.k[:1], v=p.v[:1], g=p.g[:1], beta=p.beta[:1],
                                 initial_state=p.kwargs["initial_state"][:1]), "cu_seqlens"),
]


@needs_native
@pytest.mark.parametrize("row,change,match", OP_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(OP_CASES)])
@pytest.mark.parametrize("op", ["fused_recurrent", "chunk"])  # one set of checks, both ops
def test_native_op_rejects(row, change, match, op):
    # C++ TORCH_CHECK_TYPE / TORCH_CHECK_VALUE: the Python API's exception types (TypeError for
    # dtypes, ValueError for values), not a bare RuntimeError; the message names the called op.
    p = _op_problem()
    exc = TypeError if "floating tensor" in match else ValueError
    with pytest.raises(exc, match=rf"^kda::{op}: .*{re.escape(match)}"):
        getattr(torch.ops.kda, op)(*_op_args(p, **change(p)))


@needs_native
@pytest.mark.parametrize("which,match", [
    ("grad_o_shape", "grad_o must have shape"),
    ("grad_o_dtype", "grad_o must be a floating tensor"),
    ("grad_state_shape", "grad_final_state must have shape"),
    ("grad_state_dtype", "grad_final_state must be a floating tensor"),
    ("checkpoints_shape", "checkpoints must have shape"),
    ("checkpoints_dtype", "checkpoints must be a floating tensor"),
])
@pytest.mark.parametrize("op", ["fused_recurrent_bwd", "chunk_bwd"])  # one check, both backwards
def test_native_backward_op_rejects(which, match, op):  # row "bwd-op"
    p = _op_problem()
    args = _op_args(p)
    o, s, ck = torch.ops.kda.fused_recurrent_fwd(*args)
    d_o, d_s = torch.randn_like(o), torch.randn_like(s)
    d_o, d_s, ck = {
        "grad_o_shape": (d_o[:, :5], d_s, ck),
        "grad_o_dtype": (d_o.int(), d_s, ck),
        "grad_state_shape": (d_o, d_s[:1], ck),
        "grad_state_dtype": (d_o, d_s.long(), ck),
        "checkpoints_shape": (d_o, d_s, ck[:1]),
        "checkpoints_dtype": (d_o, d_s, ck.int()),
    }[which]
    with pytest.raises(TypeError if "floating" in match else ValueError,
                       match=rf"^kda::{op}: {match}"):
        getattr(torch.ops.kda, op)(d_o, d_s, ck, *args)


# Several bad arguments at once: the first check in the order of _checks.check_kda_inputs raises
# (per tensor q, k, v, g, beta: type, dtype, rank; then q/k/v dtypes; shapes; devices; then the
# rest). The checks test the valid case at once and name the error only when that test fails,
# so these pin the order of the named checks behind it.
FIRST_ERROR = [
    ("k-dtype-before-g-shape", dict(k=lambda c: c["k"].long(), g=lambda c: c["g"][..., :2]),
     TypeError, "k must have a dtype in"),
    ("q-rank-before-qkv-dtypes", dict(q=lambda c: c["q"][0], k=lambda c: c["k"].double()),
     ValueError, "q must be 4-D"),
    ("beta-rank-before-qkv-dtypes", dict(v=lambda c: c["v"].double(), beta=lambda c: c["beta"][0]),
     ValueError, "beta must be 3-D"),
    ("qkv-dtypes-before-shapes", dict(v=lambda c: c["v"].double(), g=lambda c: c["g"][..., :2]),
     TypeError, "q, k and v must share a dtype"),
    ("g-rank-before-k-shape", dict(k=lambda c: c["k"][:, :3], g=lambda c: c["g"][0]),
     ValueError, "g must be 4-D"),
    ("heads-before-beta-shape", dict(v=lambda c: c["v"][:, :, :3], beta=lambda c: c["beta"][..., :1]),
     ValueError, "positive multiple of the query/key heads"),
    ("g-shape-before-device", dict(g=lambda c: c["g"][..., :2], k=lambda c: c["k"].to("meta")),
     ValueError, "g must have shape"),
    ("device-before-state-shape", dict(beta=lambda c: c["beta"].to("meta"),
                                       initial_state=lambda c: c["initial_state"][:, :1]),
     ValueError, "beta must be on the same device as q"),
    ("state-shape", dict(initial_state=lambda c: c["initial_state"][:, :1]),
     ValueError, "initial_state must have shape [N, HV, K, V]"),
]


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("changes,exc,words", [c[1:] for c in FIRST_ERROR], ids=[c[0] for c in FIRST_ERROR])
def test_python_api_names_the_first_error_of_several(changes, exc, words, backend):
    for fn in (torch_kda.fused_recurrent_kda, torch_kda.chunk_kda):
        with pytest.raises(exc, match=re.escape(words)):
            fn(**_call(**changes), backend=backend)


# ---- the environment knobs of the native ops (csrc/cpu/env_knob.h) -----------------------------

@needs_native
@pytest.mark.parametrize("knob,value", [("TORCH_KDA_DECODE_KERNEL", "Recurrent"),
                                        ("TORCH_KDA_DECODE_STREAM", "yes")])
def test_unknown_decode_knob_value_warns_and_is_ignored(knob, value, monkeypatch, capfd):
    # A typo must not silently pick another path: it warns and counts as unset (same result).
    # (A warning of an op called through torch.ops goes to stderr. K = V = 16: the final state's
    # rows fill whole vectors, where the stream knob is read.)
    p = _op_problem(T=1, K=16, V=16).to(torch.float32)
    o_unset, s_unset = torch.ops.kda.fused_recurrent(*_op_args(p))
    capfd.readouterr()
    monkeypatch.setenv(knob, value)
    o, s = torch.ops.kda.fused_recurrent(*_op_args(p))
    assert re.search(rf"{knob}={value} is not one of .*; ignored", capfd.readouterr().err)
    assert torch.equal(o, o_unset) and torch.equal(s, s_unset)


@needs_native
def test_unknown_isa_knob_value_warns_and_is_ignored():
    # The instruction set is chosen once per process: a fresh one, with a wrong case.
    import subprocess
    import sys
    code = ("import warnings, torch, torch_kda\n"
            "warnings.simplefilter('always')\n"
            "q = torch.randn(1, 3, 1, 16); g = -torch.rand(1, 3, 1, 16)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    torch_kda.fused_recurrent_kda(q, q, q, g, torch.rand(1, 3, 1), backend='native')\n"
            "print([str(x.message) for x in w if 'TORCH_KDA_ISA' in str(x.message)])\n")
    env = dict(__import__("os").environ, TORCH_KDA_ISA="AVX512")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "TORCH_KDA_ISA=AVX512 is not one of generic, avx2, avx512; ignored" in out.stdout + out.stderr
