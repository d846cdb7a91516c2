"""The ``"fla"`` backend: flash-linear-attention's Triton kernels on CUDA, imported lazily.

Nothing here imports ``fla`` at module import time, so CPU-only installs never load it.
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from ._checks import KDAInputs


def unavailable_reason() -> Optional[str]:
    """None when FLA can run here, else why not (checked without importing ``fla``)."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed (pip install fla-core)"
    if not torch.cuda.is_available():
        return "flash-linear-attention needs a CUDA device; none is available"
    return None


def _kwargs(x: KDAInputs) -> dict:
    return dict(
        scale=x.scale, initial_state=x.initial_state, output_final_state=x.output_final_state,
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
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(x.q, x.k, x.v, x.g, x.beta, safe_gate=x.safe_gate,
                         chunk_size=x.chunk_size, **_kwargs(x))


def fused_recurrent(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FLA's ``fla.ops.kda.fused_recurrent_kda`` (forward only in FLA) with the same arguments."""
    _require_cuda(x)
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    return fla_fused_recurrent_kda(x.q, x.k, x.v, x.g, x.beta, **_kwargs(x))
