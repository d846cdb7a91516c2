"""Saturated gate parameters give finite, correct gradients in every backend and gate form.

``exp(A_log)`` overflows float32 for ``A_log > 88.7`` (float64: ``> 709.8``). The decay then
reaches its limit (0 for the softplus gate; a step ``lower_bound * (sign(z) + 1) / 2`` for the
bounded gate) and the true gradients through the gate are 0, not ``0 * inf = NaN``
(docs/math.md "Saturation"). Checked against float64, where ``A_log = 100`` is still finite, and
the float64 limit itself (``A_log = 800`` overflows float64) against ``A_log = 100``.
"""

from __future__ import annotations

import pytest
import torch

import torch_kda
from kda_testing import make_problem, rel_err

RUNS = {
    "native": lambda p: torch_kda.chunk_kda(*p.args, **p.kwargs, backend="native"),
    "reference_recurrent": lambda p: torch_kda.fused_recurrent_kda(*p.args, **p.kwargs,
                                                                   backend="reference"),
    "reference_chunk": lambda p: torch_kda.chunk_kda(*p.args, **p.kwargs, backend="reference",
                                                     chunk_size=8),
}
NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _problem(gate: str, a_log_first_head: float):
    # B=1, T=16, H=2, K=V=8 (the shape); head 0 saturated, head 1 ordinary.
    p = make_problem(B=1, T=16, H=2, K=8, V=8, gate=gate, seed=41, lower_bound=-3.0)
    p.kwargs["A_log"] = torch.tensor([a_log_first_head, 0.3], dtype=torch.float64)
    return p


def _grads(run, p, dtype):
    x = p.to(dtype, requires_grad=True)
    o, s = run(x)
    gen = torch.Generator().manual_seed(7)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() \
        + (s.double() * torch.randn(s.shape, generator=gen, dtype=torch.float64)).sum()
    loss.backward()
    t = x.tensors()
    return o, s, {n: t[n].grad for n in NAMES}


# exp(100) = 2.7e43: inf in float32, finite in float64; 88.7228394 = float32(log(FLT_MAX)), the
# smallest float32 A_log whose exp overflows (the reference's bound once missed it: NaN gradients).
@pytest.mark.parametrize("a_log", [100.0, 88.72283935546875])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("backend", RUNS)
def test_saturated_gate_gradients_are_finite_and_match_float64(gate, backend, a_log):
    p = _problem(gate, a_log)
    o32, s32, g32 = _grads(RUNS[backend], p, torch.float32)
    o64, s64, g64 = _grads(RUNS[backend], p, torch.float64)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert rel_err(o32, o64) < 1e-5 and rel_err(s32, s64) < 1e-5
    for name in NAMES:
        assert torch.isfinite(g32[name]).all(), f"{name}: non-finite gradient"
        assert torch.isfinite(g64[name]).all(), f"{name}: non-finite float64 gradient"
        assert rel_err(g32[name], g64[name]) < 1e-4, name
    # The saturated head receives no gradient through its gate (its decay is pinned at the limit).
    assert g64["A_log"][0] == 0 and g32["A_log"][0] == 0
    assert (g32["g"][:, :, 0] == 0).all()


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("backend", RUNS)
def test_float64_saturation_limit_equals_large_finite_rate(gate, backend):
    # exp(800) overflows float64: the limit must equal the result at a huge but finite rate.
    o_inf, s_inf, g_inf = _grads(RUNS[backend], _problem(gate, 800.0), torch.float64)
    o_big, s_big, g_big = _grads(RUNS[backend], _problem(gate, 100.0), torch.float64)
    assert rel_err(o_inf, o_big) < 1e-12 and rel_err(s_inf, s_big) < 1e-12
    for name in NAMES:
        assert torch.isfinite(g_inf[name]).all(), name
        assert rel_err(g_inf[name], g_big[name]) < 1e-12, name


@pytest.mark.parametrize("backend", RUNS)
def test_log_decay_overflow_with_finite_rate_has_finite_gradients(backend):
    # exp(88) is finite in float32 but exp(88) * softplus(z) overflows to -inf for z > 2.
    p = _problem("softplus", 88.0)
    p.g = p.g.abs() + 3.0
    _, _, g32 = _grads(RUNS[backend], p, torch.float32)
    _, _, g64 = _grads(RUNS[backend], p, torch.float64)
    for name in NAMES:
        assert torch.isfinite(g32[name]).all(), name
        assert rel_err(g32[name], g64[name]) < 1e-4, name


def test_kda_gate_saturated_values_and_gradients():
    z = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(2))
    A = torch.tensor([100.0, -1.0], requires_grad=True)
    g = torch_kda.kda_gate(z, A)
    assert (g[:, 0] == float("-inf")).all() and torch.isfinite(g[:, 1]).all()
    g.exp().sum().backward()
    assert torch.isfinite(A.grad).all() and A.grad[0] == 0
    zb = z.clone()
    zb[0, 0, 0] = 0.0  # sigmoid(inf * 0): the step's midpoint, not NaN
    gb = torch_kda.kda_gate(zb, torch.tensor([100.0, -1.0]), lower_bound=-2.0)
    expected = -2.0 * (torch.sign(zb[:, 0]) + 1) / 2
    assert torch.equal(gb[:, 0], expected)


SLOPE_RUNS = dict(RUNS, native_recurrent=lambda p: torch_kda.fused_recurrent_kda(
    *p.args, **p.kwargs, backend="native"))


@pytest.mark.parametrize("neg_eigval", [False, True])
@pytest.mark.parametrize("backend", SLOPE_RUNS)
def test_sigmoids_near_one_keep_their_gradients(backend, neg_eigval):
    # sigmoid(x) rounds to 1 in float32 once x > ~17 (from x ~ 12 it keeps only a few bits of
    # 1 - sigmoid(x)), while its slope sigmoid(x) sigmoid(-x) ~ exp(-x) is still representable:
    # the bounded gate's and beta's gradients there must keep their relative precision. Written as
    # s (1 - s), they were 0 (docs/math.md "Saturation"). x in [12, 22] keeps the float64 run exact.
    p = make_problem(B=1, T=16, H=2, K=8, V=8, gate="bounded", seed=43, lower_bound=-3.0,
                     neg_eigval=neg_eigval)
    gen = torch.Generator().manual_seed(44)
    rate = p.kwargs["A_log"].exp().reshape(2, 1)
    bias = p.kwargs["dt_bias"].reshape(2, 8)
    x = 12 + 10 * torch.rand(1, 16, 2, 4, generator=gen, dtype=torch.float64)
    p.g[..., :4] = x / rate - bias[:, :4]  # channels 0-3 of both heads: rate * (g + bias) = x
    p.beta[:, ::2] = 12 + 10 * torch.rand(1, 8, 2, generator=gen, dtype=torch.float64)
    _, _, g32 = _grads(SLOPE_RUNS[backend], p, torch.float32)
    _, _, g64 = _grads(SLOPE_RUNS[backend], p, torch.float64)
    assert (g64["g"][..., :4] != 0).all() and (g64["beta"][:, ::2] != 0).all()
    assert rel_err(g32["g"][..., :4], g64["g"][..., :4]) < 1e-3
    assert rel_err(g32["beta"][:, ::2], g64["beta"][:, ::2]) < 1e-3
    for name in NAMES:
        assert rel_err(g32[name], g64[name]) < 1e-4, name


def _extreme_inputs(gate: str, z_values):
    # Head 0 saturated (exp(100) = inf in float32) with z = g + dt_bias of channels 0-3 at
    # z_values in every token: -90 (softplus(z) flushes to 0 in float32: inf * 0 was NaN in the
    # native pass), exactly 0 (the bounded gate's step midpoint: inf * 0 was NaN in the serving
    # kernels; its float64 gradient is exp(100) / 4, the step's, so only forwards take it). Below
    # ~-96 the softplus gate's decay leaves 0 for 1 (the log-space form): EXTREME_RATES below.
    p = _problem(gate, 100.0)
    bias = p.kwargs["dt_bias"].reshape(2, 8)
    p.g[:, :, 0, :4] = torch.tensor(z_values, dtype=torch.float64) - bias[0, :4]
    return p


def _assert_finite_and_float64_close(run, p):
    # Outputs, final states and every gradient finite in float32 and float64, float32 within
    # 1e-5 (values) and 1e-4 (gradients) of float64; returns the float64 gradients.
    o32, s32, g32 = _grads(run, p, torch.float32)
    o64, s64, g64 = _grads(run, p, torch.float64)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert rel_err(o32, o64) < 1e-5 and rel_err(s32, s64) < 1e-5
    for name in NAMES:
        assert torch.isfinite(g32[name]).all(), name
        assert torch.isfinite(g64[name]).all(), name
        assert rel_err(g32[name], g64[name]) < 1e-4, name
    return g64


def _serving_decode(p):
    # The native serving path (a state pool read and written in place by slot indices) on p's
    # values: (o, the pool after the call).
    kwargs = dict(p.kwargs)
    pool = kwargs.pop("initial_state").clone()
    with torch.no_grad():
        o, _ = torch_kda.fused_recurrent_kda(*p.args, **kwargs, initial_state=pool,
                                             ssm_state_indices=torch.arange(pool.shape[0]),
                                             inplace_final_state=True, backend="native")
    return o, pool


def _assert_serving_decode_close(p):
    # float32 serving decode finite and within 1e-5 of the float64 reference.
    o, pool = _serving_decode(p.to(torch.float32))
    with torch.no_grad():
        o64, s64 = torch_kda.fused_recurrent_kda(*p.args, **p.kwargs, backend="reference")
    assert torch.isfinite(o).all() and torch.isfinite(pool).all()
    assert rel_err(o, o64) < 1e-5 and rel_err(pool, s64) < 1e-5


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("backend", SLOPE_RUNS)
def test_saturated_rate_with_extreme_gate_inputs(gate, backend):
    p = _extreme_inputs(gate, [-90.0, -95.0, 90.0, 1e4])
    _assert_finite_and_float64_close(SLOPE_RUNS[backend], p)


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_serving_decode_takes_the_saturated_gate_limits(gate, v_first):
    # The serving kernels (a state pool read and written in place by slot indices) compute the gate
    # themselves: the same limits as the prefill's pass, against the float64 reference.
    p = _extreme_inputs(gate, [-90.0, -95.0, 0.0, 90.0])
    p.kwargs["state_v_first"] = v_first
    if v_first:
        p.kwargs["initial_state"] = p.kwargs["initial_state"].transpose(-1, -2).contiguous()
    _assert_serving_decode_close(p)


@pytest.mark.parametrize("where", ["g", "dt_bias"])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("backend", SLOPE_RUNS)
def test_infinite_gate_inputs_take_their_limits(gate, backend, where):
    # z = g + dt_bias = +-inf under a finite rate: the gate sits at its limit (softplus: decay 0 at
    # +inf, 1 at -inf; bounded: the step), the gradients through those channels are 0, and
    # A_log's gradient (a sum of dg * g, or of dz * z) must take the limit 0 of those products,
    # not 0 * inf = NaN: the native chain rule did form it for the bounded gate, the reference for
    # both gates (docs/math.md "Saturation").
    p = _problem(gate, 0.5)
    if where == "g":
        p.g[:, 3, 1, 0] = float("inf")
        p.g[:, 5, 0, 2] = float("-inf")
        p.g[:, 9, 1, 5] = float("inf")
    else:
        bias = p.kwargs["dt_bias"].clone().reshape(2, 8)
        bias[1, 0], bias[0, 2] = float("inf"), float("-inf")
        p.kwargs["dt_bias"] = bias.reshape(-1)
    g64 = _assert_finite_and_float64_close(SLOPE_RUNS[backend], p)
    if where == "g":
        assert g64["g"][:, 3, 1, 0] == 0 and g64["g"][:, 5, 0, 2] == 0


# Rates at the ends of float32's range, with the gate inputs z (channels 0-3 of head 0) where
# their products matter (float64 keeps every rate normal and finite):
# - below it: exp(-100) = 3.7e-44 is subnormal, exp(-110) underflows to 0, exp(-88) = 6e-39 is
#   subnormal with z = 2e38 making rate * z = 1.2;
# - above 2^64 (the log-space softplus gate): exp(100) overflows, and z = -100 still makes
#   exp(100) softplus(z) = 1; exp(88) = 1.7e38 is finite while softplus(-88) is below float32's
#   normal range; exp(80) times softplus(-80); A_log = +inf is a decay of 0 for every z that is a
#   number (z = -inf included: inf - inf was NaN in the log-space form).
EXTREME_RATES = {
    "subnormal_infinite_z": (-100.0, [float("inf"), float("-inf"), float("inf"), 3.0]),
    "underflowed_infinite_z": (-110.0, [float("inf"), float("-inf"), 1e30, 3.0]),
    "subnormal_huge_z": (-88.0, [2e38, 1e38, -2e38, 3.0]),
    "saturated_z_far_below_0": (100.0, [-100.0, -98.5, -200.0, float("-inf")]),
    "huge_softplus_underflow": (88.0, [-88.0, -89.5, -86.0, float("-inf")]),
    "large_z_below_0": (80.0, [-80.0, -82.0, -95.0, 2.0]),
    "infinite_a_log": (float("inf"), [float("-inf"), -200.0, 0.0, 3.0]),
}


def _extreme_rate_problem(gate: str, case: str):
    a_log, z_values = EXTREME_RATES[case]
    p = _problem(gate, a_log)
    bias = p.kwargs["dt_bias"].clone().reshape(2, 8)
    bias[0, :4] = 0.0  # z = g exactly
    p.kwargs["dt_bias"] = bias.reshape(-1)
    p.g[:, :, 0, :4] = torch.tensor(z_values, dtype=torch.float64)
    return p


@pytest.mark.parametrize("case", EXTREME_RATES)
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("backend", SLOPE_RUNS)
def test_extreme_rates_keep_their_products_and_limits(gate, backend, case):
    # The native chunk kernels run with denormals read as zero (docs/math.md "Chunkwise form"),
    # where rate * z read a subnormal rate (or z) as 0: NaN at z = +-inf (0 * inf) and no decay at
    # all where rate * z is of order 1. A rate that underflowed to 0 gave NaN at z = +-inf in
    # every backend. A saturated rate gave decay 0 for every z, where exp(100) softplus(-100) is
    # a decay of e^-1; a huge finite one lost its product with a softplus below float32's range.
    # The true values: the gates' limits at z = +-inf (decay 0 or 1, the bounded gate's step)
    # and the decays of the finite products, with their gradients.
    _assert_finite_and_float64_close(SLOPE_RUNS[backend], _extreme_rate_problem(gate, case))


@pytest.mark.parametrize("case", EXTREME_RATES)
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_serving_decode_keeps_extreme_rates_products_and_limits(gate, case):
    # The serving kernels compute the gate themselves (vec_math.h, as the prefill).
    p = _extreme_rate_problem(gate, case)
    _assert_serving_decode_close(p)


@pytest.mark.parametrize("where", ["g", "dt_bias"])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
@pytest.mark.parametrize("backend", [*SLOPE_RUNS, "serving"])
def test_nan_gate_input_propagates_under_a_saturated_rate(gate, backend, where):
    # NaN propagates by policy (docs/bad_inputs.md); the saturated gate's limits (decay 0, the
    # step) hold for numbers only: they had turned a NaN z of head 0 into a decay of 0 or a step.
    p = _problem(gate, 100.0).to(torch.float32)
    if where == "g":
        p.g[:, 5, 0, 3] = float("nan")
    else:
        bias = p.kwargs["dt_bias"].clone().reshape(2, 8)
        bias[0, 3] = float("nan")
        p.kwargs["dt_bias"] = bias.reshape(-1)
    if backend == "serving":
        o, _ = _serving_decode(p)
    else:
        with torch.no_grad():
            o, _ = SLOPE_RUNS[backend](p)
    first = 5 if where == "g" else 0
    assert torch.isnan(o[0, first:, 0]).any(), "the NaN gate input was lost"
    assert torch.isfinite(o[0, :, 1]).all(), "the NaN reached the other head"
