"""The ``"fla"`` backend: flash-linear-attention's Triton kernels on CUDA, imported lazily.

Nothing here imports ``fla`` at module import time, so CPU-only installs never load it.
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from ._checks import KDAInputs


_UNKNOWN = object()
_unavailable_reason = _UNKNOWN  # cached: both facts are fixed for the life of the process


def unavailable_reason() -> Optional[str]:
    """None when FLA can run here, else why not (checked without importing ``fla``)."""
    global _unavailable_reason
    if _unavailable_reason is _UNKNOWN:
        if importlib.util.find_spec("fla") is None:
            _unavailable_reason = "flash-linear-attention is not installed (pip install fla-core)"
        elif not torch.cuda.is_available():
            _unavailable_reason = "flash-linear-attention needs a CUDA device; none is available"
        else:
            _unavailable_reason = None
    return _unavailable_reason


def _kwargs(x: KDAInputs) -> dict:
    # FLA 0.6 asserts an fp32 initial state; ours may be any float dtype.
    initial_state = None if x.initial_state is None else x.initial_state.float()
    return dict(
        scale=x.scale, initial_state=initial_state, output_final_state=x.output_final_state,
        use_qk_l2norm_in_kernel=x.use_qk_l2norm_in_kernel, use_gate_in_kernel=x.use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=x.use_beta_sigmoid_in_kernel, allow_neg_eigval=x.allow_neg_eigval,
        lower_bound=x.lower_bound, state_v_first=x.state_v_first, cu_seqlens=x.cu_seqlens,
        A_log=x.A_log, dt_bias=None if x.dt_bias is None else x.dt_bias.reshape(-1),
    )


def _require_cuda(x: KDAInputs) -> None:
    if not x.q.is_cuda:
        raise RuntimeError(f"backend='fla' requires CUDA tensors (flash-linear-attention runs on GPUs); "
                           f"got q on {x.q.device}")
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"backend='fla' is unavailable: {reason}")


def chunk(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FLA's ``fla.ops.kda.chunk_kda`` with the same arguments."""
    _require_cuda(x)
    if x.chunk_size not in (32, 64):
        raise ValueError(f"backend='fla' supports chunk_size 32 or 64, got {x.chunk_size}")
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(x.q, x.k, x.v, x.g, x.beta, safe_gate=x.safe_gate,
                         chunk_size=x.chunk_size, **_kwargs(x))


def fused_recurrent(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FLA's ``fla.ops.kda.fused_recurrent_kda`` (forward only in FLA) with the same arguments."""
    _require_cuda(x)
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    return fla_fused_recurrent_kda(x.q, x.k, x.v, x.g, x.beta, **_kwargs(x))
