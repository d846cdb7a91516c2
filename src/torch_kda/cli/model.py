"""A small byte-level language model built from this package's :class:`KimiDeltaAttention`.

Pre-norm residual blocks, as in Kimi Linear's KDA layers (arXiv 2510.26692, §3)::

    x = embed(bytes)                                   [B, T, D]
    x = x + KDA(RMSNorm(x))                            token mixing (linear attention)
    x = x + W_2 SiLU(W_1 RMSNorm(x)) * W_3 RMSNorm(x)  SwiGLU MLP, per token
    logits = RMSNorm(x) E^T                            [B, T, 256], tied to the embedding
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn import KDACache, KimiDeltaAttention

__all__ = ["ByteLMConfig", "ByteLM", "VOCAB_SIZE"]

#: Bytes are the tokens.
VOCAB_SIZE = 256


@dataclass
class ByteLMConfig:
    """Sizes of :class:`ByteLM`.

    Attributes:
        dim: model width D.
        n_layers: number of blocks.
        num_heads: KDA heads H (head size ``head_dim``).
        head_dim: KDA key/value head size K = V.
        mlp_ratio: hidden width of the SwiGLU MLP as a multiple of D.
        backend: KDA backend, ``"auto"``, ``"native"`` or ``"reference"``.
        chunk_size: chunk length of the chunkwise op (32 is the fastest reference on CPU at
            these sizes).
    """

    dim: int = 128
    n_layers: int = 2
    num_heads: int = 2
    head_dim: int = 64
    mlp_ratio: float = 2.0
    backend: str = "auto"
    chunk_size: int = 32

    def to_dict(self) -> dict:
        return asdict(self)


class SwiGLU(nn.Module):
    """``W_2 (SiLU(W_1 x) * W_3 x)``, ``[..., D] -> [..., D]``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm block: KDA token mixer, then a SwiGLU MLP, each with a residual."""

    def __init__(self, cfg: ByteLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.attn = KimiDeltaAttention(hidden_size=cfg.dim, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                                       layer_idx=layer_idx, backend=cfg.backend,
                                       chunk_size=cfg.chunk_size)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.mlp = SwiGLU(cfg.dim, int(cfg.dim * cfg.mlp_ratio))

    def forward(self, x: torch.Tensor, cache: Optional[KDACache] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class ByteLM(nn.Module):
    """Byte-level causal LM: ``[B, T]`` int64 bytes -> ``[B, T, 256]`` next-byte logits.

    Args:
        cfg: the sizes (:class:`ByteLMConfig`).

    Raises:
        ValueError: invalid sizes or backend (from :class:`torch_kda.nn.KDAConfig`).
    """

    def __init__(self, cfg: ByteLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB_SIZE, cfg.dim)
        nn.init.normal_(self.embed.weight, std=cfg.dim ** -0.5)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)

    def new_caches(self) -> List[KDACache]:
        """One empty :class:`KDACache` per block, for prefill + decoding."""
        return [KDACache() for _ in self.blocks]

    def forward(self, tokens: torch.Tensor, caches: Optional[List[KDACache]] = None) -> torch.Tensor:
        """Next-byte logits.

        Args:
            tokens: ``[B, T]`` integer bytes in ``[0, 256)``.
            caches: None, or one :class:`KDACache` per block (from :meth:`new_caches`), read and
                updated in place: prefill with the prompt, then feed one token at a time.

        Returns:
            ``[B, T, 256]`` float32 logits.
        """
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if caches is None else caches[i])
        return F.linear(self.norm(x), self.embed.weight)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n_new: int, temperature: float = 0.8, top_k: int = 40,
                 generator: Optional[torch.Generator] = None):
        """Sample ``n_new`` bytes after ``prompt`` with the decoding cache (one token per step).

        Args:
            prompt: ``[1, P]`` int64 bytes, ``P >= 1``.
            n_new: number of bytes to sample (>= 1).
            temperature, top_k: sampling controls.
            generator: optional RNG for reproducible sampling.

        Returns:
            ``(tokens [1, P + n_new], logits [1, P + n_new - 1, 256])``: the sampled sequence and
            the logits the cached path produced for positions ``0 .. P + n_new - 2`` (the prefill
            logits, then one per decoding step), for comparison with a full forward.
        """
        caches = self.new_caches()
        logits = [self(prompt, caches)]
        tokens = [prompt]
        for step in range(n_new):
            last = logits[-1][:, -1].float() / temperature
            if top_k:
                kth = last.topk(min(top_k, last.shape[-1]), dim=-1).values[:, -1:]
                last = last.masked_fill(last < kth, float("-inf"))
            nxt = torch.multinomial(last.softmax(-1), 1, generator=generator)
            tokens.append(nxt)
            if step < n_new - 1:
                logits.append(self(nxt, caches))
        return torch.cat(tokens, dim=1), torch.cat(logits, dim=1)
