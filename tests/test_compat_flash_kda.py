"""``torch_kda.compat.flash_kda.fwd``: FlashKDA's contract on CPU, checked against the reference.

The oracle is ``torch_kda.reference.chunk_kda`` in float64 with the flags FlashKDA implies
(q/k L2 norm, beta sigmoid, bounded gate with A_log, V-first state), run on the same (rounded)
input values; errors are relative RMS errors (``kda_testing.rel_err``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import torch_kda
from torch_kda.compat import flash_kda as fk
from kda_testing import rel_err

NATIVE = torch_kda.available_backends()["native"].available
BACKENDS = ["reference"] + (["native"] if NATIVE else [])


def make_call(B=2, T=23, H=2, D=16, *, seed=0, dtype=torch.bfloat16, state_dtype=torch.float32,
              seqlens=None, lower_bound=-5.0, with_state=True):
    """Fresh random FlashKDA-style arguments (raw q/k/g/beta logits, fp32 A_log/dt_bias [H, D])."""
    gen = torch.Generator().manual_seed(seed)
    if seqlens is not None:
        B, T = 1, sum(seqlens)
    N = len(seqlens) if seqlens is not None else B

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    args = dict(
        q=rnd(B, T, H, D).to(dtype), k=rnd(B, T, H, D).to(dtype), v=rnd(B, T, H, D).to(dtype),
        g=rnd(B, T, H, D).to(dtype), beta=rnd(B, T, H).to(dtype), scale=D ** -0.5,
        out=torch.full((B, T, H, D), float("nan"), dtype=dtype),
        A_log=rnd(H, scale=0.5).float(), dt_bias=rnd(H, D, scale=0.5).float(), lower_bound=lower_bound,
        initial_state=rnd(N, H, D, D, scale=0.5).to(state_dtype) if with_state else None,
        final_state=torch.full((N, H, D, D), float("nan"), dtype=state_dtype),
    )
    if seqlens is not None:
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(seqlens).cumsum(0)
        args["cu_seqlens"] = cu
    return args


def oracle(a):
    """Float64 reference with FlashKDA's flags; returns (out, final_state [N, H, V, K])."""
    d = lambda x: None if x is None else x.double()  # noqa: E731
    gate = dict(use_gate_in_kernel=True, lower_bound=a["lower_bound"], A_log=d(a["A_log"]),
                dt_bias=d(a["dt_bias"]))
    g = d(a["g"])
    if a["lower_bound"] == 0.0:
        gate, g = dict(use_gate_in_kernel=False), torch.zeros_like(g)
    return torch_kda.reference.chunk_kda(
        d(a["q"]), d(a["k"]), d(a["v"]), g, d(a["beta"]), scale=a["scale"],
        initial_state=d(a.get("initial_state")), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
        cu_seqlens=a.get("cu_seqlens"), **gate)


@pytest.mark.parametrize("backend", BACKENDS)
# bf16 state: FLA's accuracy bar (0.005, tests/test_chunk_products.py): on CPUs with AMX or AVX-512
# BF16 the native chunk kernel takes bf16 operands for the state products of bf16 inputs
# (TORCH_KDA_CHUNK_PRODUCTS=auto; 2.2e-3 measured on a Sapphire Rapids Xeon), elsewhere fp32 ones
# (~1e-7).
@pytest.mark.parametrize("dtype,tol_out,tol_state", [
    (torch.bfloat16, 1e-2, 5e-3), (torch.float32, 1e-5, 1e-5), (torch.float64, 1e-12, 1e-12)])
def test_fwd_matches_float64_reference(backend, dtype, tol_out, tol_state):
    a = make_call(dtype=dtype, state_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                  seed=1)
    o_ref, s_ref = oracle(a)
    assert fk.fwd(**a, backend=backend) is None
    assert a["out"].dtype == dtype and a["final_state"].dtype == a["initial_state"].dtype
    assert torch.isfinite(a["out"]).all() and torch.isfinite(a["final_state"]).all()
    assert rel_err(a["out"], o_ref) < tol_out
    assert rel_err(a["final_state"], s_ref) < tol_state


def test_fwd_flash_kda_shape_head_dim_128():
    """FlashKDA's own shape class: bf16, D = 128, fp32 states, default (auto) dispatch."""
    a = make_call(B=1, T=20, H=2, D=128, seed=2)
    o_ref, s_ref = oracle(a)
    fk.fwd(**a)
    assert rel_err(a["out"], o_ref) < 1e-2
    assert rel_err(a["final_state"], s_ref) < 1e-4


def test_fwd_positional_call_as_flash_kda():
    """The positional order of flash_kda.fwd: q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound."""
    a = make_call(seed=3)
    o_ref, s_ref = oracle(a)
    fk.fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], a["scale"], a["out"], a["A_log"],
           a["dt_bias"], a["lower_bound"], a["initial_state"], a["final_state"])
    assert rel_err(a["out"], o_ref) < 1e-2 and rel_err(a["final_state"], s_ref) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_matches_per_sequence_calls(backend):
    seqlens = [5, 0, 17, 9]
    a = make_call(seqlens=seqlens, dtype=torch.float32, seed=4)
    o_ref, s_ref = oracle(a)
    fk.fwd(**a, backend=backend)
    assert rel_err(a["out"], o_ref) < 1e-5 and rel_err(a["final_state"], s_ref) < 1e-5
    start = 0
    for i, n in enumerate(seqlens):
        sl = slice(start, start + n)
        one = {name: a[name][:, sl] for name in ("q", "k", "v", "g", "beta")}
        out = torch.empty_like(one["q"])
        fs = torch.empty_like(a["final_state"][i:i + 1])
        fk.fwd(**one, scale=a["scale"], out=out, A_log=a["A_log"], dt_bias=a["dt_bias"],
               lower_bound=a["lower_bound"], initial_state=a["initial_state"][i:i + 1],
               final_state=fs, backend=backend)
        assert rel_err(out, a["out"][:, sl]) < 1e-5 if n else out.numel() == 0
        assert rel_err(fs, a["final_state"][i:i + 1]) < 1e-5
        start += n


def test_zero_length_sequence_passes_state_through():
    a = make_call(seqlens=[4, 0, 3], dtype=torch.float32, seed=5)
    fk.fwd(**a)
    torch.testing.assert_close(a["final_state"][1], a["initial_state"][1], rtol=0, atol=0)


def test_bf16_states_are_read_and_written_in_bf16():
    a = make_call(state_dtype=torch.bfloat16, seed=6)
    o_ref, s_ref = oracle(a)
    fk.fwd(**a)
    assert a["final_state"].dtype == torch.bfloat16
    assert rel_err(a["out"], o_ref) < 1e-2 and rel_err(a["final_state"], s_ref) < 1e-2


def test_no_initial_state_means_zeros():
    a = make_call(with_state=False, dtype=torch.float32, seed=7)
    b = dict(a, initial_state=torch.zeros_like(a["final_state"]), out=torch.empty_like(a["out"]),
             final_state=torch.empty_like(a["final_state"]))
    fk.fwd(**a)
    fk.fwd(**b)
    torch.testing.assert_close(a["out"], b["out"])
    torch.testing.assert_close(a["final_state"], b["final_state"])


def test_final_state_may_alias_initial_state():
    """Decoding loops update the state in place: final_state is initial_state."""
    a = make_call(dtype=torch.float32, seed=8)
    o_ref, s_ref = oracle(a)
    state = a["initial_state"].clone()
    fk.fwd(**dict(a, initial_state=state, final_state=state))
    assert rel_err(state, s_ref) < 1e-5


def test_inputs_untouched_and_no_autograd_graph():
    a = make_call(dtype=torch.float32, seed=9)
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
        a[name].requires_grad_(True)
    before = {n: a[n].detach().clone() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")}
    fk.fwd(**a)
    for n, x in before.items():
        assert torch.equal(a[n].detach(), x), n
    assert not a["out"].requires_grad and a["out"].grad_fn is None


def test_non_contiguous_buffers_are_written():
    a = make_call(dtype=torch.float32, seed=10)
    o_ref, s_ref = oracle(a)
    out = torch.full((a["out"].shape[0], a["out"].shape[2], a["out"].shape[1], a["out"].shape[3]),
                     float("nan")).transpose(1, 2)
    fs = torch.full_like(a["final_state"], float("nan")).transpose(-1, -2).contiguous().transpose(-1, -2)
    q = a["q"].transpose(1, 2).contiguous().transpose(1, 2)
    fk.fwd(**dict(a, q=q, out=out, final_state=fs))
    assert not out.is_contiguous() and rel_err(out, o_ref) < 1e-5 and rel_err(fs, s_ref) < 1e-5


def test_lower_bound_zero_means_no_decay():
    a = make_call(dtype=torch.float32, lower_bound=0.0, seed=11)
    o_ref, s_ref = oracle(a)
    fk.fwd(**a)
    assert rel_err(a["out"], o_ref) < 1e-5 and rel_err(a["final_state"], s_ref) < 1e-5


def test_dt_bias_flat_and_int32_cu_seqlens_accepted():
    a = make_call(seqlens=[6, 7], dtype=torch.float32, seed=12)
    o_ref, s_ref = oracle(a)
    fk.fwd(**dict(a, dt_bias=a["dt_bias"].reshape(-1), cu_seqlens=a["cu_seqlens"].int()))
    assert rel_err(a["out"], o_ref) < 1e-5 and rel_err(a["final_state"], s_ref) < 1e-5


def test_real_flash_kda_is_called_when_it_qualifies(monkeypatch):
    """With FlashKDA 'available', fwd forwards FlashKDA's exact arguments (dt_bias [H, D], int64
    cu_seqlens, contiguous tensors, keyword names) and nothing else runs."""
    seen = {}

    def fake_fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
                 final_state=None, cu_seqlens=None):
        seen.update(scale=scale, dt_bias=tuple(dt_bias.shape), cu=cu_seqlens.dtype,
                    contiguous=all(x.is_contiguous() for x in (q, k, v, g, beta, out)))
        fk.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
               final_state, cu_seqlens, backend="reference")

    monkeypatch.setitem(sys.modules, "flash_kda", types.SimpleNamespace(fwd=fake_fwd))
    monkeypatch.setattr(fk, "flash_kda_unavailable_reason", lambda *a, **kw: None)
    a = make_call(seqlens=[5, 8], dtype=torch.float32, seed=13)
    o_ref, s_ref = oracle(a)
    fk.fwd(**dict(a, dt_bias=a["dt_bias"].reshape(-1), cu_seqlens=a["cu_seqlens"].int(),
                  k=a["k"].transpose(1, 2).contiguous().transpose(1, 2)))
    assert seen == dict(scale=a["scale"], dt_bias=(2, 16), cu=torch.int64, contiguous=True)
    assert rel_err(a["out"], o_ref) < 1e-5 and rel_err(a["final_state"], s_ref) < 1e-5


def test_flash_kda_unavailable_reasons_on_cpu(monkeypatch):
    a = make_call()
    assert fk.flash_kda_unavailable_reason(a["q"]) is not None
    monkeypatch.setenv("TORCH_KDA_FLASH_KDA", "0")
    assert "TORCH_KDA_FLASH_KDA" in fk.flash_kda_unavailable_reason(a["q"])
    monkeypatch.delenv("TORCH_KDA_FLASH_KDA")
    with pytest.raises(RuntimeError, match="backend='flash_kda'"):
        fk.fwd(**a, backend="flash_kda")


def _bad(**changes):
    def build():
        a = make_call(B=1, T=5, H=2, D=4, seed=14)
        for name, fn in changes.items():
            a[name] = fn(a) if callable(fn) else fn
        return a
    return build


BAD = [
    ("q_list", _bad(q=lambda a: a["q"].tolist()), TypeError, ["q", "torch.Tensor"]),
    ("q_int", _bad(q=lambda a: a["q"].long()), TypeError, ["q", "dtype"]),
    ("k_dtype", _bad(k=lambda a: a["k"].float()), TypeError, ["k", "dtype of q"]),
    ("v_heads", _bad(v=lambda a: a["v"].repeat(1, 1, 2, 1)), ValueError, ["v", "[B, T, H, D]"]),
    ("out_shape", _bad(out=lambda a: a["out"][:, :3]), ValueError, ["out", "[B, T, H, D]"]),
    ("g_3d", _bad(g=lambda a: a["g"][0]), ValueError, ["g", "4-D"]),
    ("beta_shape", _bad(beta=lambda a: a["beta"][:, :, :1]), ValueError, ["beta", "[B, T, H]"]),
    ("scale_str", _bad(scale="0.5"), TypeError, ["scale"]),
    ("A_log_shape", _bad(A_log=lambda a: a["A_log"][:1]), ValueError, ["A_log", "[H]"]),
    ("A_log_bf16", _bad(A_log=lambda a: a["A_log"].bfloat16()), TypeError, ["A_log", "dtype"]),
    ("A_log_none", _bad(A_log=None), TypeError, ["A_log"]),
    ("dt_bias_shape", _bad(dt_bias=lambda a: a["dt_bias"][:, :3]), ValueError, ["dt_bias", "[H, D]"]),
    ("lb_low", _bad(lower_bound=-6.0), ValueError, ["lower_bound", "[-5, 0]"]),
    ("lb_pos", _bad(lower_bound=0.5), ValueError, ["lower_bound", "[-5, 0]"]),
    ("lb_none", _bad(lower_bound=None), TypeError, ["lower_bound"]),
    ("state_shape", _bad(initial_state=lambda a: a["initial_state"][:, :1]), ValueError,
     ["initial_state", "[N, H, V, K]"]),
    ("state_dtypes", _bad(final_state=lambda a: a["final_state"].bfloat16()), TypeError,
     ["initial_state and final_state", "dtype"]),
    ("state_fp16", _bad(final_state=lambda a: a["final_state"].half(), initial_state=None), TypeError,
     ["final_state", "dtype"]),
    ("cu_float", _bad(cu_seqlens=torch.tensor([0.0, 5.0])), TypeError, ["cu_seqlens", "dtype"]),
    ("cu_start", _bad(cu_seqlens=torch.tensor([1, 5])), ValueError, ["cu_seqlens[0]", "0"]),
    ("cu_end", _bad(cu_seqlens=torch.tensor([0, 4])), ValueError, ["cu_seqlens[-1]", "T = 5"]),
    ("cu_decreasing", _bad(cu_seqlens=torch.tensor([0, 4, 3, 5]),
                           initial_state=None, final_state=torch.zeros(3, 2, 4, 4)),
     ValueError, ["non-decreasing"]),
    ("backend", _bad(), ValueError, ["backend"]),
    # written in place while FlashKDA reads: no aliasing (final_state may be initial_state)
    ("out_is_q", _bad(out=lambda a: a["q"]), ValueError, ["out shares memory with q"]),
    ("out_expanded", _bad(out=lambda a: a["out"][:, :1].expand(a["out"].shape)), ValueError,
     ["out has elements that share memory"]),
    ("final_state_in_out", _bad(out=lambda a: a["out"].float(), q=lambda a: a["q"].float(),
                                k=lambda a: a["k"].float(), v=lambda a: a["v"].float(),
                                g=lambda a: a["g"].float(), beta=lambda a: a["beta"].float(),
                                initial_state=None,
                                final_state=lambda a: a["out"].view(-1)[:32].view(1, 2, 4, 4)),
     ValueError, ["out shares memory with final_state"]),
]


@pytest.mark.parametrize("build,exc,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_raise_named_errors(build, exc, words):
    a = build()
    kwargs = dict(backend="nope") if words == ["backend"] else {}
    with pytest.raises(exc) as info:
        fk.fwd(**a, **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_cu_seqlens_requires_batch_one():
    a = make_call(B=2, T=5, H=2, D=4, seed=15)
    a["cu_seqlens"] = torch.tensor([0, 5])
    with pytest.raises(ValueError, match="B must be 1"):
        fk.fwd(**a)
