"""PEP 517 build backend for torch-kda: scikit-build-core with a pure-Python fallback.

The native operator is optional. ``TORCH_KDA_BUILD_EXT=0`` skips CMake entirely (no compiler
needed); otherwise a failed native build (no compiler, no CMake, no libtorch, compile error) is
reported and the pure-Python package is built instead, unless ``TORCH_KDA_REQUIRE_EXT=1`` asks
for the native library to be mandatory (what ``make test`` does, so CI never tests a silent
fallback).
"""

from __future__ import annotations

import os
import sys

from scikit_build_core import build as _skbuild

_FALSE = {"0", "false", "no", "off"}


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in _FALSE


def _pure_python(keep_platform_tag: bool = False) -> None:
    # scikit-build-core reads every setting from SKBUILD_* environment variables as well.
    os.environ["SKBUILD_WHEEL_CMAKE"] = "false"
    if keep_platform_tag:
        # The metadata was already prepared for a platform wheel: keep the tag consistent.
        os.environ["SKBUILD_WHEEL_PLATLIB"] = "true"


def _with_fallback(build, *args, **kwargs):
    if not _flag("TORCH_KDA_BUILD_EXT", "1"):
        _pure_python()
        return build(*args, **kwargs)
    try:
        return build(*args, **kwargs)
    except (Exception, SystemExit) as exc:
        if _flag("TORCH_KDA_REQUIRE_EXT", "0"):
            raise
        print(
            "\n*** torch-kda: the native C++ operator failed to build "
            f"({type(exc).__name__}: {exc}).\n"
            "*** Installing the pure-Python package instead: backend='auto' will use the "
            "PyTorch reference.\n*** torch_kda.available_backends() says why native is missing. "
            "Set TORCH_KDA_REQUIRE_EXT=1 to make this an error.\n",
            file=sys.stderr,
        )
        _pure_python(keep_platform_tag=True)
        return build(*args, **kwargs)


def get_requires_for_build_wheel(config_settings=None):
    if not _flag("TORCH_KDA_BUILD_EXT", "1"):
        _pure_python()
    return _skbuild.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    if not _flag("TORCH_KDA_BUILD_EXT", "1"):
        _pure_python()
    return _skbuild.get_requires_for_build_editable(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    return _skbuild.get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    if not _flag("TORCH_KDA_BUILD_EXT", "1"):
        _pure_python()
    return _skbuild.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _with_fallback(_skbuild.build_wheel, wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _with_fallback(_skbuild.build_editable, wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _skbuild.build_sdist(sdist_directory, config_settings)
