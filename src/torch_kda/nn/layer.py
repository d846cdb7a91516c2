"""The Kimi Delta Attention layer: ``(B, T, M) -> (B, T, M)``.

Architecture (Kimi Linear report, arXiv 2510.26692, §3 and Fig. 1; parameter names, shapes and
initialisation as flash-linear-attention's ``fla.layers.kda.KimiDeltaAttention``, read for facts):

    q = SiLU(ShortConv(x W_q))              [.., H, K]    k likewise
    v = SiLU(ShortConv(x W_v))              [.., HV, V]
    f = (x W_f1) W_f2                       [.., HV, K]   low rank (rank V), raw forget gate
    b = x W_b                               [.., HV]      raw write strength
    o = KDA(q, k, v, f, b; A_log, dt_bias)  gate, L2 norm of q/k and sigmoid of b inside the op
    o = RMSNorm(o) * weight * sigmoid((x W_g1) W_g2 + b_g2)   per head
    y = o W_o

The gate math lives in one place, the functional op (:func:`torch_kda.chunk_kda` and
:func:`torch_kda.fused_recurrent_kda`), called with ``use_gate_in_kernel``,
``use_qk_l2norm_in_kernel`` and ``use_beta_sigmoid_in_kernel`` all true.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_kda as _kda

from .._checks import as_int, check_cu_seqlens
from .cache import KDACache
from .config import KDAConfig
from .conv import ShortConvolution
from .norm import GatedRMSNorm

__all__ = ["KimiDeltaAttention", "build_kda"]

# FLA's layer switches multi-token inference without gradients to the recurrent op up to this length.
_RECURRENT_MAX_LEN = 64


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    # Parameters may be kept in fp32 while activations are bf16/fp16: compute in the activation
    # dtype (autocast, when active, chooses its own dtype anyway). Gradients reach the fp32 weights.
    w = layer.weight.to(x.dtype)
    b = layer.bias.to(x.dtype) if layer.bias is not None else None
    return F.linear(x, w, b)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (KDA), the linear-attention token mixer of Kimi Linear.

    Weight-compatible with flash-linear-attention's ``fla.layers.kda.KimiDeltaAttention``: same
    constructor arguments, parameter names, shapes and initialisation, so an FLA layer's
    ``state_dict()`` loads here with ``strict=True`` (and back). Parameters:

    ============================  ==========================  =====================================
    name                          shape                       init
    ============================  ==========================  =====================================
    ``q_proj.weight``             ``[H*K, M]``                ``nn.Linear`` default
    ``k_proj.weight``             ``[H*K, M]``                ``nn.Linear`` default
    ``v_proj.weight``             ``[HV*V, M]``               ``nn.Linear`` default
    ``{q,k,v}_conv1d.weight``     ``[D, 1, conv_size]``       ``nn.Conv1d`` default (+ ``bias [D]``
                                                              with ``conv_bias``)
    ``f_proj.0.weight``           ``[V, M]``                  ``nn.Linear`` default
    ``f_proj.1.weight``           ``[HV*K, V]``               ``nn.Linear`` default
    ``b_proj.weight``             ``[HV, M]``                 ``nn.Linear`` default
    ``A_log``                     ``[HV]`` fp32               ``log U(1, 16)``; zeros if safe_gate
    ``dt_bias``                   ``[HV*K]`` fp32             softplus⁻¹(dt), dt = exp U(ln 1e-3,
                                                              ln 1e-1) clamped >= 1e-4
    ``g_proj.0.weight``           ``[V, M]``                  ``nn.Linear`` default
    ``g_proj.1.weight`` / bias    ``[HV*V, V]`` / ``[HV*V]``  ``nn.Linear`` default
    ``o_norm.weight``             ``[V]``                     ones
    ``o_proj.weight``             ``[M, HV*V]``               ``nn.Linear`` default
    ============================  ==========================  =====================================

    (M = hidden_size, H = num_heads, K = head_dim, HV = num_v_heads, V = head_dim * expand_v;
    the conv weights exist only with ``use_short_conv``.) ``A_log`` and ``dt_bias`` carry
    ``_no_weight_decay = True``, as in FLA.

    Args: see :class:`KDAConfig` (same names and defaults); invalid values raise the
    ``ValueError`` of :class:`KDAConfig`. ``backend="fla"`` imports FLA only when the layer runs.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1.0,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        backend: str = "auto",
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        cfg = KDAConfig(
            hidden_size=hidden_size, expand_v=expand_v, head_dim=head_dim, num_heads=num_heads,
            num_v_heads=num_v_heads, mode=mode, use_short_conv=use_short_conv,
            allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
            conv_size=conv_size, conv_bias=conv_bias, layer_idx=layer_idx, norm_eps=norm_eps,
            backend=backend, chunk_size=chunk_size,
        )
        self.config = cfg
        # FLA's attribute names.
        self.hidden_size = cfg.hidden_size
        self.expand_v = cfg.expand_v
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads
        self.num_v_heads = cfg.n_v_heads
        self.head_k_dim = cfg.head_k_dim
        self.head_v_dim = cfg.head_v_dim
        self.key_dim = cfg.key_dim
        self.value_dim = cfg.value_dim
        self.gate_dim = cfg.gate_dim
        self.mode = cfg.mode
        self.use_short_conv = cfg.use_short_conv
        self.conv_size = cfg.conv_size
        self.conv_bias = cfg.conv_bias
        self.allow_neg_eigval = cfg.allow_neg_eigval
        self.safe_gate = cfg.safe_gate
        self.lower_bound = cfg.lower_bound
        self.layer_idx = cfg.layer_idx
        self.backend = cfg.backend
        self.chunk_size = cfg.chunk_size

        M = self.hidden_size
        self.q_proj = nn.Linear(M, self.key_dim, bias=False)
        self.k_proj = nn.Linear(M, self.key_dim, bias=False)
        self.v_proj = nn.Linear(M, self.value_dim, bias=False)
        if self.use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, self.conv_size, bias=self.conv_bias, activation="silu")
            self.k_conv1d = ShortConvolution(self.key_dim, self.conv_size, bias=self.conv_bias, activation="silu")
            self.v_conv1d = ShortConvolution(self.value_dim, self.conv_size, bias=self.conv_bias, activation="silu")
        self.f_proj = nn.Sequential(
            nn.Linear(M, self.head_v_dim, bias=False),
            nn.Linear(self.head_v_dim, self.gate_dim, bias=False),
        )
        self.b_proj = nn.Linear(M, self.num_v_heads, bias=False)

        if self.safe_gate:
            A_log = torch.zeros(self.num_v_heads, dtype=torch.float32)
        else:
            A_log = torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(1, 16).log()
        self.A_log = nn.Parameter(A_log)
        self.A_log._no_weight_decay = True
        # dt log-uniform in [1e-3, 1e-1]; dt_bias = softplus^-1(dt) = dt + log(1 - exp(-dt)).
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(torch.rand(self.gate_dim, dtype=torch.float32) * (hi - lo) + lo).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True

        self.g_proj = nn.Sequential(
            nn.Linear(M, self.head_v_dim, bias=False),
            nn.Linear(self.head_v_dim, self.value_dim, bias=True),
        )
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=cfg.norm_eps)
        self.o_proj = nn.Linear(self.value_dim, M, bias=False)

    @classmethod
    def from_config(cls, config: KDAConfig) -> KimiDeltaAttention:
        """Build the layer from a :class:`KDAConfig` (same as :func:`build_kda`)."""
        if not isinstance(config, KDAConfig):
            raise TypeError(f"config: expected a KDAConfig, got {type(config).__name__}")
        return cls(**config.to_dict())

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden_size={c.hidden_size}, num_heads={c.num_heads}, num_v_heads={c.n_v_heads}, "
                f"head_dim={c.head_dim}, head_v_dim={c.head_v_dim}, backend={c.backend!r}")

    # ------------------------------------------------------------------------------------------
    def _fla_may_run(self, x: torch.Tensor) -> bool:
        return x.device.type == "cuda" and self.backend in ("auto", "fla")

    def _choose_op(self, T: int) -> str:
        # As FLA's layer: training and anything under autograd use the chunk op (FLA's recurrent op
        # has no backward); inference on short inputs (decoding) uses the recurrent op.
        if torch.is_grad_enabled():
            return "chunk"
        if T <= _RECURRENT_MAX_LEN and not self.training:
            return "fused_recurrent"
        return self.mode

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: KDACache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """Mix tokens with KDA.

        Args:
            hidden_states: ``[B, T, M]``, any floating dtype (bf16/fp16 activations work with fp32
                parameters: projections run in the activation dtype, the short convolutions, the
                gate, the L2 norms and the output RMSNorm in fp32).
            attention_mask: optional ``[B, T']`` padding mask in FLA's convention, ``T' >= T``
                (the last T columns are used, as with a Hugging Face mask that covers past tokens
                too): 1/True = token, 0/False = padding, on either side; bool, integer or float
                0/1. An additive mask (0 = keep, -inf = pad) is rejected with a ValueError. The
                tokens of each row are packed into one sequence (``cu_seqlens``), run, and
                scattered back; padded positions output zeros.
            cu_seqlens: optional ``[N + 1]`` int64/int32 offsets (a tensor, or a list of ints) of
                N sequences packed in a batch of one (``B == 1``), as in FLA; the short
                convolutions and the recurrence restart at each boundary. Not together with
                ``attention_mask``.
            cache: optional :class:`KDACache`, read (an empty one means "start from zeros") and
                updated in place with the conv states, the recurrent state (``[N, HV, V, K]``,
                fp32) and ``seen_tokens``. N = B, or the number of sequences in ``cu_seqlens``.
            use_cache: kept for FLA/Hugging Face call compatibility; the cache is updated whenever
                one is passed. ``use_cache=True`` without a cache is an error.

        Returns:
            ``[B, T, M]`` in the activation dtype. Unlike FLA's layer, which returns the tuple
            ``(output, None, past_key_values)``, only the output tensor is returned; the state
            lives in ``cache``.

        Raises:
            RuntimeError: ``backend="fla"`` with a non-CUDA input (checked first, before any
                projection runs); a backend that cannot run here (from the functional op).
            TypeError: ``cu_seqlens`` neither an int64/int32 tensor nor a list of ints;
                ``attention_mask`` not a tensor.
            ValueError: wrong shape of ``hidden_states`` or ``attention_mask``; an
                ``attention_mask`` with values other than 0/1 (e.g. an additive mask); bad
                ``cu_seqlens`` (the functional API's checks); both ``attention_mask`` and
                ``cu_seqlens``; ``use_cache=True`` without a cache; a cache holding a different
                number of sequences.
        """
        if self.backend == "fla" and hidden_states.device.type != "cuda":
            raise RuntimeError(
                f"KimiDeltaAttention(backend='fla') requires CUDA tensors (flash-linear-attention runs "
                f"on CUDA only), got hidden_states on {hidden_states.device}; use backend='native' "
                f"or 'reference' on this device"
            )
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states: expected shape [B, T, {self.hidden_size}], got {list(hidden_states.shape)}"
            )
        if use_cache and cache is None:
            raise ValueError("use_cache=True: expected a torch_kda.nn.KDACache passed as cache, got None")
        if cache is not None and not isinstance(cache, KDACache):
            raise TypeError(f"cache: expected a torch_kda.nn.KDACache, got {type(cache).__name__}")
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("attention_mask and cu_seqlens: expected at most one of them, got both")
        B, T, M = hidden_states.shape
        x = hidden_states

        indices = None
        if attention_mask is not None:
            keep = _padding_mask_keep(attention_mask, B, T).to(x.device)
            indices = keep.reshape(-1).nonzero().squeeze(1)
            cu_seqlens = F.pad(keep.sum(1).cumsum(0), (1, 0))
            x = x.reshape(B * T, M).index_select(0, indices).unsqueeze(0)
        elif cu_seqlens is not None:
            if isinstance(cu_seqlens, (list, tuple)):
                ints = [as_int(c) for c in cu_seqlens]
                if any(c is None for c in ints):
                    raise TypeError(f"cu_seqlens: expected a tensor or a list of ints, got {cu_seqlens!r}")
                cu_seqlens = torch.tensor(ints, dtype=torch.long, device=x.device)
            # the functional API's validator (the short convolutions and the op check it too)
            cu_seqlens = check_cu_seqlens(cu_seqlens, B, T, x.device)
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if cache is not None and not cache.is_empty and cache.num_sequences != N:
            raise ValueError(f"cache: expected state for {N} sequences, got {cache.num_sequences}")

        conv_in = cache.conv_state if cache is not None else None
        if self.use_short_conv:
            cq, ck, cv = conv_in if conv_in is not None else (None, None, None)
            want = cache is not None
            q, cq = self.q_conv1d(_linear(x, self.q_proj), cache=cq, output_final_state=want, cu_seqlens=cu_seqlens)
            k, ck = self.k_conv1d(_linear(x, self.k_proj), cache=ck, output_final_state=want, cu_seqlens=cu_seqlens)
            v, cv = self.v_conv1d(_linear(x, self.v_proj), cache=cv, output_final_state=want, cu_seqlens=cu_seqlens)
            conv_out = (cq, ck, cv) if want else None
        else:
            q = F.silu(_linear(x, self.q_proj))
            k = F.silu(_linear(x, self.k_proj))
            v = F.silu(_linear(x, self.v_proj))
            conv_out = None
        g = _linear(_linear(x, self.f_proj[0]), self.f_proj[1])
        beta = _linear(x, self.b_proj)

        lead = x.shape[:2]
        q = q.reshape(*lead, self.num_heads, self.head_k_dim)
        k = k.reshape(*lead, self.num_heads, self.head_k_dim)
        v = v.reshape(*lead, self.num_v_heads, self.head_v_dim)
        g = g.reshape(*lead, self.num_v_heads, self.head_k_dim)
        if q.dtype == torch.float16 and not self._fla_may_run(x):
            # The op computes in fp32 whatever its input dtype and returns o in q's dtype: fp16
            # inputs go in as fp32, so that o stays fp32 until the fp32 RMSNorm (an fp16 rounding
            # of o before the norm overflows for large states). bf16 has fp32's range: bf16
            # inputs go in as they are (half the bytes read; on CPUs with AMX or AVX-512 BF16, under
            # TORCH_KDA_CHUNK_PRODUCTS=bf16, `backend="auto"` can pick the chunk kernel's bf16
            # products, which the rule grants bf16 inputs only), as FLA's layer keeps the
            # activation dtype.
            q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))

        op_args = dict(
            q=q, k=k, v=v, g=g, beta=beta,
            A_log=self.A_log, dt_bias=self.dt_bias,
            initial_state=cache.recurrent_state if cache is not None else None,
            output_final_state=cache is not None,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval,
            lower_bound=self.lower_bound,
            state_v_first=True,
            cu_seqlens=cu_seqlens,
            backend=self.backend,
        )
        if self._choose_op(T) == "chunk":
            o, state = _kda.chunk_kda(**op_args, safe_gate=self.safe_gate, chunk_size=self.chunk_size)
        else:
            o, state = _kda.fused_recurrent_kda(**op_args)

        if cache is not None:
            cache.recurrent_state = state
            cache.conv_state = conv_out
            cache.seen_tokens += T

        gate = _linear(_linear(x, self.g_proj[0]), self.g_proj[1])
        o = self.o_norm(o, gate.reshape(*lead, self.num_v_heads, self.head_v_dim)).to(x.dtype)
        o = _linear(o.reshape(*lead, self.value_dim), self.o_proj)
        if indices is not None:
            o = o.new_zeros(B * T, M).index_copy(0, indices, o[0]).reshape(B, T, M)
        return o


def _padding_mask_keep(attention_mask, B: int, T: int) -> torch.Tensor:
    """``[B, T]`` bool "keep" of a padding mask in FLA's convention (1/True = token, 0 = padding).

    Raises:
        TypeError: not a tensor.
        ValueError: not ``[B, T']`` with ``T' >= T``; values other than 0/1 (an additive mask,
            0 = keep and -inf = pad, as Hugging Face attention uses, would keep the padding and
            drop the tokens: named, not guessed).
    """
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a [B, T'] tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(
            f"attention_mask: expected a [B, T'] padding mask with B={B}, T'>={T} "
            f"(1/True = token, 0/False = padding), got shape {list(attention_mask.shape)}"
        )
    m = attention_mask[:, attention_mask.shape[1] - T:]
    if m.dtype != torch.bool:
        bad = (m != 0) & (m != 1)
        if bool(bad.any()):
            value = m[bad][0].item()
            hint = (" (an additive mask, 0 = keep and -inf = pad? pass (mask == 0) instead)"
                    if m.is_floating_point() and value < 0 else "")
            raise ValueError(
                f"attention_mask: expected a padding mask of 0/1 or False/True "
                f"(1 = token, 0 = padding), got the value {value}{hint}")
    return m != 0


def build_kda(config: KDAConfig) -> KimiDeltaAttention:
    """Build a :class:`KimiDeltaAttention` from a validated :class:`KDAConfig`.

    Imports nothing from flash-linear-attention (even with ``backend="fla"``, FLA is imported by the
    functional op at the first forward).

    Raises:
        TypeError: ``config`` is not a :class:`KDAConfig`.
    """
    return KimiDeltaAttention.from_config(config)
