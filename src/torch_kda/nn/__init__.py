"""The KDA layer: :class:`KimiDeltaAttention`, its :class:`KDAConfig`, :func:`build_kda`, the
decoding :class:`KDACache`, and a converter from Hugging Face Kimi-Linear weights.

Parameter names, shapes and initialisation follow flash-linear-attention's
``fla.layers.kda.KimiDeltaAttention`` (Kimi Linear report, arXiv 2510.26692). Importing this
package never imports ``fla`` or ``transformers``.
"""

from .cache import KDACache
from .config import BACKENDS, MODES, KDAConfig
from .conv import ShortConvolution
from .hf import convert_hf_kimi_linear_state_dict, kda_config_from_hf, kda_from_hf_kimi_linear
from .layer import KimiDeltaAttention, build_kda
from .norm import GatedRMSNorm

__all__ = [
    "KimiDeltaAttention",
    "KDAConfig",
    "KDACache",
    "build_kda",
    "ShortConvolution",
    "GatedRMSNorm",
    "convert_hf_kimi_linear_state_dict",
    "kda_config_from_hf",
    "kda_from_hf_kimi_linear",
    "BACKENDS",
    "MODES",
]
