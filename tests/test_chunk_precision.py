"""The reference chunkwise form keeps float32 within 1e-5 of float64 for any decay pattern.

Inside a chunk the cumulative log-decay G can reach thousands (64 steps of -100), where float32's
spacing (~5e-4) would swallow the small decays that follow; the reference forms G and its
differences in float64 (docs/math.md "Chunkwise form").
"""

from __future__ import annotations

import pytest
import torch

import torch_kda
from kda_testing import make_problem, rel_err


def _run(p, dtype, chunk_size):
    x = p.to(dtype)
    return torch_kda.chunk_kda(*x.args, **x.kwargs, backend="reference", chunk_size=chunk_size)


def test_strong_then_weak_decay_in_one_chunk_matches_float64():
    # The case: one 64-token chunk, K=16, V=8, l2 norm on, g = -99.99 for t < 48 then -7e-4.
    p = make_problem(B=1, T=64, H=1, K=16, V=8, gate="none", seed=51, initial_state=True)
    p.g[:, :48] = -99.99
    p.g[:, 48:] = -7e-4
    o32, s32 = _run(p, torch.float32, 64)
    o64, s64 = _run(p, torch.float64, 64)
    assert rel_err(o32, o64) <= 1e-5
    assert rel_err(s32, s64) <= 1e-5


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("pattern", ["alternating", "random_spikes", "ramp"])
def test_any_decay_pattern_and_chunk_size_matches_float64(pattern, chunk_size):
    p = make_problem(B=1, T=96, H=2, HV=2, K=8, V=4, gate="none", seed=52)
    gen = torch.Generator().manual_seed(53)
    t = torch.arange(96, dtype=torch.float64)
    if pattern == "alternating":       # blocks of full forget and of near-1 decays
        strong = ((t // 7) % 2 == 0).reshape(1, -1, 1, 1)
        p.g = torch.where(strong, torch.full_like(p.g, -80.0), torch.full_like(p.g, -3e-4))
    elif pattern == "random_spikes":   # rare huge decays among tiny ones
        spikes = torch.rand(p.g.shape, generator=gen, dtype=torch.float64) < 0.2
        p.g = torch.where(spikes, torch.full_like(p.g, -95.0), -1e-3 * torch.rand(
            p.g.shape, generator=gen, dtype=torch.float64))
    else:                              # decays from -100 smoothly to -1e-4
        p.g = -torch.logspace(2, -4, 96, dtype=torch.float64).reshape(1, -1, 1, 1).expand_as(p.g)
    p.g = p.g.contiguous()
    o32, s32 = _run(p, torch.float32, chunk_size)
    o64, s64 = _run(p, torch.float64, chunk_size)
    assert rel_err(o32, o64) <= 1e-5
    assert rel_err(s32, s64) <= 1e-5
