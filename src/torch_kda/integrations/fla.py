"""torch-kda as the CPU backend of flash-linear-attention's dispatch registry (``fla.backends``).

flash-linear-attention (FLA, PyPI ``fla-core``) routes its public KDA functions through a backend
registry: a :class:`fla.backends.BaseBackend` subclass, registered with
:func:`fla.backends.register`, offers an implementation per function name plus a
``<name>_verifier`` that accepts or declines each call; declined calls fall through to the next
backend and finally to FLA's own Triton kernels. FLA has no CPU compute path: on a CPU-only machine
(Triton from PyPI imports without a GPU) its KDA functions fail inside Triton.

:func:`register` adds one backend, ``backend_type = "torch_kda"``, at two entry points:

=====================================================  =======================================
FLA entry point (fla-core 0.6.0)                       what is covered
=====================================================  =======================================
``fla.ops.kda.chunk_kda`` (function registry,          the public training/prefill function,
``@dispatch`` on the function itself)                  forward and backward
``fused_recurrent_kda_fwd`` (operation registry        FLA's serving entry, and through it
``"kda"``)                                             ``fla.ops.kda.fused_recurrent_kda``
=====================================================  =======================================

Its verifiers accept a call when every tensor argument is on the CPU and decline everything else
(CUDA, meta, ...), so GPUs keep FLA's kernels. Accepted calls run :func:`torch_kda.chunk_kda` /
:func:`torch_kda.fused_recurrent_kda` (``backend="auto"``: the native operator, or the pure-PyTorch
reference where the native library is missing) with FLA's argument names, defaults and return
conventions; gradients flow through torch-kda's analytic backward (FLA's ``fused_recurrent_kda``
has no backward of its own; through this backend it has one).

Switch it off per process with the environment variable ``FLA_TORCH_KDA=0`` (FLA's own
per-backend switch, read at every call). Nothing here imports ``fla`` until :func:`register` runs.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

__all__ = ["register", "is_registered", "chunk_kda_verifier", "fused_recurrent_kda_fwd_verifier",
           "BACKEND_TYPE", "ENV_VAR", "PRIORITY"]

BACKEND_TYPE = "torch_kda"
ENV_VAR = "FLA_TORCH_KDA"
# FLA tries backends by ascending priority (its own defaults are 3 to 5). This one only takes CPU
# tensors, which no FLA backend handles, so its place in the order changes nothing on GPUs.
PRIORITY = 1

# Arguments of FLA's fused_recurrent_kda_fwd that torch_kda.fused_recurrent_kda receives once the
# serving interface exists there; until then calls that use them are declined (FLA's path runs).
_SERVING_ARGS = ("ssm_state_indices", "num_accepted_tokens")


# --------------------------------------------------------------------------------------------
# Adapters: FLA's signatures, torch-kda's computation
# --------------------------------------------------------------------------------------------

def _chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: Optional[float] = None,
    disable_recompute: bool = False, return_intermediate_states: bool = False,
    state_v_first: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None, cp_context: Any = None, use_graph: bool = False,
    max_num_seqs: Optional[int] = None, **kwargs: Any,
):
    """``fla.ops.kda.chunk_kda`` on CPU tensors, computed by :func:`torch_kda.chunk_kda`.

    Same arguments, defaults and returns as FLA's (fla-core 0.6.0): ``A_log``, ``dt_bias`` and
    ``chunk_size`` arrive as keywords and, as in FLA, the gate parameters are read only with
    ``use_gate_in_kernel=True``. ``disable_recompute``, ``use_graph`` and ``max_num_seqs`` tune
    FLA's GPU kernels and change nothing here; ``cu_seqlens_cpu`` is the host copy of
    ``cu_seqlens`` (on CPU the two are the same tensor, and must agree).

    Returns:
        ``(o, final_state)``; with ``return_intermediate_states=True`` (inference mode only, as in
        FLA) ``(o, final_state, h)``, ``h`` the state entering each chunk.

    Raises:
        ValueError: ``cp_context`` is set (context parallelism spans several GPUs; there is nothing
            to split on one CPU), ``cu_seqlens_cpu`` disagrees with ``cu_seqlens``,
            ``return_intermediate_states`` outside inference mode, and every error of
            :func:`torch_kda.chunk_kda`.
    """
    import torch_kda

    state_v_first = _deprecated_layout_name(state_v_first, kwargs)
    if cp_context is not None:
        raise ValueError("cp_context: torch-kda's CPU backend for FLA has no context parallelism "
                         f"(it splits a sequence across GPUs); expected None, got {type(cp_context).__name__}")
    # FLA reads cu_seqlens_cpu only beside cu_seqlens; torch_kda.chunk_kda checks that they agree.
    cu_seqlens_cpu = cu_seqlens_cpu if cu_seqlens is not None else None
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    chunk_size = kwargs.get("chunk_size", 64)
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                  safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first,
                  cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size,
                  cu_seqlens_cpu=cu_seqlens_cpu)
    if return_intermediate_states:
        if not torch.is_inference_mode_enabled():
            raise ValueError("return_intermediate_states=True is inference only (as in FLA): call it "
                             "under torch.inference_mode(); got it outside inference mode")
        if disable_recompute:
            raise ValueError("return_intermediate_states=True needs disable_recompute=False (as in FLA), "
                             "got disable_recompute=True")
        return torch_kda.chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **common)
    return torch_kda.chunk_kda(q, k, v, g, beta, **common)


def _fused_recurrent_kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None, scale: Optional[float] = None,
    output_final_state: bool = False, inplace_final_state: bool = True, state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False, lower_bound: Optional[float] = None,
    out: Optional[torch.Tensor] = None, **kwargs: Any,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FLA's ``fused_recurrent_kda_fwd`` on CPU tensors, computed by :func:`torch_kda.fused_recurrent_kda`.

    FLA's conventions (fla-core 0.6.0): ``inplace_final_state=True`` (the default) writes the final
    states into ``initial_state`` and returns it as the final state; ``out``, when given, receives
    the output and is returned; otherwise the final state is returned only with
    ``output_final_state=True``. ``fla.ops.kda.fused_recurrent_kda`` calls this with
    ``inplace_final_state=False``.

    Raises:
        ValueError: ``inplace_final_state=True`` without ``initial_state``; in-place writes into
            tensors that require grad while autograd records (serving is inference only); ``out``
            of the wrong shape; and every error of :func:`torch_kda.fused_recurrent_kda`.
    """
    import torch_kda

    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state=True writes the final state into initial_state; "
                         "got initial_state=None (pass the state pool, or inplace_final_state=False)")
    if out is not None and tuple(out.shape) != tuple(v.shape):
        raise ValueError(f"out must have the shape of v {tuple(v.shape)}, got {tuple(out.shape)}")
    if torch.is_grad_enabled():
        for name, t in (("initial_state", initial_state if inplace_final_state else None), ("out", out)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} is written in place, which is inference only; got a tensor that "
                                 "requires grad (call under torch.no_grad() or detach it)")
    if not use_gate_in_kernel:  # FLA's kernel ignores the gate parameters without the in-kernel gate
        A_log = dt_bias = None
    common = dict(scale=scale, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                  allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
                  cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
    if _accepts("fused_recurrent_kda", "inplace_final_state"):
        # This torch-kda has the serving interface: the pool is gathered/scattered in the kernel.
        o, final_state = torch_kda.fused_recurrent_kda(
            q, k, v, g, beta, output_final_state=output_final_state, inplace_final_state=inplace_final_state,
            ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens, out=out, **common)
        return o, (initial_state if inplace_final_state else final_state)
    # Without it (the verifier has declined indices): one state per sequence, copied in place here.
    o, final_state = torch_kda.fused_recurrent_kda(
        q, k, v, g, beta, output_final_state=output_final_state or inplace_final_state, **common)
    if out is not None:
        with torch.no_grad():
            out.copy_(o)
        o = out
    if inplace_final_state:
        with torch.no_grad():
            initial_state.copy_(final_state)
        final_state = initial_state
    return o, final_state


def _deprecated_layout_name(state_v_first: bool, kwargs: Dict[str, Any]) -> bool:
    # FLA 0.6 renamed transpose_state_layout to state_v_first and still accepts the old name.
    if "transpose_state_layout" not in kwargs:
        return state_v_first
    if state_v_first:
        raise ValueError("pass state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                  DeprecationWarning, stacklevel=3)
    layout = kwargs.pop("transpose_state_layout")
    if not isinstance(layout, bool):  # (its truth value would make "False" mean True)
        raise TypeError(f"transpose_state_layout must be a bool, got {type(layout).__name__} "
                        f"{layout!r}")
    return layout


# --------------------------------------------------------------------------------------------
# Verifiers: (accepted, reason) for FLA's registry; usable without FLA
# --------------------------------------------------------------------------------------------

def _bind(fn: Callable, args: tuple, kwargs: dict) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        return None, f"arguments do not match FLA's signature: {exc}"
    values = dict(bound.arguments)
    values.update(values.pop("kwargs", {}))
    return values, None


def _non_cpu_tensor(values: Dict[str, Any]) -> Optional[str]:
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return f"torch-kda's FLA backend takes CPU tensors only; {name} is on {value.device}"
    return None


def chunk_kda_verifier(*args: Any, **kwargs: Any) -> Tuple[bool, Optional[str]]:
    """Whether torch-kda takes a ``fla.ops.kda.chunk_kda`` call: ``(True, None)`` or ``(False, why)``.

    Accepts calls whose tensor arguments all live on the CPU; declines anything else, so FLA's
    own kernels run on GPUs. Arguments are those of ``fla.ops.kda.chunk_kda``.
    """
    values, reason = _bind(_chunk_kda, args, kwargs)
    if values is None:
        return False, reason
    reason = _non_cpu_tensor(values)
    if reason is not None:
        return False, reason
    if values.get("return_intermediate_states") and not _accepts("chunk_kda", "return_intermediate_states"):
        return False, ("return_intermediate_states needs a torch-kda release with it in "
                       "torch_kda.chunk_kda; this one has none")
    return True, None


def fused_recurrent_kda_fwd_verifier(*args: Any, **kwargs: Any) -> Tuple[bool, Optional[str]]:
    """Whether torch-kda takes a ``fused_recurrent_kda_fwd`` call: ``(True, None)`` or ``(False, why)``.

    Accepts CPU tensors; declines other devices, and serving arguments (``ssm_state_indices``,
    ``num_accepted_tokens``, a head-wise ``beta [B, T, HV, V]``) that this torch-kda's
    :func:`torch_kda.fused_recurrent_kda` does not take.
    """
    values, reason = _bind(_fused_recurrent_kda_fwd, args, kwargs)
    if values is None:
        return False, reason
    reason = _non_cpu_tensor(values)
    if reason is not None:
        return False, reason
    for name in _SERVING_ARGS:
        if values.get(name) is not None and not _accepts("fused_recurrent_kda", name):
            return False, f"{name} needs a torch-kda release with it in torch_kda.fused_recurrent_kda"
    beta, v = values.get("beta"), values.get("v")
    if isinstance(beta, torch.Tensor) and isinstance(v, torch.Tensor) and beta.dim() == v.dim() \
            and not _accepts("fused_recurrent_kda", "ssm_state_indices"):
        return False, "a head-wise beta [B, T, HV, V] needs a torch-kda release with serving arguments"
    return True, None


def _accepts(function: str, argument: str) -> bool:
    import torch_kda

    return argument in inspect.signature(getattr(torch_kda, function)).parameters


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------

_registered_backend = None


def _backend_class():
    from fla.backends import BaseBackend

    class TorchKDABackend(BaseBackend):
        """torch-kda's CPU kernels for FLA's KDA entry points (see :mod:`torch_kda.integrations.fla`)."""

        backend_type = BACKEND_TYPE
        package_name = "torch_kda"
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        def chunk_kda_verifier(self, *args, **kwargs):
            return chunk_kda_verifier(*args, **kwargs)

        def chunk_kda(self, *args, **kwargs):
            return _chunk_kda(*args, **kwargs)

        def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs):
            return fused_recurrent_kda_fwd_verifier(*args, **kwargs)

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            return _fused_recurrent_kda_fwd(*args, **kwargs)

    return TorchKDABackend


def register() -> None:
    """Register torch-kda as FLA's CPU backend for KDA (idempotent; one call per process).

    After it, unmodified code calling ``fla.ops.kda.chunk_kda``, ``fla.ops.kda.fused_recurrent_kda``
    or ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` with CPU tensors runs torch-kda
    (forward and backward); other devices keep FLA's kernels. ``FLA_TORCH_KDA=0`` in the
    environment switches the backend off again.

    Raises:
        ImportError: FLA (``fla-core`` >= 0.6, with its ``fla.backends`` registry) or Triton, which
            ``fla.ops.kda`` imports even on CPU, is not installed; the message says what to install.
    """
    global _registered_backend
    try:
        import fla.backends as fla_backends
        import fla.ops.kda  # noqa: F401  (loads the KDA entry points and FLA's own backends)
        from fla.ops.kda.chunk import chunk_kda
    except ImportError as exc:
        raise ImportError(
            "torch_kda.integrations.fla.register() needs flash-linear-attention with its backend "
            "registry and Triton (tested: pip install fla-core==0.6.0 triton==3.9.0; Triton imports "
            f"without a GPU); importing it failed: {exc}") from exc
    cls = _backend_class()
    # One instance per entry point: the registries key backends by backend_type, so calling this
    # again replaces the entries instead of adding duplicates.
    fla_backends.register(chunk_kda)(cls)
    fla_backends.register("kda")(cls)
    _registered_backend = cls


def is_registered() -> bool:
    """True once :func:`register` has run in this process (``FLA_TORCH_KDA=0`` may still switch it off)."""
    return _registered_backend is not None
