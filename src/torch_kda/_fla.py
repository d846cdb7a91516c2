"""The ``"fla"`` backend: flash-linear-attention's Triton kernels on CUDA, imported lazily.

Nothing here imports ``fla`` at module import time, so CPU-only installs never load it.
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from ._checks import KDAInputs, ServingArgs, check_value_domain


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
    # FLA checks no values: the same domain checks as the reference (host syncs), and under
    # torch.compile the cu_seqlens values too (check_kda_inputs leaves them to the consumer).
    check_value_domain(x)
    if x.cu_seqlens is not None and torch.compiler.is_compiling():
        x.seq_bounds  # reads (and so checks) the values


def chunk(x: KDAInputs, cu_seqlens_cpu: Optional[torch.Tensor] = None,
          disable_recompute: bool = False, cp_context: object = None, use_graph: bool = False,
          max_num_seqs: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FLA's ``fla.ops.kda.chunk_kda`` with the same arguments (``cp_context``, ``use_graph``,
    ``max_num_seqs`` passed only where not at their defaults, so FLA releases without them keep
    working)."""
    _require_cuda(x)
    if x.chunk_size not in (32, 64):
        raise ValueError(f"backend='fla' supports chunk_size 32 or 64, got {x.chunk_size}")
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    extra = dict(cp_context=cp_context) if cp_context is not None else {}
    if use_graph:
        extra["use_graph"] = True
    if max_num_seqs is not None:
        extra["max_num_seqs"] = max_num_seqs
    return fla_chunk_kda(x.q, x.k, x.v, x.g, x.beta, safe_gate=x.safe_gate,
                         chunk_size=x.chunk_size, cu_seqlens_cpu=cu_seqlens_cpu,
                         disable_recompute=disable_recompute, **extra, **_kwargs(x))


def fused_recurrent(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FLA's ``fla.ops.kda.fused_recurrent_kda`` (forward only in FLA) with the same arguments."""
    _require_cuda(x)
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    return fla_fused_recurrent_kda(x.q, x.k, x.v, x.g, x.beta, **_kwargs(x))


# ---- serving arguments (docs/serving.md) -------------------------------------------------------

def _flags(x: KDAInputs) -> dict:
    return dict(scale=x.scale, use_qk_l2norm_in_kernel=x.use_qk_l2norm_in_kernel,
                use_gate_in_kernel=x.use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=x.use_beta_sigmoid_in_kernel,
                allow_neg_eigval=x.allow_neg_eigval, lower_bound=x.lower_bound,
                state_v_first=x.state_v_first, cu_seqlens=x.cu_seqlens, A_log=x.A_log,
                dt_bias=None if x.dt_bias is None else x.dt_bias.reshape(-1))


def _gathered_state(x: KDAInputs, s: ServingArgs) -> Optional[torch.Tensor]:
    """Each sequence's starting state as an fp32 ``[N, ...]`` tensor (zeros for pad sequences)."""
    pool = x.initial_state
    if pool is None:
        return None
    if not s.uses_pool:
        return pool.float()
    shape = pool.shape[1:]
    rows = [pool[r].float() if r is not None else pool.new_zeros(shape, dtype=torch.float32)
            for r in s.read_slots]
    return torch.stack(rows) if rows else pool.new_zeros((0, *shape), dtype=torch.float32)


def _finish(x: KDAInputs, s: ServingArgs, o: torch.Tensor, final: torch.Tensor):
    """Zero pad outputs, scatter final states into the pool (in place), fill ``out``."""
    bounds = (x.seq_bounds if x.cu_seqlens is not None else None)
    for n, pad in enumerate(s.is_pad):
        if pad:
            if bounds is None:
                o[n].zero_()
            else:
                o[0, bounds[n]:bounds[n + 1]].zero_()
            final[n].zero_()
    if s.final_slots is not None:
        pool = x.initial_state
        for n, slot in enumerate(s.final_slots):
            if slot is not None:
                pool[slot].copy_(final[n])
    if s.out is not None:
        s.out.copy_(o)
        o = s.out
    if s.inplace_final_state:
        return o, x.initial_state
    return o, (final if x.output_final_state else None)


def serving(x: KDAInputs, s: ServingArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The serving arguments through FLA's ``fused_recurrent_kda_fwd``.

    Calls FLA's continuous-batching kernel directly where its semantics are ours (2-D indices;
    1-D indices with one token per sequence) and no pad slot is involved: FLA 0.6's kernel does not
    skip pad slots (it would read and write slot ``pad_slot_id``). Otherwise (pad slots, 1-D indices
    with longer sequences: FLA would write each token's state to ``indices[n + t]``) it gathers the
    states, calls FLA without indices and scatters the final states back.
    """
    _require_cuda(x)
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    has_pad = any(s.is_pad) or (s.snapshot_slots is not None and
                                any(slot is None for row in s.snapshot_slots for slot in row))
    if s.snapshot_slots is not None:
        if has_pad:
            raise ValueError("backend='fla': FLA's fused_recurrent_kda_fwd does not skip pad slots "
                             "in 2-D ssm_state_indices (it would write slot pad_slot_id); use "
                             "backend='native' or 'reference' for calls with pad entries")
        o, _ = fused_recurrent_kda_fwd(
            x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state, output_final_state=False,
            inplace_final_state=True, ssm_state_indices=s.ssm_state_indices,
            num_accepted_tokens=s.num_accepted_tokens, out=s.out, **_flags(x))
        return o, x.initial_state
    if s.uses_pool and not has_pad and all(t == 1 for t in s.seq_lens):
        o, final = fused_recurrent_kda_fwd(
            x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state, output_final_state=True,
            inplace_final_state=s.inplace_final_state, ssm_state_indices=s.ssm_state_indices,
            out=s.out, **_flags(x))
        if s.inplace_final_state:
            return o, x.initial_state
        return o, (final if x.output_final_state else None)
    o, final = fused_recurrent_kda_fwd(
        x.q, x.k, x.v, x.g, x.beta, initial_state=_gathered_state(x, s), output_final_state=True,
        inplace_final_state=False, **_flags(x))
    return _finish(x, s, o, final)


def serving_chunk(x: KDAInputs, s: ServingArgs):
    """``chunk_kda`` with a state pool through FLA's ``chunk_kda`` (which takes no slot indices):
    gather the states, run, scatter back; ``return_intermediate_states`` in fp32."""
    _require_cuda(x)
    if x.chunk_size not in (32, 64):
        raise ValueError(f"backend='fla' supports chunk_size 32 or 64, got {x.chunk_size}")
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    kw = _kwargs(x)
    kw.update(initial_state=_gathered_state(x, s), output_final_state=True)
    if s.return_intermediate_states:
        with torch.inference_mode():
            o, final, h = fla_chunk_kda(x.q, x.k, x.v, x.g, x.beta, safe_gate=x.safe_gate,
                                        chunk_size=x.chunk_size, return_intermediate_states=True, **kw)
        o, final, h = o.clone(), final.clone(), h.float().clone()
        starts = [0]
        for T_n in s.seq_lens:
            starts.append(starts[-1] + -(-T_n // x.chunk_size))
        flat = h.reshape(-1, *h.shape[2:])
        for n, pad in enumerate(s.is_pad):
            if pad:
                flat[starts[n]:starts[n + 1]].zero_()
        return (*_finish(x, s, o, final), h)
    o, final = fla_chunk_kda(x.q, x.k, x.v, x.g, x.beta, safe_gate=x.safe_gate,
                             chunk_size=x.chunk_size, **kw)
    return _finish(x, s, o, final)
