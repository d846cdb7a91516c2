"""Loads the native C++ operator library (``torch.ops.kda.*``) shipped inside the package.

The library is optional: a pure-Python install (``TORCH_KDA_BUILD_EXT=0``, or a machine without a
compiler) has none, and then :data:`LOAD_ERROR` says why, for ``available_backends()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import torch

from ._checks import KDAInputs

_PACKAGE_DIR = Path(__file__).resolve().parent


def _load() -> Optional[str]:
    """Load ``libkda`` into the torch.ops registry; return None on success, else the reason."""
    candidates = sorted(_PACKAGE_DIR.glob("libkda.*")) + sorted(_PACKAGE_DIR.glob("kda.*.dll"))
    if not candidates:
        return ("the native library was not built (installed with TORCH_KDA_BUILD_EXT=0, or the C++ "
                "build failed or found no compiler); reinstall with "
                "`pip install --no-build-isolation .` and a C++17 compiler")
    try:
        torch.ops.load_library(str(candidates[0]))
    except Exception as exc:  # a stale or ABI-incompatible build must not break `import torch_kda`
        return f"the native library {candidates[0].name} failed to load: {exc}"
    if not hasattr(torch.ops.kda, "fused_recurrent"):
        return f"the native library {candidates[0].name} does not register kda::fused_recurrent"
    return None


LOAD_ERROR: Optional[str] = _load()


def fused_recurrent(x: KDAInputs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run checked inputs through ``torch.ops.kda.fused_recurrent`` (CPU, fused C++ kernels)."""
    o, final_state = torch.ops.kda.fused_recurrent(
        x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, x.use_qk_l2norm_in_kernel,
        x.use_gate_in_kernel, x.use_beta_sigmoid_in_kernel, x.allow_neg_eigval, x.lower_bound,
        x.state_v_first, x.cu_seqlens, x.A_log, x.dt_bias)
    return o, (final_state if x.output_final_state else None)
