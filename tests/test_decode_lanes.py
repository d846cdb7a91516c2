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
    assert not failures, failures
    """
)


@pytest.mark.parametrize("isa", [None, "avx2", "generic"])
def test_vfirst_columns_permute_bit_for_bit(isa):
    env = dict(os.environ)
    env.pop("TORCH_KDA_ISA", None)
    if isa is not None:
        env["TORCH_KDA_ISA"] = isa  # lowers the choice on a machine that has more; never raises
    r = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
