"""Drop-in entry points with the signatures of other KDA libraries, backed by this one.

- :mod:`torch_kda.compat.flash_kda`: MoonshotAI FlashKDA's ``flash_kda.fwd`` (in-place outputs,
  V-first state, gate/norm/sigmoid in the op). Calls FlashKDA itself when it is installed and the
  inputs qualify, else :func:`torch_kda.chunk_kda`, so code written for FlashKDA runs anywhere.

Nothing here imports ``flash_kda`` or ``fla`` at import time.
"""

from . import flash_kda

__all__ = ["flash_kda"]
