"""The native chunkwise operator (torch.ops.kda.chunk / chunk_fwd) against the native recurrent
operator and the float64 oracle.

Covers every feature combination (GVA, varlen with empty and sub-chunk sequences, gates, state
layouts, initial state, float64/float32), low-precision inputs, strong and infinite decays (where
a cumulative-sum chunk form loses accuracy), bitwise determinism across thread counts, the
checkpoints (interchangeable with fused_recurrent_fwd's), gradients through kda::chunk, mixed
forward/backward pairs, opcheck, torch.compile and bad inputs. Shapes are small and T crosses
several chunks (forward chunks of 32 tokens, 64 on CPUs with AMX; checkpoints and backward
chunks of 64) and sub-blocks (16 tokens), so the file runs in well under a minute.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_kda
from kda_testing import (GATES, assert_compiled_grads_match, grads, make_problem, op_args,
                         per_thread_count, rel_err, stable_seed)
from oracle import oracle_kda
from torch_kda import reference

SEQLENS = (70, 0, 1, 13, 66, 40)  # empty, shorter than a chunk, starting inside a chunk


def chunk(p):
    return torch.ops.kda.chunk(*op_args(p))


def recurrent(p):
    return torch.ops.kda.fused_recurrent(*op_args(p))


CASES = list(itertools.product(GATES, (1, 2), (False, True), (False, True), (False, True)))


@pytest.mark.parametrize("gate,group,varlen,state_v_first,init", CASES)
def test_chunk_matches_recurrent_and_oracle_every_feature(gate, group, varlen, state_v_first,
                                                         init):
    seed = stable_seed(gate, group, varlen, state_v_first, init)
    p = make_problem(B=2, T=150, H=2, HV=2 * group, K=7, V=11, gate=gate,
                     neg_eigval=gate == "bounded", state_v_first=state_v_first,
                     initial_state=init, seqlens=SEQLENS if varlen else None, seed=seed)
    o_or, s_or = oracle_kda(*p.args, **p.kwargs)
    # float64: the chunk form equals the recurrence to rounding.
    o64, s64 = chunk(p)
    assert o64.dtype == torch.float64 and s64.dtype == torch.float64
    assert rel_err(o64, o_or) <= 1e-11 and rel_err(s64, s_or) <= 1e-11
    # float32: within 1e-5 of float64, and of the recurrent op.
    p32 = p.to(torch.float32)
    o32, s32 = chunk(p32)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    assert rel_err(o32, o_or) <= 1e-5 and rel_err(s32, s_or) <= 1e-5
    o_r, s_r = recurrent(p32)
    assert rel_err(o32, o_r) <= 1e-5 and rel_err(s32, s_r) <= 1e-5


@pytest.mark.parametrize("varlen", [False, True])
def test_checkpoints_equal_the_recurrent_ones(varlen):
    p = make_problem(B=2, T=150, H=1, HV=2, K=6, V=5, gate="softplus", seed=21,
                     seqlens=SEQLENS if varlen else None)
    oc, sc, ckc = torch.ops.kda.chunk_fwd(*op_args(p))
    orr, sr, ckr = torch.ops.kda.fused_recurrent_fwd(*op_args(p))
    assert ckc.shape == ckr.shape and ckc.dtype == ckr.dtype
    assert rel_err(ckc, ckr) <= 1e-12 and rel_err(oc, orr) <= 1e-12 and rel_err(sc, sr) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_low_precision_inputs_within_fla_ratio(dtype, gate):
    p = make_problem(B=1, T=140, H=2, HV=4, K=16, V=24, gate=gate, seed=7)
    o64, s64 = oracle_kda(*p.args, **p.kwargs)
    pl = p.to(dtype)
    o, s = chunk(pl)
    assert o.dtype == dtype and s.dtype == torch.float32
    o_rec, s_rec = recurrent(pl)
    # FLA's published bar for bf16 outputs (0.005 relative RMS), and no worse than twice the
    # recurrent op on the same low-precision inputs.
    assert rel_err(o, o64) <= 0.005 and rel_err(s, s64) <= 0.005
    assert rel_err(o, o64) <= 2 * rel_err(o_rec, o64) + 1e-6


def _strong_decay_problem(kind, seed=31, K=8, seqlens=None):
    p = make_problem(B=1, T=140, H=1, HV=2, K=K, V=6, gate="none", seed=seed, seqlens=seqlens)
    g = p.g.clone()
    if kind == "strong":       # per-step decays down to -1e4
        g[:, 10:20] = -1e4
        g[:, 70:75, :, :4] = -300.0
    elif kind == "inf":        # a full forget: g = -inf
        g[:, 5] = float("-inf")
        g[:, 90:92, 1] = float("-inf")
    elif kind == "strong_then_weak":  # one strong step, then weak ones, inside each chunk
        g = -torch.rand(g.shape, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64) * 1e-3
        g[:, 3] = -60.0
        g[:, 66] = -80.0
        g[:, 130] = -1e3
    elif kind == "block_split":  # 16-token blocks too strong for the factored form, halves not
        g = g * 0.2 - 6.0         # ~ -6 per step: 16 tokens ~ e^-96, 8 tokens ~ e^-48
        g[:, 40:60] = -40.0        # halves and quarters too strong: down to pairs
        g[:, 100:110, :, ::2] = -25.0
    return type(p)(p.q, p.k, p.v, g, p.beta, p.kwargs)


@pytest.mark.parametrize("kind", ["strong", "inf", "strong_then_weak", "block_split"])
def test_strong_and_infinite_decays_stay_accurate_in_float32(kind):
    p = _strong_decay_problem(kind)
    o_or, s_or = oracle_kda(*p.args, **p.kwargs)
    o, s = chunk(p.to(torch.float32))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_or) <= 1e-5 and rel_err(s, s_or) <= 1e-5
    o64, s64 = chunk(p)
    assert rel_err(o64, o_or) <= 1e-11 and rel_err(s64, s_or) <= 1e-11


@pytest.mark.parametrize("kind", ["strong", "inf", "strong_then_weak", "block_split", "weak"])
@pytest.mark.parametrize("varlen", [False, True])
def test_vectorised_direct_form_stays_accurate_in_float32(kind, varlen):
    # K = 64: float32 diagonal blocks too strong for the factored form take the vectorised
    # direct form (K a multiple of 32), whose columns stop once their running product is all
    # zero; varlen adds sequences shorter than a chunk and chunks starting inside a sequence.
    seqlens = (70, 0, 1, 13, 56) if varlen else None
    if kind == "weak":
        p = make_problem(B=1, T=140, H=1, HV=2, K=64, V=6, gate="none", seed=37, seqlens=seqlens)
    else:
        p = _strong_decay_problem(kind, seed=37, K=64, seqlens=seqlens)
    o_or, s_or = oracle_kda(*p.args, **p.kwargs)
    o, s = chunk(p.to(torch.float32))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_or) <= 1e-5 and rel_err(s, s_or) <= 1e-5


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_saturated_in_op_gate(gate):
    # exp(A_log) overflows float32: the softplus gate's decay is exactly 0 (g = -inf), the
    # bounded gate a step.
    p = make_problem(B=1, T=90, H=1, HV=2, K=6, V=5, gate=gate, seed=41)
    p.kwargs["A_log"] = torch.full_like(p.kwargs["A_log"], 100.0)
    o_or, s_or = oracle_kda(*p.args, **p.kwargs)
    o, s = chunk(p.to(torch.float32))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_or) <= 1e-5 and rel_err(s, s_or) <= 1e-5


@pytest.mark.parametrize("K,A_log", [(33, None), (64, 2.5)])
def test_bitwise_identical_for_one_two_three_threads(K, A_log):
    # K = 64 with exp(A_log) ~ 12: diagonal blocks in the vectorised direct form too.
    p = make_problem(B=1, T=200, H=1, HV=3, K=K, V=70, gate="softplus", seed=9,
                     seqlens=(130, 5, 65)).to(torch.float32)
    if A_log is not None:
        p.kwargs["A_log"] = torch.full_like(p.kwargs["A_log"], A_log)
    results = per_thread_count(lambda: torch.ops.kda.chunk_fwd(*op_args(p)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("gate,varlen,group", [("softplus", False, 2), ("bounded", True, 1),
                                               ("none", True, 2)])
def test_gradients_through_chunk_op_match_reference(gate, varlen, group):
    p = make_problem(B=2, T=80, H=1, HV=group, K=5, V=4, gate=gate, seed=13,
                     seqlens=(20, 0, 70) if varlen else None)
    p64 = p.to(torch.float64, requires_grad=True)
    g_ref = grads(lambda x: reference.fused_recurrent_kda(*x.args, **x.kwargs), p64)
    g_chk = grads(chunk, p64)
    for name, gr in g_ref.items():
        assert g_chk[name] is not None and g_chk[name].shape == gr.shape, name
        assert rel_err(g_chk[name], gr) <= 1e-10, name


def test_chunk_forward_with_recurrent_backward_equals_recurrent_pair():
    p = make_problem(B=2, T=100, H=1, HV=2, K=5, V=6, gate="softplus", seed=17)
    args = op_args(p)
    o, s, ck = torch.ops.kda.chunk_fwd(*args)
    _, _, ck_r = torch.ops.kda.fused_recurrent_fwd(*args)
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=s.dtype)
    g_mixed = torch.ops.kda.fused_recurrent_bwd(do, ds, ck, *args)
    g_rec = torch.ops.kda.fused_recurrent_bwd(do, ds, ck_r, *args)
    for a, b in zip(g_mixed, g_rec):
        if b.numel():
            assert rel_err(a, b) <= 1e-11


def test_opcheck_and_compile():
    p = make_problem(B=2, T=70, H=2, HV=4, K=5, V=6, gate="softplus", seed=3).to(torch.float32)
    args = op_args(p)
    torch.library.opcheck(torch.ops.kda.chunk_fwd.default, args)
    torch.library.opcheck(torch.ops.kda.chunk.default, op_args(p.to(torch.float32,
                                                                    requires_grad=True)))
    pv = make_problem(B=1, T=12, H=1, HV=2, K=5, V=3, gate="bounded", seqlens=(5, 7),
                      state_v_first=True, seed=4).to(torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.kda.chunk.default, op_args(pv))

    pc = make_problem(B=2, T=20, H=2, HV=2, K=6, V=9, gate="softplus", seed=5)
    pc = pc.to(torch.float32, requires_grad=True)
    ins = list(pc.tensors().values())
    names = list(pc.tensors())

    def f(*xs):
        d = dict(zip(names, xs))
        kw = dict(pc.kwargs, **{n: d[n] for n in ("initial_state", "A_log", "dt_bias")})
        x = type(pc)(d["q"], d["k"], d["v"], d["g"], d["beta"], kw)
        o, s = torch.ops.kda.chunk(*op_args(x))
        return (o * o).sum() + s.sum()

    assert_compiled_grads_match(f, ins)


def test_empty_input_and_zero_length_sequences_pass_state_through():
    p = make_problem(B=2, T=0, H=1, HV=2, K=5, V=3, seed=1)
    o, s = chunk(p)
    assert o.shape == (2, 0, 2, 3)
    assert torch.equal(s, p.kwargs["initial_state"])
    p = make_problem(H=1, K=5, V=3, seqlens=(0, 4, 0), seed=1)
    o, s = chunk(p)
    h0 = p.kwargs["initial_state"]
    assert torch.equal(s[0], h0[0]) and torch.equal(s[2], h0[2])


@pytest.mark.parametrize("change,match,exc", [
    (lambda p: dict(k=p.k[..., :3]), "k must have shape", ValueError),
    (lambda p: dict(g=p.g.long()), "g must be a floating tensor", TypeError),
    (lambda p: dict(A_log=None), "requires A_log", ValueError),
    (lambda p: dict(cu_seqlens=torch.tensor([0, 4])), "batch size must be 1", ValueError),
    (lambda p: dict(use_gate_in_kernel=False, A_log=None, dt_bias=None, g=p.g.abs()),
     "log-decay <= 0", ValueError),
])
def test_bad_inputs_raise_like_the_recurrent_op(change, match, exc):
    p = make_problem(B=2, T=6, H=2, HV=2, K=4, V=3, gate="softplus", seed=8).to(torch.float32)
    names = ("q", "k", "v", "g", "beta", "scale", "initial_state", "use_qk_l2norm_in_kernel",
             "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
             "lower_bound", "state_v_first", "cu_seqlens", "A_log", "dt_bias")
    args = dict(zip(names, op_args(p)))
    args.update(change(p))
    for op in (torch.ops.kda.chunk, torch.ops.kda.chunk_fwd):
        with pytest.raises(exc, match=match):
            op(*args.values())


def test_chunk_kda_native_runs_the_chunk_op_and_fused_recurrent_stays_recurrent():
    import torch_kda

    p = make_problem(B=2, T=90, H=1, HV=2, K=6, V=5, gate="softplus", seed=23).to(torch.float32)
    o, s = torch_kda.chunk_kda(*p.args, **p.kwargs, backend="native")
    oc, sc = chunk(p)
    assert torch.equal(o, oc) and torch.equal(s, sc)
    o, s = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="native")
    orr, sr = recurrent(p)
    assert torch.equal(o, orr) and torch.equal(s, sr)
    assert not torch.equal(oc, orr)  # two kernels, equal to rounding only


def test_auto_rule_keeps_decoding_recurrent():
    from torch_kda import _native
    from torch_kda._checks import check_kda_inputs

    kw = dict(scale=None, initial_state=None, output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None)
    for B, T in ((8, 1), (1, 1), (64, 1)):
        p = make_problem(B=B, T=T, H=2, HV=2, K=8, V=8, gate="none", beta_sigmoid=False, seed=2)
        assert not _native.prefer_chunk(check_kda_inputs(*p.args, **kw))


@pytest.mark.parametrize("seqlens", [None, (700, 30, 0, 333)], ids=["batch", "varlen"])
def test_chunks_across_token_blocks(seqlens):
    # 8 + 16 heads of K = 130: the forward runs in token blocks of 320 tokens per sequence
    # (tests/test_token_blocks.py); with varlen, sequence 1 starts inside a chunk, so a chunk is
    # cut by a block boundary and continues in the next block.
    p = make_problem(B=2, T=450, H=8, HV=16, K=130, V=6, seqlens=seqlens, gate="softplus", seed=4)
    oc, sc, ckc = torch.ops.kda.chunk_fwd(*op_args(p))
    orr, sr, ckr = torch.ops.kda.fused_recurrent_fwd(*op_args(p))
    assert rel_err(oc, orr) <= 1e-11 and rel_err(sc, sr) <= 1e-11 and rel_err(ckc, ckr) <= 1e-11
    p32 = p.to(torch.float32)
    oc, sc = chunk(p32)
    assert rel_err(oc, orr) <= 1e-5 and rel_err(sc, sr) <= 1e-5


@pytest.mark.parametrize("seqlens", [None, (300, 0, 37, 93)], ids=["batch", "varlen"])
def test_chunks_pre_process_every_input_storage_across_token_blocks(seqlens, monkeypatch):
    # Each chunk pre-processes its own rows of one head (csrc/cpu/chunk_fwd.cpp): 16-bit inputs
    # are widened as they are read (v into the chunk's rows), fp32 inputs of a float64 call are
    # converted block by block first. Both exact: with fp32 products on both sides the results
    # equal those of the same values in fp32 / float64, bit for bit.
    monkeypatch.setenv("TORCH_KDA_CHUNK_PRODUCTS", "fp32")
    p = make_problem(B=2, T=300, H=8, HV=16, K=130, V=6, seqlens=seqlens, gate="softplus", seed=9)
    args = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    side = {n: x.float() for n, x in args.items()
            if n in ("initial_state", "A_log", "dt_bias")}
    mixed = dict(args, q=args["q"].bfloat16(), k=args["k"].bfloat16(), v=args["v"].bfloat16(),
                 g=args["g"].half(), beta=args["beta"].float(), **side)
    same = {n: (x.float() if torch.is_tensor(x) and x.is_floating_point() else x)
            for n, x in mixed.items()}
    o, s = torch_kda.chunk_kda(**mixed, backend="native")
    o32, s32 = torch_kda.chunk_kda(**same, backend="native")
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, o32.bfloat16()) and torch.equal(s, s32)
    o_ref, _ = reference.fused_recurrent_kda(**{n: (x.double() if torch.is_tensor(x) and
                                                    x.is_floating_point() else x)
                                                 for n, x in same.items()})
    assert rel_err(o32, o_ref) < 1e-5
    # float64 q, k, v with fp32 g and beta: converted per block, equal to all-float64 inputs
    p64 = dict(args, g=args["g"].float(), beta=args["beta"].float())
    o64, s64 = torch_kda.chunk_kda(**p64, backend="native")
    o_all, s_all = torch_kda.chunk_kda(**dict(p64, g=p64["g"].double(),
                                              beta=p64["beta"].double()), backend="native")
    assert torch.equal(o64, o_all) and torch.equal(s64, s_all)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_value_outside_the_domain_is_named_as_the_recurrent_op_names_it(dtype):
    # The chunks' own pre-processing finds offenders head by head, in any order: the op names
    # the smallest index of the block (token first, then head), as the recurrent op does.
    p = make_problem(B=1, T=300, H=2, HV=4, K=16, V=8, gate="none", beta_sigmoid=False, seed=15)
    args = dict(zip(("q", "k", "v", "g", "beta"), p.to(dtype).args), **p.to(dtype).kwargs)
    g = args["g"].clone()
    g[0, 260, 0, 1] = 0.25
    g[0, 250, 3, 7] = 0.5
    g[0, 250, 2, 9] = 0.75
    beta = args["beta"].clone()
    beta[0, 199, 3] = 3.0
    beta[0, 150, 1] = -1.0
    for fn in (torch_kda.chunk_kda, torch_kda.fused_recurrent_kda):
        with pytest.raises(ValueError, match=r"g\[0, 250, 2, 9\] = 0\.75"):
            fn(**dict(args, g=g), backend="native")
        with pytest.raises(ValueError, match=r"beta\[0, 150, 1\] = -1"):
            fn(**dict(args, beta=beta), backend="native")


def test_auto_rule_picks_the_chunk_kernel_only_where_it_was_measured_faster(monkeypatch):
    # _native.prefer_chunk: bf16 products asked for, on a matrix engine, no gradient recorded, a
    # mean length of at least 2048 tokens, at least 2 (sequence, value head) units per thread.
    import torch_kda
    from torch_kda import _native

    monkeypatch.setenv("TORCH_KDA_CHUNK_PRODUCTS", "bf16")

    p = make_problem(B=1, T=2048, H=1, HV=2, K=16, V=16, gate="softplus", seed=3)
    p = p.to(torch.bfloat16)
    short = make_problem(B=1, T=2047, H=1, HV=2, K=16, V=16, gate="softplus", seed=3)
    short = short.to(torch.bfloat16)
    assert not torch.equal(chunk(p)[0], recurrent(p)[0])  # the two kernels are told apart

    def auto(p, q=None):
        return torch_kda.chunk_kda(q if q is not None else p.q, *p.args[1:], **p.kwargs,
                                   backend="auto")[0]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for products, expect_chunk in ((True, True), (False, False)):
            monkeypatch.setattr(_native, "chunk_bf16_products", lambda *a, v=products: v)
            assert torch.equal(auto(p), (chunk if expect_chunk else recurrent)(p)[0])
        monkeypatch.setattr(_native, "chunk_bf16_products", lambda *a: True)
        # too short, or a gradient recorded: recurrent
        assert torch.equal(auto(short), recurrent(short)[0])
        q = p.q.clone().requires_grad_()
        assert torch.equal(auto(p, q).detach(), recurrent(p)[0])
        with torch.no_grad():
            assert torch.equal(auto(p, q), chunk(p)[0])
        torch.set_num_threads(2)  # 2 units for 2 threads: recurrent
        assert torch.equal(auto(p), recurrent(p)[0])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("knob", [None, "auto", "fp32"])
def test_auto_rule_keeps_the_recurrent_kernel_unless_bf16_products_are_asked_for(knob,
                                                                                monkeypatch):
    # Where everything else favours the chunk kernel (its bf16 products on a matrix engine, no
    # gradient, long sequences, units for every thread), backend="auto" still runs the recurrent
    # one: the bf16 products' error grows with the sequence, so only TORCH_KDA_CHUNK_PRODUCTS=bf16
    # makes auto take them (the test above).
    import torch_kda
    from torch_kda import _native

    if knob is None:
        monkeypatch.delenv("TORCH_KDA_CHUNK_PRODUCTS", raising=False)
    else:
        monkeypatch.setenv("TORCH_KDA_CHUNK_PRODUCTS", knob)
    monkeypatch.setattr(_native, "chunk_bf16_products", lambda *a: True)
    p = make_problem(B=1, T=2048, H=1, HV=2, K=16, V=16, gate="softplus", seed=3)
    p = p.to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            o = torch_kda.chunk_kda(*p.args, **p.kwargs, backend="auto")[0]
        assert torch.equal(o, recurrent(p)[0])
        assert not torch.equal(o, chunk(p)[0])
    finally:
        torch.set_num_threads(threads)


def test_chunk_bf16_products_query_follows_the_op_choice(monkeypatch):
    from torch_kda import _native

    assert _native.chunk_bf16_products(torch.float32, 128, 128) is False
    assert _native.chunk_bf16_products(torch.bfloat16, 130, 128) is False  # K not a multiple of 16
    assert isinstance(_native.chunk_bf16_products(torch.bfloat16, 128, 128), bool)
    monkeypatch.setenv("TORCH_KDA_CHUNK_PRODUCTS", "fp32")
    assert _native.chunk_bf16_products(torch.bfloat16, 128, 128) is False
    monkeypatch.setenv("TORCH_KDA_CHUNK_PRODUCTS", "fast")
    with pytest.raises(ValueError, match="TORCH_KDA_CHUNK_PRODUCTS must be auto, fp32 or bf16"):
        _native.chunk_bf16_products(torch.bfloat16, 128, 128)


def test_chunk_bf16_products_query_follows_onednn_and_rejects_empty_heads(monkeypatch):
    # With oneDNN off ATen's brgemm has no bf16 products: the cached answer must follow the switch
    # both ways (it once stayed True after torch.backends.mkldnn.enabled = False).
    from torch_kda import _native

    monkeypatch.setenv("TORCH_KDA_CHUNK_PRODUCTS", "bf16")
    on = _native.chunk_bf16_products(torch.bfloat16, 128, 128)
    assert on is bool(torch.ops.kda._chunk_bf16_products(torch.bfloat16, 128, 128))
    with torch.backends.mkldnn.flags(enabled=False):
        assert _native.chunk_bf16_products(torch.bfloat16, 128, 128) is False
        assert torch.ops.kda._chunk_bf16_products(torch.bfloat16, 128, 128) is False
    assert _native.chunk_bf16_products(torch.bfloat16, 128, 128) is on
    for K in (0, -16):
        assert torch.ops.kda._chunk_bf16_products(torch.bfloat16, K, 128) is False
        assert torch.ops.kda._chunk_bf16_products(torch.bfloat16, 128, K) is False


@pytest.mark.parametrize("T", [1, 5, 2048])
def test_a_misspelt_products_knob_raises_under_auto_at_any_length(T, monkeypatch):
    # (it was read only where the rule's other conditions held: a long sequence)
    import torch_kda

    monkeypatch.setenv("TORCH_KDA_CHUNK_PRODUCTS", "BF16")
    p = make_problem(B=1, T=T, H=1, HV=2, K=16, V=16, gate="softplus", seed=8)
    p = p.to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(ValueError, match="must be auto, fp32 or bf16, got 'BF16'"):
        torch_kda.chunk_kda(*p.args, **p.kwargs, backend="auto")


def test_auto_rule_compiles_without_graph_breaks():
    # The rule's machine facts (threads, the op's products) are constants to torch.compile.
    import torch_kda

    p = make_problem(B=1, T=2048, H=1, HV=2, K=16, V=16, gate="softplus", seed=5)
    p = p.to(torch.bfloat16)

    def f(q, k, v, g, beta):
        return torch_kda.chunk_kda(q, k, v, g, beta, **p.kwargs, backend="auto")[0]

    with torch.no_grad():
        o = torch.compile(f, backend="eager", fullgraph=True)(*p.args)
    assert torch.equal(o, f(*p.args))
