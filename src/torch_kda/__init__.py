"""torch-kda: Kimi Delta Attention (KDA) for PyTorch, on any device.

- :func:`chunk_kda`, :func:`fused_recurrent_kda`: FLA-compatible functional API with a
  ``backend=`` switch (``"auto" | "native" | "reference" | "fla"``);
- :func:`kda_gate`: the in-op gate as a standalone function;
- :mod:`torch_kda.reference`: the pure-PyTorch definition (recurrent and chunkwise);
- :mod:`torch_kda.nn`: the ``KimiDeltaAttention`` layer, weight-compatible with FLA's;
- :func:`available_backends`: what runs here and why not the rest.

The math is specified in the repository's docs/math.md (Kimi Linear report, arXiv 2510.26692).
"""

from . import compat, reference
from .api import BACKENDS, BackendStatus, available_backends, chunk_kda, fused_recurrent_kda, kda_gate

__version__ = "0.1.0"

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_gate", "available_backends", "BackendStatus",
           "BACKENDS", "reference", "compat", "__version__"]
