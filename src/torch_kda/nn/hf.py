"""Load the KDA weights of a Hugging Face ``transformers`` Kimi-Linear model into this layer.

``transformers`` (5.x) ships ``models/kimi_linear`` (``KimiLinearDeltaAttention``, the KDA layers
of moonshotai/Kimi-Linear-48B-A3B). Its parameters map one to one onto FLA's layout used here
(facts read from its public source):

==========================================  ==========================================
Hugging Face (``...self_attn.`` prefix)     torch_kda.nn.KimiDeltaAttention
==========================================  ==========================================
``q_proj / k_proj / v_proj .weight``        same names
``conv1d.weight [3*H*K, 1, W]`` (q;k;v)     ``q_conv1d / k_conv1d / v_conv1d .weight``
``forget_gate.f_a_proj.weight [K, M]``      ``f_proj.0.weight``
``forget_gate.f_b_proj.weight [H*K, K]``    ``f_proj.1.weight``
``forget_gate.A_log [1, 1, H, 1]``          ``A_log [H]``
``forget_gate.dt_bias [H*K]``               ``dt_bias``
``b_proj.weight``                           ``b_proj.weight``
``g_a_proj.weight / g_b_proj.weight``       ``g_proj.0.weight / g_proj.1.weight``
(no bias on ``g_b_proj``)                   ``g_proj.1.bias`` = zeros
``o_norm.weight``, ``o_proj.weight``        same names
==========================================  ==========================================

The Hugging Face layer has no grouped value heads, ``expand_v = 1``, no conv bias, the softplus
gate, beta = sigmoid (no negative eigenvalues), and its conv activation is ``config.hidden_act``
(SiLU in the released model). Nothing here imports ``transformers``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from .config import KDAConfig

__all__ = ["convert_hf_kimi_linear_state_dict", "kda_config_from_hf", "kda_from_hf_kimi_linear"]

_HF_KEYS = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "conv1d.weight",
    "forget_gate.f_a_proj.weight", "forget_gate.f_b_proj.weight", "forget_gate.A_log",
    "forget_gate.dt_bias", "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight",
    "o_norm.weight", "o_proj.weight",
)


# Fields that choose how the same function is computed; every other KDAConfig field is fixed by
# the Hugging Face layer (softplus gate, beta in [0, 1], no grouped heads...), and changing it
# would give a layer that computes another function than the weights were trained for.
_HF_FREE_FIELDS = ("backend", "chunk_size", "layer_idx", "mode")


def kda_config_from_hf(hf_config: Any, **overrides: Any) -> KDAConfig:
    """The :class:`KDAConfig` of the KDA layers of a Hugging Face ``KimiLinearConfig``.

    Reads ``hidden_size``, ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``,
    ``rms_norm_eps`` and ``hidden_act`` (duck-typed: any object with these attributes).
    ``overrides`` may set only the fields that do not change the function: ``backend``,
    ``chunk_size``, ``layer_idx`` and ``mode``.

    Raises:
        ValueError: ``hidden_act`` is not SiLU (this layer's short convolutions use SiLU); an
            override of another field (e.g. ``lower_bound``, ``safe_gate``, ``allow_neg_eigval``:
            Kimi-Linear has the softplus gate and beta in [0, 1]), named; an invalid resulting
            config (see :class:`KDAConfig`).
    """
    changed = sorted(k for k in overrides if k not in _HF_FREE_FIELDS)
    if changed:
        raise ValueError(
            f"overrides {changed}: the Hugging Face Kimi-Linear layer fixes these (softplus gate, "
            f"beta in [0, 1], no grouped value heads, its own sizes), so the converted layer would "
            f"compute another function; only {list(_HF_FREE_FIELDS)} may be overridden")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hf_config.hidden_act: expected 'silu' (the KDA short-conv activation), got {act!r}")
    fields: dict[str, Any] = dict(
        hidden_size=int(hf_config.hidden_size),
        num_heads=int(hf_config.linear_num_heads),
        head_dim=int(hf_config.linear_head_dim),
        num_v_heads=None,
        expand_v=1.0,
        conv_size=int(hf_config.linear_conv_kernel_dim),
        conv_bias=False,
        norm_eps=float(hf_config.rms_norm_eps),
    )
    fields.update(overrides)
    return KDAConfig(**fields)


def convert_hf_kimi_linear_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Map the weights of one Hugging Face ``KimiLinearDeltaAttention`` onto this layer's names.

    Args:
        hf_state_dict: the layer's ``state_dict()``, or a whole model's with ``prefix`` set to the
            layer's, e.g. ``"model.layers.0.self_attn."``. Keys outside ``prefix`` are ignored.
        prefix: prefix of the layer's keys.

    Returns:
        A state dict for ``KimiDeltaAttention(**kda_config_from_hf(cfg).to_dict())`` that loads with
        ``strict=True``; tensors keep their dtype (``A_log`` reshaped to ``[H]``, the conv weight
        split in q, k, v thirds, ``g_proj.1.bias`` zeros).

    Raises:
        KeyError: a required key is missing (the message names it).
        ValueError: inconsistent shapes (the conv weight is not three equal parts of ``[3*H*K, 1, W]``,
            ``A_log`` does not hold one value per head).
    """
    sd = {}
    for name in _HF_KEYS:
        key = prefix + name
        if key not in hf_state_dict:
            raise KeyError(f"hf_state_dict: missing {key!r} (expected the keys of a KimiLinearDeltaAttention)")
        sd[name] = hf_state_dict[key]
    qk = sd["q_proj.weight"].shape[0]
    vd = sd["v_proj.weight"].shape[0]
    conv = sd["conv1d.weight"]
    if conv.dim() != 3 or conv.shape[0] != 2 * qk + vd or conv.shape[1] != 1:
        raise ValueError(f"{prefix}conv1d.weight: expected shape [{2 * qk + vd}, 1, W], got {list(conv.shape)}")
    cq, ck, cv = torch.split(conv, [qk, qk, vd], dim=0)
    heads = sd["b_proj.weight"].shape[0]
    A_log = sd["forget_gate.A_log"].reshape(-1)
    if A_log.numel() != heads:
        raise ValueError(f"{prefix}forget_gate.A_log: expected {heads} values (one per head), "
                         f"got shape {list(sd['forget_gate.A_log'].shape)}")
    g_b = sd["g_b_proj.weight"]
    return {
        "q_proj.weight": sd["q_proj.weight"],
        "k_proj.weight": sd["k_proj.weight"],
        "v_proj.weight": sd["v_proj.weight"],
        "q_conv1d.weight": cq.clone(),
        "k_conv1d.weight": ck.clone(),
        "v_conv1d.weight": cv.clone(),
        "f_proj.0.weight": sd["forget_gate.f_a_proj.weight"],
        "f_proj.1.weight": sd["forget_gate.f_b_proj.weight"],
        "b_proj.weight": sd["b_proj.weight"],
        "A_log": A_log.clone(),
        "dt_bias": sd["forget_gate.dt_bias"].reshape(-1),
        "g_proj.0.weight": sd["g_a_proj.weight"],
        "g_proj.1.weight": g_b,
        "g_proj.1.bias": torch.zeros(g_b.shape[0], dtype=g_b.dtype, device=g_b.device),
        "o_norm.weight": sd["o_norm.weight"],
        "o_proj.weight": sd["o_proj.weight"],
    }


def kda_from_hf_kimi_linear(
    hf_layer: nn.Module | Mapping[str, torch.Tensor], hf_config: Any, prefix: str = "", **overrides: Any
) -> nn.Module:
    """Build a :class:`~torch_kda.nn.KimiDeltaAttention` holding the weights of a Hugging Face
    Kimi-Linear KDA layer (a ``KimiLinearDeltaAttention`` module, or a state dict + ``prefix``).

    ``overrides`` go to :func:`kda_config_from_hf` (only ``backend``, ``chunk_size``,
    ``layer_idx``, ``mode``; e.g. ``backend="native"``). The result computes
    the same function as the Hugging Face layer (its output tensor) in fp32/fp64; ``A_log`` and
    ``dt_bias`` are kept in fp32 (fp64 if given so), the rest in the dtype of the given weights.

    Raises: see :func:`kda_config_from_hf` and :func:`convert_hf_kimi_linear_state_dict`.
    """
    from .layer import KimiDeltaAttention

    sd = hf_layer.state_dict() if isinstance(hf_layer, nn.Module) else hf_layer
    config = kda_config_from_hf(hf_config, **overrides)
    layer = KimiDeltaAttention.from_config(config)
    converted = convert_hf_kimi_linear_state_dict(sd, prefix)
    ref = converted["q_proj.weight"]
    layer.to(device=ref.device)
    for name, p in layer.named_parameters():
        dtype = converted[name].dtype
        if name in ("A_log", "dt_bias"):
            dtype = torch.promote_types(dtype, torch.float32)
        p.data = p.data.to(dtype)
    layer.load_state_dict(converted, strict=True)
    return layer
