"""Concurrency: the native op called from several Python threads at once, and across thread counts.

- Python threads running forward + backward concurrently (each on its own inputs, and all on
  shared inputs) get exactly the results of the same calls made one after another;
- the very first calls in a fresh process, made from many threads at once (lazy op-handle and
  kernel-table initialisation), are correct;
- results are bitwise identical for 1, 2, 3 and 4 intra-op threads on shapes where the number of
  work units per head changes with the thread count (tests/test_native.py covers 1 vs 2 threads
  on one dense shape; here: packed sequences, grouped heads, state_v_first, float64).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import List

import pytest
import torch

import torch_kda
from kda_testing import make_problem, per_thread_count


N_THREADS = 6


def _forward_backward(p, seed: int) -> List[torch.Tensor]:
    """Outputs and every input gradient of a random projection of (o, final_state)."""
    x = p.to(p.q.dtype, requires_grad=True)
    o, s = torch_kda.chunk_kda(*x.args, **x.kwargs, backend="native")
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ws = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    ts = list(x.tensors().values())
    grads = torch.autograd.grad((o * wo).sum() + (s * ws).sum(), ts)
    return [o.detach(), s.detach(), *grads]


def _problems():
    shapes = [dict(B=2, T=70, H=2, HV=4, K=9, V=33, gate="softplus"),
              dict(seqlens=(5, 0, 64, 1, 30), H=1, HV=2, K=16, V=40, gate="bounded",
                   state_v_first=True),
              dict(B=1, T=129, H=1, HV=1, K=7, V=70, gate="none", l2norm=False)]
    return [make_problem(**kw, seed=500 + i, dtype=torch.float32 if i % 2 == 0 else torch.float64)
            for i, kw in enumerate(shapes)]


def _run_threads(jobs):
    """Run callables in N threads released together; returns their results (re-raises errors)."""
    results, errors = [None] * len(jobs), []
    barrier = threading.Barrier(len(jobs))

    def work(i):
        try:
            barrier.wait()
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


def test_threads_with_own_inputs_match_sequential_calls():
    problems = _problems()
    expected = [_forward_backward(p, seed=i) for i, p in enumerate(problems)]
    jobs = [(lambda i=i: _forward_backward(problems[i % len(problems)], seed=i % len(problems)))
            for i in range(N_THREADS)]
    for _ in range(2):
        results = _run_threads(jobs)
        for i, got in enumerate(results):
            want = expected[i % len(problems)]
            assert len(got) == len(want)
            for j, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), f"thread {i}, tensor {j}"


def test_threads_sharing_one_input_match_and_leave_it_unmodified():
    p = _problems()[1]
    before = {n: t.clone() for n, t in p.tensors().items()}
    expected = _forward_backward(p, seed=3)
    results = _run_threads([lambda: _forward_backward(p, seed=3)] * N_THREADS)
    for i, got in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"thread {i}"
    for n, t in p.tensors().items():
        assert torch.equal(t, before[n]), n


FIRST_CALL_SCRIPT = r"""
import sys, threading, torch
sys.path.insert(0, sys.argv[1])
import torch_kda
from kda_testing import make_problem
from oracle import oracle_kda
from kda_testing import rel_err
p = make_problem(B=1, T=20, H=1, HV=2, K=6, V=5, seed=77)
barrier, errors, outs = threading.Barrier(8), [], [None] * 8
def work(i):
    try:
        barrier.wait()
        dtype = torch.float64 if i % 2 else torch.float32
        outs[i] = torch_kda.fused_recurrent_kda(*p.to(dtype).args, **p.kwargs, backend="native")
    except BaseException as exc:
        errors.append(repr(exc))
ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
[t.start() for t in ts]
[t.join() for t in ts]
assert not errors, errors
o_ref, s_ref = oracle_kda(*p.args, **p.kwargs)
errs = [(rel_err(o, o_ref), rel_err(s, s_ref)) for o, s in outs]
bad = [i for i, e in enumerate(errs) if max(e) > (1e-10 if i % 2 else 1e-5)]
if bad:
    # What a failure needs for its diagnosis: every thread's errors, and whether the wrong result
    # is what the same call gives now, made again from the main thread (a lasting state) or not.
    again = [torch_kda.fused_recurrent_kda(*p.to(outs[i][0].dtype).args, **p.kwargs, backend="native")
             for i in bad]
    raise AssertionError(f"threads {bad} wrong; (o, final state) errors per thread {errs}; the same "
                         f"call again equals it: {[torch.equal(a[0], outs[i][0]) for a, i in zip(again, bad)]}")
print("ok")
"""


def test_first_calls_from_many_threads_in_a_fresh_process():
    tests_dir = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", FIRST_CALL_SCRIPT, tests_dir], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("case", range(3))
def test_bitwise_identical_for_1_2_3_4_intra_op_threads(case):
    p = [make_problem(seqlens=(3, 0, 90, 1, 40), H=1, HV=2, K=12, V=160, gate="bounded",
                      state_v_first=True, seed=600, dtype=torch.float32),
         make_problem(B=1, T=100, H=1, HV=1, K=8, V=130, gate="softplus", seed=601,
                      dtype=torch.float64),
         make_problem(B=3, T=65, H=2, HV=6, K=5, V=97, gate="none", seed=602,
                      dtype=torch.bfloat16)][case]
    results = per_thread_count(lambda: _forward_backward(p, seed=case), (1, 2, 3, 4))
    for n, res in zip((2, 3, 4), results[1:]):
        for j, (a, b) in enumerate(zip(res, results[0])):
            assert torch.equal(a, b), f"{n} threads vs 1: tensor {j}"


# K not a multiple of 16 (ragged vector tails in every row) with enough tokens that each thread's
# share of the pre-processing rows and of the chunks starts and ends mid-sequence, and the rows of
# the last head end the buffers. The inputs are made once, outside the thread counts: torch's own
# elementwise ops are not bitwise the same for every thread count (fp32 softplus of 102800
# elements with torch 2.13 differs at 2 elements between 1 and 2 threads, where the split leaves a
# partial vector), so inputs computed under each count differ before the op sees them.
@pytest.mark.parametrize("op", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("K,shape", [(17, dict(B=1, T=1025)), (100, dict(B=1, T=257)),
                                     (120, dict(seqlens=(0, 100, 155)))])
def test_bitwise_identical_across_thread_counts_for_ragged_K_and_long_rows(op, K, shape):
    p = make_problem(**shape, H=2, HV=4, K=K, V=72, gate="softplus", seed=604 + K,
                     dtype=torch.float32)
    fn = getattr(torch_kda, f"{op}_kda")

    def run():
        x = p.to(torch.float32, requires_grad=True)
        o, s = fn(*x.args, **x.kwargs, backend="native")
        gen = torch.Generator().manual_seed(K)
        wo = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
        ws = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
        ts = list(x.tensors().values())
        grads = torch.autograd.grad((o * wo).sum() + (s * ws).sum(), ts)
        with torch.no_grad():
            o_inf, s_inf = fn(*x.args, **x.kwargs, backend="native")
        return [o.detach(), s.detach(), o_inf, s_inf, *grads]

    results = per_thread_count(run, (1, 2, 3))
    for n, res in zip((2, 3), results[1:]):
        for j, (a, b) in enumerate(zip(res, results[0])):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{n} threads vs 1: tensor {j}"


@pytest.mark.parametrize("op", ["fused_recurrent", "chunk"])
def test_bitwise_identical_where_the_token_blocks_differ_with_the_thread_count(op):
    # The forward's token-block workspace grows with more than 4 threads (csrc/cpu/recurrent_fwd.cpp,
    # plan_blocks): at K = 64, H = 2, HV = 8 (fp32) a block has 1600 tokens of each sequence at 1
    # thread and 3200 at 8 (more than 3 x 1600 / 3 x 3200 tokens in all, so both cut into blocks),
    # and these sequences are cut at different tokens; the results must not change.
    p = make_problem(seqlens=(7000, 3, 3300), H=2, HV=8, K=64, V=12, gate="softplus",
                     seed=603, dtype=torch.float32)
    fn = getattr(torch_kda, f"{op}_kda")

    def run():
        x = p.to(torch.float32, requires_grad=True)
        o, s = fn(*x.args, **x.kwargs, backend="native")
        ts = list(x.tensors().values())
        grads = torch.autograd.grad(o.square().sum() + s.sin().sum(), ts)
        with torch.no_grad():
            o_inf, s_inf = fn(*x.args, **x.kwargs, backend="native")
        return [o.detach(), s.detach(), o_inf, s_inf, *grads]

    one, eight = per_thread_count(run, (1, 8))
    for j, (a, b) in enumerate(zip(eight, one)):
        assert torch.equal(a, b), f"8 threads vs 1: tensor {j}"
