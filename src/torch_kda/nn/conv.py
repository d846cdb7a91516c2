"""Depthwise causal short convolution with a decoding cache, in plain PyTorch.

Same parameters as flash-linear-attention's ``fla.modules.ShortConvolution`` (an ``nn.Conv1d``
with ``groups = channels``, ``weight [D, 1, W]``, optional ``bias [D]``) and the same cache
layout ``[N, D, W]``: the last W inputs of each sequence, oldest first, most recent at index
``W - 1`` (only the last ``W - 1`` are read; the full width keeps FLA's layout).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_cu_seqlens

__all__ = ["ShortConvolution"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 arithmetic for bf16/fp16/fp32 activations, fp64 for fp64.
    return torch.promote_types(dtype, torch.float32)


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over time, optionally followed by SiLU.

    ``y[t, d] = act(bias[d] + sum_{w < W} weight[d, 0, w] * x[t - W + 1 + w, d])`` with inputs before
    the start of a sequence taken from ``cache`` (zeros without one). Arithmetic is in fp32 (fp64
    for fp64 inputs), whatever the dtype of the input and of the parameters; the output has the
    input's dtype. Gradients flow to the input, the parameters and the cache.

    Args:
        hidden_size: channels D.
        kernel_size: width W (>= 1).
        bias: learn a per-channel bias.
        activation: ``"silu"`` (alias ``"swish"``) or ``None``.
        device, dtype: for the parameters.

    Raises:
        ValueError: unknown activation.
    """

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int,
        bias: bool = False,
        activation: str | None = "silu",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_channels=hidden_size,
            out_channels=hidden_size,
            kernel_size=kernel_size,
            padding=kernel_size - 1,
            groups=hidden_size,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"ShortConvolution.activation: expected 'silu', 'swish' or None, got {activation!r}")
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(
        self,
        x: torch.Tensor,
        cache: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Convolve ``x`` causally, continuing from ``cache``.

        Args:
            x: ``[B, T, D]``; with ``cu_seqlens``, ``B == 1`` and the N packed sequences restart
                the convolution at their boundaries.
            cache: ``[N, D, W]`` (N = B, or ``len(cu_seqlens) - 1``), the last W inputs before
                this call, as returned by a previous call; ``None`` means zeros. Not modified.
            output_final_state: also return the new cache.
            cu_seqlens: ``[N + 1]`` int64/int32 offsets of packed sequences on ``x``'s device
                (``B == 1``, starts at 0, non-decreasing, ends at T; zero lengths allowed: the
                cache of such a sequence passes through unchanged). Checked by the functional
                API's validator, eagerly and under ``torch.compile``.

        Returns:
            ``(y, final_state)``: ``y [B, T, D]`` in ``x.dtype``; ``final_state [N, D, W]`` in
            ``x.dtype`` (the last W inputs of each sequence, cache included), or ``None``.

        Raises:
            TypeError: ``cu_seqlens`` not an int64/int32 tensor.
            ValueError: wrong shapes of ``x`` or ``cache``; ``cu_seqlens`` not 1-D, with fewer
                than 2 entries, ``B != 1``, on another device, not starting at 0, decreasing or
                not ending at T.
        """
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"ShortConvolution: x expected [B, T, {self.hidden_size}], got {list(x.shape)}")
        B, T, D = x.shape
        W = self.kernel_size[0]
        if cu_seqlens is not None:
            # The functional API's validator (same errors); the values are checked also under
            # torch.compile (outside the graph), since the gather below would silently read
            # another sequence's tokens (or fail with an IndexError) for bad offsets.
            cu_seqlens = check_cu_seqlens(cu_seqlens, B, T, x.device, compiled_too=True)
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if cache is not None and tuple(cache.shape) != (N, D, W):
            raise ValueError(f"ShortConvolution: cache expected shape {[N, D, W]}, got {list(cache.shape)}")

        cd = _compute_dtype(x.dtype)
        weight = self.weight[:, 0, :].to(cd)  # [D, W]
        hist = x.new_zeros(N, W, D, dtype=cd) if cache is None else cache.transpose(1, 2).to(cd)

        if cu_seqlens is None:
            ext = torch.cat([hist, x.to(cd)], dim=1)  # [B, W + T, D]
            y = ext[:, 1 : 1 + T] * weight[:, 0]
            for w in range(1, W):
                y = y + ext[:, 1 + w : 1 + w + T] * weight[:, w]
            final = ext[:, ext.shape[1] - W :].transpose(1, 2) if output_final_state else None
        else:
            # Packed: one buffer [history of the N sequences (N * W rows); the T tokens], and for
            # every token and tap the row it reads (its own sequence or that sequence's history).
            cu = cu_seqlens.to(device=x.device, dtype=torch.long)
            ext = torch.cat([hist.reshape(N * W, D), x[0].to(cd)], dim=0)
            pos = torch.arange(T, device=x.device)
            seq = torch.searchsorted(cu[1:], pos, right=True)
            local = pos - cu[seq]

            def source(n: torch.Tensor, start: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
                return torch.where(j >= 0, N * W + start + j, n * W + W + j)

            y = None
            for w in range(W):
                j = local - (W - 1) + w
                term = ext[source(seq, cu[seq], j)] * weight[:, w]
                y = term if y is None else y + term
            y = y.unsqueeze(0) if T > 0 else x.new_zeros(1, 0, D, dtype=cd)
            final = None
            if output_final_state:
                n = torch.arange(N, device=x.device)[:, None]
                j = (cu[1:] - cu[:-1])[:, None] - W + torch.arange(W, device=x.device)[None, :]
                final = ext[source(n, cu[:-1][:, None], j)].transpose(1, 2)  # [N, D, W]
        if self.bias is not None:
            y = y + self.bias.to(cd)
        if self.activation is not None:
            y = F.silu(y)
        return y.to(x.dtype), (final.to(x.dtype) if final is not None else None)
