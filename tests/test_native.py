"""The native C++ CPU operator (torch.ops.kda.*) against the pure-PyTorch reference.

Covers every feature combination (forward and gradients), bf16/fp16 accuracy by ratio, gradcheck
in float64 on all inputs, torch.library.opcheck, torch.compile(fullgraph=True) through forward and
backward, bitwise determinism across thread counts, the second-order error and bad inputs.
Shapes are small (K, V not powers of two, K != V) so the file runs in well under two minutes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_kda
from kda_testing import (GATES, OP_ARGS, assert_compiled_grads_match, grads, make_problem, op_args,
                         per_thread_count, rel_err, stable_seed)
from torch_kda import reference

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def native(p):
    return torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="native")


FLAG_SETS = [  # (l2norm, beta_sigmoid, neg_eigval)
    (True, True, False),
    (False, False, False),
    (True, True, True),
]
CASES = list(itertools.product(GATES, (1, 2), (False, True), (False, True), (False, True),
                               FLAG_SETS))


@pytest.mark.parametrize("gate,group,varlen,state_v_first,init,flags", CASES)
def test_native_matches_reference_every_feature(gate, group, varlen, state_v_first, init, flags):
    l2, sig, neg = flags
    seed = stable_seed(gate, group, varlen, state_v_first, init, flags)
    p = make_problem(B=2, T=21, H=2, HV=2 * group, K=7, V=11, gate=gate, l2norm=l2,
                     beta_sigmoid=sig, neg_eigval=neg, state_v_first=state_v_first,
                     initial_state=init, seqlens=(6, 0, 1, 14) if varlen else None, seed=seed)
    # float64: forward and every gradient within 1e-10 of the reference.
    p64 = p.to(torch.float64, requires_grad=True)
    o_ref, s_ref = reference.fused_recurrent_kda(*p64.args, **p64.kwargs)
    o_nat, s_nat = native(p64)
    assert o_nat.dtype == torch.float64 and s_nat.dtype == torch.float64
    assert rel_err(o_nat, o_ref) <= 1e-10 and rel_err(s_nat, s_ref) <= 1e-10
    g_ref = grads(lambda x: reference.fused_recurrent_kda(*x.args, **x.kwargs), p64)
    g_nat = grads(native, p64)
    for name, gr in g_ref.items():
        assert g_nat[name] is not None, name
        assert g_nat[name].shape == gr.shape and g_nat[name].dtype == gr.dtype, name
        assert rel_err(g_nat[name], gr) <= 1e-10, name
    # float32: within 1e-5 of the float64 reference.
    p32 = p.to(torch.float32)
    o32, s32 = native(p32)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    assert rel_err(o32, o_ref) <= 1e-5 and rel_err(s32, s_ref) <= 1e-5


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("gate", ["softplus", "bounded", "none"])
def test_whole_vector_rows_match_reference(K, gate):
    # K a multiple of the pre-processing pass's vector group (64 floats under AVX2, 128 under
    # AVX-512) takes its whole-vector path (csrc/cpu/kernels/recurrent_kernels.cpp, prep_tokens);
    # the K of the feature matrix above take the general one. GVA, varlen, every flag in the op.
    seed = stable_seed("whole", K, gate)
    p = make_problem(B=1, T=19, H=1, HV=2, K=K, V=9, gate=gate, seqlens=(7, 12), seed=seed)
    p64 = p.to(torch.float64, requires_grad=True)
    o_ref, s_ref = reference.fused_recurrent_kda(*p64.args, **p64.kwargs)
    o_nat, s_nat = native(p64)
    assert rel_err(o_nat, o_ref) <= 1e-10 and rel_err(s_nat, s_ref) <= 1e-10
    g_ref = grads(lambda x: reference.fused_recurrent_kda(*x.args, **x.kwargs), p64)
    g_nat = grads(native, p64)
    for name, gr in g_ref.items():
        assert rel_err(g_nat[name], gr) <= 1e-10, name
    p32 = p.to(torch.float32, requires_grad=True)
    o32, s32 = native(p32)
    assert rel_err(o32, o_ref) <= 1e-5 and rel_err(s32, s_ref) <= 1e-5
    g32 = grads(native, p32)
    for name, gr in g_ref.items():
        assert rel_err(g32[name], gr) <= 1e-4, name
    for dtype in (torch.bfloat16, torch.float16):  # 16-bit inputs widened by the pass
        pl = p.to(dtype)
        o_low, _ = reference.fused_recurrent_kda(*pl.args, **pl.kwargs)
        o_nat_low, _ = native(pl)
        assert rel_err(o_nat_low, o_ref) <= 2 * rel_err(o_low, o_ref) + 1e-6, dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_low_precision_error_at_most_twice_reference(dtype, gate):
    p = make_problem(B=2, T=40, H=2, HV=4, K=13, V=19, gate=gate, seed=7)
    o64, s64 = reference.fused_recurrent_kda(*p.args, **p.kwargs)
    pl = p.to(dtype)
    o_ref, s_ref = reference.fused_recurrent_kda(*pl.args, **pl.kwargs)
    o_nat, s_nat = native(pl)
    assert o_nat.dtype == dtype and s_nat.dtype == torch.float32
    assert rel_err(o_nat, o64) <= 2 * rel_err(o_ref, o64) + 1e-6
    assert rel_err(s_nat, s64) <= 2 * rel_err(s_ref, s64) + 1e-6
    # gradients arrive in each input's dtype
    g = grads(native, p.to(dtype, requires_grad=True))
    for name, t in p.to(dtype).tensors().items():
        assert g[name].dtype == t.dtype, name


@pytest.mark.parametrize("gate,varlen,group", [("softplus", False, 2), ("bounded", True, 1),
                                               ("bounded_no_alog", False, 1), ("none", True, 2)])
def test_gradcheck_all_inputs(gate, varlen, group):
    p = make_problem(B=2, T=9, H=1, HV=group, K=3, V=4, gate=gate, seed=11,
                     neg_eigval=gate == "bounded", seqlens=(3, 0, 6) if varlen else None)
    p = p.to(torch.float64, requires_grad=True)
    ts = p.tensors()
    names = list(ts)
    kw = dict(p.kwargs)

    def fn(*xs):
        d = dict(zip(names, xs))
        k2 = dict(kw)
        for n in ("initial_state", "A_log", "dt_bias"):
            if n in d:
                k2[n] = d[n]
        return torch.ops.kda.fused_recurrent(*op_args(type(p)(d["q"], d["k"], d["v"], d["g"],
                                                                 d["beta"], k2)))

    assert torch.autograd.gradcheck(fn, [ts[n] for n in names], eps=1e-6, atol=1e-8, rtol=1e-6)


def test_opcheck_ops():
    p = make_problem(B=2, T=70, H=2, HV=4, K=5, V=6, gate="softplus", seed=3).to(torch.float32)
    args = op_args(p)
    torch.library.opcheck(torch.ops.kda.fused_recurrent_fwd.default, args)
    o, s, ck = torch.ops.kda.fused_recurrent_fwd(*args)
    torch.library.opcheck(torch.ops.kda.fused_recurrent_bwd.default,
                          (torch.randn_like(o), torch.randn_like(s), ck, *args))
    pg = p.to(torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.kda.fused_recurrent.default, op_args(pg))
    pv = make_problem(B=1, T=12, H=1, HV=2, K=5, V=3, gate="bounded", seqlens=(5, 7),
                      state_v_first=True, seed=4).to(torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.kda.fused_recurrent.default, op_args(pv))


def test_torch_compile_fullgraph_forward_and_backward():
    p = make_problem(B=2, T=20, H=2, HV=2, K=6, V=9, gate="softplus", seed=5)
    p = p.to(torch.float32, requires_grad=True)
    kw = {k: v for k, v in p.kwargs.items() if k not in ("A_log", "dt_bias", "initial_state")}

    def f(q, k, v, g, beta, h0, A_log, dt_bias):
        o, s = torch_kda.chunk_kda(q, k, v, g, beta, initial_state=h0, A_log=A_log,
                                   dt_bias=dt_bias, backend="native", **kw)
        return (o * o).sum() + s.sum()

    ins = [*p.args, p.kwargs["initial_state"], p.kwargs["A_log"], p.kwargs["dt_bias"]]
    assert_compiled_grads_match(f, ins)


def test_bitwise_identical_for_one_and_two_threads():
    p = make_problem(B=1, T=150, H=1, HV=2, K=9, V=70, gate="softplus", seed=9)

    def run():
        x = p.to(torch.float32, requires_grad=True)
        o, s = native(x)
        return [o, s, *grads(native, x).values()]

    results = per_thread_count(run, (1, 2))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# K and V above one vector of lanes (16 floats / 8 doubles under AVX-512, 8 / 4 under AVX2): the
# backward loads each chunk's checkpoint and the initial state into its transposed slices as whole
# lanes x lanes tiles in registers, and the rows and columns past the last tile one by one.
# Several chunks per sequence, sequences that start inside a chunk (varlen), an empty one.
@pytest.mark.parametrize("varlen", [False, True])
def test_gradients_through_transposed_tiles_match_the_float64_reference(varlen):
    p = make_problem(B=2, T=150, H=1, HV=2, K=37, V=45, gate="softplus", seed=21,
                     seqlens=(130, 0, 170) if varlen else None)
    p64 = p.to(torch.float64, requires_grad=True)
    g_ref = grads(lambda x: reference.fused_recurrent_kda(*x.args, **x.kwargs), p64)
    g64 = grads(native, p64)
    g32 = grads(native, p.to(torch.float32, requires_grad=True))
    for name, gr in g_ref.items():
        assert rel_err(g64[name], gr) <= 1e-10, name
        assert rel_err(g32[name], gr) <= 5e-5, name


# K above one group of the pre-processing's gate vectors and with a ragged last vector: the
# in-op gate's softplus / sigmoid and the decay's exp run 8 vectors at a time (128 floats under
# AVX-512, 64 under AVX2), the group past K on zeros that are never stored. Forward (the
# inference path and the one that keeps checkpoints) and gradients (the backward's pass also
# writes the gate's sigmoid) against the float64 reference.
@pytest.mark.parametrize("gate", GATES)
def test_preprocessing_in_vector_groups_matches_the_float64_reference(gate):
    p = make_problem(B=1, T=24, H=2, HV=4, K=137, V=20, gate=gate, seed=31)
    p64 = p.to(torch.float64, requires_grad=True)
    o_ref, s_ref = reference.fused_recurrent_kda(*p64.args, **p64.kwargs)
    g_ref = grads(lambda x: reference.fused_recurrent_kda(*x.args, **x.kwargs), p64)
    p32 = p.to(torch.float32)
    with torch.no_grad():
        o32, s32 = native(p32)
    assert rel_err(o32, o_ref) <= 1e-5 and rel_err(s32, s_ref) <= 1e-5
    g32 = grads(native, p.to(torch.float32, requires_grad=True))
    for name, gr in g_ref.items():
        assert rel_err(g32[name], gr) <= 5e-5, name


def test_second_order_gradient_names_reference_backend():
    p = make_problem(B=1, T=5, H=1, K=3, V=4, seed=2).to(torch.float64, requires_grad=True)
    o, s = native(p)
    (gq,) = torch.autograd.grad(o.sum(), p.q, create_graph=True)
    with pytest.raises(RuntimeError, match='backend="reference"'):
        torch.autograd.grad(gq.sum(), p.q)


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("name", ["fused_recurrent_kda", "chunk_kda"])
def test_forward_mode_ad_runs_the_reference_under_auto_and_native_refuses(name, l2norm):
    # The native op has no forward-mode formula: its outputs carried no tangent, which
    # torch.func.jvp read as zero. auto runs the reference for inputs with tangents; native and the
    # raw ops refuse (under forward_ad and under torch.func.jvp, whose tangents never reach the
    # kernels). Without the in-op l2 norm the unstable-write check runs on the inputs too.
    import torch.autograd.forward_ad as fwAD
    fn = getattr(torch_kda, name)
    p = make_problem(B=1, T=9, H=2, HV=4, K=5, V=3, l2norm=l2norm, seed=41).to(torch.float64)
    if not l2norm:
        p.k = p.k / p.k.norm(dim=-1, keepdim=True)
    tq = torch.randn(p.q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(42))

    def f(backend):
        return lambda q: fn(q, *p.args[1:], **p.kwargs, backend=backend)[0]

    # float64 oracle: the reference's Jacobian (reverse mode) times the tangent
    J = torch.autograd.functional.jacobian(f("reference"), p.q)
    _, jvp_auto = torch.func.jvp(f("auto"), (p.q,), (tq,))
    expected = (J.reshape(-1, p.q.numel()) @ tq.reshape(-1)).reshape(jvp_auto.shape)
    assert expected.norm() > 0
    assert rel_err(jvp_auto, expected) < 1e-10
    with fwAD.dual_level():
        o = f("auto")(fwAD.make_dual(p.q, tq))
        assert rel_err(fwAD.unpack_dual(o).tangent, expected) < 1e-10
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        torch.func.jvp(f("native"), (p.q,), (tq,))
    # the raw ops (and those with checkpoints that autograd calls) refuse forward_ad's tangents at
    # their CPU kernels
    ops = ("chunk", "chunk_fwd") if name == "chunk_kda" else ("fused_recurrent", "fused_recurrent_fwd")
    args = op_args(p)
    for op in ops:
        with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
            getattr(torch.ops.kda, op)(fwAD.make_dual(args[0], tq), *args[1:])
    # under torch.func.jvp the public ops refuse at their autograd kernels (the internal *_fwd ops
    # have none: autograd calls them below it)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda q: getattr(torch.ops.kda, ops[0])(q, *args[1:])[0], (args[0],), (tq,))


def test_empty_input_and_zero_length_sequences_pass_state_through():
    p = make_problem(B=2, T=0, H=1, HV=2, K=5, V=3, seed=1)
    o, s = native(p)
    assert o.shape == (2, 0, 2, 3)
    assert torch.equal(s, p.kwargs["initial_state"])
    p = make_problem(H=1, K=5, V=3, seqlens=(0, 4, 0), seed=1)
    o, s = native(p)
    h0 = p.kwargs["initial_state"]
    assert torch.equal(s[0], h0[0]) and torch.equal(s[2], h0[2])
    g = grads(native, p.to(torch.float64, requires_grad=True))
    assert all(t is not None for t in g.values())


def test_non_contiguous_inputs_work_and_inputs_are_not_modified():
    p = make_problem(B=2, T=17, H=2, HV=2, K=6, V=5, seed=6).to(torch.float32)
    before = {n: t.clone() for n, t in p.tensors().items()}
    q_nc = p.q.transpose(0, 1).contiguous().transpose(0, 1)
    v_nc = torch.empty(*p.v.shape[:-1], 2 * p.v.shape[-1])[..., ::2].copy_(p.v)
    assert not q_nc.is_contiguous() and not v_nc.is_contiguous()
    o1, s1 = torch.ops.kda.fused_recurrent(*op_args(type(p)(q_nc, p.k, v_nc, p.g, p.beta,
                                                            p.kwargs)))
    o2, s2 = torch.ops.kda.fused_recurrent(*op_args(p))
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    for n, t in p.tensors().items():
        assert torch.equal(t, before[n]), n


def _bad(p, **changes):
    args = dict(zip(("q", "k", "v", "g", "beta") + OP_ARGS, op_args(p)))
    args.update(changes)
    return list(args.values())


@pytest.mark.parametrize("change,match", [
    (lambda p: dict(k=p.k[..., :3]), "k must have shape"),
    (lambda p: dict(v=p.v[:, :4]), "v must have shape"),
    (lambda p: dict(g=p.g[..., :2]), "g must have shape"),
    (lambda p: dict(beta=p.beta[..., None]), "beta must have shape"),
    (lambda p: dict(v=p.v[:, :, :1], g=p.g[:, :, :1], beta=p.beta[:, :, :1]), "HV"),
    (lambda p: dict(k=p.k.double()), "k must have the dtype of q"),
    (lambda p: dict(q=p.q.int(), k=p.k.int(), v=p.v.int()), "q must be float64"),
    (lambda p: dict(g=p.g.long()), "g must be a floating tensor"),
    (lambda p: dict(A_log=None), "requires A_log"),
    (lambda p: dict(A_log=p.kwargs["A_log"][:1]), "A_log must have shape"),
    (lambda p: dict(dt_bias=p.kwargs["dt_bias"][:3]), "dt_bias must have shape"),
    (lambda p: dict(lower_bound=0.5), "lower_bound must be a finite negative number"),
    (lambda p: dict(use_beta_sigmoid_in_kernel=False, allow_neg_eigval=True), "allow_neg_eigval"),
    (lambda p: dict(initial_state=p.kwargs["initial_state"][:, :, :2]), "initial_state must have"),
    (lambda p: dict(cu_seqlens=torch.tensor([0, 4])), "batch size must be 1"),
])
def test_bad_inputs_raise(change, match):
    p = make_problem(B=2, T=6, H=2, HV=2, K=4, V=3, gate="softplus", seed=8).to(torch.float32)
    exc = TypeError if ("dtype" in match or "float" in match) else ValueError
    with pytest.raises(exc, match=match):
        torch.ops.kda.fused_recurrent(*_bad(p, **change(p)))


@pytest.mark.parametrize("cu,match", [
    ([1, 3, 6], r"cu_seqlens\[0\] must be 0"),
    ([0, 4, 2, 6], "non-decreasing"),
    ([0, 2, 5], "must equal T"),
    ([0, 2, 7], "must equal T"),
])
def test_bad_cu_seqlens_raise(cu, match):
    p = make_problem(H=1, K=4, V=3, seqlens=(2, 4), initial_state=False, seed=8)
    with pytest.raises(ValueError, match=match):
        torch.ops.kda.fused_recurrent(*_bad(p, cu_seqlens=torch.tensor(cu)))
    with pytest.raises(TypeError, match="int64 or int32"):
        torch.ops.kda.fused_recurrent(*_bad(p, cu_seqlens=torch.tensor([0.0, 2.0, 6.0])))
