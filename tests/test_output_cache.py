"""The native ops take their large outputs (o, the final state, the checkpoints) from a bounded
per-process cache of freed blocks (csrc/cpu/output_cache.cpp), so a call reuses the pages of the
previous call's outputs instead of faulting fresh ones in. These tests pin down that reuse
happens, that the limit on the bytes held is respected, that the results do not change, that
gradients still held are never handed out again, and that the tensors are ordinary tensors
(resize, autograd, pickling, freed on another thread).

Shapes: o is T * HV * V * 4 bytes = 1.2 MB and the checkpoints 19 slots of 64 KB (both above the
128 KB threshold); the final state (64 KB) is below it and comes from the ordinary allocator."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import threading

import pytest
import torch

import torch_kda
from kda_testing import grads, make_problem, rel_err
from torch_kda import reference

MB = 1 << 20


def stats():
    limit, held, in_use, hits, misses, released = torch.ops.kda._output_cache_stats()
    return dict(limit=limit, held=held, in_use=in_use, hits=hits, misses=misses, released=released)


@pytest.fixture
def cache_limit():
    """Sets the cache's limit for one test and restores it afterwards."""
    old = []

    def set_limit(nbytes):
        prev = torch.ops.kda._output_cache_set_limit(nbytes)
        if not old:
            old.append(prev)

    yield set_limit
    if old:
        torch.ops.kda._output_cache_set_limit(old[0])


def test_a_negative_limit_raises_and_changes_nothing(cache_limit):
    # -5 once turned the cache off silently (clamped to 0)
    cache_limit(1 << 20)
    with pytest.raises(RuntimeError, match=r"bytes must be >= 0 \(0 turns the cache off\), got -5"):
        torch.ops.kda._output_cache_set_limit(-5)
    assert stats()["limit"] == 1 << 20


def problem(seed=0, **kw):
    args = dict(B=1, T=1200, H=4, K=64, V=64, gate="softplus", seed=seed)
    args.update(kw)
    return make_problem(**args).to(torch.float32)


def native(p):
    return torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="native")


def test_second_call_reuses_the_first_calls_output_block_and_matches_the_reference(cache_limit):
    cache_limit(256 * MB)
    p = problem(seed=1)
    o1, s1 = native(p)
    o_ref, s_ref = reference.fused_recurrent_kda(*p.to(torch.float64).args,
                                                 **p.to(torch.float64).kwargs)
    assert rel_err(o1, o_ref) < 2e-5 and rel_err(s1, s_ref) < 2e-5
    first = o1.clone()
    del o1
    before = stats()
    assert before["held"] >= first.numel() * 4
    o2, s2 = native(p)
    after = stats()
    assert after["hits"] > before["hits"]  # o, and the block workspace (1.2 MB per array here)
    assert after["misses"] == before["misses"]  # no fresh block: nothing faulted in
    assert torch.equal(o2, first)  # the reused block is fully overwritten
    assert torch.equal(s2, s1)


@pytest.mark.parametrize("op", ["fused_recurrent_kda", "chunk_kda"])
@pytest.mark.parametrize("threads", [1, 2])
def test_buffers_under_1_mb_are_recycled_too(cache_limit, op, threads):
    # A call whose outputs and work buffers all lie between 128 KB and 1 MB (o 600 KB, the block
    # workspaces and the chunk kernel's per-thread parts 150-600 KB): they came from glibc, which
    # handed them back to the system when it trimmed its heap, so the next call faulted them in
    # again (620-970 faults per call of the forward at T = 1K, H = 4 with 2 threads; session 18).
    # Now every such buffer is a cached block: the second call takes all of them from the first
    # call's freed blocks and maps none.
    cache_limit(256 * MB)
    fn = getattr(torch_kda, op)
    p = problem(seed=11, T=300, H=4, K=128, V=128)
    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            o, s = fn(*p.args, **p.kwargs, backend="native")
            assert o.nbytes < MB
            first = (o.clone(), s.clone())
            del o, s
            before = stats()
            o, s = fn(*p.args, **p.kwargs, backend="native")
            after = stats()
    finally:
        torch.set_num_threads(threads_before)
    assert after["hits"] >= before["hits"] + 2  # o and at least one work buffer
    assert after["misses"] == before["misses"]
    assert torch.equal(o, first[0]) and torch.equal(s, first[1])


def test_results_are_bitwise_identical_with_the_cache_off(cache_limit):
    p = problem(seed=2, state_v_first=True, seqlens=(700, 0, 500))
    cache_limit(256 * MB)
    native(p)  # leaves blocks with other values in the free list
    on = [native(p) for _ in range(2)]
    cache_limit(0)
    off = native(p)
    assert stats()["held"] == 0
    for o_on, s_on in on:
        assert torch.equal(o_on, off[0]) and torch.equal(s_on, off[1])


def chunk(p):
    return torch_kda.chunk_kda(*p.args, **p.kwargs, backend="native")


OPS = {"recurrent": native, "chunk": chunk}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_through_cached_outputs_and_checkpoints_are_unchanged(cache_limit, op, dtype):
    # With 16-bit inputs the backward widens grad_o and the inputs and narrows the gradients
    # through cached blocks too; a V-first initial state is transposed into one.
    p = problem(seed=3, T=2400, state_v_first=True)
    cache_limit(256 * MB)
    x = p.to(dtype, requires_grad=True)
    g_on = [grads(OPS[op], x) for _ in range(2)]
    assert stats()["hits"] > 0
    cache_limit(0)
    g_off = grads(OPS[op], x)
    for g in g_on:
        for name, t in g_off.items():
            assert (t is None and g[name] is None) or torch.equal(g[name], t), name


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_held_from_one_call_stay_intact_through_the_next(cache_limit, op, dtype):
    # The gradients handed to the caller are cached blocks (T = 2400: 1.2 MB and up, in bf16
    # too). A block goes back to the cache only when its tensor is freed: the next call, which
    # reuses the first call's freed workspace, must not write into gradients still held.
    cache_limit(256 * MB)
    fn = OPS[op]
    x1 = problem(seed=8, T=2400, state_v_first=True).to(dtype, requires_grad=True)
    x2 = problem(seed=9, T=2400, state_v_first=True).to(dtype, requires_grad=True)
    g1 = grads(fn, x1)
    big = [n for n, t in g1.items() if t is not None and t.nbytes >= MB]
    assert {"q", "k", "v", "g"} <= set(big)
    assert stats()["in_use"] >= sum(g1[n].nbytes for n in big)  # they are the cache's blocks
    kept = {n: t.clone() for n, t in g1.items() if t is not None}
    before = stats()
    g2 = grads(fn, x2)
    assert stats()["hits"] > before["hits"]  # the second call did reuse freed blocks
    for name, t in kept.items():
        assert torch.equal(g1[name], t), name
        assert not torch.equal(g2[name], t), name  # other inputs, other gradients
    first = {g1[n].untyped_storage().data_ptr() for n in kept}
    assert first.isdisjoint(g2[n].untyped_storage().data_ptr() for n in kept)


@pytest.mark.parametrize("op", sorted(OPS))
def test_repeated_training_steps_map_no_new_blocks(cache_limit, op):
    # After one step every large buffer of forward + backward (16-bit inputs: the widened copies,
    # the fp32 gradients and their bf16 copies) is served from blocks the previous step freed.
    cache_limit(256 * MB)
    x = problem(seed=10, T=2400).to(torch.bfloat16, requires_grad=True)
    grads(OPS[op], x)
    before = stats()
    g = grads(OPS[op], x)
    after = stats()
    assert after["misses"] == before["misses"]
    assert after["hits"] > before["hits"]
    del g


def test_the_bytes_held_stay_within_the_limit(cache_limit):
    cache_limit(3 * MB)  # room for two 1.2 MB blocks, not three
    p = problem(seed=4)
    outs = [native(p)[0] for _ in range(4)]
    nbytes = outs[0].nbytes
    before = stats()
    del outs
    after = stats()
    assert after["held"] <= 3 * MB
    assert after["held"] >= 2 * nbytes
    assert after["released"] >= before["released"] + 2
    cache_limit(MB)  # a lower limit trims at once
    assert stats()["held"] <= MB


def test_the_cache_off_hands_out_no_cached_blocks(cache_limit):
    cache_limit(0)
    before = stats()
    o, _ = native(problem(seed=5))
    after = stats()
    assert after["hits"] == before["hits"] and after["misses"] == before["misses"]
    assert after["held"] == 0
    del o


def test_cached_outputs_behave_as_ordinary_tensors(cache_limit):
    cache_limit(256 * MB)
    p = problem(seed=6)
    o, _ = native(p)
    ref = o.clone()
    # pickling and torch.save round trips
    assert torch.equal(pickle.loads(pickle.dumps(o)), ref)
    buf = io.BytesIO()
    torch.save(o, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf), ref)
    # views, in-place ops and autograd on the output
    w = torch.randn(o.shape, dtype=o.dtype, requires_grad=True)
    (o * w).sum().backward()
    assert torch.equal(w.grad, ref)
    o.mul_(2)
    assert torch.equal(o, 2 * ref)
    # resize: grows (a new block, contents kept), shrinks, grows past 1 MB again
    o.resize_(2 * o.numel())
    assert torch.equal(o[: ref.numel()].view_as(ref), 2 * ref)
    o.resize_(10)
    assert torch.equal(o, 2 * ref.flatten()[:10])
    o.resize_(ref.numel()).copy_(ref.flatten())
    assert torch.equal(o.view_as(ref), ref)


def test_an_output_freed_on_another_thread_returns_to_the_cache(cache_limit):
    cache_limit(256 * MB)
    p = problem(seed=7)
    box = [native(p)[0]]
    before = stats()
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    after = stats()
    assert after["held"] > before["held"]
    assert after["in_use"] < before["in_use"]
    misses = after["misses"]
    o, _ = native(p)
    assert stats()["hits"] > after["hits"] and stats()["misses"] == misses
    del o


@pytest.mark.parametrize("value, limit", [("3", 3 * MB), ("0", 0)])
def test_the_environment_variable_sets_the_limit(value, limit):
    env = dict(os.environ, TORCH_KDA_OUTPUT_CACHE_MB=value)
    code = "import torch, torch_kda; print(torch.ops.kda._output_cache_stats()[0])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert int(out.stdout.strip().splitlines()[-1]) == limit


def _limit_with(value):
    env = dict(os.environ)
    env.pop("TORCH_KDA_OUTPUT_CACHE_MB", None)
    if value is not None:
        env["TORCH_KDA_OUTPUT_CACHE_MB"] = value
    code = "import torch, torch_kda; print(torch.ops.kda._output_cache_stats()[0])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1]), out.stderr


def test_the_default_limit_is_2_gb_or_an_eighth_of_the_ram():
    # Large enough for the blocks a training step at B1 T8K H16 frees at its end (0.5-1.2 GB),
    # an eighth of the RAM at most on small machines (the RAM is read on Linux only).
    expected = 2048 * MB
    if sys.platform.startswith("linux"):
        expected = min(expected, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8)
    limit, _ = _limit_with(None)
    assert limit == expected


def test_a_value_that_is_not_a_whole_number_of_megabytes_warns_and_keeps_the_default():
    # "1e3" was read as its leading digit (a 1 MB cache) and "-5" as 0 (no cache), silently.
    default, _ = _limit_with(None)
    for value in ("1e3", "-5", "abc", "64MB"):
        limit, err = _limit_with(value)
        assert limit == default, value
        assert f"TORCH_KDA_OUTPUT_CACHE_MB={value} is not" in err, (value, err)
