"""MoonshotAI FlashKDA's ``flash_kda.fwd``, runnable on any device.

``fwd`` keeps FlashKDA's signature and contract (facts from its public README, its Python wrapper
and its test oracle; no code is taken from it):

- inputs ``q, k, v, g`` are ``[B, T, H, D]`` (``D = K = V``, 128 in FlashKDA; no grouped value
  heads), ``beta`` is ``[B, T, H]``; all bfloat16 in FlashKDA;
- everything is computed in the op: ``q`` and ``k`` are L2-normalised
  (``x / sqrt(sum x^2 + 1e-6)``), then ``q`` is scaled by ``scale``; ``beta = sigmoid(beta)``
  (logits in, no ``2 *`` variant); the gate is the bounded one,
  ``g = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :]))``, per channel, in
  ``[lower_bound, 0]``;
- the recurrent state is V-first, ``[N, H, V, K]``, bf16 or fp32 (both states of one dtype),
  ``N = B`` or the number of sequences in ``cu_seqlens`` (int64 ``[N + 1]``, then ``B == 1``);
- ``out`` ``[B, T, H, V]`` and ``final_state`` are written in place; the function returns None;
- inference only: no gradients flow through it.

In :func:`torch_kda.chunk_kda`'s terms that is ``use_qk_l2norm_in_kernel=True``,
``use_gate_in_kernel=True``, ``use_beta_sigmoid_in_kernel=True``, ``safe_gate=True``,
``lower_bound=lower_bound``, ``state_v_first=True`` (docs/math.md, "Gates").

Dispatch (``backend="auto"``): the real ``flash_kda.fwd`` when the package is importable and the
call qualifies (CUDA tensors on an SM90+ GPU, bf16 inputs, ``D == 128``, fp32 ``A_log``/``dt_bias``,
bf16/fp32 states); otherwise :func:`torch_kda.chunk_kda` with ``backend="auto"`` (the native C++ op
on CPU, FLA or the reference on CUDA). The fallback also accepts fp16/fp32/fp64 inputs, any
``D``, ``dt_bias`` as ``[H * D]``, int32 ``cu_seqlens`` and ``scale=None`` (``D ** -0.5``).
``TORCH_KDA_FLASH_KDA=0`` keeps ``"auto"`` off FlashKDA.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .._checks import check_cu_seqlens, check_no_aliasing, check_scale

__all__ = ["fwd", "flash_kda_unavailable_reason", "BACKENDS"]

#: Values of ``fwd(..., backend=)``: ``"auto"``; ``"flash_kda"`` (FlashKDA or an error); or a
#: :func:`torch_kda.chunk_kda` backend used directly.
BACKENDS = ("auto", "flash_kda", "native", "reference", "fla")

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
_PARAM_DTYPES = (torch.float32, torch.float64)
FLASH_KDA_HEAD_DIM = 128


@dataclass(frozen=True)
class _Call:
    """Checked arguments of one ``fwd`` call plus the derived sizes."""

    B: int
    T: int
    H: int
    D: int
    N: int
    scale: float
    lower_bound: float
    cu_seqlens: Optional[torch.Tensor]


def _tensor(name: str, x, ndim: int, dtypes=_FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)} ({x.dim()}-D)")


def _same_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {x.device}")


def _check(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
           cu_seqlens) -> _Call:
    """Validate a ``fwd`` call; raise TypeError/ValueError naming the argument."""
    _tensor("q", q, 4)
    B, T, H, D = q.shape
    for name, x in (("k", k), ("v", v), ("g", g), ("out", out)):
        _tensor(name, x, 4)
        if tuple(x.shape) != (B, T, H, D):
            raise ValueError(f"{name} must have the shape [B, T, H, D] of q = {(B, T, H, D)}, "
                             f"got {tuple(x.shape)} (FlashKDA has K = V and no grouped value heads)")
    _tensor("beta", beta, 3)
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must have shape [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}; FlashKDA takes bfloat16), "
                            f"got {x.dtype}")
        _same_device(name, x, q.device)
    if H == 0 or D == 0:
        raise ValueError(f"q must have at least one head and a non-empty head dim, got shape {(B, T, H, D)}")

    scale = check_scale(scale, D, q.dtype)  # the functional API's rule: TypeError for types, ValueError for NaN/inf

    _tensor("A_log", A_log, 1, _PARAM_DTYPES)
    if tuple(A_log.shape) != (H,):
        raise ValueError(f"A_log must have shape [H] = ({H},), got {tuple(A_log.shape)}")
    _same_device("A_log", A_log, q.device)
    if not isinstance(dt_bias, torch.Tensor):
        raise TypeError(f"dt_bias must be a torch.Tensor, got {type(dt_bias).__name__}")
    if dt_bias.dtype not in _PARAM_DTYPES:
        raise TypeError(f"dt_bias must have a dtype in {[str(d) for d in _PARAM_DTYPES]}, got {dt_bias.dtype}")
    if tuple(dt_bias.shape) not in ((H, D), (H * D,)):
        raise ValueError(f"dt_bias must have shape [H, D] = {(H, D)} (or [H * D]), got {tuple(dt_bias.shape)}")
    _same_device("dt_bias", dt_bias, q.device)

    if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real):
        raise TypeError(f"lower_bound must be a float, got {type(lower_bound).__name__}")
    lower_bound = float(lower_bound)
    if not (-5.0 <= lower_bound <= 0.0):
        raise ValueError(f"lower_bound must be in [-5, 0] (FlashKDA's gate range), got {lower_bound}")

    if cu_seqlens is not None:
        # The functional API's validator; values checked also under torch.compile (FlashKDA
        # itself checks nothing).
        cu_seqlens = check_cu_seqlens(cu_seqlens, B, T, q.device, compiled_too=True)
        N = cu_seqlens.numel() - 1
    else:
        N = B

    for name, s in (("initial_state", initial_state), ("final_state", final_state)):
        if s is None:
            continue
        _tensor(name, s, 4, _STATE_DTYPES)
        if tuple(s.shape) != (N, H, D, D):
            raise ValueError(f"{name} must have shape [N, H, V, K] = {(N, H, D, D)} (N = "
                             f"{'len(cu_seqlens) - 1' if cu_seqlens is not None else 'B'}), "
                             f"got {tuple(s.shape)}")
        _same_device(name, s, q.device)
    if initial_state is not None and final_state is not None and initial_state.dtype != final_state.dtype:
        raise TypeError(f"initial_state and final_state must have one dtype (as in FlashKDA), got "
                        f"{initial_state.dtype} and {final_state.dtype}")
    # out and final_state are written in place (by FlashKDA's kernel while it reads the inputs):
    # they must not alias an input, each other or themselves. final_state may be initial_state
    # itself (the state updated in place, a documented use).
    same_state = (initial_state is not None and final_state is not None
                  and initial_state.data_ptr() == final_state.data_ptr()
                  and initial_state.stride() == final_state.stride())
    check_no_aliasing({"out": out, "final_state": final_state},
                      {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log,
                       "dt_bias": dt_bias, "cu_seqlens": cu_seqlens,
                       "initial_state": None if same_state else initial_state})
    return _Call(B, T, H, D, N, float(scale), lower_bound, cu_seqlens)


def flash_kda_unavailable_reason(q: torch.Tensor, A_log: Optional[torch.Tensor] = None,
                                 dt_bias: Optional[torch.Tensor] = None,
                                 state: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when MoonshotAI FlashKDA can run this call, else why not (without importing it)."""
    if os.environ.get("TORCH_KDA_FLASH_KDA", "1").strip() == "0":
        return "disabled by TORCH_KDA_FLASH_KDA=0"
    if importlib.util.find_spec("flash_kda") is None:
        return "FlashKDA (the flash_kda package) is not installed"
    if not q.is_cuda:
        return f"FlashKDA needs CUDA tensors, got q on {q.device}"
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 9:
        return f"FlashKDA needs an SM90+ GPU, got compute capability {major}.x"
    if q.dtype != torch.bfloat16:
        return f"FlashKDA needs bfloat16 inputs, got {q.dtype}"
    if q.shape[-1] != FLASH_KDA_HEAD_DIM:
        return f"FlashKDA needs head dim {FLASH_KDA_HEAD_DIM}, got {q.shape[-1]}"
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and x.dtype != torch.float32:
            return f"FlashKDA needs float32 {name}, got {x.dtype}"
    if state is not None and state.dtype not in (torch.bfloat16, torch.float32):
        return f"FlashKDA needs bfloat16 or float32 states, got {state.dtype}"
    return None


def _run_flash_kda(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, c: _Call) -> None:
    import flash_kda  # noqa: PLC0415 (lazy: only when chosen)

    out_buf = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    fs_buf = None
    if final_state is not None:
        fs_buf = final_state if final_state.is_contiguous() else torch.empty_like(
            final_state, memory_format=torch.contiguous_format)
    flash_kda.fwd(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                  c.scale, out_buf, A_log=A_log.contiguous(),
                  dt_bias=dt_bias.reshape(c.H, c.D).contiguous(), lower_bound=c.lower_bound,
                  initial_state=None if initial_state is None else initial_state.contiguous(),
                  final_state=fs_buf, cu_seqlens=c.cu_seqlens)
    if out_buf is not out:
        out.copy_(out_buf)
    if fs_buf is not None and fs_buf is not final_state:
        final_state.copy_(fs_buf)


def _run_torch_kda(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, c: _Call,
                   backend: str) -> None:
    from .. import api  # noqa: PLC0415 (torch_kda imports this package)

    gate = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=c.lower_bound, A_log=A_log,
                dt_bias=dt_bias)
    if c.lower_bound == 0.0:
        # lower_bound * sigmoid(...) == 0: no decay at all (this library's bounded gate needs a
        # negative bound, so pass the zero log-decay directly).
        g = torch.zeros(g.shape, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                        device=g.device)
        gate = dict(use_gate_in_kernel=False)
    h0 = initial_state
    if h0 is not None and h0.dtype == torch.bfloat16:
        h0 = h0.float()  # FLA takes fp32 states; the arithmetic is fp32 on every backend anyway
    o, ht = api.chunk_kda(q, k, v, g, beta, scale=c.scale, initial_state=h0,
                          output_final_state=final_state is not None, use_qk_l2norm_in_kernel=True,
                          use_beta_sigmoid_in_kernel=True, state_v_first=True,
                          cu_seqlens=c.cu_seqlens, backend=backend, **gate)
    out.copy_(o)
    if final_state is not None:
        final_state.copy_(ht)


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        scale: Optional[float], out: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
        lower_bound: float, initial_state: Optional[torch.Tensor] = None,
        final_state: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
        *, backend: str = "auto") -> None:
    """FlashKDA forward (Kimi Delta Attention, inference): ``flash_kda.fwd``'s contract, any device.

    Per sequence and head, with ``q̂, k̂`` the L2-normalised q, k, ``β = sigmoid(beta)`` and
    ``γ = lower_bound · sigmoid(exp(A_log[h]) · (g + dt_bias[h]))`` (docs/math.md "Gates")::

        S_t = Diag(exp γ_t) S_{t-1} + k̂_t β_t (v_t − (Diag(exp γ_t) S_{t-1})ᵀ k̂_t)ᵀ
        out_t = S_tᵀ (scale · q̂_t)

    with S stored transposed (``[V, K]``) in ``initial_state``/``final_state``.

    Args:
        q, k: ``[B, T, H, D]`` queries and keys (raw; normalised in the op). bf16 for FlashKDA,
            which needs ``D == 128``; the fallback takes any float dtype and ``D``.
        v: ``[B, T, H, D]`` values, dtype of q.
        g: ``[B, T, H, D]`` raw gate input (before ``dt_bias`` and the activation), dtype of q.
        beta: ``[B, T, H]`` write-strength logits (sigmoid in the op), dtype of q.
        scale: query scale (FlashKDA's callers pass ``D ** -0.5``; None means that here).
        out: ``[B, T, H, D]`` output buffer in q's dtype, overwritten.
        A_log: ``[H]`` fp32 log decay rate. dt_bias: ``[H, D]`` fp32 gate bias (``[H * D]`` too).
        lower_bound: gate bound in ``[-5, 0]`` (per-step log-decay ``>= lower_bound``).
        initial_state: ``[N, H, V, K]`` (V-first) bf16/fp32 state, zeros when None.
        final_state: ``[N, H, V, K]`` buffer for the final state, overwritten; same dtype as
            ``initial_state`` when both are given. May be ``initial_state`` itself.
        cu_seqlens: ``[N + 1]`` int64 offsets of packed sequences (``B == 1``), or None (N = B).
        backend: keyword only, not in FlashKDA: ``"auto"``, ``"flash_kda"`` (FlashKDA or an
            error), or a :func:`torch_kda.chunk_kda` backend (``"native"``, ``"reference"``,
            ``"fla"``) to skip FlashKDA.

    Returns:
        None, as FlashKDA: the results are in ``out`` and ``final_state``. No autograd graph is
        recorded (FlashKDA is inference-only).

    Raises:
        TypeError: a non-tensor, mixed input dtypes, non-fp32/fp64 ``A_log``/``dt_bias``, states of
            two dtypes, non-integer ``cu_seqlens``, a non-numeric ``scale``/``lower_bound``.
        ValueError: shapes that disagree with q, a NaN/infinite ``scale``, ``lower_bound`` outside
            ``[-5, 0]``, ``out`` / ``final_state`` sharing memory with an input, with each other
            or within themselves (an expanded tensor; ``final_state`` may be ``initial_state``), bad
            ``cu_seqlens`` (B != 1, not starting at 0, decreasing, not ending at T), tensors on
            another device than q, an unknown ``backend``.
        RuntimeError: ``backend="flash_kda"`` where FlashKDA cannot run (the message says why), or
            a torch_kda backend that cannot run here.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    c = _check(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
               final_state, cu_seqlens)
    use_flash = False
    if backend in ("auto", "flash_kda"):
        reason = flash_kda_unavailable_reason(q, A_log, dt_bias,
                                              initial_state if initial_state is not None else final_state)
        if reason is None:
            use_flash = True
        elif backend == "flash_kda":
            raise RuntimeError(f"backend='flash_kda' cannot run this call: {reason}")
    with torch.no_grad():
        if use_flash:
            _run_flash_kda(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, c)
        else:
            _run_torch_kda(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, c,
                           "auto" if backend in ("auto", "flash_kda") else backend)
    return None
