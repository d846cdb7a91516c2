"""Tests of the KDA layer (torch_kda.nn): FLA weight layout, backends, cache, padding, packing,
config errors, lazy imports, mixed precision and the Hugging Face Kimi-Linear converter.

Fresh random inputs and weights from explicit ``torch.Generator`` seeds; comparisons by relative
error (``kda_testing.rel_err``) in float64 unless the test is about another dtype.
"""

from __future__ import annotations

import importlib
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torch_kda
from kda_testing import rel_err
from torch_kda.nn import (
    GatedRMSNorm,
    KDACache,
    KDAConfig,
    KimiDeltaAttention,
    ShortConvolution,
    build_kda,
    convert_hf_kimi_linear_state_dict,
    kda_config_from_hf,
    kda_from_hf_kimi_linear,
)

# Small sizes: M = 32, H = 2 query/key heads of K = 8, HV = 4 value heads of V = 12 (GVA, V != K).
SMALL = dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.5)
VARIANTS = {
    "softplus": dict(SMALL, conv_bias=True),
    "bounded_safe_negeig": dict(SMALL, safe_gate=True, lower_bound=-5.0, allow_neg_eigval=True),
    "no_conv": dict(hidden_size=32, head_dim=8, num_heads=4, use_short_conv=False),
}
BACKENDS = ("reference", "native")
TOL64 = 1e-10


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_layer(backend: str = "reference", seed: int = 0, dtype: torch.dtype = torch.float64,
               chunk_size: int = 16, **cfg) -> KimiDeltaAttention:
    """A layer whose every parameter is drawn afresh (not the init's zeros/ones)."""
    layer = KimiDeltaAttention(**{**SMALL, **cfg}, backend=backend, chunk_size=chunk_size)
    g = gen(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name == "A_log":
                p.copy_(torch.empty(p.shape, dtype=torch.float64).uniform_(0.5, 4.0, generator=g).log())
            elif name == "o_norm.weight":
                p.copy_(1.0 + 0.2 * noise)
            elif name == "dt_bias":
                p.copy_(noise * 0.5 - 1.0)
            else:
                p.add_(0.1 * noise)
    return layer.to(dtype)


def copy_layer(layer: KimiDeltaAttention, backend: str) -> KimiDeltaAttention:
    cfg = layer.config.to_dict()
    cfg["backend"] = backend
    other = KimiDeltaAttention(**cfg).to(layer.A_log.dtype)
    other.load_state_dict(layer.state_dict(), strict=True)
    return other


def rand(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed), dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------
# FLA weight compatibility
# --------------------------------------------------------------------------------------------

def fla_expected_params(M, H, K, HV, V, W, conv, conv_bias):
    """Names and shapes of fla.layers.kda.KimiDeltaAttention (flash-linear-attention 0.6.0),
    in its state_dict order (own parameters first, then submodules in construction order)."""
    out = {"A_log": (HV,), "dt_bias": (HV * K,),
           "q_proj.weight": (H * K, M), "k_proj.weight": (H * K, M), "v_proj.weight": (HV * V, M)}
    if conv:
        for name, d in (("q", H * K), ("k", H * K), ("v", HV * V)):
            out[f"{name}_conv1d.weight"] = (d, 1, W)
            if conv_bias:
                out[f"{name}_conv1d.bias"] = (d,)
    out.update({"f_proj.0.weight": (V, M), "f_proj.1.weight": (HV * K, V), "b_proj.weight": (HV, M),
                "g_proj.0.weight": (V, M), "g_proj.1.weight": (HV * V, V), "g_proj.1.bias": (HV * V,),
                "o_norm.weight": (V,), "o_proj.weight": (M, HV * V)})
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_state_dict_has_fla_names_shapes_and_loads_strict(variant):
    cfg = VARIANTS[variant]
    layer = KimiDeltaAttention(**cfg)
    c = layer.config
    expected = fla_expected_params(c.hidden_size, c.num_heads, c.head_dim, c.n_v_heads, c.head_v_dim,
                                   c.conv_size, c.use_short_conv, c.conv_bias)
    sd = layer.state_dict()
    assert list(sd) == list(expected)
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert all(v.dtype == torch.float32 for v in sd.values())
    # An "FLA checkpoint" with those names loads with strict=True and lands where it should.
    g = gen(1)
    fla_sd = {k: torch.randn(s, generator=g) for k, s in expected.items()}
    missing = layer.load_state_dict(fla_sd, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in fla_sd.items())
    with pytest.raises(RuntimeError):
        layer.load_state_dict({**fla_sd, "extra.weight": torch.zeros(1)}, strict=True)


def test_init_follows_fla_recipe():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(**SMALL)
    A = layer.A_log.detach().exp()
    assert A.dtype == torch.float32 and bool(((A >= 1) & (A <= 16)).all())
    dt = F.softplus(layer.dt_bias.detach().double())
    assert bool(((dt >= 1e-3 * (1 - 1e-4)) & (dt <= 0.1 * (1 + 1e-4))).all())
    assert torch.equal(layer.o_norm.weight.detach(), torch.ones(layer.head_v_dim))
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    safe = KimiDeltaAttention(**SMALL, safe_gate=True, lower_bound=-5.0)
    assert torch.equal(safe.A_log.detach(), torch.zeros(SMALL["num_v_heads"]))
    # Conv weights follow nn.Conv1d's default (kaiming-uniform, fan_in = W): |w| <= 1/sqrt(W).
    assert float(layer.q_conv1d.weight.detach().abs().max()) <= 1 / math.sqrt(layer.conv_size) + 1e-6


# --------------------------------------------------------------------------------------------
# Backends: native == reference, float64, forward and every parameter gradient
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_layer_matches_reference_fp64_forward_and_all_grads(variant):
    ref = make_layer("reference", seed=3, **VARIANTS[variant])
    nat = copy_layer(ref, "native")
    x = rand((2, 37, 32), seed=4)
    xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yn = ref(xr), nat(xn)
    assert rel_err(yn, yr) < TOL64
    w = rand(yr.shape, seed=5)
    (yr * w).sum().backward()
    (yn * w).sum().backward()
    assert rel_err(xn.grad, xr.grad) < TOL64
    grads_r = dict(ref.named_parameters())
    for name, p in nat.named_parameters():
        assert p.grad is not None and grads_r[name].grad is not None, name
        assert rel_err(p.grad, grads_r[name].grad) < TOL64, name


# --------------------------------------------------------------------------------------------
# Decoding cache
# --------------------------------------------------------------------------------------------

class _Spy:
    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("chunk_kda", "fused_recurrent_kda"):
            fn = getattr(torch_kda, name)
            monkeypatch.setattr(torch_kda, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapped(*a, **kw):
            self.calls.append((name, kw["q"].shape[1]))
            return fn(*a, **kw)
        return wrapped


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_then_decode_equals_full_forward(backend, variant, monkeypatch):
    layer = make_layer(backend, seed=7, **VARIANTS[variant]).eval()
    x = rand((2, 78, 32), seed=8)
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        full = layer(x)
        cache = KDACache()
        outs = [layer(x[:, :70], cache=cache, use_cache=True)]
        for t in range(70, 75):
            outs.append(layer(x[:, t : t + 1], cache=cache))
        outs.append(layer(x[:, 75:], cache=cache))
    assert rel_err(torch.cat(outs, 1), full) < TOL64
    assert cache.seen_tokens == 78
    assert cache.recurrent_state.shape == (2, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim)
    assert cache.recurrent_state.dtype == torch.float64
    # The long prefill runs the chunk op, decoding the recurrent op.
    assert spy.calls[:2] == [("chunk_kda", 78), ("chunk_kda", 70)]
    assert all(name == "fused_recurrent_kda" for name, _ in spy.calls[2:])


def test_prefill_then_decode_with_autograd_equals_full_forward():
    layer = make_layer("reference", seed=9).train()
    x = rand((2, 15, 32), seed=10)
    full = layer(x)
    cache = KDACache()
    parts = [layer(x[:, :11], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(11, 15)]
    y = torch.cat(parts, 1)
    assert rel_err(y, full) < TOL64
    w = rand(y.shape, seed=11)
    g_full = torch.autograd.grad((full * w).sum(), layer.A_log)[0]
    g_inc = torch.autograd.grad((y * w).sum(), layer.A_log)[0]
    assert rel_err(g_inc, g_full) < TOL64


def test_reorder_for_beam_search_equals_decoding_the_chosen_rows():
    layer = make_layer("reference", seed=13).eval()
    x = rand((3, 9, 32), seed=14)
    nxt = rand((4, 1, 32), seed=15)
    beams = torch.tensor([2, 0, 2, 1])  # row 2 twice (two beams of one parent)
    with torch.no_grad():
        cache = KDACache()
        layer(x, cache=cache)
        y = layer(nxt, cache=cache.reorder_(beams))
        for i, parent in enumerate(beams.tolist()):  # each beam alone: its parent's prefix
            alone = KDACache()
            layer(x[parent:parent + 1], cache=alone)
            assert rel_err(y[i:i + 1], layer(nxt[i:i + 1], cache=alone)) < TOL64


def test_reorder_rejects_a_bad_index_and_keeps_the_cache():
    layer = make_layer("reference", seed=16).eval()
    with torch.no_grad():
        cache = KDACache()
        layer(rand((2, 5, 32), seed=17), cache=cache)
    state = cache.recurrent_state.clone()
    for bad, exc, words in ((torch.tensor([0, 2]), ValueError, "0 <= i < N = 2 of the cache, got 2"),
                            (torch.tensor([-1]), ValueError, "got -1"),
                            ([1, 0], TypeError, "index must be an int64 or int32 tensor, got list"),
                            (torch.tensor([1.0]), TypeError, "got torch.float32"),
                            (torch.tensor([[0]]), ValueError, "1-D")):
        with pytest.raises(exc, match=re.escape(words)):
            cache.reorder_(bad)
        assert torch.equal(cache.recurrent_state, state)


def test_cache_errors():
    layer = make_layer("reference")
    x = rand((2, 5, 32), seed=12)
    with pytest.raises(ValueError, match="use_cache"):
        layer(x, use_cache=True)
    cache = KDACache()
    layer(x, cache=cache)
    with pytest.raises(ValueError, match="cache: expected state for 3 sequences, got 2"):
        layer(rand((3, 1, 32), seed=13), cache=cache)
    with pytest.raises(TypeError, match="KDACache"):
        layer(x, cache={"recurrent_state": None})


# --------------------------------------------------------------------------------------------
# Padding and packing
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("lens", [(6,), (9, 6)])
def test_padding_mask_equals_unpadded(backend, side, lens):
    layer = make_layer(backend, seed=14)
    T = max(lens) + 2  # every row has padding at B = 1 too
    seqs = [rand((1, n, 32), seed=20 + i) for i, n in enumerate(lens)]
    x = rand((len(lens), T, 32), seed=15)  # padding positions hold garbage, not zeros
    mask = torch.zeros(len(lens), T, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        sl = slice(T - n, T) if side == "left" else slice(0, n)
        x[i, sl] = s[0]
        mask[i, sl] = 1
    x.requires_grad_()
    y = layer(x, attention_mask=mask)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        sl = slice(T - n, T) if side == "left" else slice(0, n)
        assert rel_err(y[i, sl], layer(s)[0]) < TOL64
    assert bool((y[mask == 0] == 0).all())
    y.sum().backward()
    assert bool((x.grad[mask == 0] == 0).all())


def test_padded_prompt_then_decode_with_growing_mask():
    layer = make_layer("reference", seed=16).eval()
    lens, T, extra = (7, 4), 7, 3
    seqs = [rand((1, n + extra, 32), seed=30 + i) for i, n in enumerate(lens)]
    x = rand((2, T, 32), seed=17)
    mask = torch.zeros(2, T, dtype=torch.long)
    for i, n in enumerate(lens):
        x[i, T - n :] = seqs[i][0, :n]
        mask[i, T - n :] = 1
    cache = KDACache()
    with torch.no_grad():
        outs = [layer(x, attention_mask=mask, cache=cache)]
        for j in range(extra):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)  # HF-style: covers the past
            step = torch.stack([seqs[i][0, lens[i] + j] for i in range(2)])[:, None]
            outs.append(layer(step, attention_mask=mask, cache=cache))
        y = torch.cat(outs, 1)
        for i, n in enumerate(lens):
            assert rel_err(y[i, T - n :], layer(seqs[i])[0]) < TOL64


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_cu_seqlens_equals_separate_calls(backend):
    layer = make_layer(backend, seed=18)
    lens = [5, 0, 11, 3]
    seqs = [rand((1, n, 32), seed=40 + i) for i, n in enumerate(lens)]
    x = torch.cat(seqs, 1).requires_grad_()
    cu = torch.tensor([0] + lens).cumsum(0)
    cache = KDACache()
    y = layer(x, cu_seqlens=cu, cache=cache)
    w = rand(y.shape, seed=19)
    (y * w).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    total = 0.0
    for i, (s, n) in enumerate(zip(seqs, lens)):
        a, b = int(cu[i]), int(cu[i + 1])
        c = KDACache()
        yi = layer(s, cache=c)
        assert rel_err(y[:, a:b], yi) < TOL64 if n else yi.shape == (1, 0, 32)
        if n:
            total = total + (yi * w[:, a:b]).sum()
            assert rel_err(cache.recurrent_state[i], c.recurrent_state[0]) < TOL64
            for mine, theirs in zip(cache.conv_state, c.conv_state):
                assert rel_err(mine[i], theirs[0]) < TOL64
        else:  # an empty sequence keeps the (zero) initial state
            assert bool((cache.recurrent_state[i] == 0).all())
            assert all(bool((cs[i] == 0).all()) for cs in cache.conv_state)
    total.backward()
    for n, p in layer.named_parameters():
        assert rel_err(packed_grads[n], p.grad) < TOL64, n


def test_mask_and_shape_errors():
    layer = make_layer("reference")
    x = rand((2, 5, 32), seed=21)
    with pytest.raises(ValueError, match="attention_mask and cu_seqlens"):
        layer(x[:1], attention_mask=torch.ones(1, 5), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"attention_mask: expected a \[B, T'\]"):
        layer(x, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="with cu_seqlens the batch size B must be 1"):
        layer(x, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \[B, T, 32\]"):
        layer(x[..., :16])


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------

def test_short_conv_matches_conv1d_and_continues_from_cache():
    conv = ShortConvolution(24, 4, bias=True).double()
    with torch.no_grad():
        conv.bias.normal_(generator=gen(50))
    x = rand((3, 10, 24), seed=51)
    expected = F.silu(F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=3, groups=24)[..., :10]).transpose(1, 2)
    y, state = conv(x, output_final_state=True)
    assert rel_err(y, expected) < 1e-13
    assert torch.equal(state, x[:, -4:].transpose(1, 2))
    y1, s1 = conv(x[:, :6], output_final_state=True)
    y2, _ = conv(x[:, 6:], cache=s1, output_final_state=True)
    assert rel_err(torch.cat([y1, y2], 1), expected) < 1e-13
    # Packed sequences restart at their boundaries; a sequence shorter than W keeps part of its cache.
    lens = [2, 0, 8]
    xs = [rand((1, n, 24), seed=60 + i) for i, n in enumerate(lens)]
    hist = rand((3, 24, 4), seed=52)
    cu = torch.tensor([0] + lens).cumsum(0)
    yp, sp = conv(torch.cat(xs, 1), cache=hist, output_final_state=True, cu_seqlens=cu)
    for i, xi in enumerate(xs):
        yi, si = conv(xi, cache=hist[i : i + 1], output_final_state=True)
        assert rel_err(yp[:, cu[i] : cu[i + 1]], yi) < 1e-13 if lens[i] else True
        assert torch.equal(sp[i], si[0])


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("inf"), float("nan"), "1e-5", True])
def test_gated_rmsnorm_rejects_an_eps_that_is_not_a_finite_positive_number(eps):
    with pytest.raises(ValueError, match=r"GatedRMSNorm: eps: expected a finite number > 0"):
        GatedRMSNorm(12, eps=eps)


def test_gated_rmsnorm_formula_and_fp32_arithmetic():
    norm = GatedRMSNorm(12, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(rand((12,), seed=70, dtype=torch.float32))
    x, g = rand((5, 12), seed=71), rand((5, 12), seed=72)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double() * torch.sigmoid(g)
    assert rel_err(norm(x, g), expected) < 1e-13
    xb, gb = x.bfloat16(), g.bfloat16()
    yb = norm(xb, gb)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, norm(xb.float(), gb.float()).bfloat16())


def test_gated_rmsnorm_gate_gradient_keeps_its_precision_near_sigmoid_one():
    # sigmoid(g) rounds to 1 in float32 for g > ~17; its slope ~exp(-g) must survive there
    # (docs/math.md "Saturation"). g in [12, 22]: the float64 run stays exact.
    x = rand((5, 12), seed=73)
    g = 12 + 10 * torch.rand(5, 12, generator=torch.Generator().manual_seed(74), dtype=torch.float64)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        norm = GatedRMSNorm(12, eps=1e-5).to(dtype)
        gd = g.to(dtype).requires_grad_()
        (norm(x.to(dtype), gd) * rand((5, 12), seed=75).to(dtype)).sum().backward()
        grads[dtype] = gd.grad
    assert (grads[torch.float64] != 0).all()
    assert rel_err(grads[torch.float32], grads[torch.float64]) < 1e-4


# --------------------------------------------------------------------------------------------
# Mixed precision
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_params_with_bf16_activations(backend):
    layer = make_layer(backend, seed=80, dtype=torch.float32)
    x = rand((2, 20, 32), seed=81, dtype=torch.float32)
    y32 = layer(x)
    xb = x.bfloat16().requires_grad_()
    yb = layer(xb)
    assert yb.dtype == torch.bfloat16
    assert rel_err(yb, y32) < 3e-2
    yb.float().pow(2).mean().backward()
    for name, p in layer.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        assert bool(torch.isfinite(p.grad).all()), name
    assert xb.grad.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = layer(x)
    assert ya.dtype == torch.bfloat16
    assert rel_err(ya, y32) < 3e-2


@pytest.mark.parametrize("decoding", [False, True])
@pytest.mark.parametrize(
    "act, autocast, op_dtype",
    [
        (torch.bfloat16, None, torch.bfloat16),  # bf16 has fp32's range: the op takes it as it is
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.float16, None, torch.float32),  # fp16: widened, o fp32 until the RMSNorm
        (torch.float32, torch.float16, torch.float32),
    ],
)
def test_the_op_gets_bf16_activations_as_they_are_and_fp16_ones_widened(
        monkeypatch, decoding, act, autocast, op_dtype):
    """With bf16 activations the op (and ``backend="auto"``'s rule, which grants the chunk
    kernel's bf16 products to bf16 inputs only) sees bf16 q, k, v, g, beta; fp16 ones, with or
    without autocast, reach it as fp32 (an fp16 o would overflow before the norm). Both ops: the
    chunk op under autograd, the recurrent one for short inputs in inference."""
    seen = []
    for name in ("chunk_kda", "fused_recurrent_kda"):
        real = getattr(torch_kda, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, *(kwargs[n].dtype for n in ("q", "k", "v", "g", "beta"))))
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch_kda, name, spy)
    layer = make_layer("reference", seed=82, dtype=torch.float32)
    expected = copy_layer(layer, "reference").double()
    if decoding:
        layer.eval()
    if act != torch.float32:
        layer = layer.to(act)
    x = rand((1, 20, 32), seed=83, dtype=act)
    with torch.set_grad_enabled(not decoding), torch.autocast(
            "cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = layer(x)
    op = "fused_recurrent_kda" if decoding else "chunk_kda"
    assert seen == [(op,) + (op_dtype,) * 5]
    assert y.dtype == (act if autocast is None else autocast)
    with torch.no_grad():
        assert rel_err(y, expected(x.double())) < 3e-2


# --------------------------------------------------------------------------------------------
# Config, build, backends, lazy imports
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(head_dim=-1), "head_dim"),
        (dict(num_heads=2.0), "num_heads"),
        (dict(num_heads=4, num_v_heads=6), "num_v_heads"),
        (dict(expand_v=0.3, head_dim=8), "expand_v"),
        (dict(expand_v=0), "expand_v"),
        (dict(conv_size=0), "conv_size"),
        (dict(safe_gate=True), "lower_bound"),
        (dict(safe_gate=True, lower_bound=-6.0), "lower_bound"),
        (dict(lower_bound=0.5), "lower_bound"),
        (dict(backend="cuda"), "backend"),
        (dict(mode="parallel"), "mode"),
        (dict(backend="fla", chunk_size=16), "chunk_size"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(norm_eps=float("inf")), "norm_eps"),  # would zero every output
        (dict(expand_v=float("inf")), "expand_v"),
        (dict(use_short_conv=1), "use_short_conv"),
    ],
)
def test_config_errors_name_field_expected_and_actual(kwargs, field):
    with pytest.raises(ValueError, match=rf"KDAConfig\.{field}: expected .*, got "):
        KDAConfig(**{**SMALL, **kwargs})
    with pytest.raises(ValueError, match=rf"KDAConfig\.{field}"):
        KimiDeltaAttention(**{**SMALL, **kwargs})


def test_config_error_message_is_specific():
    with pytest.raises(ValueError, match=r"KDAConfig\.num_v_heads: expected a multiple of num_heads=4, got 6"):
        KDAConfig(hidden_size=32, num_heads=4, num_v_heads=6)


def test_build_kda_from_config():
    cfg = KDAConfig(**SMALL, backend="reference", chunk_size=32, layer_idx=3)
    layer = build_kda(cfg)
    assert isinstance(layer, KimiDeltaAttention) and layer.config == cfg and layer.layer_idx == 3
    assert layer(rand((1, 5, 32), seed=90, dtype=torch.float32)).shape == (1, 5, 32)
    with pytest.raises(TypeError, match="KDAConfig"):
        build_kda(dict(SMALL))


def test_fla_backend_on_cpu_raises_before_any_projection():
    layer = KimiDeltaAttention(**SMALL, backend="fla")

    def boom(*_):
        raise AssertionError("a projection ran")

    layer.q_proj.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="requires CUDA"):
        layer(torch.randn(1, 4, 32))


def test_building_and_running_native_layer_never_imports_fla():
    code = (
        "import sys, torch, torch_kda\n"
        "from torch_kda.nn import KDAConfig, build_kda\n"
        "for b in ('native', 'reference'):\n"
        "    layer = build_kda(KDAConfig(hidden_size=16, head_dim=4, num_heads=2, backend=b))\n"
        "    layer(torch.randn(1, 5, 16)).sum().backward()\n"
        "build_kda(KDAConfig(hidden_size=16, head_dim=4, num_heads=2, backend='fla'))\n"
        "bad = [m for m in sys.modules if m == 'fla' or m.startswith('fla.') or m == 'transformers']\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# --------------------------------------------------------------------------------------------
# Hugging Face Kimi-Linear converter (transformers ships models/kimi_linear)
# --------------------------------------------------------------------------------------------

@pytest.fixture
def hf_modeling():
    """transformers' Kimi-Linear modeling with its pure-PyTorch KDA path: the module picks FLA's
    kernels at import time when ``fla`` imports, and those need a GPU. Imported with ``fla``
    blocked, and imported again afterwards with it: other tests' models (their classes read the
    module's globals) expect what transformers binds by default."""
    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    with pytest.MonkeyPatch.context() as mp:
        for blocked in ("fla", "causal_conv1d"):
            mp.setitem(sys.modules, blocked, None)
        mod = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    yield mod
    importlib.reload(mod)


def test_hf_kimi_linear_converter_matches_transformers_layer(hf_modeling):
    mod = hf_modeling
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    cfg = KimiLinearConfig(hidden_size=32, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
                           num_hidden_layers=2, vocab_size=64, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, rms_norm_eps=1e-5)
    hf = mod.KimiLinearDeltaAttention(cfg, layer_idx=0).double()
    g = gen(100)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        hf.forget_gate.A_log.copy_(torch.empty(hf.forget_gate.A_log.shape, dtype=torch.float64).uniform_(1, 16, generator=g).log())
    c = kda_config_from_hf(cfg, backend="reference")
    assert (c.hidden_size, c.num_heads, c.head_dim, c.n_v_heads, c.conv_size, c.norm_eps) == (32, 2, 8, 2, 4, 1e-5)
    layer = kda_from_hf_kimi_linear(hf, cfg, backend="reference")
    assert layer.A_log.dtype == torch.float64 and layer.q_proj.weight.dtype == torch.float64
    x = rand((2, 70, 32), seed=101)  # T > 64: the transformers chunk path pads a partial chunk
    with torch.no_grad():
        expected = hf(x)
        got = layer(x)
    # transformers' PyTorch KDA path computes in fp32 whatever the input dtype.
    assert rel_err(got, expected) < 1e-4
    sd = convert_hf_kimi_linear_state_dict({"model.layers.0.self_attn." + k: v for k, v in hf.state_dict().items()},
                                           prefix="model.layers.0.self_attn.")
    assert set(sd) == set(layer.state_dict())
    with pytest.raises(KeyError, match="conv1d.weight"):
        convert_hf_kimi_linear_state_dict({k: v for k, v in hf.state_dict().items() if k != "conv1d.weight"})
