"""The state pool of the serving arguments (docs/serving.md): where the sequences are, gather
the states they start from, scatter the states they end with. The one place of both, for every path that does not
read the pool inside a C++ kernel (the native chunkwise prefill and the reference).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ._checks import KDAInputs, ServingArgs


def sequences(x: KDAInputs) -> List[Tuple[int, int, int]]:
    """``(batch row, first token, end token)`` of every sequence, in order."""
    if x.cu_seqlens is None:
        return [(b, 0, x.T) for b in range(x.B)]
    bounds = x.seq_bounds
    return [(0, bounds[n], bounds[n + 1]) for n in range(x.N)]


def gather_states(x: KDAInputs, s: ServingArgs) -> Optional[torch.Tensor]:
    """The state each sequence starts from, as a fresh tensor (never a view of the pool).

    Returns ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``, the pool's layout) in
    the compute dtype (fp32, fp64 for fp64 inputs): row ``n`` is pool slot ``s.read_slots[n]``
    (with ``ssm_state_indices``), zeros for a pad sequence, or row ``n`` of ``initial_state``
    (without indices); None without ``initial_state``. A bf16 pool is widened here, once.
    """
    pool = x.initial_state
    if pool is None:
        return None
    dtype = x.compute_dtype
    if not s.uses_pool:
        return pool.to(dtype, copy=True)
    live = [n for n, slot in enumerate(s.read_slots) if slot is not None]
    slots = torch.tensor([s.read_slots[n] for n in live], dtype=torch.long, device=pool.device)
    if len(live) == x.N:  # index_select copies: the pool is written later
        return pool.index_select(0, slots).to(dtype)
    states = pool.new_zeros((x.N, *pool.shape[1:]), dtype=dtype)
    if live:
        states[live] = pool.index_select(0, slots).to(dtype)
    return states


def scatter_states(pool: torch.Tensor, slots: List[Optional[int]], states: torch.Tensor) -> None:
    """Write ``states[n]`` into pool slot ``slots[n]`` in place (None: nothing written).

    ``states`` is ``[len(slots), *pool.shape[1:]]`` (the pool's layout) in any float dtype; it is
    rounded once to the pool's dtype. Slots not named are not touched. Inference only (the checks
    of ``_checks.check_serving_inputs`` made sure nothing written requires grad).
    """
    rows = [n for n, slot in enumerate(slots) if slot is not None]
    if not rows:
        return
    idx = torch.tensor([slots[n] for n in rows], dtype=torch.long, device=pool.device)
    src = states if len(rows) == states.shape[0] else states[rows]
    with torch.no_grad():
        pool.index_copy_(0, idx, src.to(pool.dtype))
