"""The functional API's one-call path for plain native calls (``_native.fused_recurrent_fast``,
the op ``kda::_fused_recurrent_fast``): it returns what the checked path returns, bit for bit, and
refuses, without raising in C++, every call the Python checks reject (so their errors stay)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_kda
from torch_kda import _checks, _native
from kda_testing import make_problem, rel_err
from oracle import oracle_kda
from test_api import BAD_INPUTS
from test_bad_inputs import FIRST_ERROR, PY_CASES, _call

_FAST = "_fused_recurrent_fast"


def _checked(call):
    """The checked path: check_kda_inputs, then kda::_fused_recurrent_checked."""
    x = _checks.check_kda_inputs(
        call["q"], call["k"], call["v"], call["g"], call["beta"], call.get("scale"),
        call.get("initial_state"), call.get("output_final_state", False),
        call.get("use_qk_l2norm_in_kernel", False), call.get("use_gate_in_kernel", False),
        call.get("use_beta_sigmoid_in_kernel", False), call.get("allow_neg_eigval", False), False,
        call.get("lower_bound"), call.get("state_v_first", False), call.get("cu_seqlens"),
        call.get("A_log"), call.get("dt_bias"))
    return _native.fused_recurrent(x)


def _spy(monkeypatch, name):
    """Records the status of every call of the op ``name`` made through the API (the direct
    callables of _native.direct); an exception raised by the op itself is recorded and re-raised,
    so a test can tell a refusal (a status) from a C++ error."""
    op = _native.direct(name)
    seen = []

    def spy(*args):
        try:
            r = op(*args)
        except Exception as exc:  # noqa: BLE001 - any raise from the probe is the failure
            seen.append(exc)
            raise
        seen.append(r[2])
        return r

    monkeypatch.setitem(_native._DIRECT, name, spy)
    return seen


@pytest.fixture
def fast_calls(monkeypatch):
    """Statuses of kda::_fused_recurrent_fast (the plain call)."""
    return _spy(monkeypatch, _FAST)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("gate", ["none", "softplus", "bounded_no_alog"])
def test_fast_path_equals_checked_path_and_oracle(dtype, T, v_first, gate, fast_calls):
    p = make_problem(B=3, T=T, H=2, HV=4, K=16, V=8, seed=T + 7 * v_first, dtype=dtype,
                     gate=gate, l2norm=gate != "none", beta_sigmoid=gate != "none",
                     state_v_first=v_first)
    call = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    for backend in ("native", "auto"):
        o, s = torch_kda.fused_recurrent_kda(**call, backend=backend)
        o_ref, s_ref = _checked(call)
        assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    assert fast_calls == [-1, -1]  # both calls ran on the one-call path
    o64, s64 = oracle_kda(*[t.double() for t in p.args],
                          **{n: (t.double() if isinstance(t, torch.Tensor) else t)
                             for n, t in p.kwargs.items()})
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(o.double(), o64) < tol and rel_err(s.double(), s64) < tol


@pytest.mark.parametrize("K", [1, 3, 7, 100, 128])
def test_default_scale_is_pythons(K, fast_calls):
    # scale=None is K ** -0.5 in C++ too: fp64 outputs equal those with the Python float passed
    p = make_problem(B=1, T=1, H=1, K=K, V=4, seed=K, gate="none", l2norm=False,
                     beta_sigmoid=False)
    call = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    o_none, _ = torch_kda.fused_recurrent_kda(**call, backend="native")
    o_given, _ = torch_kda.fused_recurrent_kda(**call, scale=K ** -0.5, backend="native")
    assert torch.equal(o_none, o_given) and fast_calls == [-1, -1]


@pytest.mark.parametrize("case,build,exc,words",
                         [c for c in BAD_INPUTS if c[0] not in ("safe_gate_range", "safe_gate_none",
                                                                "chunk_size")],
                         ids=[c[0] for c in BAD_INPUTS if c[0] not in ("safe_gate_range",
                                                                      "safe_gate_none", "chunk_size")])
def test_bad_inputs_are_refused_without_a_cpp_error(case, build, exc, words, fast_calls):
    with pytest.raises(exc) as info:
        torch_kda.fused_recurrent_kda(**{"backend": "native", **build()})
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert not str(info.value).startswith("kda::")  # the Python checks' words, not the op's
    assert all(s == _native._REFUSED for s in fast_calls), fast_calls


@pytest.mark.parametrize("changes,exc,words", [c[1:] for c in PY_CASES]
                         + [c[1:] for c in FIRST_ERROR],
                         ids=[f"py-{i}" for i in range(len(PY_CASES))]
                         + [c[0] for c in FIRST_ERROR])
def test_python_case_rows_are_refused_without_a_cpp_error(changes, exc, words, fast_calls):
    with pytest.raises(exc) as info:
        torch_kda.fused_recurrent_kda(**_call(**changes), backend="native")
    assert not str(info.value).startswith("kda::"), info.value
    assert all(s == _native._REFUSED for s in fast_calls), fast_calls


def test_python_only_argument_types_take_the_checked_path(fast_calls):
    p = make_problem(B=1, T=1, H=2, K=8, V=4, seed=3, dtype=torch.float32)
    call = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    ref, _ = torch_kda.fused_recurrent_kda(**call, backend="native")
    # accepted by the checks (an int scale), not by the op's argument parser as the checks read
    # it: the checked path runs it, with the same result (a flag that is not a bool is an error,
    # docs/bad_inputs.md row 53)
    o, _ = torch_kda.fused_recurrent_kda(**dict(call, scale=1), backend="native")
    o_ref, _ = torch_kda.fused_recurrent_kda(**dict(call, scale=1.0), backend="native")
    assert torch.equal(o, o_ref) and fast_calls == [-1, -1]
    assert rel_err(ref, o) > 0  # the scale changed the result: the int was used


def test_unstable_write_warning_from_the_fast_path(fast_calls):
    p = make_problem(B=1, T=1, H=1, K=8, V=4, seed=5, dtype=torch.float32, gate="none",
                     l2norm=False, beta_sigmoid=False)
    k = p.k.clone()
    k[0, 0, 0] = 1.0  # ||k||^2 = 8, beta * ||k||^2 > 2
    beta = torch.full_like(p.beta, 0.5)
    with pytest.warns(UserWarning, match=r"beta \* \|\|k\|\|\^2 = 4 > 2 at \[0, 0, 0\]") as rec:
        torch_kda.fused_recurrent_kda(p.q, k, p.v, p.g, beta, **p.kwargs, backend="native")
    assert fast_calls == [0]
    assert rec[0].filename == torch_kda.api.__file__  # attributed as the checked path's is


def test_environment_backend_keeps_auto_off_the_fast_path(monkeypatch, fast_calls):
    p = make_problem(B=1, T=1, H=2, K=8, V=4, seed=6, dtype=torch.float32)
    monkeypatch.setenv("TORCH_KDA_BACKEND", "reference")
    o, _ = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs)
    assert fast_calls == []
    o_ref, _ = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="reference")
    assert torch.equal(o, o_ref)


def test_gradients_through_the_fast_path(fast_calls):
    p = make_problem(B=2, T=3, H=2, K=8, V=4, seed=8, dtype=torch.float64)
    grads = []
    for run in ("fast", "checked", "reference"):
        args = [t.clone().requires_grad_() for t in p.args]
        call = dict(zip(("q", "k", "v", "g", "beta"), args), **p.kwargs)
        if run == "fast":
            o, s = torch_kda.fused_recurrent_kda(**call, backend="native")
        elif run == "checked":
            o, s = _checked(call)
        else:
            o, s = torch_kda.fused_recurrent_kda(**call, backend="reference")
        (o.sum() + s.square().sum()).backward()
        grads.append([a.grad for a in args])
    assert fast_calls == [-1]
    for fast, checked, ref in zip(*grads):
        assert torch.equal(fast, checked) and rel_err(fast, ref) < 1e-10


# ---- serving calls: kda::_fused_recurrent_serving_fast ----------------------------------------

_SRV = "_fused_recurrent_serving_fast"


@pytest.fixture
def serving_calls(monkeypatch):
    """Statuses of kda::_fused_recurrent_serving_fast (serving calls)."""
    return _spy(monkeypatch, _SRV)


def _serving_checked(call):
    """The checked serving path: check_serving_inputs, then _native.serving."""
    c = dict(call)
    x, srv = _checks.check_serving_inputs(
        c.pop("q"), c.pop("k"), c.pop("v"), c.pop("g"), c.pop("beta"), c.pop("scale", None),
        c.pop("initial_state", None), c.pop("output_final_state", False),
        c.pop("use_qk_l2norm_in_kernel", False), c.pop("use_gate_in_kernel", False),
        c.pop("use_beta_sigmoid_in_kernel", False), c.pop("allow_neg_eigval", False), False,
        c.pop("lower_bound", None), c.pop("state_v_first", False), c.pop("cu_seqlens", None),
        c.pop("A_log", None), c.pop("dt_bias", None), **c)
    return _native.serving(x, srv)


def _serving_cases(v_first):
    """(name, call) of serving calls: pools with pads, fresh final states, out=, head-wise beta,
    speculative snapshots, packed decode tokens."""
    HV, K, V = 4, 16, 8
    gen = torch.Generator().manual_seed(11 + v_first)
    per_slot = (HV, V, K) if v_first else (HV, K, V)

    def pool(n, dtype=torch.float32):
        return (torch.randn(n, *per_slot, generator=gen) * 0.5).to(dtype)

    dec = make_problem(B=4, T=1, H=2, HV=HV, K=K, V=V, seed=12, initial_state=False,
                       output_final_state=False, dtype=torch.float32)
    base = {**dict(zip(("q", "k", "v", "g", "beta"), dec.args)), **dec.kwargs, "state_v_first": v_first}
    spec = make_problem(B=2, T=3, H=2, HV=HV, K=K, V=V, seed=13, initial_state=False,
                        output_final_state=False, dtype=torch.float32)
    spec_call = {**dict(zip(("q", "k", "v", "g", "beta"), spec.args)), **spec.kwargs,
                 "state_v_first": v_first}
    packed = make_problem(seqlens=(1, 1, 1), H=2, HV=HV, K=K, V=V, seed=14, initial_state=False,
                          output_final_state=False, dtype=torch.float32)
    packed_call = {**dict(zip(("q", "k", "v", "g", "beta"), packed.args)), **packed.kwargs,
                   "state_v_first": v_first}
    headwise = torch.rand(4, 1, HV, V, generator=gen)
    return [
        ("pool in place, pads", dict(base, initial_state=pool(9), inplace_final_state=True,
                                     ssm_state_indices=torch.tensor([7, -1, 0, 3], dtype=torch.int32))),
        ("bf16 pool, out=", dict(base, initial_state=pool(6, torch.bfloat16), inplace_final_state=True,
                                 ssm_state_indices=torch.tensor([5, 1, 2, 0]),
                                 out=torch.full((4, 1, HV, V), float("nan")))),
        ("pool read only, fresh final", dict(base, initial_state=pool(5),
                                             ssm_state_indices=torch.tensor([4, 1, -1, 0]),
                                             output_final_state=True)),
        ("out= only", dict(base, out=torch.empty(4, 1, HV, V), initial_state=pool(4),
                           output_final_state=True)),
        ("head-wise beta", dict(base, beta=headwise, use_beta_sigmoid_in_kernel=False,
                                initial_state=pool(4), output_final_state=True)),
        ("pad_slot_id", dict(base, initial_state=pool(6), inplace_final_state=True, pad_slot_id=5,
                             ssm_state_indices=torch.tensor([5, 0, 1, 2]))),
        ("snapshots", dict(spec_call, initial_state=pool(8), inplace_final_state=True,
                           ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]]),
                           num_accepted_tokens=torch.tensor([2, 1]))),
        ("packed decode", dict(packed_call, initial_state=pool(5), inplace_final_state=True,
                               ssm_state_indices=torch.tensor([4, 0, 2]))),
    ]


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("case", range(8))
def test_serving_fast_path_equals_checked_path(v_first, case, serving_calls):
    name, call = _serving_cases(v_first)[case]

    def fresh(c):  # the written tensors copied, so that both runs start from the same values
        return {n: (t.clone() if n in ("initial_state", "out") and t is not None else t)
                for n, t in c.items()}

    a, b = fresh(call), fresh(call)
    with torch.no_grad():
        o, s = torch_kda.fused_recurrent_kda(**a, backend="native")
        o_ref, s_ref = _serving_checked(b)
    assert serving_calls == [-1], name
    assert torch.equal(o, o_ref), name
    assert (s is None) == (s_ref is None) and (s is None or torch.equal(s, s_ref)), name
    if call.get("out") is not None:
        assert o is a["out"]
    if call.get("inplace_final_state"):
        assert s is a["initial_state"] and torch.equal(a["initial_state"], b["initial_state"])


def _serving_bad_calls():
    """Serving calls the checks reject: tests/test_serving.py's, aliasing and grad cases."""
    from test_serving import _aliased_pools, _bad_calls, _decode_problem, _pool

    calls = []
    for name, p, extra, exc, match in _bad_calls():
        calls.append((name, dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs,
                                 initial_state=_pool(8, 4, 16, 24, False),
                                 inplace_final_state=True, **extra), exc, match))
    p = _decode_problem(N=2)
    base = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    for name, pool in _aliased_pools():
        calls.append((name, dict(base, initial_state=pool, ssm_state_indices=torch.tensor([1, 3]),
                                 inplace_final_state=True), ValueError, "overlap"))
    calls += [
        ("out is q", dict(base, out=base["v"]), ValueError, "out shares memory with v"),
        ("out dtype", dict(base, out=torch.empty(2, 1, 4, 24, dtype=torch.float64)), TypeError,
         "out must have the dtype of q"),
        ("pool dtype", dict(base, initial_state=_pool(3, 4, 16, 24, False).half(),
                            ssm_state_indices=torch.tensor([0, 1]), inplace_final_state=True),
         TypeError, "float32"),
        ("q requires grad", dict(base, q=base["q"].clone().requires_grad_(),
                                 initial_state=_pool(3, 4, 16, 24, False),
                                 ssm_state_indices=torch.tensor([0, 2]), inplace_final_state=True),
         ValueError, "inference only"),
        ("head-wise beta with grad", dict(base, beta=torch.rand(2, 1, 4, 24, requires_grad=True),
                                          use_beta_sigmoid_in_kernel=False), ValueError,
         "forward only"),
        ("head-wise beta shape", dict(base, beta=torch.rand(2, 1, 4, 5)), ValueError, "head-wise"),
        ("cu_seqlens count", dict(base, cu_seqlens=torch.tensor([0]),
                                  out=torch.empty(2, 1, 4, 24)), ValueError, "cu_seqlens"),
    ]
    return calls


@pytest.mark.parametrize("case", range(len(_serving_bad_calls())))
def test_bad_serving_calls_are_refused_without_a_cpp_error(case, serving_calls):
    name, call, exc, match = _serving_bad_calls()[case]
    pool = call.get("initial_state")
    before = None if pool is None else pool.clone()
    with pytest.raises(exc, match=match) as info:
        torch_kda.fused_recurrent_kda(**call, backend="native")
    assert not str(info.value).startswith("kda::"), info.value
    assert all(s == _native._REFUSED for s in serving_calls), (name, serving_calls)
    assert pool is None or torch.equal(pool, before), name
