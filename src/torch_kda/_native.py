"""Loads the native C++ operator library (``torch.ops.kda.*``) shipped inside the package.

The library is optional: a pure-Python install (``TORCH_KDA_BUILD_EXT=0``) has none, and then
:data:`LOAD_ERROR` says why, for ``available_backends()``. It is looked up in every folder of the
package's ``__path__``: a regular install has one (site-packages/torch_kda); an editable install
(``pip install --no-build-isolation -e .``, scikit-build-core) has two, the source folder
(src/torch_kda, the Python files) and site-packages/torch_kda (where CMake installed ``libkda``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ._checks import (INT64_MAX, INT64_MIN, KDAInputs, ServingArgs, check_serving_inputs,
                      warn_unstable_writes)
from ._pool import gather_states, scatter_states, sequences

_PACKAGE_DIR = Path(__file__).resolve().parent
_FIX = ("reinstall with `pip install --no-build-isolation .` (`-e .` for an editable install; it needs "
        "torch, CMake and a C++17 compiler, see README.md)")


def _search_dirs() -> List[Path]:
    """The package's folders, in import order (``__path__``; this file's folder as a fall-back)."""
    package = sys.modules.get(__package__ or "torch_kda")
    dirs = [Path(d).resolve() for d in getattr(package, "__path__", None) or []]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i]] or [_PACKAGE_DIR]


def _why_missing(dirs: List[Path]) -> str:
    """The reason no library was found, told apart by what the installed distribution says."""
    from importlib import metadata

    where = " or ".join(str(d) for d in dirs)
    try:
        dist = metadata.distribution("torch-kda")
    except metadata.PackageNotFoundError:
        return (f"no native library (libkda) in {where}: torch_kda was imported from a source tree "
                f"that is not installed; {_FIX}")
    if "py3-none-any" in (dist.read_text("WHEEL") or ""):
        return (f"the installed torch-kda is the pure-Python package (built with TORCH_KDA_BUILD_EXT=0), "
                f"without the native library; {_FIX}")
    libs = [Path(str(f.locate())).resolve() for f in dist.files or []
            if f.name.startswith("libkda.") or (f.name.startswith("kda.") and f.name.endswith(".dll"))]
    elsewhere = [lib for lib in libs if lib.parent not in dirs]
    if elsewhere:
        return (f"torch_kda was imported from {where}, which has no native library, while the installed "
                f"torch-kda has it in {elsewhere[0].parent}: another copy of the package comes first on "
                f"sys.path (PYTHONPATH?)")
    return f"the native library (libkda) is missing from {where} (removed after the install?); {_FIX}"


def _load() -> Optional[str]:
    """Load ``libkda`` into the torch.ops registry; return None on success, else the reason."""
    dirs = _search_dirs()
    candidates = [c for d in dirs for c in sorted(d.glob("libkda.*")) + sorted(d.glob("kda.*.dll"))]
    if not candidates:
        return _why_missing(dirs)
    try:
        torch.ops.load_library(str(candidates[0]))
    except Exception as exc:  # a stale or ABI-incompatible build must not break `import torch_kda`
        return f"the native library {candidates[0]} failed to load: {exc}"
    if not hasattr(torch.ops.kda, "fused_recurrent"):
        return f"the native library {candidates[0]} does not register kda::fused_recurrent"
    return None


LOAD_ERROR: Optional[str] = _load()


# name -> the C++ callable of torch.ops.kda.<name>'s one overload (direct), filled on first use
_DIRECT: Dict[str, Callable] = {}


def direct(name: str) -> Callable:
    """``torch.ops.kda.<name>.default._op``: the C++ callable that ``torch.ops.kda.<name>(...)``
    reaches after two Python frames (the overload packet's and the overload's ``__call__``, which
    only forward to it). For the calls made on every decode step (docs/benchmarks.md "Decode: the
    Python layer, fourth round"). Not while ``torch.compile`` traces: dynamo knows the
    ``OpOverload``, not this. Falls back to the packet where the attribute is missing."""
    fn = _DIRECT.get(name)
    if fn is None:
        packet = getattr(torch.ops.kda, name)
        fn = _DIRECT[name] = getattr(packet.default, "_op", packet)
    return fn


def _call(op, x: KDAInputs):
    """``op`` (a ``kda::`` forward with the schema of ``fused_recurrent``) on checked inputs."""
    return op(
        x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, x.use_qk_l2norm_in_kernel,
        x.use_gate_in_kernel, x.use_beta_sigmoid_in_kernel, x.allow_neg_eigval, x.lower_bound,
        x.state_v_first, x.cu_seqlens, x.A_log, x.dt_bias)


def _run(op, x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    warn_unstable_writes(x)
    o, final_state = _call(op, x)
    return o, (final_state if x.output_final_state else None)


def fused_recurrent(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run checked inputs through ``torch.ops.kda.fused_recurrent`` (CPU, fused C++ kernels).

    The op itself rejects ``g > 0`` and ``beta`` outside ``[0, 2]`` (in its pre-processing pass);
    the warning about unnormalised keys is raised here (free with the l2 norm on). Outside
    ``torch.compile`` one Python -> C++ call does both: ``kda::_fused_recurrent_checked`` (the op
    and the place of the warning; csrc/ops.cpp), through its direct callable (:func:`direct`).
    """
    if torch.compiler.is_compiling():
        return _run(torch.ops.kda.fused_recurrent, x)
    o, final_state, first = direct("_fused_recurrent_checked")(
        x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, x.use_qk_l2norm_in_kernel,
        x.use_gate_in_kernel, x.use_beta_sigmoid_in_kernel, x.allow_neg_eigval, x.lower_bound,
        x.state_v_first, x.cu_seqlens, x.A_log, x.dt_bias)
    if first >= 0:
        warn_unstable_writes(x, first)
    return o, (final_state if x.output_final_state else None)


# kda::_fused_recurrent_fast's status when its probe of the arguments failed (csrc/ops.cpp)
_REFUSED = -2


def fused_recurrent_fast(q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, A_log, dt_bias,
                         ssm_state_indices, num_accepted_tokens, inplace_final_state, out,
                         pad_slot_id):
    """``fused_recurrent_kda(..., backend="native")`` on CPU tensors in one Python -> C++ call,
    or None where the caller must run its checks (and then raise, or pick another backend).

    The plain call goes to ``kda::_fused_recurrent_fast``, a serving call (``ssm_state_indices``,
    ``num_accepted_tokens``, ``inplace_final_state``, ``out``, head-wise beta) to
    ``kda::_fused_recurrent_serving_fast`` (csrc/ops.cpp, csrc/serving_op.cpp). They probe the rules of
    :func:`~torch_kda._checks.check_serving_inputs` / :func:`~torch_kda._checks.check_kda_inputs`
    in C++ without raising (the ops' own checks in their probing mode, plus the Python rules
    beyond them) and, where they hold, run the kernels that :func:`fused_recurrent` /
    :func:`serving` run, and find the place of the unstable-write warning. What C++ cannot see is
    tested here: the Python types of the arguments (the ops' argument parser takes a bool or a
    tensor for a float, an int for a bool, where the checks raise or convert). So every call
    they refuse gets the checks' exact errors, and every call they run returns what the checked
    path returns. A decode step's Python cost: docs/benchmarks.md "Decode: the Python layer,
    fifth round". Not under ``torch.compile`` (dynamo traces the checked path).
    """
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
            and isinstance(g, Tensor) and isinstance(beta, Tensor)
            and (initial_state is None or isinstance(initial_state, Tensor))
            and (A_log is None or isinstance(A_log, Tensor))
            and (dt_bias is None or isinstance(dt_bias, Tensor))
            and (cu_seqlens is None or isinstance(cu_seqlens, Tensor))
            and (scale is None or type(scale) is float)
            and (lower_bound is None or type(lower_bound) is float)
            and type(output_final_state) is bool
            and type(use_qk_l2norm_in_kernel) is bool and type(use_gate_in_kernel) is bool
            and type(use_beta_sigmoid_in_kernel) is bool and type(allow_neg_eigval) is bool
            and type(state_v_first) is bool and type(inplace_final_state) is bool
            # (a pad_slot_id beyond int64 goes to the checks, which name it)
            and type(pad_slot_id) is int and INT64_MIN <= pad_slot_id <= INT64_MAX
            and LOAD_ERROR is None and not torch.compiler.is_compiling()):
        return None
    if (ssm_state_indices is None and num_accepted_tokens is None and out is None
            and not inplace_final_state and beta.dim() != 4):
        o, final_state, status = direct("_fused_recurrent_fast")(
            q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens,
            A_log, dt_bias)
        if not output_final_state:
            final_state = None
    else:
        if not ((ssm_state_indices is None or isinstance(ssm_state_indices, Tensor))
                and (num_accepted_tokens is None or isinstance(num_accepted_tokens, Tensor))
                and (out is None or isinstance(out, Tensor))):
            return None
        o, final_state, status = direct("_fused_recurrent_serving_fast")(
            q, k, v, g, beta, scale, initial_state, ssm_state_indices, num_accepted_tokens, out,
            output_final_state, pad_slot_id, inplace_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
            state_v_first, cu_seqlens, A_log, dt_bias)
        if out is not None:
            o = out
        if inplace_final_state:
            final_state = initial_state
    if status == _REFUSED:
        return None
    if status >= 0:  # the warning's words need the checked bundle (rare: unnormalised keys)
        x, _ = check_serving_inputs(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, False, lower_bound,
            state_v_first, cu_seqlens, A_log, dt_bias, ssm_state_indices=ssm_state_indices,
            num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state,
            out=out, pad_slot_id=pad_slot_id)
        warn_unstable_writes(x, status)
    return o, final_state


def chunk(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run checked inputs through ``torch.ops.kda.chunk`` (CPU, chunkwise form with matrix
    products, chunks of 32 tokens, 64 with AMX; same results as :func:`fused_recurrent` to
    rounding)."""
    return _run(torch.ops.kda.chunk, x)


def prefer_chunk(x: KDAInputs) -> bool:
    """``backend="auto"`` on CPU: whether :func:`chunk_kda` runs the chunkwise kernel
    (``torch.ops.kda.chunk``) rather than the recurrent one.

    The one place of the rule, from the crossovers measured side by side in docs/benchmarks.md
    ("The ``backend="auto"`` rule", ``python -m torch_kda.benchmark chunk``). The chunk kernel runs
    when all of these hold, else the recurrent one:

    - the caller asked for bf16 products (``TORCH_KDA_CHUNK_PRODUCTS=bf16``): where the chunk
      kernel is faster it is so through bf16 operands, whose rounding of the state every chunk
      adds up over the sequence (relative RMS error of the output against float64 ~0.005 at
      T = 4K with beta = 1 and no decay, 0.026 with beta = 2, growing about as sqrt(T); the
      recurrent kernel 0.0017 at any length), for 1.0-1.2x the recurrent kernel's speed: not a
      trade ``auto`` makes on its own;
    - its state products take bf16 operands on the CPU's bf16 product hardware
      (``torch.ops.kda._chunk_bf16_products``: bf16 or fp16 inputs, K and V multiples of 16, a
      CPU with AMX or AVX-512 BF16 whose dot products ATen's brgemm drives). There the chunk
      forward measured 1.0-1.2x the recurrent one (AMX host; AMD Zen 4, AVX-512 BF16: 0.94-1.19x,
      its forward + backward 0.94-1.16x, B1 T2K / T8K, H4 / H16, 1-2 threads); elsewhere
      0.4-0.95x (AVX2, AVX-512 without BF16, and fp32 inputs);
    - no gradient is recorded: the chunk forward + backward, with bf16 products in its backward
      too, measured 1.06-1.21x the recurrent pair on the AMX host (1 thread at H4 / H16, 16
      threads at H16), but 0.88-0.94x at H4 with 16 threads, and its gradient of A_log carries
      up to 1.9e-2 relative error against the recurrent op's 2.4e-3 (docs/benchmarks.md
      "Accuracy of the bf16 products"): training keeps the recurrent pair;
    - sequences of at least ``_CHUNK_MIN_MEAN_TOKENS`` tokens on average (decoding, T = 1,
      never);
    - at least 2 (sequence, value head) units per thread: the chunk kernel's state steps run one
      unit per thread, the recurrent kernel also splits the value columns (B1 H4 at 16 threads:
      chunk 0.48-0.50x).
    """
    # Asked first: it reads TORCH_KDA_CHUNK_PRODUCTS, whose misspelling then raises at any length,
    # as the native chunk op raises it.
    if not chunk_bf16_products(x.q.dtype, x.K, x.V) or not _bf16_products_asked():
        return False
    if x.T <= 1:
        return False
    if torch.is_grad_enabled() and _any_requires_grad(x) is not None:
        return False
    sequences = max(1, x.N)
    if x.B * x.T < sequences * _CHUNK_MIN_MEAN_TOKENS:
        return False
    return sequences * x.HV >= 2 * _threads()


# The shortest mean sequence length (tokens) from which prefer_chunk picks the chunk kernel.
_CHUNK_MIN_MEAN_TOKENS = 2048


def _constant_to_compile(fn):
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does: torch.compile calls it once
    while tracing and keeps its result as a constant (no graph break under ``fullgraph=True``;
    a compiled function keeps the choice it was traced with).

    Not the public decorator: applying it imports torch._dynamo, and triton with it (1.2 s),
    which ``import torch_kda`` must not. The decorator sets only this attribute (torch 2.11 to
    2.13); tests/test_chunk_native.py's fullgraph test fails if a torch version stops reading it.
    """
    fn._dynamo_marked_constant = True
    return fn


# The machine's facts the rule reads are constants to torch.compile.
@_constant_to_compile
def _threads() -> int:
    return torch.get_num_threads()


@_constant_to_compile
def chunk_bf16_products(dtype: torch.dtype, K: int, V: int) -> bool:
    """Whether ``torch.ops.kda.chunk`` would take bf16 state products on the CPU's bf16 product
    hardware (AMX or AVX-512 BF16) for inputs of ``dtype`` and head sizes ``K``, ``V`` (the op's
    own choice, the TORCH_KDA_CHUNK_PRODUCTS knob included, read at each call). Raises
    ValueError on an unknown knob value."""
    return _op_bf16_products(os.environ.get("TORCH_KDA_CHUNK_PRODUCTS"),
                             torch.backends.mkldnn.enabled, dtype, K, V)


@_constant_to_compile
def _bf16_products_asked() -> bool:
    """Whether TORCH_KDA_CHUNK_PRODUCTS is ``bf16`` (read at each call; a constant to
    torch.compile, as the op's own choice)."""
    return os.environ.get("TORCH_KDA_CHUNK_PRODUCTS") == "bf16"


# The op's answer depends only on the knob's value and whether oneDNN is enabled (parts of the key:
# the op reads both itself; with oneDNN off ATen's brgemm has no bf16 products) and on the CPU:
# asked once per key, not on every chunk_kda call of backend="auto" (3 us per call of the op). A
# bad knob value raises on every call (lru_cache keeps no exceptions).
@functools.lru_cache(maxsize=64)
def _op_bf16_products(knob: Optional[str], onednn: bool, dtype: torch.dtype, K: int,
                      V: int) -> bool:
    return bool(torch.ops.kda._chunk_bf16_products(dtype, K, V))


def _any_requires_grad(x: KDAInputs) -> Optional[str]:
    for name in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"):
        t = getattr(x, name)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return name
    return None


def _forward_only(x: KDAInputs) -> None:
    """The native serving paths have no backward: refuse inputs that require grad."""
    if torch.is_grad_enabled():
        name = _any_requires_grad(x)
        if name is not None:
            raise ValueError(f"the native CPU kernels (backend='native', and backend='auto' on CPU) "
                             f"run the serving arguments (ssm_state_indices, inplace_final_state, "
                             f"out=, head-wise beta, return_intermediate_states) forward only, but "
                             f"{name} requires grad; use backend='reference' for gradients")


def serving(x: KDAInputs, s: ServingArgs):
    """Serving arguments through ``torch.ops.kda.fused_recurrent_serving`` (in-place pool updates,
    snapshots, pad slots, head-wise beta; forward only). Returns ``(o, final_state)``."""
    _forward_only(x)
    # The op checks g <= 0 and beta in [0, 2] before it writes anything (csrc/cpu/serving.cpp,
    # check_domain); the warning's check runs here.
    warn_unstable_writes(x)
    out = s.out if s.out is not None else torch.empty(x.B, x.T, x.HV, x.V, dtype=x.q.dtype)
    final = None
    if not s.inplace_final_state and x.output_final_state:
        shape = (x.N, x.HV, x.V, x.K) if x.state_v_first else (x.N, x.HV, x.K, x.V)
        final = torch.empty(shape, dtype=x.compute_dtype)
    (torch.ops.kda.fused_recurrent_serving if torch.compiler.is_compiling()
     else direct("fused_recurrent_serving"))(
        x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, s.ssm_state_indices,
        s.num_accepted_tokens, out, final, s.pad_slot_id, s.inplace_final_state,
        x.use_qk_l2norm_in_kernel, x.use_gate_in_kernel, x.use_beta_sigmoid_in_kernel,
        x.allow_neg_eigval, x.lower_bound, x.state_v_first, x.cu_seqlens, x.A_log, x.dt_bias)
    return out, (x.initial_state if s.inplace_final_state else final)


# The native chunk kernel's chunk length (kernels::kChunk): its checkpoints are the states entering
# each chunk of this many tokens, FLA's intermediate states when chunk_size equals it.
CHUNK = 64


def chunk_serving(x: KDAInputs, s: ServingArgs):
    """Prefill into a state pool through the chunkwise kernel (``chunk_kda``'s serving arguments).

    Gathers the start states of the sequences (``_pool.gather_states``: pool slots, zeros for pad
    sequences), runs ``torch.ops.kda.chunk`` on them (``kda::chunk_fwd`` when the chunk-entry
    states are wanted), scatters the final states back (``_pool.scatter_states``: in place, one
    rounding for a bf16 pool; unnamed slots untouched) and writes ``s.out`` when given. Pad
    sequences run from a zero state (their tokens are in the packed inputs anyway) and get zero
    output, nothing written. Nothing is written before the op returns, so a call it rejects
    (``g > 0``, ``beta`` outside ``[0, 2]``) leaves the pool unchanged. Forward only.

    With ``s.return_intermediate_states`` (``x.chunk_size`` must be :data:`CHUNK`) also returns
    ``h``, FLA's ``[B, NT, HV, K, V]`` (``[1, NT_total, ...]`` with ``cu_seqlens``; ``V, K``
    with ``state_v_first``): the op's checkpoints, which are the states entering each 64-token
    chunk (see :func:`_entry_states`).

    Returns ``(o, final_state)`` or ``(o, final_state, h)``, as ``reference.run_serving_reference``.
    """
    _forward_only(x)
    warn_unstable_writes(x)
    want_h = s.return_intermediate_states
    if want_h and x.chunk_size != CHUNK:
        raise ValueError(f"the native chunk kernel's intermediate states are every {CHUNK} tokens, "
                         f"got chunk_size={x.chunk_size}")
    starts = gather_states(x, s)
    op = torch.ops.kda.chunk_fwd if want_h else torch.ops.kda.chunk
    runs = []  # (first sequence, end sequence, first token, o, final states, checkpoints or None)
    for n0, n1, t0, t1 in _segments(x, s, want_h):
        part = x
        if (n0, n1, t0, t1) != (0, x.N, 0, x.T):  # a slice of the packed (B = 1) batch: views
            cu = x.cu_seqlens[n0:n1 + 1] - t0
            part = dataclasses.replace(
                x, q=x.q[:, t0:t1], k=x.k[:, t0:t1], v=x.v[:, t0:t1], g=x.g[:, t0:t1],
                beta=x.beta[:, t0:t1], cu_seqlens=cu, T=t1 - t0, N=n1 - n0)
        part = dataclasses.replace(part, initial_state=None if starts is None else starts[n0:n1])
        r = _call(op, part)
        runs.append((n0, n1, t0, r[0], r[1], r[2] if want_h else None))

    if len(runs) == 1 and s.out is None:
        o = runs[0][3]
    else:
        o = s.out if s.out is not None else x.q.new_empty(x.B, x.T, x.HV, x.V)
        with torch.no_grad():
            for _, _, t0, o_part, _, _ in runs:
                o[:, t0:t0 + o_part.shape[1]].copy_(o_part)
    final = runs[0][4] if len(runs) == 1 else torch.cat([r[4] for r in runs])
    pads = [n for n in range(x.N) if s.is_pad[n]]
    bounds = sequences(x)
    with torch.no_grad():
        for n in pads:  # pad sequences ran from zeros: zero output, zero state, nothing written
            b, start, end = bounds[n]
            o[b, start:end] = 0
        final[pads] = 0
    if s.final_slots is not None:
        scatter_states(x.initial_state, s.final_slots, final)
    final = x.initial_state if s.inplace_final_state else (final if x.output_final_state else None)
    if not want_h:
        return o, final
    return o, final, _entry_states(x, s, starts, runs, bounds)


def _segments(x: KDAInputs, s: ServingArgs, want_h: bool) -> List[Tuple[int, int, int, int]]:
    """The op calls: ``(first sequence, end sequence, first token, end token)`` each.

    One call, except for packed sequences whose chunk-entry states are wanted: the op cuts a packed
    batch into chunks at multiples of 64 tokens from the start of the batch (a sequence starting
    inside a chunk has a shorter first chunk; csrc/cpu/chunk_fwd.cpp), so its checkpoints are a
    sequence's own chunk-entry states only where the sequence starts at such a multiple. A new call
    (views of the inputs, no copy) starts at each sequence longer than one chunk that does not;
    sequences of one chunk or less need only their start state, which is known.
    """
    if not want_h or x.cu_seqlens is None:
        return [(0, x.N, 0, x.T)]
    cu = x.seq_bounds
    segs, first = [], 0
    for n in range(x.N):
        if n > first and s.seq_lens[n] > CHUNK and (cu[n] - cu[first]) % CHUNK != 0:
            segs.append((first, n, cu[first], cu[n]))
            first = n
    segs.append((first, x.N, cu[first], cu[x.N]))
    return segs


def _entry_states(x: KDAInputs, s: ServingArgs, starts: Optional[torch.Tensor], runs,
                  bounds) -> torch.Tensor:
    """FLA's intermediate states from the checkpoints ``[n_slots, HV, K, V]`` (K-first) of the calls.

    Slot ``c`` of a call holds the state before its token ``origin + 64 c`` (csrc/cpu/chunk_fwd.cpp).
    Batch rows (no ``cu_seqlens``): row ``b`` enters its chunk ``c`` at slot ``b * NT + c``, so the
    checkpoints are ``h`` as they are (a view; one transposing copy for V-first). Packed: sequence
    ``n`` of a call starting at token ``t0`` enters its chunk ``c`` at slot ``(start_n - t0) / 64 + c``
    where 64 divides ``start_n - t0`` (every sequence longer than one chunk, by :func:`_segments`),
    else (one chunk) at its start state. Where every entry is the slot of its own position (one
    call, every sequence starting at a multiple of 64) the checkpoints are again ``h`` as they are;
    otherwise the entries are gathered (one copy). Entries of pad sequences are zeros.
    """
    kfirst = (lambda S: S.transpose(-1, -2)) if x.state_v_first else (lambda S: S)
    if x.cu_seqlens is None:
        ck = runs[0][5]
        h = kfirst(ck.view(x.B, -(-x.T // CHUNK), *ck.shape[1:])).contiguous()
        h[[n for n in range(x.N) if s.is_pad[n]]] = 0
        return h
    pos, pads = 0, []
    from_ck = []  # per call: (checkpoints, entry positions, their slots)
    from_start = ([], [])  # (entry positions, sequences)
    for n0, n1, t0, _, _, ck in runs:
        where, slots = [], []
        for n in range(n0, n1):
            _, start, end = bounds[n]
            nt = -(-(end - start) // CHUNK)
            if s.is_pad[n]:
                pads.extend(range(pos, pos + nt))
            if (start - t0) % CHUNK == 0:
                where.extend(range(pos, pos + nt))
                slots.extend(range((start - t0) // CHUNK, (start - t0) // CHUNK + nt))
            elif nt:  # one chunk (_segments): the state it starts from
                from_start[0].append(pos)
                from_start[1].append(n)
            pos += nt
        from_ck.append((ck, where, slots))
    ck0, where0, slots0 = from_ck[0]
    if len(runs) == 1 and not from_start[0] and where0 == slots0 and pos == ck0.shape[0]:
        h_k = ck0  # the checkpoints are the entries, in order
    else:
        h_k = ck0.new_empty(pos, *ck0.shape[1:])
        for ck, where, slots in from_ck:
            if where:
                h_k[where] = ck[slots]
        if from_start[0]:
            h_k[from_start[0]] = 0 if starts is None else kfirst(starts)[from_start[1]]
    h = kfirst(h_k).contiguous()
    h[pads] = 0
    return h.unsqueeze(0)
