"""The functional API: ``chunk_kda``, ``fused_recurrent_kda``, ``kda_gate``, ``available_backends``.

Arguments are checked once (``_checks.check_serving_inputs``, which runs ``check_kda_inputs``), then
one backend runs. For :func:`fused_recurrent_kda` with the native backend the checks and the run
are first tried in one C++ call (``_native.fused_recurrent_fast``: the same rules, probed without
raising); where it refuses the arguments the checks run and raise as described. The backends:

- ``"native"``: the C++ CPU operators: ``torch.ops.kda.fused_recurrent`` (token by token) for
  :func:`fused_recurrent_kda`, ``torch.ops.kda.chunk`` (chunkwise, matrix products) for
  :func:`chunk_kda`; with ``"auto"``, :func:`chunk_kda` runs the recurrent one unless
  ``TORCH_KDA_CHUNK_PRODUCTS=bf16`` asks for the chunk kernel's bf16 products, then the faster of
  the two by a rule measured on CPUs (``_native.prefer_chunk``, docs/benchmarks.md);
- ``"reference"``: the pure-PyTorch definition in :mod:`torch_kda.reference` (any device);
- ``"fla"``: flash-linear-attention on CUDA, imported only when chosen;
- ``"auto"``: ``"fla"`` for CUDA tensors when FLA is installed, ``"native"`` for CPU tensors when
  the library is built, else ``"reference"``. The environment variable ``TORCH_KDA_BACKEND``
  (e.g. ``reference``) replaces ``"auto"``'s choice.
"""

from __future__ import annotations

import os
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from . import _fla, _native, reference
from ._checks import (KDAInputs, check_cu_seqlens_cpu, check_graph_args, check_serving_inputs,
                      forward_ad_active, has_tangent)

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_gate", "available_backends", "BackendStatus",
           "BACKENDS"]

BACKENDS = ("auto", "native", "reference", "fla")


class BackendStatus(NamedTuple):
    """Whether a backend can run here, and if not, why (``reason`` is ``""`` when available)."""

    available: bool
    reason: str


def available_backends() -> Dict[str, BackendStatus]:
    """Which backends work in this process, and why not the others.

    Returns:
        ``{"native": BackendStatus, "reference": ..., "fla": ...}``; ``reference`` is always
        available. FLA is probed without being imported.
    """
    fla_reason = _fla.unavailable_reason()
    return {
        "native": BackendStatus(_native.LOAD_ERROR is None, _native.LOAD_ERROR or ""),
        "reference": BackendStatus(True, ""),
        "fla": BackendStatus(fla_reason is None, fla_reason or ""),
    }


def _env(name: str) -> str:
    """``os.environ.get(name, "")`` without its cost when the variable is unset (the usual case):
    ``os.environ.get`` raises and catches a KeyError inside then, which cost ~15 us of CPU time per
    decode call on the 2-core box (docs/benchmarks.md "Decode: the Python layer, fourth round").
    Reads the mapping behind ``os.environ`` as ``os.environ[name]`` does (CPython's ``_data``,
    ``encodekey``, ``decodevalue``), so a change made through ``os.environ`` is seen at once;
    ``os.environ.get`` where those are missing."""
    env = os.environ
    try:
        key = _ENV_KEYS.get(name)
        if key is None:  # encoded once per name (~1 us of a decode call with backend="auto")
            key = _ENV_KEYS[name] = env.encodekey(name)
        raw = env._data.get(key)
    except AttributeError:  # another Python implementation
        return env.get(name, "")
    return "" if raw is None else env.decodevalue(raw)


_ENV_KEYS: Dict[str, object] = {}  # name -> its key in os.environ's mapping (_env)


# TORCH_KDA_BACKEND values that leave backend="auto" its own choice
_AUTO = ("", "auto")


def _backend_for_tangents(backend: str, *tensors) -> str:
    """The backend for a call under forward-mode AD (``torch.autograd.forward_ad``,
    ``torch.func.jvp``) whose inputs carry tangents: only the reference has a forward-mode
    formula, so ``"auto"`` becomes ``"reference"`` and ``"native"`` raises NotImplementedError
    (the native op raises too when called directly: a tangent is never dropped without a word).
    ``backend`` itself when no dual level is active (one attribute read) or no input has one."""
    if (backend not in ("auto", "native") or not forward_ad_active()
            or not any(has_tangent(t) for t in tensors)):
        return backend
    if backend == "native":
        raise NotImplementedError("forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is "
                                  "not implemented by the native backend; use backend='reference' "
                                  "(or 'auto', which picks it for inputs with tangents)")
    return "reference"


def _resolve_backend(backend: str, x: KDAInputs) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        forced = _env("TORCH_KDA_BACKEND").strip()
        if forced and forced != "auto":
            if forced not in BACKENDS:
                raise ValueError(f"TORCH_KDA_BACKEND must be one of {BACKENDS}, got {forced!r}")
            backend = forced
    if backend == "auto":
        if x.q.is_cpu:
            return "native" if _native.LOAD_ERROR is None else "reference"
        if x.q.is_cuda and _fla.unavailable_reason() is None:
            return "fla"
        return "reference"
    if backend == "native":
        if _native.LOAD_ERROR is not None:
            raise RuntimeError(f"backend='native' is unavailable: {_native.LOAD_ERROR}; "
                               "use backend='reference'")
        if not x.q.is_cpu:
            raise ValueError(f"backend='native' runs on CPU tensors, got q on {x.q.device}; "
                             "use backend='fla' or 'reference' on this device")
    return backend


def fused_recurrent_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False, lower_bound: Optional[float] = None,
    state_v_first: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    backend: str = "auto", ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None, inplace_final_state: bool = False,
    out: Optional[torch.Tensor] = None, pad_slot_id: int = -1,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention, token by token (the recurrent form; best for decoding).

    Per sequence and value head, for t = 1..T (docs/math.md "Forward recurrence"; Kimi Linear
    report, arXiv 2510.26692, Eq. 1)::

        S'_t = Diag(exp(g_t)) S_{t-1};  u_t = beta_t (v_t - S'_t^T k_t);  S_t = S'_t + k_t u_t^T;
        o_t  = S_t^T (scale * q_t)

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (fp64, fp32, bf16 or fp16; same dtype as ``v``).
        v: ``[B, T, HV, V]`` values; ``HV % H == 0``, value head ``hv`` reads q/k head
            ``hv // (HV // H)`` (grouped value heads, GVA).
        g: ``[B, T, HV, K]`` per-channel log-decay (``<= 0``), or the raw gate input when
            ``use_gate_in_kernel=True``.
        beta: ``[B, T, HV]`` write strength in ``[0, 1]``, or logits with
            ``use_beta_sigmoid_in_kernel=True``.
        scale: query scale, default ``K ** -0.5``. The sixth positional argument, as in FLA's
            ``chunk_kda``; FLA 0.6's ``fused_recurrent_kda`` takes ``A_log`` and ``dt_bias``
            positionally before it: pass those by keyword here (a tensor given as ``scale``
            raises a TypeError that says so).
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), any float
            dtype; zeros when None. N = B, or the number of sequences in ``cu_seqlens``.
        output_final_state: also return the final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(sum x^2 + 1e-6)``) in the op.
        use_gate_in_kernel: compute ``g`` from the raw input in the op (see :func:`kda_gate`).
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)`` in the op.
        allow_neg_eigval: ``beta = 2 * sigmoid(beta)`` (needs ``use_beta_sigmoid_in_kernel``).
        lower_bound: with ``use_gate_in_kernel``, selects the bounded gate (a float in ``[-5, 0)``
            typically; must be negative). Without ``use_gate_in_kernel`` it is, as in FLA, only a
            promise that ``g >= lower_bound`` (it licenses ``safe_gate``) and is not applied.
        state_v_first: states are stored transposed, ``[N, HV, V, K]`` (FLA's V-first layout).
        cu_seqlens: ``[N + 1]`` int64/int32 offsets of packed variable-length sequences
            (``B == 1``, starts at 0, non-decreasing, ends at T).
        A_log: ``[HV]`` gate parameter; dt_bias: ``[HV * K]`` or ``[HV, K]`` gate bias.
        backend: ``"auto"``, ``"native"``, ``"reference"`` or ``"fla"`` (module docstring).
        ssm_state_indices: serving (docs/serving.md): ``initial_state`` is then a state pool
            ``[num_slots, HV, K, V]`` (``[num_slots, HV, V, K]`` V-first; fp32 or bf16) and this
            int32/int64 tensor names the slots: ``[N]``: sequence n starts from slot
            ``ssm_state_indices[n]`` and (in place) writes its final state there; ``[N, T_max]``
            (speculative decoding, needs ``inplace_final_state``): it starts from slot
            ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` and the state after its token t is
            written to slot ``ssm_state_indices[n, t]``. Names of FLA's ``fused_recurrent_kda_fwd``.
        num_accepted_tokens: ``[N]`` int32/int64 in ``[1, T_n]``, with 2-D indices (default: 1).
        inplace_final_state: write the final states (or snapshots) into ``initial_state`` in place
            and return it; slots not named are left bitwise unchanged. Inference only.
        out: preallocated ``o`` (``[B, T, HV, V]``, ``q``'s dtype), written and returned.
        pad_slot_id: an index equal to it marks a pad sequence (zero output, nothing read or
            written); default -1 (vLLM's convention). ``beta`` may also be head-wise
            ``[B, T, HV, V]`` (one strength per value column, as in FLA's recurrent kernel).

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` in ``q``'s dtype; ``final_state`` fp32 (fp64 for
        fp64 inputs) in the requested layout, or None without ``output_final_state``; with
        ``inplace_final_state`` the pool (``initial_state``) itself.
        Arithmetic is fp32 (fp64 for fp64 inputs) whatever the input dtype.

    Raises:
        TypeError: non-tensors, non-float dtypes, mixed q/k/v dtypes, non-integer ``cu_seqlens``.
        ValueError: inconsistent shapes or devices, bad ``cu_seqlens``, ``HV % H != 0``, gate
            arguments missing or out of range, unknown backend; serving: an index out of range,
            two sequences writing one slot, ``num_accepted_tokens`` outside ``[1, T_n]``, a pool
            shape/dtype/layout mismatch, in-place calls on tensors that require grad. A rejected
            call leaves the pool unchanged.
        RuntimeError: the requested backend cannot run here (see :func:`available_backends`).
    """
    backend = _backend_for_tangents(backend, q, k, v, g, beta, initial_state, A_log, dt_bias)
    # The native backend: checked and run in one C++ call (decode loops: docs/benchmarks.md
    # "Decode: the Python layer, fifth round"); None where it refuses the arguments, and then the
    # checks below raise with their words (or pick another backend).
    if backend == "native" or backend == "auto" and _env("TORCH_KDA_BACKEND") in _AUTO:
        r = _native.fused_recurrent_fast(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
            state_v_first, cu_seqlens, A_log, dt_bias, ssm_state_indices, num_accepted_tokens,
            inplace_final_state, out, pad_slot_id)
        if r is not None:
            return r
    x, srv = check_serving_inputs(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, False, lower_bound,
        state_v_first, cu_seqlens, A_log, dt_bias, ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state, out=out,
        pad_slot_id=pad_slot_id, method="recurrent")
    chosen = _resolve_backend(backend, x)
    if srv is not None:
        if chosen == "native":
            return _native.serving(x, srv)
        if chosen == "fla":
            return _fla.serving(x, srv)
        return reference.run_serving_reference(x, srv, "recurrent")
    if chosen == "native":
        return _native.fused_recurrent(x)
    if chosen == "fla":
        return _fla.fused_recurrent(x)
    return reference.run_reference(x, "recurrent")


def chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: Optional[float] = None,
    state_v_first: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    chunk_size: int = 64, backend: str = "auto", ssm_state_indices: Optional[torch.Tensor] = None,
    inplace_final_state: bool = False, return_intermediate_states: bool = False,
    out: Optional[torch.Tensor] = None, pad_slot_id: int = -1, *,
    cu_seqlens_cpu: Optional[torch.Tensor] = None, disable_recompute: bool = False,
    cp_context: object = None, use_graph: bool = False, max_num_seqs: Optional[int] = None,
):
    """Kimi Delta Attention for training and prefill: a drop-in for ``fla.ops.kda.chunk_kda``.

    Same math, arguments, shapes, dtypes, returns and errors as :func:`fused_recurrent_kda`, plus:

    Args:
        safe_gate: FLA's licence for chunk tricks that need bounded per-step decay; requires
            ``-5 <= lower_bound < 0``. It never changes the result.
        chunk_size: chunk length C of the chunkwise (WY/UT transform) form, a positive int
            (FLA accepts 32 or 64).
        ssm_state_indices, inplace_final_state, out, pad_slot_id: prefill into a state pool, as in
            :func:`fused_recurrent_kda` (1-D indices only), so a mixed batch (long prompts and
            single decode tokens packed with ``cu_seqlens``) runs in one call. On CPU the native
            backend (and ``"auto"`` where it picks the chunkwise kernel) runs the chunkwise kernel
            from the gathered slots and scatters the final states back in place; ``"auto"`` keeps
            decoding on the token-by-token serving kernel (docs/serving.md "Backends").
        return_intermediate_states: also return, for prefix caching, the state entering each chunk
            (entry i = the state after i * chunk_size tokens of its sequence), FLA's shape and
            order: ``[B, NT, HV, K, V]`` (``[1, NT_total, ...]`` with ``cu_seqlens``), fp32 (fp64
            for fp64 inputs), in the requested layout; the call then returns ``(o, final_state, h)``.
            Inference only. On CPU with ``chunk_size=64`` these are the native chunkwise kernel's
            own checkpoints (``"native"`` and ``"auto"``); other chunk sizes run the chunkwise
            reference (correct, not fast).
        cu_seqlens_cpu: keyword only, FLA's host copy of ``cu_seqlens`` (same values, on the CPU);
            checked like ``cu_seqlens`` and against it (when ``cu_seqlens`` is on the CPU).
            Requires ``cu_seqlens``.
        disable_recompute: keyword only, FLA's switch to keep intermediates for the backward
            instead of recomputing them; a memory/speed trade-off that never changes the result.
            Accepted for compatibility; the native backward always recomputes from checkpoints
            every 64 tokens and the reference keeps what autograd keeps.
        cp_context, use_graph, max_num_seqs: keyword only, FLA's (fla-core 0.6) context
            parallelism (a sequence split across GPUs) and CUDA-graph capture, passed to FLA with
            ``backend="fla"``. On the CPU backends ``cp_context`` must be None (one CPU has nothing
            to split across); ``use_graph`` changes nothing there, and with it ``max_num_seqs``
            must equal the number of sequences in ``cu_seqlens``, as FLA asserts.

    The ``"reference"`` backend runs the chunkwise form (docs/math.md "Chunkwise form"; Kimi Linear
    report Eq. 10); ``"native"`` runs the C++ chunkwise kernel ``torch.ops.kda.chunk`` (matrix
    products over chunks of 32 tokens, 64 on CPUs with AMX, fp32 products and accumulation, fp64
    for fp64 inputs; for
    bf16 inputs the state products (forward and backward) take bf16 operands with fp32
    accumulation on CPUs with AMX or AVX-512 BF16, as FLA's kernels do: about 0.8x the error of
    FLA's own chunk kernel on the same inputs, within FLA's bar of 0.005 relative RMS at FLA's
    initialisation;
    with slow decays the state's rounding in every chunk adds up, about as sqrt(T) with no
    decay (T = 4096: 0.0055 at beta = 1, 0.026 at beta = 2; the recurrent kernel: 0.0017, the
    rounding of the output, at any length); gradients 0.1-0.9x FLA's errors, within its
    0.008 at its initialisation but for ``A_log``'s (a sum with cancellation: ~0.02,
    FLA's 0.023; fp32 products 0.0024; docs/benchmarks.md "Accuracy of the bf16 products"); the
    environment variable
    ``TORCH_KDA_CHUNK_PRODUCTS=auto|fp32|bf16`` chooses, ``fp32`` keeps fp32 products,
    docs/math.md "Chunkwise form"; otherwise the same result as the recurrent kernel to
    rounding); ``"fla"`` calls FLA's Triton kernels. The native
    kernel's chunks are fixed (checkpoints every 64 tokens): ``chunk_size`` changes only the
    reference's chunk length and the spacing of ``return_intermediate_states``, never the native
    result.
    ``"auto"`` on CPU runs the recurrent kernel unless ``TORCH_KDA_CHUNK_PRODUCTS=bf16`` asks
    for those bf16 products; then it runs the native chunkwise kernel where it is measured faster
    than the recurrent one (bf16 inputs on CPUs with AMX or AVX-512 BF16, no gradient recorded,
    sequences of 2048 tokens or more, at least 2 (sequence, value head) pairs per thread;
    ``_native.prefer_chunk``, docs/benchmarks.md) and the recurrent kernel otherwise (decoding,
    short sequences, training, fp32 and fp16, CPUs without bf16 product hardware).
    """
    if not isinstance(disable_recompute, bool):
        raise TypeError(f"disable_recompute must be a bool, got {type(disable_recompute).__name__}")
    if cu_seqlens_cpu is not None:
        check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens, q)
    check_graph_args(use_graph, max_num_seqs, cu_seqlens)
    backend = _backend_for_tangents(backend, q, k, v, g, beta, initial_state, A_log, dt_bias)
    x, srv = check_serving_inputs(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
        state_v_first, cu_seqlens, A_log, dt_bias, chunk_size, ssm_state_indices=ssm_state_indices,
        inplace_final_state=inplace_final_state, out=out, pad_slot_id=pad_slot_id,
        return_intermediate_states=return_intermediate_states, method="chunk")
    chosen = _resolve_backend(backend, x)
    if cp_context is not None and (chosen != "fla" or srv is not None):
        raise ValueError("cp_context (FLA's context parallelism, a sequence split across GPUs) runs "
                         "with backend='fla' and without serving arguments only; got "
                         f"{type(cp_context).__name__} for the {chosen} backend"
                         f"{' with serving arguments' if srv is not None else ''}, expected None")
    if srv is not None:
        if chosen == "fla":
            return _fla.serving_chunk(x, srv)
        if chosen == "native":
            if return_intermediate_states:
                # the native kernel's checkpoints are the entries every 64 tokens; other chunk
                # sizes come from the chunkwise reference
                if x.chunk_size == _native.CHUNK:
                    return _native.chunk_serving(x, srv)
            elif backend == "native" or _native.prefer_chunk(x):
                return _native.chunk_serving(x, srv)
            else:  # decoding, short sequences: the token-by-token serving kernel
                return _native.serving(x, srv)
        return reference.run_serving_reference(x, srv, "chunk")
    if chosen == "native":
        if backend == "native" or _native.prefer_chunk(x):
            return _native.chunk(x)
        return _native.fused_recurrent(x)
    if chosen == "fla":
        return _fla.chunk(x, cu_seqlens_cpu=cu_seqlens_cpu, disable_recompute=disable_recompute,
                          cp_context=cp_context, use_graph=use_graph, max_num_seqs=max_num_seqs)
    return reference.run_reference(x, "chunk")


kda_gate = reference.kda_gate
