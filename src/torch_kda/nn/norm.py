"""Gated RMSNorm of the KDA output (``o_norm``).

Parameters as flash-linear-attention's ``fla.modules.FusedRMSNormGated`` with
``activation="sigmoid"`` (``weight [D]`` initialised to ones, no bias); the formula is the one of
the Kimi Linear report (arXiv 2510.26692, output gate): normalise, scale, then gate.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..reference import sigmoid_accurate_slope

__all__ = ["GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """``y = x / sqrt(mean(x**2, -1) + eps) * weight * sigmoid(gate)`` over the last axis.

    The arithmetic is in fp32 (fp64 for fp64 inputs) whatever the dtypes of ``x``, ``gate`` and
    ``weight``; the result has ``x``'s dtype.

    Args:
        hidden_size: D, the normalised (last) axis.
        eps: added to the mean square (finite, > 0).
        elementwise_affine: learn ``weight [D]`` (ones at init).
        device, dtype: for the parameter.

    Raises:
        ValueError: ``eps`` not a finite number > 0 (an infinite one would zero every output).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
            raise ValueError(f"GatedRMSNorm: eps: expected a finite number > 0, got {eps!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.activation = "sigmoid"
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Args: ``x [..., D]``, ``gate`` of the same shape (the raw gate, before the sigmoid).

        Returns: ``[..., D]`` in ``x.dtype``.

        Raises: ValueError if the shapes differ or the last axis is not D.
        """
        if x.shape[-1] != self.hidden_size or gate.shape != x.shape:
            raise ValueError(
                f"GatedRMSNorm: x and gate expected the same shape [..., {self.hidden_size}], "
                f"got x {list(x.shape)} and gate {list(gate.shape)}"
            )
        cd = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(cd)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.to(cd)
        # its gradient keeps its precision where sigmoid(gate) rounds to 1 (reference.py)
        y = y * sigmoid_accurate_slope(gate.to(cd))
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, activation=sigmoid"
