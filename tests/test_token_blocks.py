"""The native forward runs long inputs in token blocks (csrc/cpu/recurrent_fwd.cpp): q, k, the
decays and beta of one block of every sequence are pre-processed into a small reused workspace,
then the recurrence runs over the block. A block holds about 2 MB of pre-processed rows per
thread (the chunk forward's 2 MB), so HV * K of about two thousand makes blocks of a few hundred
tokens at most (the chunk forward's one or a few chunks): these shapes cross several block
boundaries (the state and the next token's read carry across them).

Both backwards (csrc/cpu/bwd_common.cpp, run_bwd_blocked: the recurrent and the chunkwise
kernels) run in blocks of whole 64-token chunks, last block first: the pre-processing, the
partial gradients and the chain rule of one block live in a reused workspace, the gradient of the
state carries across blocks. Their rows are wider (about 65 KB per token at these shapes), so
their blocks are one chunk long up to 4 threads and longer beyond (2 MB per thread). 16-bit inputs and grad_o are
read block by block too (widened exactly), never copied whole to fp32."""

from __future__ import annotations

import re

import pytest
import torch

import torch_kda
from kda_testing import grads, make_problem, per_thread_count, rel_err
from torch_kda import reference


def oracle_f64(p):
    """The pure-PyTorch definition in float64 (itself checked against tests/oracle.py, whose
    per-element loops take ~40 s at these lengths)."""
    p64 = p.to(torch.float64)
    return reference.fused_recurrent_kda(*p64.args, **p64.kwargs)


def native(p):
    return torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="native")


@pytest.mark.parametrize("seqlens", [None, (1000, 0, 60)], ids=["batch", "varlen_with_empty"])
def test_forward_across_token_blocks_matches_the_float64_reference(seqlens):
    # fp32: 8 + 16 heads of K = 130 -> 25 KB per token -> blocks of 320 tokens per sequence.
    p = make_problem(B=2, T=450, H=8, HV=16, K=130, V=6, seqlens=seqlens, gate="softplus", seed=4)
    o_ref, s_ref = oracle_f64(p)
    o, s = native(p.to(torch.float32))
    assert rel_err(o, o_ref) < 2e-5
    assert rel_err(s, s_ref) < 2e-5
    if seqlens:  # the empty sequence passes its initial state through
        assert torch.equal(s[1], p.kwargs["initial_state"][1].float())


def test_float64_forward_across_token_blocks_matches_the_reference_to_rounding():
    # fp64: 25 KB per token -> blocks of 320 tokens.
    p = make_problem(B=1, T=700, H=4, HV=8, K=130, V=5, gate="bounded", seed=6)
    o_ref, s_ref = oracle_f64(p)
    o, s = native(p)
    assert rel_err(o, o_ref) < 1e-12
    assert rel_err(s, s_ref) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_converted_per_block_equal_fp32_inputs_of_the_same_values(dtype):
    # The conversion to fp32 is exact, so converting block by block must give bitwise the
    # result of the fp32 op on the same values, rounded to the output dtype once.
    p = make_problem(B=2, T=400, H=8, HV=16, K=130, V=6, gate="softplus", seed=8,
                     state_v_first=True).to(dtype)
    o, s = native(p)
    p32 = p.to(torch.float32)
    o32, s32 = native(p32)
    assert o.dtype == dtype
    assert torch.equal(o, o32.to(dtype))
    assert torch.equal(s, s32)


def chunk_native(p):
    return torch_kda.chunk_kda(*p.args, **p.kwargs, backend="native")


# The backward's blocks hold max(8, 2 x threads) MB of rows: one chunk at 1 and 2 threads, two at
# 6 threads (12 MB), so 6 threads also cuts the blocks elsewhere; the bits must not move. At 8
# threads (three chunks per block) the recurrent backward runs a block's units beside the chain
# rule of the next and the pre-processing of the previous block (three workspaces in turn).
@pytest.mark.parametrize("op", [native, chunk_native], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("seqlens", [None, (300, 0, 37, 83)], ids=["batch", "varlen"])
def test_token_blocks_are_bitwise_identical_for_any_thread_count_with_gradients(op, seqlens):
    p = make_problem(B=1, T=420, H=8, HV=16, K=130, V=6, seqlens=seqlens, gate="softplus",
                     seed=11)

    def run():
        x = p.to(torch.float32, requires_grad=True)
        o, s = op(x)
        loss = (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + s.square().sum()
        return [o, s, *torch.autograd.grad(loss, list(x.tensors().values()))]

    results = per_thread_count(run, (1, 2, 6, 8))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


# Sequences that start and end inside chunks (varlen packs them back to back), an empty one, and
# more blocks in one sequence than in the others; both gates (the chain rule reads the raw gate
# input with the bounded gate, the log decay with softplus).
@pytest.mark.parametrize("op", [native, chunk_native], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("gate,seqlens", [("softplus", None), ("bounded", (300, 0, 37, 93))],
                         ids=["batch_softplus", "varlen_bounded"])
def test_gradients_across_backward_blocks_match_the_float64_reference(op, gate, seqlens):
    p = make_problem(B=2, T=200, H=8, HV=16, K=130, V=6, seqlens=seqlens, gate=gate, seed=12)
    p64 = p.to(torch.float64, requires_grad=True)
    g_ref = grads(lambda x: reference.fused_recurrent_kda(*x.args, **x.kwargs), p64)
    g32 = grads(op, p.to(torch.float32, requires_grad=True))
    g64 = grads(op, p64)
    for name, gr in g_ref.items():
        assert rel_err(g64[name], gr) < 1e-11, name
        assert rel_err(g32[name], gr) < 5e-5, name


# The recurrent backward keeps the running gradient of the state between blocks in its own
# layout, one transposed 32-column slice after another: with two value heads the units split the
# V = 70 columns (three slices, the last 6 wide) into groups, and K = 256 rows make blocks of five
# chunks, so the gradient crosses blocks in every slice and group, from dht (the sequence that ends
# in a later block than the others) to dh0, in both state layouts.
@pytest.mark.parametrize("state_v_first", [False, True], ids=["k_first", "v_first"])
def test_state_gradient_carries_across_blocks_in_every_column_slice(state_v_first):
    p = make_problem(B=1, T=0, H=1, HV=2, K=256, V=70, seqlens=(700, 0, 330), gate="softplus",
                     state_v_first=state_v_first, seed=13)
    p64 = p.to(torch.float64, requires_grad=True)
    g_ref = grads(lambda x: reference.fused_recurrent_kda(*x.args, **x.kwargs), p64)
    g32 = grads(native, p.to(torch.float32, requires_grad=True))
    for name, gr in g_ref.items():
        assert rel_err(g32[name], gr) < 5e-5, name


def test_mixed_16_bit_and_fp32_inputs_equal_fp32_inputs_of_the_same_values():
    # The pre-processing pass reads each input as it is stored (bf16 q/k/v, an fp16 gate input,
    # fp32 beta logits here): the result is bitwise the fp32 op's on the same values.
    p = make_problem(B=1, T=300, H=8, HV=16, K=130, V=6, gate="softplus", seed=9)
    args = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    mixed = dict(args, q=args["q"].bfloat16(), k=args["k"].bfloat16(), v=args["v"].bfloat16(),
                 g=args["g"].half(), beta=args["beta"].float(),
                 initial_state=args["initial_state"].float(), A_log=args["A_log"].float(),
                 dt_bias=args["dt_bias"].float())
    same = {n: (x.float() if torch.is_tensor(x) and x.is_floating_point() else x)
            for n, x in mixed.items()}
    o, s = torch_kda.fused_recurrent_kda(**mixed, backend="native")
    o32, s32 = torch_kda.fused_recurrent_kda(**same, backend="native")
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, o32.bfloat16())
    assert torch.equal(s, s32)


# q, k, v and grad_o in one dtype, the gate input in another; softplus reads the gate through the
# pre-processing only, the bounded gate's chain rule reads its raw input too (a block buffer when
# it is 16-bit, the caller's array when it is fp32).
@pytest.mark.parametrize("dtype,g_dtype,gate,seqlens", [
    (torch.bfloat16, torch.bfloat16, "softplus", None),
    (torch.float16, torch.float16, "bounded", (300, 0, 37, 93)),
    (torch.bfloat16, torch.float32, "bounded", None),
    (torch.bfloat16, torch.float16, "bounded", (300, 0, 37, 93)),
], ids=["bf16_softplus", "fp16_bounded_varlen", "bf16_fp32_gate", "bf16_fp16_gate_varlen"])
def test_16_bit_gradients_across_backward_blocks_equal_fp32_gradients_of_the_same_values(
        dtype, g_dtype, gate, seqlens):
    # The backward reads 16-bit inputs and grad_o block by block (widened exactly, in registers
    # or into block buffers): its gradients are bitwise the fp32 op's on the same values, each
    # rounded once to its input's dtype.
    p = make_problem(B=2, T=200, H=8, HV=16, K=130, V=6, seqlens=seqlens, gate=gate, seed=14)
    args = dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs)
    half = {n: (x.float() if torch.is_tensor(x) and x.is_floating_point() else x)
            for n, x in args.items()}
    half.update(q=args["q"].to(dtype), k=args["k"].to(dtype), v=args["v"].to(dtype),
                g=args["g"].to(g_dtype), beta=args["beta"].to(dtype))
    same = {n: (x.float() if torch.is_tensor(x) and x.is_floating_point() else x)
            for n, x in half.items()}
    names = [n for n, x in half.items() if torch.is_tensor(x) and x.is_floating_point()]
    gen = torch.Generator().manual_seed(15)

    def grads_of(inputs, d_o, d_s):
        leaves = {n: inputs[n].detach().requires_grad_() for n in names}
        o, s = torch_kda.fused_recurrent_kda(**dict(inputs, **leaves), backend="native")
        gs = torch.autograd.grad((o, s), [leaves[n] for n in names], (d_o.to(o.dtype), d_s))
        return o, dict(zip(names, gs))

    d_o = torch.randn(*args["v"].shape, generator=gen).to(dtype)
    d_s = torch.randn(*args["initial_state"].shape, generator=gen)
    o, g16 = grads_of(half, d_o, d_s)
    _, g32 = grads_of(same, d_o.float(), d_s)
    assert o.dtype == dtype
    for n in names:
        assert g16[n].dtype == half[n].dtype, n
        assert torch.equal(g16[n], g32[n].to(half[n].dtype)), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_values_outside_the_domain_are_named(dtype):
    p = make_problem(B=1, T=300, H=2, HV=4, K=16, V=8, gate="none", beta_sigmoid=False, seed=13)
    args = {n: (x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x)
            for n, x in dict(zip(("q", "k", "v", "g", "beta"), p.args), **p.kwargs).items()}
    g = args["g"].clone()
    g[0, 250, 3, 7] = 0.5
    with pytest.raises(ValueError, match=r"g\[0, 250, 3, 7\] = 0\.5"):
        torch_kda.fused_recurrent_kda(**dict(args, g=g), backend="native")
    beta = args["beta"].clone()
    beta[0, 199, 2] = 3.0
    with pytest.raises(ValueError, match=r"beta\[0, 199, 2\] = 3"):
        torch_kda.fused_recurrent_kda(**dict(args, beta=beta), backend="native")


def test_the_first_value_outside_the_domain_is_named_across_heads():
    # Several bad values in different heads and tokens: the op names the smallest index (token
    # first, then head), whatever order the pre-processing visits them in.
    p = make_problem(B=1, T=300, H=2, HV=4, K=16, V=8, gate="none", beta_sigmoid=False, seed=15)
    args = dict(zip(("q", "k", "v", "g", "beta"), p.to(torch.float32).args),
                **p.to(torch.float32).kwargs)
    g = args["g"].clone()
    g[0, 260, 0, 1] = 0.25
    g[0, 250, 3, 7] = 0.5
    g[0, 250, 2, 9] = 0.75
    with pytest.raises(ValueError, match=r"g\[0, 250, 2, 9\] = 0\.75"):
        torch_kda.fused_recurrent_kda(**dict(args, g=g), backend="native")
    beta = args["beta"].clone()
    beta[0, 199, 3] = 3.0
    beta[0, 150, 1] = -1.0
    with pytest.raises(ValueError, match=r"beta\[0, 150, 1\] = -1"):
        torch_kda.fused_recurrent_kda(**dict(args, beta=beta), backend="native")


@pytest.mark.parametrize("op", ["fused_recurrent_bwd", "chunk_bwd"])
def test_a_backward_called_alone_names_the_first_value_outside_the_domain(op):
    # The backward ops re-run the pre-processing block by block, last block first, with blocks of
    # max(8, 2 x threads) MB: bad values in two blocks must still give the forward's message (the
    # smallest index) at every thread count (found by a break-it pass: the last block's was named,
    # and which block that was moved with the thread count).
    ops = torch.ops.kda
    p = make_problem(B=1, T=1200, H=4, HV=16, K=130, V=6, gate="none", beta_sigmoid=False,
                     seed=16)
    q, k, v, g, beta = (t.float() for t in p.to(torch.float32).args)
    args = (q, k, v, g, beta, 130 ** -0.5, None, True)
    o, _, ckpt = ops.fused_recurrent_fwd(*args)
    g[0, 100, 1, 2] = 0.25
    g[0, 1100, 3, 4] = 0.5
    d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(17))

    def message():
        with pytest.raises(ValueError) as info:
            getattr(ops, op)(d_o, None, ckpt, *args)
        return str(info.value)

    for text in per_thread_count(message, (1, 2, 6)):
        assert re.search(r"g\[0, 100, 1, 2\] = 0\.25", text), text
