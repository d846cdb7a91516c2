"""Configuration of the Kimi Delta Attention layer.

The fields and their defaults are those of the constructor of flash-linear-attention's
``fla.layers.kda.KimiDeltaAttention`` (facts read from its public source), plus ``backend`` and
``chunk_size``, which choose and tune the functional op that the layer calls.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["KDAConfig", "BACKENDS", "MODES"]

#: Backend names understood by :func:`torch_kda.chunk_kda` and the layer.
BACKENDS = ("auto", "native", "reference", "fla")
#: Kernel modes of FLA's layer: ``"chunk"`` (default) or ``"fused_recurrent"`` for inference.
MODES = ("chunk", "fused_recurrent")


def _bad(field: str, expected: str, actual: Any) -> ValueError:
    return ValueError(f"KDAConfig.{field}: expected {expected}, got {actual!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class KDAConfig:
    """Hyper-parameters of :class:`torch_kda.nn.KimiDeltaAttention`, validated on construction.

    Sizes (M = ``hidden_size``): the query/key heads are ``num_heads`` heads of ``head_dim`` (K);
    the value heads are ``num_v_heads`` heads (default ``num_heads``) of
    ``head_v_dim = head_dim * expand_v`` (V). ``num_v_heads > num_heads`` gives grouped value heads
    (GVA): value head ``hv`` reads query/key head ``hv // (num_v_heads // num_heads)``.

    Attributes:
        hidden_size: model width M (> 0).
        expand_v: value head size multiplier; ``head_dim * expand_v`` must be an integer (> 0).
        head_dim: query/key head size K (> 0).
        num_heads: number of query/key heads H (> 0).
        num_v_heads: number of value heads HV; ``None`` means ``num_heads``; must be a multiple of
            ``num_heads``.
        mode: ``"chunk"`` or ``"fused_recurrent"``: the op used for multi-token inference without
            gradients (training always uses the chunk op; single-token decoding always the
            recurrent one).
        use_short_conv: depthwise causal short convolutions (+ SiLU) on q, k, v; without them
            q, k, v get a plain SiLU.
        allow_neg_eigval: beta = 2 * sigmoid(b) in [0, 2) instead of sigmoid(b).
        safe_gate: the bounded gate with the chunk kernel's fast path; needs
            ``-5 <= lower_bound < 0``. Also initialises ``A_log`` to zeros (as FLA does).
        lower_bound: if set (< 0), the gate is ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``
            instead of ``-exp(A_log) * softplus(f + dt_bias)``.
        conv_size: short convolution kernel width W (> 0).
        conv_bias: bias in the short convolutions.
        layer_idx: index of the layer in a model (informational, as in FLA).
        norm_eps: epsilon of the gated output RMSNorm (finite, > 0).
        backend: ``"auto"``, ``"native"``, ``"reference"`` or ``"fla"`` (see
            :func:`torch_kda.chunk_kda`). ``"fla"`` needs CUDA and flash-linear-attention.
        chunk_size: chunk length of the chunkwise op (> 0; 32 or 64 for ``"fla"``).

    Raises:
        ValueError: on any invalid field; the message names the field, the expected and the actual
            value (``KDAConfig.num_v_heads: expected a multiple of num_heads=4, got 6``).
    """

    hidden_size: int = 2048
    expand_v: float = 1.0
    head_dim: int = 128
    num_heads: int = 16
    num_v_heads: int | None = None
    mode: str = "chunk"
    use_short_conv: bool = True
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    lower_bound: float | None = None
    conv_size: int = 4
    conv_bias: bool = False
    layer_idx: int | None = None
    norm_eps: float = 1e-5
    backend: str = "auto"
    chunk_size: int = 64

    def __post_init__(self) -> None:
        for name in ("hidden_size", "head_dim", "num_heads", "conv_size", "chunk_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise _bad(name, "a positive int", value)
        if self.num_v_heads is not None and (not _is_int(self.num_v_heads) or self.num_v_heads <= 0):
            raise _bad("num_v_heads", "a positive int or None", self.num_v_heads)
        if self.num_v_heads is not None and self.num_v_heads % self.num_heads != 0:
            raise _bad("num_v_heads", f"a multiple of num_heads={self.num_heads}", self.num_v_heads)
        if not _is_real(self.expand_v) or not (self.expand_v > 0 and math.isfinite(self.expand_v)):
            raise _bad("expand_v", "a positive finite number", self.expand_v)
        head_v = self.head_dim * self.expand_v
        if not math.isclose(head_v, round(head_v), rel_tol=1e-5) or round(head_v) <= 0:
            raise _bad(
                "expand_v",
                f"a value making head_dim * expand_v an integer (head_dim={self.head_dim})",
                self.expand_v,
            )
        if self.mode not in MODES:
            raise _bad("mode", f"one of {MODES}", self.mode)
        if self.backend not in BACKENDS:
            raise _bad("backend", f"one of {BACKENDS}", self.backend)
        for name in ("use_short_conv", "allow_neg_eigval", "safe_gate", "conv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "a bool", getattr(self, name))
        if self.lower_bound is not None:
            if not _is_real(self.lower_bound) or not (self.lower_bound < 0 and math.isfinite(self.lower_bound)):
                raise _bad("lower_bound", "None or a finite number < 0", self.lower_bound)
        if self.safe_gate and (self.lower_bound is None or not (-5 <= self.lower_bound < 0)):
            raise _bad("lower_bound", "-5 <= lower_bound < 0 because safe_gate=True", self.lower_bound)
        if not _is_real(self.norm_eps) or not (self.norm_eps > 0 and math.isfinite(self.norm_eps)):
            raise _bad("norm_eps", "a positive finite number", self.norm_eps)
        if self.layer_idx is not None and not _is_int(self.layer_idx):
            raise _bad("layer_idx", "an int or None", self.layer_idx)
        if self.backend == "fla" and self.chunk_size not in (32, 64):
            raise _bad("chunk_size", "32 or 64 with backend='fla'", self.chunk_size)

    # Derived sizes (FLA's attribute names).
    @property
    def head_k_dim(self) -> int:
        """K, the query/key head size."""
        return self.head_dim

    @property
    def head_v_dim(self) -> int:
        """V = head_dim * expand_v, the value head size."""
        return int(round(self.head_dim * self.expand_v))

    @property
    def n_v_heads(self) -> int:
        """HV, ``num_v_heads`` with ``None`` resolved to ``num_heads``."""
        return self.num_heads if self.num_v_heads is None else self.num_v_heads

    @property
    def key_dim(self) -> int:
        """H * K, width of the q and k projections."""
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """HV * V, width of the v projection and of the output gate."""
        return self.n_v_heads * self.head_v_dim

    @property
    def gate_dim(self) -> int:
        """HV * K, width of the forget-gate projection and of ``dt_bias``."""
        return self.n_v_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``KDAConfig(**cfg.to_dict()) == cfg``)."""
        return asdict(self)
