"""Loads the native C++ operator library (``torch.ops.kda.*``) shipped inside the package.

The library is optional: a pure-Python install (``TORCH_KDA_BUILD_EXT=0``) has none, and then
:data:`LOAD_ERROR` says why, for ``available_backends()``. It is looked up in every folder of the
package's ``__path__``: a regular install has one (site-packages/torch_kda); an editable install
(``pip install --no-build-isolation -e .``, scikit-build-core) has two, the source folder
(src/torch_kda, the Python files) and site-packages/torch_kda (where CMake installed ``libkda``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ._checks import KDAInputs, ServingArgs, check_value_domain, warn_unstable_writes

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


def _run(op, x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    warn_unstable_writes(x)
    o, final_state = op(
        x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, x.use_qk_l2norm_in_kernel,
        x.use_gate_in_kernel, x.use_beta_sigmoid_in_kernel, x.allow_neg_eigval, x.lower_bound,
        x.state_v_first, x.cu_seqlens, x.A_log, x.dt_bias)
    return o, (final_state if x.output_final_state else None)


def fused_recurrent(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run checked inputs through ``torch.ops.kda.fused_recurrent`` (CPU, fused C++ kernels).

    The op itself rejects ``g > 0`` and ``beta`` outside ``[0, 2]`` (in its pre-processing pass);
    the warning about unnormalised keys is raised here (free with the l2 norm on).
    """
    return _run(torch.ops.kda.fused_recurrent, x)


def chunk(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run checked inputs through ``torch.ops.kda.chunk`` (CPU, chunkwise form with matrix
    products, chunks of 64 tokens; same results as :func:`fused_recurrent` to rounding)."""
    return _run(torch.ops.kda.chunk, x)


def prefer_chunk(x: KDAInputs) -> bool:
    """``backend="auto"`` on CPU: whether the chunkwise kernel beats the recurrent one here.

    The one place of the rule; derived from the crossovers measured side by side in
    docs/benchmarks.md ("Chunkwise vs recurrent forward"), where the numbers and the command are.
    Decoding (one token per sequence) always runs the recurrent kernel.
    """
    tokens_per_seq = x.B * x.T / max(1, x.N)
    if tokens_per_seq < _CHUNK_MIN_TOKENS:
        return False
    return _CHUNK_WINS


# Filled from the measurements in docs/benchmarks.md (see prefer_chunk).
_CHUNK_MIN_TOKENS = 256
_CHUNK_WINS = False


def _any_requires_grad(x: KDAInputs) -> Optional[str]:
    for name in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"):
        t = getattr(x, name)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return name
    return None


def serving(x: KDAInputs, s: ServingArgs):
    """Serving arguments through ``torch.ops.kda.fused_recurrent_serving`` (in-place pool updates,
    snapshots, pad slots, head-wise beta; forward only). Returns ``(o, final_state)``."""
    if torch.is_grad_enabled():
        name = _any_requires_grad(x)
        if name is not None:
            raise ValueError(f"backend='native' runs the serving arguments (ssm_state_indices, "
                             f"inplace_final_state, out=, head-wise beta) forward only, but {name} "
                             "requires grad; use backend='reference' for gradients")
    # The serving op has its own pre-processing: the domain checks (g <= 0, beta in [0, 2]) run
    # here, before anything is written to the pool (one reduction over g and beta).
    check_value_domain(x)
    out = s.out if s.out is not None else torch.empty(x.B, x.T, x.HV, x.V, dtype=x.q.dtype)
    final = None
    if not s.inplace_final_state and x.output_final_state:
        shape = (x.N, x.HV, x.V, x.K) if x.state_v_first else (x.N, x.HV, x.K, x.V)
        final = torch.empty(shape, dtype=x.compute_dtype)
    torch.ops.kda.fused_recurrent_serving(
        x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, s.ssm_state_indices,
        s.num_accepted_tokens, out, final, s.pad_slot_id, s.inplace_final_state,
        x.use_qk_l2norm_in_kernel, x.use_gate_in_kernel, x.use_beta_sigmoid_in_kernel,
        x.allow_neg_eigval, x.lower_bound, x.state_v_first, x.cu_seqlens, x.A_log, x.dt_bias)
    return out, (x.initial_state if s.inplace_final_state else final)
