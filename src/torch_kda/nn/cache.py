"""Decoding cache of one :class:`~torch_kda.nn.KimiDeltaAttention` layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KDACache"]


@dataclass
class KDACache:
    """State carried between calls of one KDA layer (prefill, then decoding), updated in place.

    Pass a fresh ``KDACache()`` as ``cache=`` to the prefill call; the layer fills it, and each later
    call reads it and replaces its fields with the new state, so that prefill followed by
    token-by-token decoding gives the outputs of one forward over the whole sequence. A model keeps
    one cache per KDA layer. Row ``n`` of every tensor belongs to sequence ``n`` of the batch (or of
    ``cu_seqlens``); the number of sequences must stay the same between calls.

    Attributes:
        conv_state: ``(q, k, v)`` short-convolution states, ``[N, key_dim, W]``, ``[N, key_dim, W]``,
            ``[N, value_dim, W]``, each the last W projected inputs of the sequence (FLA's layout),
            in the activation dtype; ``None`` before the first call or without short convolutions.
        recurrent_state: ``[N, HV, V, K]`` (``state_v_first`` layout, as FLA's layer), fp32
            (fp64 for fp64 activations); ``None`` before the first call.
        seen_tokens: number of time steps (padding included) processed so far.
    """

    conv_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    recurrent_state: torch.Tensor | None = None
    seen_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """True before the first call (nothing stored yet)."""
        return self.recurrent_state is None and self.conv_state is None

    @property
    def num_sequences(self) -> int | None:
        """N, the number of sequences held, or ``None`` when empty."""
        if self.recurrent_state is not None:
            return int(self.recurrent_state.shape[0])
        if self.conv_state is not None:
            return int(self.conv_state[0].shape[0])
        return None

    def reset(self) -> None:
        """Forget everything (start a new batch of sequences)."""
        self.conv_state = None
        self.recurrent_state = None
        self.seen_tokens = 0

    def detach_(self) -> KDACache:
        """Cut the stored tensors from the autograd graph (truncated BPTT); returns ``self``."""
        if self.recurrent_state is not None:
            self.recurrent_state = self.recurrent_state.detach()
        if self.conv_state is not None:
            self.conv_state = tuple(c.detach() for c in self.conv_state)  # type: ignore[assignment]
        return self

    def reorder_(self, index: torch.Tensor) -> KDACache:
        """Keep/reorder the sequences along the batch axis (beam search): row ``i`` becomes row
        ``index[i]`` of the old state. Returns ``self``.

        Args:
            index: ``[N']`` int64 or int32 tensor of rows of the held batch, ``0 <= index[i] < N``;
                rows may repeat (beams that share a parent) or be left out (N' may differ from N).

        Raises:
            TypeError: ``index`` is not an integer tensor.
            ValueError: ``index`` is not 1-D, or an entry is outside ``[0, N)``; the cache is left
                unchanged.
        """
        if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32):
            what = index.dtype if isinstance(index, torch.Tensor) else type(index).__name__
            raise TypeError(f"index must be an int64 or int32 tensor, got {what}")
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D [N'], got shape {tuple(index.shape)}")
        held = self.num_sequences
        if held is not None and index.numel() and not (0 <= int(index.min()) and int(index.max()) < held):
            bad = index[(index < 0) | (index >= held)][0]
            raise ValueError(f"index entries must be rows 0 <= i < N = {held} of the cache, got {int(bad)}")
        if self.recurrent_state is not None:
            self.recurrent_state = self.recurrent_state.index_select(0, index.to(self.recurrent_state.device))
        if self.conv_state is not None:
            self.conv_state = tuple(c.index_select(0, index.to(c.device)) for c in self.conv_state)  # type: ignore[assignment]
        return self
