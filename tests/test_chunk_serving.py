"""Prefill into a state pool on the native chunk kernel (chunk_kda's serving arguments,
docs/serving.md): native chunk serving vs the reference serving path vs the float64 oracle, and the
intermediate states (the op's checkpoints) vs the chunkwise reference's.
"""

import pytest
import torch

import torch_kda
from torch_kda import _native
from kda_testing import make_problem, rel_err
from oracle import oracle_kda

TOL = 2e-5  # fp32 arithmetic vs the float64 oracle
HV, H, K, V = 4, 2, 16, 24  # GVA: two value heads per key head


def _problem(seqlens=None, B=None, T=None, seed=0, gate="softplus"):
    kw = dict(seqlens=seqlens) if seqlens is not None else dict(B=B, T=T)
    p = make_problem(H=H, HV=HV, K=K, V=V, seed=seed, gate=gate, initial_state=False,
                     output_final_state=False, **kw).to(torch.float32)
    p.kwargs.pop("state_v_first")
    p.kwargs.pop("output_final_state")
    return p


def _pool(num_slots, v_first, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_slots, HV, V, K) if v_first else (num_slots, HV, K, V)
    return (torch.randn(*shape, generator=gen) * 0.5).to(dtype)


def _starts(pool, idx):
    """The oracle's start states: the named slots, zeros for pad entries (-1)."""
    s = torch.zeros(len(idx), *pool.shape[1:], dtype=torch.float64)
    for n, slot in enumerate(idx.tolist()):
        if slot >= 0:
            s[n] = pool[slot].double()
    return s


def _no_recurrent_serving(monkeypatch):
    """Make the token-by-token serving kernel unreachable: the call must take the chunk path."""
    def fail(*a, **k):
        raise AssertionError("the recurrent serving kernel ran")
    monkeypatch.setattr(_native, "serving", fail)


# Varlen batches with short, empty and chunk-crossing sequences, and pads (-1).
CASES = {
    "varlen": ([66, 0, 1, 70, 5], [3, 6, -1, 0, 4]),
    "batch": (None, [2, -1, 5]),
}


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_native_chunk_prefill_into_pool_matches_oracle_and_reference(v_first, pool_dtype, inplace,
                                                                      case, monkeypatch):
    _no_recurrent_serving(monkeypatch)
    seqlens, slots = CASES[case]
    p = _problem(seqlens, B=3, T=67, seed=len(slots) + v_first)
    idx = torch.tensor(slots)
    live = [n for n, s in enumerate(slots) if s >= 0]
    pool = _pool(8, v_first, pool_dtype)
    before = pool.clone()
    out = torch.full((p.q.shape[0], p.q.shape[1], HV, V), float("nan"))
    kw = dict(p.kwargs, initial_state=pool, ssm_state_indices=idx, state_v_first=v_first,
              inplace_final_state=inplace, output_final_state=True)
    with torch.no_grad():
        o, final = torch_kda.chunk_kda(*p.args, **kw, out=out, backend="native")
        o_ref, final_ref = torch_kda.chunk_kda(*p.args, **{**kw, "initial_state": before.clone()},
                                               backend="reference")
    o_ora, s_ora = oracle_kda(*p.args, **{**p.kwargs, "initial_state": _starts(before, idx)},
                              state_v_first=v_first, output_final_state=True)
    assert o is out
    bounds = (p.kwargs["cu_seqlens"].tolist() if seqlens else None)

    def rows(t, ns):  # the tokens of the sequences ns
        if bounds is None:
            return t[ns]
        return torch.cat([t[:, bounds[n]:bounds[n + 1]] for n in ns], dim=1)

    pads = [n for n in range(len(slots)) if n not in live]
    assert rel_err(rows(o, live), rows(o_ora, live)) < TOL
    assert rel_err(o, o_ref) < TOL
    assert torch.count_nonzero(rows(o, pads)) == 0                  # pads: zero output
    named = [slots[n] for n in live]
    unnamed = [s for s in range(8) if s not in named]
    if inplace:
        assert final is pool
        state_tol = TOL if pool_dtype == torch.float32 else 2 ** -8  # one bf16 rounding
        assert rel_err(pool[named], s_ora[live]) < state_tol
        assert rel_err(pool[named], final_ref[named]) < state_tol
    else:
        assert final.dtype == torch.float32
        assert rel_err(final[live], s_ora[live]) < TOL and rel_err(final, final_ref) < TOL
        assert torch.count_nonzero(final[pads]) == 0
        assert torch.equal(pool, before)
    assert torch.equal(pool[unnamed], before[unnamed])              # bitwise unchanged


def test_bf16_pool_rounds_once_the_fp32_result():
    """A bf16 pool holds exactly the fp32 pool's result rounded once (same start values)."""
    p = _problem([90, 3], seed=4)
    pool16 = _pool(4, False, torch.bfloat16)
    pool32 = pool16.float()
    idx = torch.tensor([3, 1])
    kw = dict(p.kwargs, ssm_state_indices=idx, inplace_final_state=True, backend="native")
    with torch.no_grad():
        o16, _ = torch_kda.chunk_kda(*p.args, **kw, initial_state=pool16)
        o32, _ = torch_kda.chunk_kda(*p.args, **kw, initial_state=pool32)
    assert torch.equal(o16, o32)
    assert torch.equal(pool16, pool32.bfloat16())


# Packed batches for the intermediate states: sequences starting inside and at 64-token
# boundaries, longer and shorter than a chunk, empty ones and a pad.
H_CASES = {
    "unaligned": [1, 70, 0, 3, 129, 64, 2, 65],
    "aligned": [64, 128, 0, 30],
}


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("case", sorted(H_CASES))
def test_intermediate_states_are_the_chunk_entry_states(v_first, case, monkeypatch):
    _no_recurrent_serving(monkeypatch)
    monkeypatch.setattr(torch_kda.reference, "run_serving_reference", None)  # native only
    seqlens = H_CASES[case]
    p = _problem(seqlens, seed=7 + len(seqlens))
    N = len(seqlens)
    slots = list(range(N))
    slots[1] = -1  # a pad
    idx = torch.tensor(slots)
    pool = _pool(N, v_first)
    before = pool.clone()
    kw = dict(p.kwargs, ssm_state_indices=idx, state_v_first=v_first, inplace_final_state=True,
              return_intermediate_states=True)
    with torch.no_grad():
        o, _, h = torch_kda.chunk_kda(*p.args, **kw, initial_state=pool, backend="native")
    monkeypatch.undo()
    with torch.no_grad():
        o_r, _, h_r = torch_kda.chunk_kda(*p.args, **kw, initial_state=before.clone(),
                                          backend="reference")
    per = (HV, V, K) if v_first else (HV, K, V)
    assert h.shape == h_r.shape == (1, sum(-(-n // 64) for n in seqlens), *per)
    assert h.dtype == torch.float32 and h.is_contiguous()
    assert rel_err(h, h_r) < TOL and rel_err(o, o_r) < TOL
    if v_first:
        return  # the oracle check below once (slow), in the K-first layout
    # entry by entry against the float64 oracle: the state after 64 c tokens of the sequence
    cu = p.kwargs["cu_seqlens"].tolist()
    plain = {k: v for k, v in p.kwargs.items() if k != "cu_seqlens"}
    e = 0
    for n in range(N):
        seq = [t[:, cu[n]:cu[n + 1]] for t in p.args]
        start = torch.zeros(1, *per, dtype=torch.float64) if slots[n] < 0 else \
            before[n:n + 1].double()
        for c in range(-(-seqlens[n] // 64)):
            if slots[n] < 0:
                assert torch.count_nonzero(h[0, e]) == 0
            else:
                _, s_c = oracle_kda(*[t[:, :64 * c] for t in seq], **plain, initial_state=start,
                                    state_v_first=v_first, output_final_state=True)
                assert rel_err(h[0, e], s_c[0]) < TOL
            e += 1


@pytest.mark.parametrize("v_first", [False, True])
def test_intermediate_states_batch_rows(v_first, monkeypatch):
    _no_recurrent_serving(monkeypatch)
    p = _problem(B=3, T=150, seed=21)
    pool = _pool(5, v_first)
    idx = torch.tensor([4, -1, 1])
    kw = dict(p.kwargs, ssm_state_indices=idx, state_v_first=v_first, output_final_state=True,
              return_intermediate_states=True)
    with torch.no_grad():
        o, s, h = torch_kda.chunk_kda(*p.args, **kw, initial_state=pool, backend="native")
        o_r, s_r, h_r = torch_kda.chunk_kda(*p.args, **kw, initial_state=pool, backend="reference")
    assert h.shape == h_r.shape == (3, 3, *pool.shape[1:])
    assert rel_err(h, h_r) < TOL and rel_err(o, o_r) < TOL and rel_err(s, s_r) < TOL
    assert torch.count_nonzero(h[1]) == 0 and torch.equal(h[0, 0], pool[4])


def test_intermediate_states_without_a_pool_or_initial_state(monkeypatch):
    """No initial state: the entries of sequences starting inside a chunk are zeros, the rest
    the chunk kernel's; ``out=`` across several op calls."""
    _no_recurrent_serving(monkeypatch)
    p = _problem([3, 70, 1, 130], seed=17)
    out = torch.full((1, 204, HV, V), float("nan"))
    with torch.no_grad():
        o, s, h = torch_kda.chunk_kda(*p.args, **p.kwargs, output_final_state=True, out=out,
                                      return_intermediate_states=True, backend="native")
        o_r, s_r, h_r = torch_kda.chunk_kda(*p.args, **p.kwargs, output_final_state=True,
                                            return_intermediate_states=True, backend="reference")
    assert o is out and h.shape == h_r.shape == (1, 1 + 2 + 1 + 3, HV, K, V)
    assert rel_err(o, o_r) < TOL and rel_err(s, s_r) < TOL and rel_err(h, h_r) < TOL
    assert torch.count_nonzero(h[0, [0, 1, 3, 4]]) == 0  # start states (zeros), non-zero after
    assert torch.count_nonzero(h[0, 2]) > 0


def test_intermediate_states_other_chunk_size_use_the_reference(monkeypatch):
    """chunk_size 32: entries every 32 tokens, from the chunkwise reference (not the native op)."""
    p = _problem([40, 70], seed=9)
    pool = _pool(3, False)
    calls = []
    real = torch_kda.reference.run_serving_reference
    monkeypatch.setattr(torch_kda.reference, "run_serving_reference",
                        lambda *a: calls.append(a) or real(*a))
    kw = dict(p.kwargs, ssm_state_indices=torch.tensor([2, 0]), return_intermediate_states=True,
              chunk_size=32, initial_state=pool)
    with torch.no_grad():
        _, _, h = torch_kda.chunk_kda(*p.args, **kw, backend="native")
    assert len(calls) == 1 and h.shape == (1, 2 + 3, HV, K, V)
    cu = p.kwargs["cu_seqlens"].tolist()
    plain = {k: v for k, v in p.kwargs.items() if k != "cu_seqlens"}
    seq = [t[:, cu[1]:cu[2]] for t in p.args]
    _, s_c = oracle_kda(*[t[:, :64] for t in seq], **plain, initial_state=pool[0:1].double(),
                        output_final_state=True)
    assert rel_err(h[0, 2 + 2], s_c[0]) < TOL  # sequence 1, entry 2: after 64 tokens


def test_mixed_prefill_and_decode_batch_equals_separate_calls(monkeypatch):
    _no_recurrent_serving(monkeypatch)
    lens = [100, 1, 1, 70, 1, 0]
    p = _problem(lens, seed=11)
    pool = _pool(7, True)
    before = pool.clone()
    idx = torch.tensor([6, 0, 2, 5, 3, 1])
    with torch.no_grad():
        o, _ = torch_kda.chunk_kda(*p.args, **p.kwargs, initial_state=pool, ssm_state_indices=idx,
                                   state_v_first=True, inplace_final_state=True, backend="native")
    cu = p.kwargs["cu_seqlens"].tolist()
    plain = {k: v for k, v in p.kwargs.items() if k != "cu_seqlens"}
    for n, slot in enumerate(idx.tolist()):
        seq = [t[:, cu[n]:cu[n + 1]] for t in p.args]
        with torch.no_grad():
            o_n, s_n = torch_kda.chunk_kda(*seq, **plain, initial_state=before[slot:slot + 1],
                                           state_v_first=True, output_final_state=True,
                                           backend="native")
        assert rel_err(o[:, cu[n]:cu[n + 1]], o_n) < TOL
        assert rel_err(pool[slot], s_n[0]) < TOL


def test_dispatch_auto_decodes_on_the_recurrent_kernel_and_prefills_on_chunk(monkeypatch):
    """backend='native' prefill runs the chunk path; 'auto' decoding keeps the serving kernel."""
    ran = []
    monkeypatch.setattr(_native, "chunk_serving", lambda *a: ran.append("chunk") or (None, None))
    monkeypatch.setattr(_native, "serving", lambda *a: ran.append("recurrent") or (None, None))
    dec = _problem(B=3, T=1, seed=2)
    pre = _problem([300], seed=3)
    pool = _pool(4, False)
    kw = dict(initial_state=pool, inplace_final_state=True)
    with torch.no_grad():
        torch_kda.chunk_kda(*dec.args, **dec.kwargs, **kw, ssm_state_indices=torch.tensor([0, 1, 2]))
        torch_kda.chunk_kda(*pre.args, **pre.kwargs, **kw, ssm_state_indices=torch.tensor([3]),
                            backend="native")
        torch_kda.chunk_kda(*dec.args, **dec.kwargs, **kw, ssm_state_indices=torch.tensor([0, 1, 2]),
                            return_intermediate_states=True)
    assert ran == ["recurrent", "chunk", "chunk"]


def test_rejected_values_leave_the_pool_unchanged():
    p = _problem([80, 4], seed=5, gate="none")
    g = p.g.clone()
    g[0, 70, 1, 3] = 0.5  # a positive log-decay
    pool = _pool(3, False)
    before = pool.clone()
    with torch.no_grad(), pytest.raises(ValueError, match=r"g must be a log-decay <= 0.*g\[0, 70, 1, 3\]"):
        torch_kda.chunk_kda(p.q, p.k, p.v, g, p.beta, **p.kwargs, initial_state=pool,
                            ssm_state_indices=torch.tensor([2, 0]), inplace_final_state=True,
                            backend="native")
    assert torch.equal(pool, before)
    q = p.q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="forward only.*q requires grad"):
        torch_kda.chunk_kda(q, *p.args[1:], **p.kwargs, initial_state=pool,
                            ssm_state_indices=torch.tensor([2, 0]), backend="native")


def test_bitwise_identical_for_one_and_two_threads():
    p = _problem([70, 1, 90], seed=13)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pool = _pool(4, True)
            with torch.no_grad():
                o, _, h = torch_kda.chunk_kda(*p.args, **p.kwargs, initial_state=pool,
                                              ssm_state_indices=torch.tensor([3, 0, 1]),
                                              state_v_first=True, inplace_final_state=True,
                                              return_intermediate_states=True, backend="native")
            results.append((o, pool, h))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*results))
