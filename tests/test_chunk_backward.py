"""The native chunkwise backward (torch.ops.kda.chunk_bwd) against float64.

chunk_bwd takes the checkpoints of the forward (fused_recurrent_fwd's, shared by the chunk
forward) and returns the gradients of fused_recurrent_bwd. Checked here: the derivation itself
(tests/chunk_backward_math.py against autograd), every feature combination against the float64
reference's autograd and the recurrent backward, gradcheck in float64, causality, strong and
saturated decays, bitwise determinism across thread counts, bf16 accuracy and opcheck, and the
chunk forward's checkpoints feeding the chunk backward.
Shapes are small (K, V not powers of two; T past one 64-token chunk so chunks chain).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import chunk_backward_math as cm
from kda_testing import GATES, make_problem, per_thread_count, rel_err
from torch_kda import reference

OP_ARGS = ("scale", "initial_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
           "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "state_v_first",
           "cu_seqlens", "A_log", "dt_bias")
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
DEFAULTS = dict(initial_state=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None)


def op_args(p):
    """Positional op arguments (after grad_o, grad_final_state, checkpoints) of a Problem."""
    kw = dict(p.kwargs)
    kw["scale"] = p.q.shape[-1] ** -0.5
    return (*p.args, *(kw.get(n, DEFAULTS.get(n)) for n in OP_ARGS))


def cotangents(p, seed=123, final=True):
    """Random grad_o and grad_final_state (None without final) in float64."""
    B, T, HV, V = p.v.shape
    K = p.q.shape[-1]
    N = len(p.kwargs["cu_seqlens"]) - 1 if p.kwargs.get("cu_seqlens") is not None else B
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    shape = (N, HV, V, K) if p.kwargs.get("state_v_first") else (N, HV, K, V)
    ds = torch.randn(*shape, generator=gen, dtype=torch.float64) if final else None
    return do, ds


def native_grads(p, do, ds, bwd="chunk_bwd"):
    """Gradients of <o, do> + <final_state, ds> by fused_recurrent_fwd + the named backward."""
    args = op_args(p)
    _, _, ck = torch.ops.kda.fused_recurrent_fwd(*args)
    sd = torch.float64 if p.q.dtype == torch.float64 else torch.float32
    r = getattr(torch.ops.kda, bwd)(do.to(p.q.dtype), None if ds is None else ds.to(sd), ck,
                                    *args)
    out = dict(zip(GRAD_NAMES, r))
    return {n: out[n] for n in p.tensors()}


def reference_grads(p, do, ds):
    """The same gradients by autograd through the float64 reference recurrence."""
    x = p.to(torch.float64, requires_grad=True)
    o, s = reference.fused_recurrent_kda(*x.args, **x.kwargs)
    loss = (o * do).sum() + ((s * ds).sum() if ds is not None else 0)
    ts = x.tensors()
    return dict(zip(ts, torch.autograd.grad(loss, list(ts.values()), allow_unused=True)))


# ---- the derivation (docs/math.md "Chunkwise backward") ----------------------------------------

def _recurrence(q, k, v, g, beta, S):
    outs = []
    for t in range(q.shape[0]):
        S = g[t].exp()[:, None] * S
        u = beta[t] * (v[t] - S.t() @ k[t])
        S = S + torch.outer(k[t], u)
        outs.append(S.t() @ q[t])
    return torch.stack(outs), S


@pytest.mark.parametrize("decay", ["weak", "strong", "strong_then_weak", "infinite"])
def test_chunk_backward_math_matches_autograd(decay):
    gen = torch.Generator().manual_seed(5)
    T, K, V = 80, 6, 5
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = rnd(T, K) / 3
    k = torch.nn.functional.normalize(rnd(T, K), dim=-1)
    v, S0 = rnd(T, V), rnd(K, V)
    beta = torch.rand(T, generator=gen, dtype=torch.float64) * 1.5 + 0.1
    g = -torch.rand(T, K, generator=gen, dtype=torch.float64) * (0.1 if decay == "weak" else 20)
    if decay == "strong_then_weak":
        g[70:80] = -1e4
        g[80:] = -1e-3
    if decay == "infinite":
        g[3:5, :2] = -torch.inf
    do, dS = rnd(T, V), rnd(K, V)
    ours = cm.sequence_backward(q, k, v, g, beta, S0, do, dS)
    for fwd in (cm.sequence_forward, _recurrence):
        xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
        o, S = fwd(*xs)[:2]
        auto = torch.autograd.grad((o * do).sum() + (S * dS).sum(), xs)
        for name, a in zip(("q", "k", "v", "g", "beta", "S0"), auto):
            a = torch.nan_to_num(a)  # autograd of exp(-inf) * ... gives NaN where the true value is 0
            assert rel_err(ours[name], a) <= 1e-12, (fwd.__name__, name)


# ---- every feature against the float64 reference ---------------------------------------------

FLAG_SETS = [  # (l2norm, beta_sigmoid, neg_eigval)
    (True, True, False),
    (False, False, False),
    (True, True, True),
]
LAYOUTS = [(False, True), (True, True), (False, False)]  # (state_v_first, initial_state)
CASES = [(gate, group, varlen, layout, FLAG_SETS[i % 3], i % 2 == 0)
         for i, (gate, group, varlen, layout) in
         enumerate(itertools.product(GATES, (1, 2), (False, True), LAYOUTS))]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_chunk_bwd_matches_reference_every_feature(case):
    gate, group, varlen, layout, flags, final = CASES[case]
    l2, sig, neg = flags
    state_v_first, init = layout
    seed = 1000 + case
    p = make_problem(B=2, T=150, H=2, HV=2 * group, K=7, V=11, gate=gate, l2norm=l2,
                     beta_sigmoid=sig, neg_eigval=neg, state_v_first=state_v_first,
                     initial_state=init, seqlens=(70, 0, 1, 129, 100) if varlen else None,
                     seed=seed)
    do, ds = cotangents(p, final=final)
    g_ref = reference_grads(p, do, ds)
    p64 = p.to(torch.float64)
    g64 = native_grads(p64, do, ds)
    p32 = p.to(torch.float32)
    g32 = native_grads(p32, do, ds)
    g32_rec = native_grads(p32, do, ds, bwd="fused_recurrent_bwd")
    for name, gr in g_ref.items():
        assert g64[name].shape == gr.shape and g64[name].dtype == gr.dtype, name
        assert rel_err(g64[name], gr) <= 1e-10, name
        assert g32[name].dtype == p32.tensors()[name].dtype, name
        # float32: as close to float64 as the recurrent backward (which runs token by token)
        assert rel_err(g32[name], gr) <= max(1e-5, 2 * rel_err(g32_rec[name], gr)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients(dtype):
    p = make_problem(B=2, T=140, H=2, HV=4, K=13, V=19, gate="softplus", seed=7)
    do, ds = cotangents(p)
    g_ref = reference_grads(p, do, ds)
    pl = p.to(dtype)
    g_nat = native_grads(pl, do, ds)
    for name, gr in g_ref.items():
        assert g_nat[name].dtype == pl.tensors()[name].dtype, name
        err = rel_err(g_nat[name], gr)
        assert err <= 0.008, (name, err)


# ---- strong decays --------------------------------------------------------------------------

def _strong_problem(kind, seed=3):
    p = make_problem(B=1, T=200, H=2, HV=2, K=8, V=9, gate="none" if kind != "saturated" else
                     "softplus", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    if kind == "strong":  # log-decays down to -1e4
        p.g = -torch.rand(p.g.shape, generator=gen, dtype=torch.float64) ** 4 * 1e4
    elif kind == "strong_then_weak":  # one chunk: full forgets, then decays of 1e-3
        g = -torch.rand(p.g.shape, generator=gen, dtype=torch.float64) * 1e-3
        g[:, 64:80] = -torch.rand(16, *p.g.shape[2:], generator=gen, dtype=torch.float64) * 1e4
        g[:, 140:150, :, :3] = -300.0
        p.g = g
    elif kind == "saturated":  # head 0: exp(A_log) = inf in float32 (decay 0, zero gradient)
        p.kwargs["A_log"] = torch.tensor([100.0, 0.3], dtype=torch.float64)
    return p


@pytest.mark.parametrize("kind", ["strong", "strong_then_weak", "saturated"])
def test_strong_decays_float32_gradients(kind):
    p = _strong_problem(kind)
    do, ds = cotangents(p)
    g_ref = reference_grads(p, do, ds)
    p32 = p.to(torch.float32)
    g32 = native_grads(p32, do, ds)
    g_rec = native_grads(p32, do, ds, bwd="fused_recurrent_bwd")
    g64 = native_grads(p.to(torch.float64), do, ds)
    for name, gr in g_ref.items():
        assert torch.isfinite(g32[name]).all() and torch.isfinite(g64[name]).all(), name
        assert rel_err(g64[name], gr) <= 1e-10, name
        assert rel_err(g32[name], gr) <= max(1e-5, 2 * rel_err(g_rec[name], gr)), name
    if kind == "saturated":
        assert g32["A_log"][0] == 0 and (g32["g"][:, :, 0] == 0).all()


# ---- structure: gradcheck, causality, determinism, opcheck ----------------------------------

@pytest.mark.parametrize("gate,varlen,group", [("softplus", False, 2), ("bounded", True, 1),
                                               ("bounded_no_alog", False, 1), ("none", True, 2)])
def test_gradcheck_chunk_op(gate, varlen, group):
    # torch.ops.kda.chunk: chunk forward, kda::chunk_bwd backward (its Autograd kernel)
    p = make_problem(B=2, T=67, H=1, HV=group, K=3, V=4, gate=gate, seed=11,
                     neg_eigval=gate == "bounded", seqlens=(3, 0, 66, 65) if varlen else None)
    p = p.to(torch.float64, requires_grad=True)
    ts = p.tensors()
    names = list(ts)

    def fn(*xs):
        d = dict(zip(names, xs))
        kw = {k: v for k, v in p.kwargs.items() if k != "output_final_state"}
        kw.update({n: d[n] for n in ("initial_state", "A_log", "dt_bias") if n in d})
        q = type(p)(d["q"], d["k"], d["v"], d["g"], d["beta"], kw)
        return torch.ops.kda.chunk(*op_args(q))

    # fast_mode: a random projection of the Jacobian (the full one takes minutes at T > 64)
    assert torch.autograd.gradcheck(fn, [ts[n] for n in names], eps=1e-6, atol=1e-8, rtol=1e-6,
                                    fast_mode=True)


@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_forward_checkpoints_feed_chunk_bwd(varlen):
    # The chunk forward's checkpoints serve the chunk backward as the recurrent ones do.
    p = make_problem(B=2, T=150, H=2, HV=4, K=7, V=11, gate="bounded", seed=21,
                     seqlens=(70, 0, 1, 129, 100) if varlen else None).to(torch.float32)
    do, ds = cotangents(p)
    g_ref = reference_grads(p, do, ds)
    args = op_args(p)
    _, _, ck = torch.ops.kda.chunk_fwd(*args)
    r = dict(zip(GRAD_NAMES, torch.ops.kda.chunk_bwd(do.float(), ds.float(), ck, *args)))
    g_rec = native_grads(p, do, ds, bwd="fused_recurrent_bwd")
    for name, gr in g_ref.items():
        assert rel_err(r[name], gr) <= max(1e-5, 2 * rel_err(g_rec[name], gr)), name


def test_causality_of_gradients():
    p = make_problem(B=1, T=150, H=1, HV=2, K=5, V=6, gate="softplus", seed=13)
    t = 100  # inside the second chunk
    do, _ = cotangents(p, final=False)
    do[:, t:] = 0  # a loss on the outputs before t only
    base = native_grads(p, do, None)
    q = p.to(torch.float64)
    gen = torch.Generator().manual_seed(1)
    for name in ("q", "k", "v", "g", "beta"):
        x = getattr(q, name)
        x[:, t:] += torch.randn(x[:, t:].shape, generator=gen, dtype=torch.float64).abs() * \
            (-0.3 if name == "g" else 0.3)
    pert = native_grads(q, do, None)
    for name, gb in base.items():
        if name in ("initial_state", "A_log", "dt_bias"):
            assert torch.equal(pert[name], gb), name
        else:
            assert torch.equal(pert[name][:, :t], gb[:, :t]), name


def test_bitwise_identical_for_one_two_three_threads():
    p = make_problem(B=1, T=300, H=2, HV=4, K=9, V=20, gate="softplus",
                     seqlens=(100, 3, 197), seed=9)
    do, ds = cotangents(p)
    results = per_thread_count(lambda: native_grads(p.to(torch.float32), do, ds))
    for r in results[1:]:
        for name, t in r.items():
            assert torch.equal(t, results[0][name]), name


def test_empty_input_and_zero_length_sequences():
    for p in (make_problem(B=2, T=0, H=1, HV=2, K=5, V=3, seed=1),
              make_problem(H=1, K=5, V=3, seqlens=(0, 70, 0), seed=1)):
        do, ds = cotangents(p)
        g_ref = reference_grads(p, do, ds)
        g = native_grads(p, do, ds)
        for name, gr in g_ref.items():
            if gr is None:  # T = 0: the reference never used the input
                gr = torch.zeros_like(g[name])
            assert rel_err(g[name], gr) <= 1e-10, name


def test_opcheck_chunk_bwd():
    p = make_problem(B=2, T=70, H=2, HV=4, K=5, V=6, gate="softplus", seed=3).to(torch.float32)
    args = op_args(p)
    o, s, ck = torch.ops.kda.fused_recurrent_fwd(*args)
    torch.library.opcheck(torch.ops.kda.chunk_bwd.default,
                          (torch.randn_like(o), torch.randn_like(s), ck, *args))
    pv = make_problem(B=1, T=80, H=1, HV=2, K=5, V=3, gate="bounded", seqlens=(5, 75),
                      state_v_first=True, seed=4).to(torch.float64)
    args = op_args(pv)
    o, s, ck = torch.ops.kda.fused_recurrent_fwd(*args)
    torch.library.opcheck(torch.ops.kda.chunk_bwd.default, (torch.randn_like(o), None, ck, *args))
