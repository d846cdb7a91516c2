"""Argument checking for the functional API: the one place where user input is validated.

Every public entry point (``torch_kda.chunk_kda``, ``torch_kda.fused_recurrent_kda``, the
reference functions, ``kda_gate``) funnels its arguments through :func:`check_kda_inputs` or
:func:`check_gate_args`, which raise ``TypeError``/``ValueError`` naming the argument, the
expected and the actual value (DESIGN.md, "Policies"), and return a normalised bundle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class KDAInputs:
    """Checked KDA arguments plus the sizes derived from them (B, T, H, K, HV, V, N)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    initial_state: Optional[torch.Tensor]
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    safe_gate: bool
    lower_bound: Optional[float]
    state_v_first: bool
    cu_seqlens: Optional[torch.Tensor]  # int64
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    chunk_size: int
    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int
    N: int

    @property
    def compute_dtype(self) -> torch.dtype:
        """float64 for float64 ``q``, float32 otherwise (DESIGN.md "Dtypes")."""
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    @property
    def seq_bounds(self) -> List[int]:
        """``cu_seqlens`` as Python ints (a host sync on CUDA)."""
        return [int(c) for c in self.cu_seqlens.tolist()]


def _require_tensor(name: str, x, ndim: Optional[int] = None, dtypes=_FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)} ({x.dim()}-D)")


def _require_shape(name: str, x: torch.Tensor, expected: tuple, meaning: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(expected)}, got {tuple(x.shape)}")


def _require_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {x.device}")


def _check_lower_bound(lower_bound, safe_gate: bool) -> Optional[float]:
    if lower_bound is None:
        if safe_gate:
            raise ValueError("safe_gate=True requires lower_bound in [-5, 0), got lower_bound=None")
        return None
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
    lb = float(lower_bound)
    if not (math.isfinite(lb) and lb < 0):
        raise ValueError(f"lower_bound must be a finite negative float, got {lb}")
    if safe_gate and lb < -5:
        raise ValueError(f"safe_gate=True requires -5 <= lower_bound < 0, got lower_bound={lb}")
    return lb


def _check_gate_params(g: torch.Tensor, A_log, dt_bias, lower_bound) -> None:
    HV, K = g.shape[-2], g.shape[-1]
    if A_log is None and lower_bound is None:
        raise ValueError(
            "the gate computed in the op needs A_log (softplus gate) or lower_bound (bounded gate); "
            "got A_log=None and lower_bound=None")
    if A_log is not None:
        _require_tensor("A_log", A_log)
        _require_shape("A_log", A_log, (HV,), "[HV]")
        _require_device("A_log", A_log, g.device)
    if dt_bias is not None:
        _require_tensor("dt_bias", dt_bias)
        if tuple(dt_bias.shape) not in ((HV * K,), (HV, K)):
            raise ValueError(
                f"dt_bias must have shape [HV * K] = ({HV * K},) or [HV, K] = ({HV}, {K}), "
                f"got {tuple(dt_bias.shape)}")
        _require_device("dt_bias", dt_bias, g.device)


def check_gate_args(g, A_log, dt_bias, lower_bound) -> None:
    """Check the arguments of :func:`torch_kda.kda_gate` (``g [..., HV, K]``)."""
    _require_tensor("g", g)
    if g.dim() < 2:
        raise ValueError(f"g must have at least 2 dims [..., HV, K], got shape {tuple(g.shape)}")
    _check_gate_params(g, A_log, dt_bias, _check_lower_bound(lower_bound, False))


def _check_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device) -> torch.Tensor:
    _require_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=_INT_DTYPES)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have N + 1 >= 2 entries, got {cu_seqlens.numel()}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size B must be 1 (pack the sequences), got B={B}")
    _require_device("cu_seqlens", cu_seqlens, device)
    if not torch.compiler.is_compiling():  # the value checks need the host; the native op re-checks
        values = cu_seqlens.tolist()
        if values[0] != 0:
            raise ValueError(f"cu_seqlens[0] must be 0, got {values[0]}")
        if values[-1] != T:
            raise ValueError(f"cu_seqlens[-1] must equal T={T}, got {values[-1]}")
        for i in range(len(values) - 1):
            if values[i + 1] < values[i]:
                raise ValueError(
                    f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={values[i]} > "
                    f"cu_seqlens[{i + 1}]={values[i + 1]}")
    return cu_seqlens.long()


def check_kda_inputs(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
    state_v_first, cu_seqlens, A_log, dt_bias, chunk_size: int = 64,
) -> KDAInputs:
    """Validate the arguments of ``chunk_kda``/``fused_recurrent_kda`` (see their docstrings).

    Raises:
        TypeError: a non-tensor or a non-floating tensor, ``q``/``k``/``v`` of different dtypes,
            non-integer ``cu_seqlens``.
        ValueError: any shape, device, ``cu_seqlens``, gate or flag inconsistency; the message names
            the argument, the expected and the actual value.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _require_tensor(name, x, ndim=4)
    _require_tensor("beta", beta, ndim=3)
    if not (k.dtype == q.dtype and v.dtype == q.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _require_shape("k", k, (B, T, H, K), "[B, T, H, K] of q")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have shape [B, T, HV, V] with B, T = {B}, {T} of q, got {tuple(v.shape)}")
    for dim_name, size, source in (("K", K, "q.shape[3]"), ("V", V, "v.shape[3]"), ("HV", HV, "v.shape[2]")):
        if size == 0:
            raise ValueError(f"the {dim_name} dimension ({source}) must be positive, got {dim_name}=0")
    if H == 0 or HV % H != 0:
        raise ValueError(f"the value heads HV must be a positive multiple of the query/key heads H, "
                         f"got HV={HV}, H={H} (from v.shape[2] and q.shape[2])")
    _require_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    _require_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    device = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_device(name, x, device)

    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")

    lower_bound = _check_lower_bound(lower_bound, safe_gate)
    if use_gate_in_kernel:
        _check_gate_params(g, A_log, dt_bias, lower_bound)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are only used with use_gate_in_kernel=True; got "
                         f"use_gate_in_kernel=False with A_log={'set' if A_log is not None else None}, "
                         f"dt_bias={'set' if dt_bias is not None else None}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                         "(beta = 2 * sigmoid(logits)); got use_beta_sigmoid_in_kernel=False")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")

    if cu_seqlens is not None:
        cu_seqlens = _check_cu_seqlens(cu_seqlens, B, T, device)
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None:
        _require_tensor("initial_state", initial_state, ndim=4)
        expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        meaning = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V]"
        _require_shape("initial_state", initial_state, expected, meaning)
        _require_device("initial_state", initial_state, device)

    return KDAInputs(q, k, v, g, beta, float(scale), initial_state, bool(output_final_state),
                     bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel),
                     bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), bool(safe_gate),
                     lower_bound, bool(state_v_first), cu_seqlens, A_log, dt_bias, chunk_size,
                     B, T, H, K, HV, V, N)
