"""V-first decode: every value column gets the same bits whichever path of the kernel sums it.

The serving kernel reduces the dot products of whole vector-length blocks of value columns with
one transposing reduction and the ragged last columns with one horizontal sum each
(csrc/cpu/kernels/lane_reduce.h); both must add the same lanes in the same order, else a column's
result would depend on where it falls. In V-first decode the value columns are independent
(column c reads row c of the state, v_c, beta), so permuting them must permute the outputs and
the final state bit for bit: the permutation below moves the ragged columns into full blocks and
back. Each instruction set's kernels run in a subprocess (TORCH_KDA_ISA lowers the choice)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_kda

_CHECK = textwrap.dedent(
    """
    import torch, torch_kda
    torch.manual_seed(0)
    torch.set_num_threads(1)
    failures = []
    # V = 37: ragged columns under every vector length (16/8/4 fp32 lanes, 8/4/2 fp64 lanes).
    for dtype in (torch.float32, torch.float64):
        for headwise_beta in (False, True):
            B, H, K, V = 2, 3, 64, 37
            q = torch.nn.functional.normalize(torch.randn(B, 1, H, K, dtype=dtype), dim=-1)
            k = torch.nn.functional.normalize(torch.randn(B, 1, H, K, dtype=dtype), dim=-1)
            v = torch.randn(B, 1, H, V, dtype=dtype)
            g = -torch.rand(B, 1, H, K, dtype=dtype)
            beta = torch.rand(B, 1, H, V if headwise_beta else 1, dtype=dtype)
            beta = beta if headwise_beta else beta[..., 0]
            h0 = torch.randn(B, H, V, K, dtype=dtype)
            perm = torch.roll(torch.arange(V), 7)  # the last 7 columns first
            def run(v, beta, h0):
                return torch_kda.fused_recurrent_kda(
                    q, k, v, g, beta, initial_state=h0, output_final_state=True,
                    state_v_first=True, backend="native")
            o, s = run(v, beta, h0)
            o2, s2 = run(v[..., perm], beta[..., perm] if headwise_beta else beta, h0[:, :, perm])
            if not (torch.equal(o2, o[..., perm]) and torch.equal(s2, s[:, :, perm])):
                failures.append((str(dtype), headwise_beta))
            if not (torch.isfinite(o).all() and torch.isfinite(s).all()):
                failures.append(("not finite", str(dtype), headwise_beta))
    # Against the float64 oracle, K-first beside, in-op gate and sigmoid beta, functional call
    # and a pool updated in place. V-first rows of K = 1-8 whole vectors in registers under
    # AVX-512 (K = 16, 32, 48, 96, 128), pieces of 4 vectors under AVX2; K-first passes of whole
    # vectors (V = 48: 32 + 16 columns, 80: 64 + 16, 96: 64 + 32).
    from oracle import oracle_kda
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-12)):
        for K, V in ((128, 128), (96, 128), (32, 48), (48, 96), (16, 80)):
            for v_first in (False, True):
                B, H = 3, 2
                q, k = torch.randn(B, 1, H, K, dtype=dtype), torch.randn(B, 1, H, K, dtype=dtype)
                v, g = torch.randn(B, 1, H, V, dtype=dtype), torch.randn(B, 1, H, K, dtype=dtype)
                beta = torch.randn(B, 1, H, dtype=dtype)
                A_log, dt_bias = torch.rand(H, dtype=dtype), torch.randn(H * K, dtype=dtype)
                h0 = torch.randn(B, H, *((V, K) if v_first else (K, V)), dtype=dtype)
                kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                          dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
                o, s = torch_kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                    output_final_state=True, state_v_first=v_first, backend="native", **kw)
                pool = torch.cat([h0, h0])
                flat = [t.reshape(1, B, *t.shape[2:]) for t in (q, k, v, g, beta)]
                o_pool, _ = torch_kda.fused_recurrent_kda(*flat, initial_state=pool,
                    ssm_state_indices=torch.arange(B, 2 * B, dtype=torch.int32),
                    cu_seqlens=torch.arange(B + 1), inplace_final_state=True,
                    state_v_first=v_first, backend="native", **kw)
                o_ref, s_ref = oracle_kda(q, k, v, g, beta, initial_state=h0,
                    output_final_state=True, state_v_first=v_first, **kw)
                def rel(a, e):
                    return ((a.double() - e).norm() / e.norm()).item()
                errs = (rel(o, o_ref), rel(s, s_ref), rel(o_pool[0], o_ref[:, 0]),
                        rel(pool[B:], s_ref))
                if max(errs) > tol:
                    failures.append(("oracle", str(dtype), K, v_first, errs))
    assert not failures, failures
    """
)


@pytest.mark.parametrize("isa", [None, "avx2", "generic"])
def test_vfirst_columns_permute_bit_for_bit(isa):
    """Each instruction set's decode kernels: V-first columns permute bit for bit, and both
    layouts match the float64 oracle (functional call and a pool updated in place)."""
    env = dict(os.environ)
    env.pop("TORCH_KDA_ISA", None)
    if isa is not None:
        env["TORCH_KDA_ISA"] = isa  # lowers the choice on a machine that has more; never raises
    tests = os.path.dirname(os.path.abspath(__file__))  # the oracle's module
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_vfirst_decode_bits_do_not_depend_on_the_batch():
    """On AMD CPUs a V-first decode call with a fresh final state whose state traffic exceeds a
    third of the cached bytes (at most 48 MB / 3 = 16 MB; here 2 x 24 x 8 x 64 KB = 25 MB, under a
    32 MB L3, so not streamed) reads each head's rows before writing them; a one-sequence call, a
    pool updated in place and other CPUs write each 16-row block right after reading it
    (csrc/cpu/serving.cpp, vfirst_two_pass). The sequences are independent, so every order must
    give the same bits; and they match the float64 oracle."""
    from kda_testing import rel_err
    from oracle import oracle_kda

    gen = torch.Generator().manual_seed(28)
    N, H, K, V = 24, 8, 128, 128
    q = torch.randn(N, 1, H, K, generator=gen)
    k = torch.randn(N, 1, H, K, generator=gen)
    v = torch.randn(N, 1, H, V, generator=gen)
    g = -torch.rand(N, 1, H, K, generator=gen)
    beta = torch.rand(N, 1, H, generator=gen)
    h0 = torch.randn(N, H, V, K, generator=gen) * 0.5
    kw = dict(use_qk_l2norm_in_kernel=True, state_v_first=True, backend="native")
    with torch.no_grad():
        o, s = torch_kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                             output_final_state=True, **kw)
        pool = torch.cat([h0, torch.randn(3, H, V, K, generator=gen)])
        slots = torch.randperm(N + 3, generator=gen)[:N]
        pool[slots] = h0
        flat = [t.reshape(1, N, *t.shape[2:]) for t in (q, k, v, g, beta)]
        o_pool, _ = torch_kda.fused_recurrent_kda(
            *flat, initial_state=pool, ssm_state_indices=slots.to(torch.int32),
            cu_seqlens=torch.arange(N + 1), inplace_final_state=True, **kw)
        for n in (0, 11, N - 1):
            one = slice(n, n + 1)
            o1, s1 = torch_kda.fused_recurrent_kda(q[one], k[one], v[one], g[one], beta[one],
                                                   initial_state=h0[one],
                                                   output_final_state=True, **kw)
            assert torch.equal(o[one], o1) and torch.equal(s[one], s1), n
            assert torch.equal(o_pool[0, n], o1[0, 0]) and torch.equal(pool[slots[n]], s1[0]), n
    sel = [0, N - 1]
    o_ref, s_ref = oracle_kda(q[sel], k[sel], v[sel], g[sel], beta[sel], initial_state=h0[sel],
                              output_final_state=True, use_qk_l2norm_in_kernel=True,
                              state_v_first=True)
    assert rel_err(o[sel], o_ref) < 2e-5
    assert rel_err(s[sel], s_ref) < 2e-5
