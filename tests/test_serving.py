"""Serving arguments (docs/serving.md): a state pool updated in place by slot index, pad slots,
speculative decoding with per-token snapshots, prefill into the pool, the decode fast path.

Every backend on CPU ("native" and "reference") is compared against the float64 oracle applied to
the gathered states, and against plain calls.
"""

import pytest
import torch

import torch_kda
from kda_testing import make_problem, rel_err
from oracle import oracle_kda

BACKENDS = ("native", "reference")
TOL = 2e-5  # fp32 arithmetic vs the float64 oracle


def _pool(num_slots, HV, K, V, v_first, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_slots, HV, V, K) if v_first else (num_slots, HV, K, V)
    return (torch.randn(*shape, generator=gen) * 0.5).to(dtype)


def _decode_problem(N, HV=4, H=2, K=16, V=24, seed=0, seqlens=None):
    p = make_problem(B=N, T=1, H=H, HV=HV, K=K, V=V, seed=seed, initial_state=False,
                     seqlens=seqlens, output_final_state=False).to(torch.float32)
    p.kwargs.pop("state_v_first")
    return p


def _oracle_from(p, state, v_first, sel=None):
    """The oracle on the sequences ``sel`` (batch rows) started from ``state``."""
    args = [t if sel is None else t[sel] for t in p.args]
    kw = {k: v for k, v in p.kwargs.items() if k not in ("initial_state", "output_final_state",
                                                           "state_v_first")}
    return oracle_kda(*args, initial_state=state.double(), output_final_state=True,
                      state_v_first=v_first, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v_first", [False, True])
def test_pool_1d_indices_equal_gather_call_scatter(backend, v_first):
    p = _decode_problem(N=4)
    HV, K, V = 4, 16, 24
    pool = _pool(9, HV, K, V, v_first)
    before = pool.clone()
    idx = torch.tensor([7, -1, 0, 3], dtype=torch.int32)
    with torch.no_grad():
        o, final = torch_kda.fused_recurrent_kda(*p.args, **{**p.kwargs, "state_v_first": v_first},
                                                 initial_state=pool, ssm_state_indices=idx,
                                                 inplace_final_state=True, backend=backend)
    assert final is pool
    live = [0, 2, 3]
    o_ref, s_ref = _oracle_from(p, before[[7, 0, 3]], v_first, sel=live)
    assert rel_err(o[live], o_ref) < TOL
    assert rel_err(pool[[7, 0, 3]], s_ref) < TOL
    assert torch.count_nonzero(o[1]) == 0                                    # pad: zero output
    untouched = [s for s in range(9) if s not in (7, 0, 3)]
    assert torch.equal(pool[untouched], before[untouched])                   # bitwise unchanged


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_read_only_returns_fresh_states_and_leaves_pool(backend):
    p = _decode_problem(N=3, seqlens=[2, 1, 3])  # varlen, several tokens per sequence
    pool = _pool(5, 4, 16, 24, False)
    before = pool.clone()
    idx = torch.tensor([4, 1, 2])
    o, final = torch_kda.fused_recurrent_kda(*p.args, **{**p.kwargs, "output_final_state": True},
                                             initial_state=pool, ssm_state_indices=idx,
                                             backend=backend)
    o_ref, s_ref = oracle_kda(*p.args, **{**p.kwargs, "initial_state": before[[4, 1, 2]].double(),
                                          "output_final_state": True})
    assert rel_err(o, o_ref) < TOL and rel_err(final, s_ref) < TOL
    assert torch.equal(pool, before)


@pytest.mark.parametrize("v_first", [False, True])
def test_bf16_pool_within_bf16_rounding_of_fp32_pool(v_first):
    p = _decode_problem(N=3, K=32, V=32)
    pool32 = _pool(4, 4, 32, 32, v_first).bfloat16().float()  # same starting values
    pool16 = pool32.bfloat16()
    idx = torch.tensor([2, 0, 3])
    kw = {**p.kwargs, "state_v_first": v_first}
    with torch.no_grad():
        o32, _ = torch_kda.fused_recurrent_kda(*p.args, **kw, initial_state=pool32,
                                               ssm_state_indices=idx, inplace_final_state=True)
        o16, _ = torch_kda.fused_recurrent_kda(*p.args, **kw, initial_state=pool16,
                                               ssm_state_indices=idx, inplace_final_state=True)
    assert rel_err(o16, o32) < 1e-6                        # same starting state, fp32 math
    assert rel_err(pool16.float(), pool32) < 2 ** -8       # one bf16 rounding of the result
    assert torch.equal(pool16[1], pool32[1].bfloat16())    # unnamed slot untouched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v_first", [False, True])
def test_speculative_snapshots_equal_sequential_decode(backend, v_first):
    N, T, HV, K, V = 2, 4, 4, 16, 24
    p = make_problem(B=N, T=T, H=2, HV=HV, K=K, V=V, seed=3, initial_state=False,
                     output_final_state=False).to(torch.float32)
    kw = {**p.kwargs, "state_v_first": v_first}
    pool = _pool(12, HV, K, V, v_first)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    nat = torch.tensor([3, 1])  # sequence 0 resumes from slot 2, sequence 1 from slot 4
    with torch.no_grad():
        o, _ = torch_kda.fused_recurrent_kda(*p.args, **kw, initial_state=pool, ssm_state_indices=idx,
                                             num_accepted_tokens=nat, inplace_final_state=True,
                                             backend=backend)
    o_ref, _ = _oracle_from(p, before[[2, 4]], v_first)
    assert rel_err(o, o_ref) < TOL
    for t in range(T):  # snapshot t == the state after token t of a sequential decode
        prefix = [x[:, :t + 1] for x in p.args]
        _, s_t = oracle_kda(*prefix, **{**kw, "initial_state": before[[2, 4]].double(),
                                        "output_final_state": True})
        assert rel_err(pool[idx[:, t]], s_t) < TOL
    assert torch.equal(pool[8:], before[8:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("v_first", [False, True])
def test_fp64_inputs_write_a_narrower_pool_in_place(backend, pool_dtype, v_first):
    """fp64 inputs with an fp32 or bf16 pool: final states and snapshots land in the pool itself,
    rounded once to its dtype (the native kernel once wrote fp64 values through the fp32 pool's
    pointer: out-of-bounds writes; and its snapshots into a temporary copy)."""
    N, T, HV, K, V = 2, 3, 4, 16, 24
    p = make_problem(B=N, T=T, H=2, HV=HV, K=K, V=V, seed=5, initial_state=False,
                     output_final_state=False)  # float64
    kw = {**p.kwargs, "state_v_first": v_first}
    pool = _pool(10, HV, K, V, v_first, dtype=pool_dtype, seed=6)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]])
    nat = torch.tensor([1, 3])  # sequence 0 starts from slot 0, sequence 1 from slot 5
    with torch.no_grad():
        o, final = torch_kda.fused_recurrent_kda(*p.args, **kw, initial_state=pool,
                                                 ssm_state_indices=idx, num_accepted_tokens=nat,
                                                 inplace_final_state=True, backend=backend)
    assert final is pool and o.dtype == torch.float64
    start = before[[0, 5]].double()
    o_ref, _ = _oracle_from(p, start, v_first)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2 ** -7}[pool_dtype]
    assert rel_err(o, o_ref) < 1e-12
    for t in range(T):  # snapshot t == the state after token t, rounded once to the pool's dtype
        prefix = [x[:, :t + 1] for x in p.args]
        _, s_t = oracle_kda(*prefix, **{**kw, "initial_state": start, "output_final_state": True})
        assert rel_err(pool[idx[:, t]], s_t) < tol
    assert torch.equal(pool[6:], before[6:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_then_continue_equals_decoding_accepted_tokens(backend):
    """Verify 3 drafts in one call, accept 2, continue: equals decoding the accepted tokens."""
    HV, K, V = 2, 16, 16
    p = make_problem(B=1, T=4, H=2, HV=HV, K=K, V=V, seed=5, initial_state=False,
                     output_final_state=False).to(torch.float32)
    kw = {**p.kwargs}
    kw.pop("output_final_state")
    pool = _pool(8, HV, K, V, False)
    start = pool[5].clone()
    with torch.no_grad():
        # step 1: verify tokens 0..2 from slot 5 (num_accepted_tokens = 1 reads column 0 = slot 5)
        torch_kda.fused_recurrent_kda(*[x[:, :3] for x in p.args], **kw, initial_state=pool,
                                      ssm_state_indices=torch.tensor([[5, 6, 7]]),
                                      num_accepted_tokens=torch.tensor([1]),
                                      inplace_final_state=True, backend=backend)
        # 2 accepted: the state after token 1 is in slot 6; step 2 decodes token 3 from there
        o3, _ = torch_kda.fused_recurrent_kda(*[x[:, 3:4] for x in p.args], **kw, initial_state=pool,
                                              ssm_state_indices=torch.tensor([[6]]),
                                              inplace_final_state=True, backend=backend)
        # the same accepted tokens (0, 1, then 3) one at a time, plain calls
        S = start.unsqueeze(0)
        for t in (0, 1, 3):
            o_t, S = torch_kda.fused_recurrent_kda(*[x[:, t:t + 1] for x in p.args], **kw,
                                                   initial_state=S, output_final_state=True,
                                                   backend=backend)
    assert rel_err(o3, o_t) < TOL
    assert rel_err(pool[6], S[0]) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_prefill_and_decode_in_one_chunk_call_equal_separate_calls(backend):
    HV, K, V = 2, 16, 16
    lens = [37, 1, 20, 1]
    p = make_problem(H=2, HV=HV, K=K, V=V, seed=7, initial_state=False, seqlens=lens,
                     output_final_state=False).to(torch.float32)
    pool = _pool(6, HV, K, V, False)
    before = pool.clone()
    idx = torch.tensor([3, 0, 5, 1])
    with torch.no_grad():
        o, _, h = torch_kda.chunk_kda(*p.args, **p.kwargs, initial_state=pool, ssm_state_indices=idx,
                                      inplace_final_state=True, return_intermediate_states=True,
                                      chunk_size=16, backend=backend)
        o2, _ = torch_kda.chunk_kda(*p.args, **p.kwargs, initial_state=before.clone(),
                                    ssm_state_indices=idx, inplace_final_state=False,
                                    backend=backend)
    cu = p.kwargs["cu_seqlens"].tolist()
    chunk = 0
    for n, slot in enumerate(idx.tolist()):
        seq = [x[:, cu[n]:cu[n + 1]] for x in p.args]
        kw = {k: v for k, v in p.kwargs.items() if k != "cu_seqlens"}
        o_ref, s_ref = oracle_kda(*seq, **{**kw, "initial_state": before[slot:slot + 1].double(),
                                           "output_final_state": True})
        assert rel_err(o[:, cu[n]:cu[n + 1]], o_ref) < TOL
        assert rel_err(pool[slot], s_ref[0]) < TOL
        for c in range(-(-lens[n] // 16)):  # entry c = state after c * 16 tokens (a split prefill)
            if c == 0:
                expect = before[slot].double()
            else:
                _, s_c = oracle_kda(*[x[:, :16 * c] for x in seq],
                                    **{**kw, "initial_state": before[slot:slot + 1].double(),
                                       "output_final_state": True})
                expect = s_c[0]
            assert rel_err(h[0, chunk], expect) < TOL
            chunk += 1
    assert h.shape == (1, chunk, HV, K, V)
    assert rel_err(o2, o) < TOL


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("K,V", [(32, 40), (7, 5), (20, 3)])  # whole vectors, ragged K, odd V
def test_plain_decode_matches_oracle_in_both_layouts(v_first, K, V):
    p = make_problem(B=3, T=1, H=2, HV=4, K=K, V=V, seed=11, state_v_first=v_first
                     ).to(torch.float32)
    with torch.no_grad():
        o, s = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="native")
    o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL
    assert s.shape == p.kwargs["initial_state"].shape


@pytest.mark.parametrize("T", [2, 3, 4, 10])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("gate", ["none", "softplus", "bounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_plain_calls_run_the_decode_kernels_token_by_token(T, v_first, gate, dtype):
    # Small calls run on the serving kernels (csrc/cpu/serving.h, is_short_call: here
    # T x B x HV x K x V <= 30,720 of the bound's 32,768), which carry each state slice from token
    # to token exactly: bitwise the chain of T one-token decode calls, and within fp32 rounding of
    # the float64 oracle.
    p = make_problem(B=2, T=T, H=2, HV=4, K=16, V=24, seed=11, state_v_first=v_first, gate=gate
                     ).to(torch.float32)
    args = [x.to(dtype) if x.is_floating_point() and x.dim() >= 3 else x for x in p.args]
    with torch.no_grad():
        o, s = torch_kda.fused_recurrent_kda(*args, **p.kwargs, backend="native")
        state, steps = p.kwargs["initial_state"], []
        for t in range(T):
            o_t, state = torch_kda.fused_recurrent_kda(*[x[:, t:t + 1] for x in args],
                                                       **{**p.kwargs, "initial_state": state},
                                                       backend="native")
            steps.append(o_t)
    assert torch.equal(o, torch.cat(steps, 1)) and torch.equal(s, state)
    o_ref, s_ref = oracle_kda(*args, **p.kwargs)
    tol = TOL if dtype == torch.float32 else 1e-2  # bf16 o: one rounding of each output
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < TOL


def test_short_packed_sequences_match_the_oracle():
    # cu_seqlens under the work bound (the serving kernels), with an empty sequence among them,
    # and past it (the general kernels): few long sequences, many short ones.
    for lens in ([1, 4, 2, 3], [4, 5, 0, 1], [17], [20, 30], [4] * 80):
        p = make_problem(B=1, T=sum(lens), H=2, HV=4, K=24, V=20, seed=5, seqlens=lens).to(torch.float32)
        with torch.no_grad():
            o, s = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="native")
        o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
        assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL, lens


@pytest.mark.parametrize("gate", ["none", "bounded"])
def test_native_serving_bitwise_identical_for_any_thread_count(gate):
    p = make_problem(B=5, T=1, H=2, HV=4, K=32, V=48, seed=13, gate=gate, initial_state=False,
                     output_final_state=False).to(torch.float32)
    p.kwargs.pop("state_v_first")
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            pool = _pool(6, 4, 32, 48, True)
            with torch.no_grad():
                o, _ = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, state_v_first=True,
                                                     initial_state=pool, inplace_final_state=True,
                                                     ssm_state_indices=torch.tensor([5, 0, 2, 1, 4]),
                                                     backend="native")
            results.append((o, pool))
    finally:
        torch.set_num_threads(old)
    for o, pool in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(pool, results[0][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_headwise_beta_with_equal_columns_equals_scalar_beta(backend):
    p = _decode_problem(N=2, seqlens=[3, 2])
    beta4 = p.beta.unsqueeze(-1).expand(*p.beta.shape, 24).contiguous()
    kw = {**p.kwargs, "output_final_state": True}
    o1, s1 = torch_kda.fused_recurrent_kda(*p.args, **kw, backend="reference")
    with torch.no_grad():
        o2, s2 = torch_kda.fused_recurrent_kda(p.q, p.k, p.v, p.g, beta4, **kw, backend=backend)
    assert rel_err(o2, o1) < TOL and rel_err(s2, s1) < TOL


def test_headwise_beta_native_matches_reference():
    p = _decode_problem(N=2, seqlens=[3, 2])
    gen = torch.Generator().manual_seed(2)
    beta4 = torch.randn(*p.beta.shape, 24, generator=gen)
    args = (p.q, p.k, p.v, p.g, beta4)
    kw = {**p.kwargs, "output_final_state": True}
    o_ref, s_ref = torch_kda.fused_recurrent_kda(*[a.double() for a in args], **kw,
                                                 backend="reference")
    with torch.no_grad():
        o, s = torch_kda.fused_recurrent_kda(*args, **kw, backend="native")
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_is_written_and_returned(backend):
    p = _decode_problem(N=2)
    out = torch.full((2, 1, 4, 24), float("nan"))
    with torch.no_grad():
        o, _ = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, out=out, backend=backend)
    o_ref, _ = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="reference")
    assert o is out and rel_err(out, o_ref) < TOL


def _serving_calls(p, pool, out, final):
    """The ways to write a pool, out and a final state in place on the native op: the functional
    API (its C++ fast path), chunk_kda's "auto" (the recurrent serving kernel for one token),
    and the op itself."""
    idx = torch.tensor([0, 2])
    kw = dict(initial_state=pool, ssm_state_indices=idx, inplace_final_state=True, out=out)
    flags = {n: x for n, x in p.kwargs.items()
             if n in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                      "allow_neg_eigval", "lower_bound", "A_log", "dt_bias")}
    return {
        "fused_recurrent_kda": lambda: torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, **kw,
                                                                     backend="native"),
        "chunk_kda auto": lambda: torch_kda.chunk_kda(*p.args, **p.kwargs, **kw, backend="auto"),
        "op, in place": lambda: torch.ops.kda.fused_recurrent_serving(
            *p.args, 0.25, pool, idx, None, out, None, -1, True, **flags),
        "op, final_state": lambda: torch.ops.kda.fused_recurrent_serving(
            *p.args, 0.25, pool, idx, None, out, final, -1, False, **flags),
    }


@pytest.mark.parametrize("call", ["fused_recurrent_kda", "chunk_kda auto", "op, in place",
                                  "op, final_state"])
def test_native_writes_in_place_bump_versions_as_pytorch_in_place_ops(call):
    # The native serving op writes below autograd's in-place layer: without the bump, a graph
    # that saved the pool (or out) backpropagated through the new values without a word.
    p = _decode_problem(N=2)
    pool, out = _pool(3, 4, 16, 24, False), torch.empty(2, 1, 4, 24)
    final = _pool(2, 4, 16, 24, False)
    w = torch.ones_like(pool, requires_grad=True)
    saved = (w * pool).sum()  # mul saves pool for its backward
    before = {n: t._version for n, t in (("pool", pool), ("out", out), ("final", final))}
    with torch.no_grad():
        _serving_calls(p, pool, out, final)[call]()
    assert out._version > before["out"]
    if call == "op, final_state":
        assert final._version > before["final"] and pool._version == before["pool"]
    else:
        assert pool._version > before["pool"]
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()


# ---- bad input: named errors, and the pool is unchanged ---------------------------------------

def _bad_calls():
    p = _decode_problem(N=2)
    idx2d = torch.tensor([[0, 1], [2, 3]])
    spec = make_problem(B=2, T=2, H=2, HV=4, K=16, V=24, seed=0, initial_state=False,
                        output_final_state=False).to(torch.float32)
    return [
        ("out of range", p, dict(ssm_state_indices=torch.tensor([0, 9])), ValueError, "out of range"),
        ("negative index", p, dict(ssm_state_indices=torch.tensor([0, -3])), ValueError, "out of range"),
        ("duplicate slot", p, dict(ssm_state_indices=torch.tensor([4, 4])), ValueError, "two sequences write slot 4"),
        ("float indices", p, dict(ssm_state_indices=torch.tensor([0.0, 1.0])), TypeError, "ssm_state_indices"),
        ("list of indices", p, dict(ssm_state_indices=[0, 1]), TypeError,
         "ssm_state_indices must be a torch.Tensor or None, got list"),
        ("list of accepted counts", spec, dict(ssm_state_indices=idx2d, num_accepted_tokens=[1, 1]),
         TypeError, "num_accepted_tokens must be a torch.Tensor or None, got list"),
        ("wrong N", p, dict(ssm_state_indices=torch.tensor([0, 1, 2])), ValueError, "ssm_state_indices"),
        ("nat without 2-D", p, dict(ssm_state_indices=torch.tensor([0, 1]), num_accepted_tokens=torch.tensor([1, 1])),
         ValueError, "num_accepted_tokens"),
        ("nat zero", spec, dict(ssm_state_indices=idx2d, num_accepted_tokens=torch.tensor([0, 1])), ValueError,
         r"num_accepted_tokens\[0\] must be in \[1, T_n\]"),
        ("nat too large", spec, dict(ssm_state_indices=idx2d, num_accepted_tokens=torch.tensor([1, 3])),
         ValueError, r"num_accepted_tokens\[1\]"),
        ("read slot written by another", spec, dict(ssm_state_indices=torch.tensor([[0, 1], [1, 3]]),
                                                   num_accepted_tokens=torch.tensor([1, 1])),
         ValueError, "slot 1"),
        ("one row writes a slot twice", spec, dict(ssm_state_indices=torch.tensor([[0, 1], [2, 2]]),
                                                   num_accepted_tokens=torch.tensor([1, 1])),
         ValueError, r"sequence 1 writes slot 2 twice \(at ssm_state_indices\[1, 0\] and \[1, 1\]\)"),
        ("T_n > T_max", spec, dict(ssm_state_indices=torch.tensor([[0], [2]])), ValueError, "T_max"),
        ("pad_slot_id not an int", p, dict(ssm_state_indices=torch.tensor([0, 1]), pad_slot_id=-1.0),
         TypeError, "pad_slot_id must be an int, got float"),
        # (the reference accepted it, the native op raised the dispatcher's type error)
        ("pad_slot_id beyond int64", p, dict(ssm_state_indices=torch.tensor([0, 1]), pad_slot_id=2 ** 70),
         ValueError, "pad_slot_id must fit in int64"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_serving_input_raises_named_error_and_leaves_pool(backend, case):
    name, p, extra, exc, match = _bad_calls()[case]
    pool = _pool(8, 4, 16, 24, False)
    before = pool.clone()
    with torch.no_grad(), pytest.raises(exc, match=match):
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=pool,
                                      inplace_final_state=True, backend=backend, **extra)
    assert torch.equal(pool, before), name


def test_pool_layout_and_dtype_mismatch_raise():
    p = _decode_problem(N=2)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"state pool.*\[num_slots, HV, V, K\]"):
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=_pool(3, 4, 16, 24, False),
                                      ssm_state_indices=idx, state_v_first=True, inplace_final_state=True)
    with pytest.raises(TypeError, match="float32 or bfloat16|float32', 'torch.bfloat16"):
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=_pool(3, 4, 16, 24, False).half(),
                                      ssm_state_indices=idx, inplace_final_state=True)
    with pytest.raises(ValueError, match="need inplace_final_state=True"):
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=_pool(3, 4, 16, 24, False),
                                      ssm_state_indices=torch.tensor([[0], [1]]))


def test_inplace_serving_on_tensors_requiring_grad_is_rejected():
    p = _decode_problem(N=2)
    pool = _pool(3, 4, 16, 24, False)
    before = pool.clone()
    q = p.q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="inference only.*q requires grad"):
        torch_kda.fused_recurrent_kda(q, *p.args[1:], **p.kwargs, initial_state=pool,
                                      ssm_state_indices=torch.tensor([0, 2]), inplace_final_state=True)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("written", ["out", "final_state"])
def test_serving_op_refuses_written_tensors_requiring_grad(written):
    # The op writes out and a caller's final_state below autograd: under grad mode a leaf that
    # requires grad would change without a word, and a non-leaf's graph would go stale (its
    # gradient then wrong), where PyTorch's in-place ops record the write or refuse it.
    p = _decode_problem(N=2)
    pool = _pool(3, 4, 16, 24, False)
    tensors = {"out": torch.empty(2, 1, 4, 24), "final_state": torch.zeros(2, 4, 16, 24)}
    leaf = torch.randn_like(tensors[written]).requires_grad_(True)
    tensors[written] = leaf * 2  # a non-leaf requiring grad
    before = tensors[written].detach().clone()
    with pytest.raises(ValueError, match=f"inference only.*but {written} requires grad"):
        torch.ops.kda.fused_recurrent_serving(p.q, p.k, p.v, p.g, p.beta, 0.25, pool,
                                              torch.tensor([0, 2]), None, tensors["out"],
                                              tensors["final_state"], -1, False)
    assert torch.equal(tensors[written].detach(), before)


@pytest.mark.parametrize("on_meta", ["out", "final_state", "initial_state", "ssm_state_indices",
                                     "cu_seqlens", "beta"])
def test_serving_op_with_one_meta_tensor_among_cpu_tensors_is_refused(on_meta):
    # One meta tensor sends the whole call to the op's Meta kernel (Meta has the higher dispatch
    # priority), which returned with nothing written; it now checks the devices as the plain
    # op's Meta kernel does. A call with every tensor on meta still runs (fake tensors, tracing).
    p = _decode_problem(N=2)
    args = {"q": p.q, "k": p.k, "v": p.v, "g": p.g, "beta": p.beta,
            "initial_state": _pool(3, 4, 16, 24, False), "ssm_state_indices": torch.tensor([0, 2]),
            "out": torch.full((2, 1, 4, 24), 7.0), "final_state": torch.full((2, 4, 16, 24), 7.0),
            "cu_seqlens": None}
    if on_meta == "cu_seqlens":  # packed: B = 1 with two one-token sequences
        args.update({n: args[n].reshape(1, 2, *args[n].shape[2:])
                     for n in ("q", "k", "v", "g", "beta", "out")},
                    cu_seqlens=torch.tensor([0, 1, 2]))
    args[on_meta] = args[on_meta].to("meta")

    def call(a):
        torch.ops.kda.fused_recurrent_serving(
            a["q"], a["k"], a["v"], a["g"], a["beta"], 0.25, a["initial_state"],
            a["ssm_state_indices"], None, a["out"], a["final_state"], -1, False,
            cu_seqlens=a["cu_seqlens"])

    with pytest.raises(ValueError, match=f"fused_recurrent_serving: {on_meta} must be on the "
                                         r"device of q \(cpu\), got meta"):
        call(args)
    call({n: t if t is None else t.to("meta") for n, t in args.items()})


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_pool_written_outside_inference_mode_is_refused_before_writing(backend):
    # PyTorch refuses the version bump of an inference tensor outside inference mode only after
    # the write: the call is refused first, the pool and out unchanged.
    p = _decode_problem(N=2)
    with torch.inference_mode():
        pool = _pool(4, 4, 16, 24, False)
        out = torch.full((2, 1, 4, 24), 7.0)
    before = pool.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="initial_state was made under inference mode"):
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=pool, inplace_final_state=True,
                                      ssm_state_indices=torch.tensor([1, 3]), backend=backend)
    assert torch.equal(pool, before)
    with torch.no_grad(), pytest.raises(ValueError, match="out was made under inference mode"):
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, out=out, backend=backend)
    assert (out == 7.0).all()
    with torch.no_grad(), pytest.raises(ValueError, match="initial_state was made under inference mode"):
        torch.ops.kda.fused_recurrent_serving(p.q, p.k, p.v, p.g, p.beta, 0.25, pool,
                                              torch.tensor([1, 3]), None, torch.empty(2, 1, 4, 24),
                                              None, -1, True)
    assert torch.equal(pool, before)
    with torch.inference_mode():  # inside inference mode: allowed, and the pool is updated
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=pool, inplace_final_state=True,
                                      ssm_state_indices=torch.tensor([1, 3]), backend=backend)
    assert not torch.equal(pool, before)


def test_forward_mode_ad_through_the_serving_op_is_refused():
    # No native op has a forward-mode formula: a tangent would be dropped without a word.
    import torch.autograd.forward_ad as fwAD
    p = _decode_problem(N=2)
    pool = _pool(4, 4, 16, 24, False)
    before = pool.clone()
    with torch.no_grad(), fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.ops.kda.fused_recurrent_serving(fwAD.make_dual(p.q, torch.randn_like(p.q)), p.k, p.v,
                                              p.g, p.beta, 0.25, pool, torch.tensor([1, 3]), None,
                                              torch.empty(2, 1, 4, 24), None, -1, True)
    assert torch.equal(pool, before)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda q: torch.ops.kda.fused_recurrent_serving(
            q, p.k, p.v, p.g, p.beta, 0.25, pool, torch.tensor([1, 3]), None,
            torch.empty(2, 1, 4, 24), None, -1, False), (p.q,), (torch.randn_like(p.q),))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("backend", BACKENDS + ("auto",))
def test_in_place_serving_under_forward_mode_ad_is_refused_and_read_only_serving_runs(backend):
    # In place, the pool (and out) could carry no tangent (forward_ad dropped the pool's; under
    # torch.func.jvp the checks met functorch's wrappers): refused before writing. A read-only
    # pool gives the reference's tangent (auto) or is refused (native).
    import torch.autograd.forward_ad as fwAD
    p = _decode_problem(N=2)
    pool = _pool(4, 4, 16, 24, False)
    before = pool.clone()
    tq = torch.randn_like(p.q)
    call = lambda q, **kw: torch_kda.fused_recurrent_kda(q, *p.args[1:], **p.kwargs, initial_state=pool,
                                                         ssm_state_indices=torch.tensor([1, 3]),
                                                         backend=backend, **kw)[0]
    with torch.no_grad():
        with fwAD.dual_level(), pytest.raises((ValueError, NotImplementedError),
                                              match="forward-mode AD"):
            call(fwAD.make_dual(p.q, tq), inplace_final_state=True)
        with pytest.raises((ValueError, NotImplementedError), match="forward-mode AD"):
            torch.func.jvp(lambda q: call(q, inplace_final_state=True), (p.q,), (tq,))
        with pytest.raises((ValueError, NotImplementedError), match="forward-mode AD"):
            torch.func.jvp(lambda q: call(q, out=torch.empty(2, 1, 4, 24)), (p.q,), (tq,))
    assert torch.equal(pool, before)
    if backend == "native":
        return
    _, t = torch.func.jvp(call, (p.q,), (tq,))
    eps = 1e-3  # central difference in fp32 on a smooth map: about eps^2 relative
    fd = (call(p.q + eps * tq) - call(p.q - eps * tq)) / (2 * eps)
    assert t.norm() > 0 and rel_err(t, fd) < 1e-3


def test_cpp_op_rejects_duplicate_slots_before_writing():
    p = _decode_problem(N=2)
    pool = _pool(4, 4, 16, 24, False)
    before = pool.clone()
    out = torch.empty(2, 1, 4, 24)
    with torch.no_grad(), pytest.raises(ValueError, match="two sequences write slot 3"):
        torch.ops.kda.fused_recurrent_serving(p.q, p.k, p.v, p.g, p.beta, 0.25, pool,
                                              torch.tensor([3, 3]), None, out, None, -1, True)
    with torch.no_grad(), pytest.raises(ValueError, match="out of range"):
        torch.ops.kda.fused_recurrent_serving(p.q, p.k, p.v, p.g, p.beta, 0.25, pool,
                                              torch.tensor([1, 4]), None, out, None, -1, True)
    # two snapshots of one speculative row in one slot
    spec = make_problem(B=2, T=2, H=2, HV=4, K=16, V=24, seed=1, initial_state=False,
                        output_final_state=False).to(torch.float32)
    out2 = torch.empty(2, 2, 4, 24)
    with torch.no_grad(), pytest.raises(ValueError, match=r"sequence 0 writes slot 1 twice"):
        torch.ops.kda.fused_recurrent_serving(spec.q, spec.k, spec.v, spec.g, spec.beta, 0.25, pool,
                                              torch.tensor([[1, 1], [2, 3]]), torch.tensor([1, 1]),
                                              out2, None, -1, True)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool", [False, True])
def test_decode_final_state_non_temporal_stores_write_the_same_bits(monkeypatch, v_first, pool):
    # Decode writes a fresh fp32 final state larger than the last-level cache with non-temporal
    # stores (csrc/cpu/serving.cpp, stream_final_state); TORCH_KDA_DECODE_STREAM forces either way.
    p = make_problem(B=3, T=1, H=2, HV=4, K=32, V=48, seed=17, state_v_first=v_first
                     ).to(torch.float32)
    kw = dict(p.kwargs)
    if pool:  # a read-only pool: fresh final states of the named slots
        kw["initial_state"] = _pool(5, 4, 32, 48, v_first)
        kw["ssm_state_indices"] = torch.tensor([4, 0, 2])
    results = []
    old = torch.get_num_threads()
    try:
        for stream, threads in (("0", 1), ("1", 1), ("1", 3)):
            monkeypatch.setenv("TORCH_KDA_DECODE_STREAM", stream)
            torch.set_num_threads(threads)
            with torch.no_grad():
                results.append(torch_kda.fused_recurrent_kda(*p.args, **kw, backend="native"))
    finally:
        torch.set_num_threads(old)
    (o0, s0), (o1, s1), (o3, s3) = results
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
    assert torch.equal(o1, o3) and torch.equal(s1, s3)
    start = kw["initial_state"][kw["ssm_state_indices"]] if pool else kw["initial_state"]
    o_ref, s_ref = _oracle_from(p, start, v_first)
    assert rel_err(o1, o_ref) < TOL and rel_err(s1, s_ref) < TOL


# ---- memory written in place must not alias what the call reads (or itself) -------------------

def _aliased_pools(HV=4, K=16, V=24):
    slot = HV * K * V
    return [
        ("expanded (stride 0)", torch.randn(1, HV, K, V).expand(6, -1, -1, -1)),
        ("overlapping slots", torch.randn(6 * slot).as_strided((6, HV, K, V), (slot // 2, K * V, V, 1))),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(2))
def test_pool_whose_slots_share_memory_is_rejected(backend, case):
    # Two slot indices naming one memory location: the native kernel wrote both sequences' states
    # there and returned wrong outputs without a word (o off by 55% for an expanded pool).
    name, pool = _aliased_pools()[case]
    p = _decode_problem(N=2)
    before = pool.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="slots of the state pool .*overlap"):
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=pool,
                                      ssm_state_indices=torch.tensor([1, 3]),
                                      inplace_final_state=True, backend=backend)
    assert torch.equal(pool, before), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_with_strided_separate_slots_is_accepted(backend):
    # every other slot of a larger buffer: strided, but no two slots overlap (the valid contrast)
    p = _decode_problem(N=2)
    buf = _pool(12, 4, 16, 24, False)
    pool = buf[::2]
    before = pool.clone()
    with torch.no_grad():
        o, _ = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=pool,
                                             ssm_state_indices=torch.tensor([5, 2]),
                                             inplace_final_state=True, backend=backend)
    o_ref, s_ref = _oracle_from(p, before[[5, 2]], False)
    assert rel_err(o, o_ref) < TOL and rel_err(pool[[5, 2]], s_ref) < TOL
    assert torch.equal(pool[[0, 1, 3, 4]], before[[0, 1, 3, 4]]) and torch.equal(buf[1::2], _pool(12, 4, 16, 24, False)[1::2])


@pytest.mark.parametrize("fn", ["fused_recurrent_kda", "chunk_kda"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alias", ["q", "k", "v", "g", "expanded"])
def test_out_sharing_memory_with_an_input_or_itself_is_rejected(fn, backend, alias):
    # out=q (same shape when HV = H and K = V): the native recurrent kernel wrote o into q while
    # other threads still read it, and returned o off by 66% (B1 T300 H1 K=V=64, 2 threads).
    p = make_problem(B=1, T=5, H=2, K=8, V=8, seed=4, initial_state=False,
                     output_final_state=False).to(torch.float32)
    args = [t.clone() for t in p.args]
    out = (args["qkvg".index(alias)] if alias != "expanded"
           else torch.zeros(1, 1, 2, 8).expand(1, 5, 2, 8))
    before = [t.clone() for t in args]
    match = "out shares memory with" if alias != "expanded" else "out has elements that share memory"
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        getattr(torch_kda, fn)(*args, **p.kwargs, out=out, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(args, before))


def test_out_sharing_memory_with_the_pool_is_rejected():
    p = _decode_problem(N=2, HV=2, K=4, V=24)  # out [2, 1, 2, 24] fits inside the pool's memory
    pool = _pool(3, 2, 4, 24, False)
    before = pool.clone()
    out = pool.view(-1)[:96].view(2, 1, 2, 24)
    with torch.no_grad(), pytest.raises(ValueError, match="out shares memory with initial_state"):
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, initial_state=pool, out=out,
                                      ssm_state_indices=torch.tensor([0, 2]),
                                      inplace_final_state=True)
    assert torch.equal(pool, before)


def test_cpp_serving_op_rejects_aliased_outputs_before_writing():
    p = _decode_problem(N=2, HV=2, K=24, V=24)
    out = torch.empty(2, 1, 2, 24)
    pool = torch.randn(1, 2, 24, 24).expand(4, -1, -1, -1)
    with torch.no_grad(), pytest.raises(ValueError, match="kda::fused_recurrent_serving: .*slots of the state pool"):
        torch.ops.kda.fused_recurrent_serving(p.q, p.k, p.v, p.g, p.beta, 0.25, pool,
                                              torch.tensor([0, 2]), None, out, None, -1, True)
    pool = _pool(4, 2, 24, 24, False)
    before = pool.clone()
    q = p.q.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="kda::fused_recurrent_serving: out shares memory with q"):
        torch.ops.kda.fused_recurrent_serving(q, p.k, p.v, p.g, p.beta, 0.25, pool,
                                              torch.tensor([0, 2]), None, q, None, -1, True)
    final = pool[:2]
    with torch.no_grad(), pytest.raises(ValueError, match="final_state shares memory with initial_state"):
        torch.ops.kda.fused_recurrent_serving(p.q, p.k, p.v, p.g, p.beta, 0.25, pool,
                                              torch.tensor([3, 2]), None, out, final, -1, False)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("case", ["g", "beta", "headwise beta"])
def test_cpp_serving_op_rejects_values_outside_the_domain_before_writing(case):
    # The plain ops reject g > 0 and beta outside [0, 2] (docs/bad_inputs.md rows 46-47); the
    # serving op (the C++ API's kda::fused_recurrent with serving options) computed with them
    # and wrote the pool (Python checked them only on its own way to the op).
    p = make_problem(B=2, T=3, H=2, K=8, V=8, gate="none", beta_sigmoid=False, seed=6,
                     initial_state=False, output_final_state=False).to(torch.float32)
    q, k, v, g, beta = p.args
    if case == "g":
        g = g.clone()
        g[1, 2, 0, 3] = 0.7
        match = r"kda::fused_recurrent_serving: g must be a log-decay <= 0 .* got g\[1, 2, 0, 3\] = 0.7"
    elif case == "beta":
        beta = beta.clone()
        beta[0, 1, 1] = 3.0
        match = r"kda::fused_recurrent_serving: beta must lie in \[0, 2\] .* got beta\[0, 1, 1\] = 3"
    else:
        beta = beta[..., None].repeat(1, 1, 1, 8)
        beta[1, 0, 1, 5] = -0.5
        match = r"kda::fused_recurrent_serving: beta must lie in \[0, 2\] .* = -0.5"
    pool = _pool(4, 2, 8, 8, False)
    before = pool.clone()
    out = torch.empty(2, 3, 2, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        torch.ops.kda.fused_recurrent_serving(q, k, v, g, beta, 0.3, pool, torch.tensor([0, 2]),
                                              None, out, None, -1, True)
    assert torch.equal(pool, before)


def test_headwise_beta_without_columns_is_a_named_error():
    # beta [B, T, HV, 0]: the checks took its column 0 to check the rest (an IndexError, from
    # Python and from the op alike) before they named the shape.
    p = _decode_problem(N=2)
    beta = torch.empty(2, 1, 4, 0)
    match = r"head-wise beta \[B, T, HV, V\] needs V = v.shape\[3\] > 0 columns, got shape \(2, 1, 4, 0\)"
    for backend in BACKENDS:
        with torch.no_grad(), pytest.raises(ValueError, match=match):
            torch_kda.fused_recurrent_kda(*p.args[:4], beta, **p.kwargs, backend=backend)
    with torch.no_grad(), pytest.raises(ValueError, match="kda::fused_recurrent_serving: head-wise beta"):
        torch.ops.kda.fused_recurrent_serving(p.q, p.k, p.v, p.g, beta, 0.25, None, None, None,
                                              torch.empty(2, 1, 4, 24), None, -1, False)


@pytest.mark.parametrize("fn", ["fused_recurrent_kda", "chunk_kda"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["q", "beta", "A_log"])
def test_out_with_inputs_requiring_grad_is_rejected(fn, backend, name):
    # out= is written outside autograd: the reference returned an o without a graph, so a loss
    # over o and the final state silently got the gradients of the final state only.
    p = make_problem(B=1, T=4, H=2, K=8, V=8, seed=9).to(torch.float32)
    p.tensors()[name].requires_grad_(True)
    out = torch.empty(1, 4, 2, 8)
    with pytest.raises(ValueError, match=f"out= is inference only .*but {name} requires grad"):
        getattr(torch_kda, fn)(*p.args, **p.kwargs, out=out, backend=backend)
    with torch.no_grad():  # the same call without autograd is fine
        o, _ = getattr(torch_kda, fn)(*p.args, **p.kwargs, out=out, backend=backend)
    assert o is out and rel_err(out, _oracle_from(p, p.kwargs["initial_state"], False)[0]) < TOL
