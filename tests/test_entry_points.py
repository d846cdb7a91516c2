"""Every public entry point takes the functional API's arguments by the same rules.

- ``ShortConvolution`` validates ``cu_seqlens`` with the functional API's validator (eager and
  compiled), so bad offsets never read another sequence's tokens;
- the layer's ``attention_mask`` follows FLA's convention (1/True = token, 0/False = padding) and
  rejects an additive mask (0 = keep, -inf = pad) by name; ``cu_seqlens`` may be a list of ints;
- the layer keeps the op's output in fp32 until its fp32 RMSNorm (fp16 decoding with a large state);
- the Hugging Face converter refuses overrides that change the function;
- ``compat.flash_kda.fwd`` and ``chunk_kda`` share one ``scale`` policy (TypeError for types,
  ValueError for NaN/inf; NumPy scalars are numbers);
- ``chunk_kda`` accepts FLA's ``cu_seqlens_cpu``, ``disable_recompute``, ``cp_context``,
  ``use_graph`` and ``max_num_seqs``; FLA 0.6's positional ``A_log``, ``dt_bias`` get an error
  that names the keyword form.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_kda
from kda_testing import make_problem, rel_err
from torch_kda.compat import flash_kda as fk
from torch_kda.nn import KDACache, KDAConfig, KimiDeltaAttention, ShortConvolution, kda_config_from_hf

# --- ShortConvolution ----------------------------------------------------------------------------

BAD_CONV_CU = [
    ([0, 3], ValueError, r"cu_seqlens\[-1\] must equal T = 5, got 3"),
    ([0, 4, 2, 5], ValueError, r"cu_seqlens must be non-decreasing"),
    ([1, 5], ValueError, r"cu_seqlens\[0\] must be 0, got 1"),
    ([0], ValueError, r"cu_seqlens must have N \+ 1 >= 2 entries"),
    ([0, 7], ValueError, r"cu_seqlens\[-1\] must equal T = 5, got 7"),
]


@pytest.mark.parametrize("cu,exc,match", BAD_CONV_CU, ids=["short", "decreasing", "start", "one",
                                                           "past-end"])
def test_short_convolution_rejects_bad_cu_seqlens_eager_and_compiled(cu, exc, match):
    conv = ShortConvolution(4, 3)
    x = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(exc, match=match):
        conv(x, cu_seqlens=torch.tensor(cu))
    torch._dynamo.reset()
    with pytest.raises(exc, match=match):
        torch.compile(lambda x, c: conv(x, cu_seqlens=c), backend="eager")(x, torch.tensor(cu))


def test_short_convolution_rejects_cu_seqlens_types():
    conv = ShortConvolution(4, 3)
    x = torch.randn(1, 5, 4)
    with pytest.raises(TypeError, match="cu_seqlens"):
        conv(x, cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="B must be 1"):
        conv(torch.randn(2, 5, 4), cu_seqlens=torch.tensor([0, 5]))


def test_short_convolution_valid_packed_call_matches_per_sequence():
    conv = ShortConvolution(4, 3)
    x = torch.randn(1, 7, 4, generator=torch.Generator().manual_seed(2))
    y, _ = conv(x, cu_seqlens=torch.tensor([0, 3, 3, 7]))
    y0, _ = conv(x[:, :3])
    y1, _ = conv(x[:, 3:])
    assert rel_err(y, torch.cat([y0, y1], 1)) < 1e-6


# --- the layer: attention_mask, cu_seqlens as a list, fp32 until the norm ------------------------

def _layer(**kw):
    torch.manual_seed(3)
    return KimiDeltaAttention(hidden_size=16, head_dim=4, num_heads=2, backend="native", **kw)


def test_layer_attention_mask_follows_fla_convention_and_rejects_additive_masks():
    layer = _layer()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4))
    keep = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0: two left-padding slots
    with torch.no_grad():
        ref = layer(x, attention_mask=keep)
        for mask in (keep.bool(), keep.float()):  # 1/True = token, in any dtype
            assert torch.equal(layer(x, attention_mask=mask), ref)
        # the unpadded tokens give what the row alone gives; padding outputs zeros
        alone = layer(x[:1, 2:])
        assert rel_err(ref[:1, 2:], alone) < 1e-5 and (ref[0, :2] == 0).all()
        additive = torch.zeros(2, 6).masked_fill(keep == 0, float("-inf"))
        with pytest.raises(ValueError, match=r"attention_mask.*0/1.*additive mask"):
            layer(x, attention_mask=additive)
        with pytest.raises(ValueError, match=r"attention_mask.*0/1"):
            layer(x, attention_mask=keep * 2)


def test_layer_accepts_cu_seqlens_as_a_list():
    layer = _layer()
    x = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = layer(x, cu_seqlens=[0, 3, 7])
        b = layer(x, cu_seqlens=torch.tensor([0, 3, 7]))
        assert torch.equal(a, b)
        with pytest.raises(TypeError, match="cu_seqlens"):
            layer(x, cu_seqlens=[0, 3.5, 7])
        with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal T = 7"):
            layer(x, cu_seqlens=[0, 3, 6])


def test_layer_fp16_decode_with_large_state_is_finite_where_fp32_is():
    layer = _layer().eval()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 1, 16, generator=gen)
    state = torch.randn(1, 2, 4, 4, generator=gen) * 3e5  # finite in fp32, |o| >> fp16 max
    outs = {}
    for dtype in (torch.float32, torch.float16):
        cache = KDACache()
        cache.recurrent_state = state.clone()
        with torch.no_grad():
            outs[dtype] = layer(x.to(dtype), cache=cache)
    assert torch.isfinite(outs[torch.float32]).all()
    assert torch.isfinite(outs[torch.float16]).all()
    assert rel_err(outs[torch.float16], outs[torch.float32]) < 1e-2


# --- the Hugging Face converter --------------------------------------------------------------------

class _HFConfig:
    hidden_size, linear_num_heads, linear_head_dim, linear_conv_kernel_dim = 16, 2, 4, 4
    rms_norm_eps, hidden_act = 1e-5, "silu"


@pytest.mark.parametrize("override", [dict(lower_bound=-5.0, safe_gate=True),
                                      dict(allow_neg_eigval=True), dict(num_v_heads=4),
                                      dict(expand_v=2.0), dict(conv_bias=True)])
def test_hf_converter_rejects_overrides_that_change_the_function(override):
    with pytest.raises(ValueError, match=sorted(override)[0]):
        kda_config_from_hf(_HFConfig(), **override)


def test_hf_converter_accepts_overrides_that_keep_the_function():
    c = kda_config_from_hf(_HFConfig(), backend="reference", chunk_size=32, layer_idx=3, mode="chunk")
    assert isinstance(c, KDAConfig) and (c.backend, c.chunk_size, c.layer_idx) == ("reference", 32, 3)


# --- scale: one policy -----------------------------------------------------------------------------

def _fk_call(scale):
    gen = torch.Generator().manual_seed(7)
    B, T, H, D = 1, 5, 2, 4
    r = lambda *s: torch.randn(*s, generator=gen)
    return dict(q=r(B, T, H, D), k=r(B, T, H, D), v=r(B, T, H, D), g=r(B, T, H, D), beta=r(B, T, H),
                scale=scale, out=torch.empty(B, T, H, D), A_log=r(H), dt_bias=r(H, D),
                lower_bound=-5.0)


@pytest.mark.parametrize("scale,exc", [(math.nan, ValueError), (math.inf, ValueError),
                                       (-math.inf, ValueError), ("0.5", TypeError),
                                       (True, TypeError), (torch.tensor(0.5), TypeError)])
def test_scale_policy_is_the_same_in_every_entry_point(scale, exc):
    p = make_problem(B=1, T=5, H=2, K=4, V=4, seed=8, dtype=torch.float32)
    with pytest.raises(exc, match="scale"):
        fk.fwd(**_fk_call(scale), backend="native")
    for fn in (torch_kda.chunk_kda, torch_kda.fused_recurrent_kda):
        with pytest.raises(exc, match="scale"):
            fn(*p.args, **{**p.kwargs, "scale": scale})


@pytest.mark.parametrize("scale", [np.float32(0.4), np.float64(0.4), np.int64(1)])
def test_numpy_scalar_scale_is_accepted(scale):
    p = make_problem(B=1, T=5, H=2, K=4, V=4, seed=9, dtype=torch.float32)
    a, _ = torch_kda.chunk_kda(*p.args, **{**p.kwargs, "scale": scale})
    b, _ = torch_kda.chunk_kda(*p.args, **{**p.kwargs, "scale": float(scale)})
    assert torch.equal(a, b)
    fk.fwd(**_fk_call(scale), backend="native")


# --- FLA's extra keyword arguments -----------------------------------------------------------------

def test_chunk_kda_accepts_fla_cu_seqlens_cpu_and_disable_recompute():
    p = make_problem(seqlens=(3, 5), H=2, K=4, V=3, seed=10, dtype=torch.float32)
    cu = p.kwargs["cu_seqlens"]
    base, _ = torch_kda.chunk_kda(*p.args, **p.kwargs)
    for backend in ("native", "reference"):
        o, _ = torch_kda.chunk_kda(*p.args, **p.kwargs, cu_seqlens_cpu=cu.clone(),
                                   disable_recompute=True, backend=backend)
        assert rel_err(o, base) < 1e-5
    with pytest.raises(ValueError, match="cu_seqlens_cpu must hold the values of cu_seqlens"):
        torch_kda.chunk_kda(*p.args, **p.kwargs, cu_seqlens_cpu=torch.tensor([0, 4, 8]))
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu\[-1\] must equal T"):
        torch_kda.chunk_kda(*p.args, **{**p.kwargs, "cu_seqlens": torch.tensor([0, 3, 7])},
                            cu_seqlens_cpu=torch.tensor([0, 3, 7]))
    no_cu = {k: v for k, v in p.kwargs.items() if k not in ("cu_seqlens", "initial_state")}
    with pytest.raises(ValueError, match="cu_seqlens_cpu .* requires cu_seqlens"):
        torch_kda.chunk_kda(*p.args, **no_cu, cu_seqlens_cpu=cu)
    with pytest.raises(TypeError, match="disable_recompute"):
        torch_kda.chunk_kda(*p.args, **p.kwargs, disable_recompute="yes")


def test_chunk_kda_accepts_fla_graph_and_context_parallel_keywords():
    # fla-core 0.6's chunk_kda takes cp_context, use_graph and max_num_seqs: a call written for it
    # runs here with them at their CPU meaning (cp_context None; the graph arguments checked as
    # FLA checks them, the result unchanged).
    p = make_problem(seqlens=(3, 5), H=2, K=4, V=3, seed=13, dtype=torch.float32)
    base, _ = torch_kda.chunk_kda(*p.args, **p.kwargs)
    for backend in ("native", "reference"):
        o, _ = torch_kda.chunk_kda(*p.args, **p.kwargs, cp_context=None, use_graph=True,
                                   max_num_seqs=2, backend=backend)
        assert rel_err(o, base) < 1e-5
    with pytest.raises(ValueError, match="max_num_seqs=4 needs cu_seqlens of exactly"):
        torch_kda.chunk_kda(*p.args, **p.kwargs, use_graph=True, max_num_seqs=4)
    with pytest.raises(ValueError, match="cp_context .* backend='fla'"):
        torch_kda.chunk_kda(*p.args, **p.kwargs, cp_context=object())
    with pytest.raises(TypeError, match="use_graph must be a bool"):
        torch_kda.chunk_kda(*p.args, **p.kwargs, use_graph="yes")
    with pytest.raises(TypeError, match="max_num_seqs must be an int"):
        torch_kda.chunk_kda(*p.args, **p.kwargs, max_num_seqs=2.0)
    # a 2-D cu_seqlens gets its own shape error, not the count's
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        torch_kda.chunk_kda(*p.args, **{**p.kwargs, "cu_seqlens": p.kwargs["cu_seqlens"][None]},
                            use_graph=True, max_num_seqs=5)


def test_fla_positional_gate_parameters_get_a_pointed_error():
    # FLA 0.6's fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, ...): positionally,
    # A_log lands on torch-kda's scale; the error names the keyword form instead of only float().
    p = make_problem(B=1, T=5, H=2, K=4, V=4, seed=14, dtype=torch.float32, gate="softplus")
    kw = {k: v for k, v in p.kwargs.items() if k not in ("A_log", "dt_bias", "scale")}
    with pytest.raises(TypeError, match="A_log and dt_bias positionally before scale"):
        torch_kda.fused_recurrent_kda(*p.args, p.kwargs["A_log"], p.kwargs["dt_bias"], **{
            k: v for k, v in kw.items() if k != "initial_state"})
    with pytest.raises(TypeError, match=r"pass float\(scale\)$"):  # a 0-d tensor: no FLA hint
        torch_kda.fused_recurrent_kda(*p.args, **p.kwargs | {"scale": torch.tensor(0.3)})


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_layer_compiles_fullgraph_with_the_value_checks_in_place(backend):
    # The layer's call (in-op gate, sigmoid beta, l2 norm) has no data-dependent check to run, so
    # nothing leaves the graph.
    torch.manual_seed(11)
    layer = KimiDeltaAttention(hidden_size=16, head_dim=4, num_heads=2, backend=backend)
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(12))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert rel_err(compiled(x), layer(x)) < 1e-6
