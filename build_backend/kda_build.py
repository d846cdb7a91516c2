"""PEP 517 build backend for torch-kda: scikit-build-core, with checks that name the fix.

Two kinds of install, chosen by the environment variable ``TORCH_KDA_BUILD_EXT``:

- ``1`` (the default): the package with its native C++ operator, built by CMake against the torch
  of the build environment, so ``pip install --no-build-isolation .`` (pip's default isolated
  build would not see the installed torch). A missing prerequisite (scikit-build-core, torch,
  CMake or Ninja, a C++17 compiler) fails the build with a message that names the command that
  fixes it: a wheel without the native library is never produced by accident, and pip shows the
  message without ``-v`` because the build failed.
- ``0``: the pure-Python package (the reference backend), tagged ``py3-none-any``; no compiler,
  CMake or torch is needed to build it.

``pip`` hides what a successful build prints unless run with ``-v``, which is why a failed native
build is an error rather than a silent fall-back to pure Python.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_PURE_HINT = "for the pure-Python package (no compiler, no CMake): TORCH_KDA_BUILD_EXT=0 pip install ."
_TORCH_HINT = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   "
               "(or another torch build of your choice)")

try:
    from scikit_build_core import build as _skbuild
except ModuleNotFoundError as _exc:  # pip --no-build-isolation does not install build requirements
    raise ModuleNotFoundError(
        "torch-kda is built with scikit-build-core, which is not installed in this build "
        "environment (pip --no-build-isolation does not install build requirements). Fix:\n"
        "    pip install \"scikit-build-core>=0.10\" ninja cmake\n"
        "then run the install again.") from _exc

_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}


class NativeBuildError(RuntimeError):
    """A prerequisite of the native build is missing or the C++ build failed; the message says
    what to run."""


def _native_requested() -> bool:
    value = os.environ.get("TORCH_KDA_BUILD_EXT", "1").strip().lower()
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise NativeBuildError(f"TORCH_KDA_BUILD_EXT: expected 1 (native operator, the default) or 0 "
                           f"(pure Python), got {value!r}")


def _banner(lines: list) -> str:
    return "\n" + "\n".join("*** torch-kda: " + line for line in lines) + "\n"


def _configure() -> bool:
    """Select the kind of build from ``TORCH_KDA_BUILD_EXT``; returns True for the native one.

    scikit-build-core reads every setting from ``SKBUILD_*`` environment variables as well: the
    pure-Python build switches CMake off and marks the wheel pure (``py3-none-any``).
    """
    if _native_requested():
        return True
    os.environ["SKBUILD_WHEEL_CMAKE"] = "false"
    os.environ["SKBUILD_WHEEL_PLATLIB"] = "false"
    return False


def _check_torch() -> None:
    """The native operator is compiled against the torch that the build environment imports."""
    if importlib.util.find_spec("torch") is not None:
        return
    msg = _banner([
        "the native C++ operator is built against the installed PyTorch, and this build environment",
        "cannot import torch (not installed, or pip's isolated build environment hides it). Fix:",
        f"    {_TORCH_HINT}",
        "    pip install \"scikit-build-core>=0.10\" ninja cmake",
        "    pip install --no-build-isolation .        (python -m build: --wheel --no-isolation)",
        _PURE_HINT,
    ])
    print(msg, file=sys.stderr)
    raise NativeBuildError("torch is not importable in the build environment (what to run is printed above)")


def _check_build_tools(requires: list) -> None:
    """scikit-build-core asks for ``cmake`` / ``ninja`` wheels when none is on the PATH; pip installs
    them in an isolated build only, so with ``--no-build-isolation`` name them here."""
    from importlib import metadata

    missing = []
    for req in requires:
        name = req.split(">")[0].split("<")[0].split("=")[0].split(";")[0].split("[")[0].strip()
        if name in ("cmake", "ninja"):
            try:
                metadata.version(name)
            except metadata.PackageNotFoundError:
                missing.append(name)
    if missing:
        msg = _banner([
            f"building the native C++ operator needs {' and '.join(missing)}, not found on the PATH "
            "nor installed in this environment. Fix:",
            f"    pip install {' '.join(missing)}      (or your system's package, e.g. apt-get install cmake ninja-build)",
            _PURE_HINT,
        ])
        print(msg, file=sys.stderr)
        raise NativeBuildError(f"{' and '.join(missing)} not found (what to run is printed above)")


def _native_build(build, *args, **kwargs):
    _check_torch()
    _check_build_tools(list(_skbuild.get_requires_for_build_wheel(None)))
    try:
        return build(*args, **kwargs)
    except (Exception, SystemExit) as exc:
        msg = _banner([
            f"the native C++ operator failed to build ({type(exc).__name__}: {exc}); CMake's output is above.",
            "It needs a C++17 compiler with OpenMP (Debian/Ubuntu: apt-get install g++), CMake >= 3.18",
            "and the torch it is built against (pip install --no-build-isolation . uses the installed one).",
            _PURE_HINT,
        ])
        print(msg, file=sys.stderr)
        raise NativeBuildError("the native C++ operator failed to build (what to run is printed above)") from exc


def _requires(hook, config_settings):
    if _configure():
        _check_torch()
    return hook(config_settings)


def get_requires_for_build_wheel(config_settings=None):
    return _requires(_skbuild.get_requires_for_build_wheel, config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _requires(_skbuild.get_requires_for_build_editable, config_settings)


def get_requires_for_build_sdist(config_settings=None):
    return _skbuild.get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _configure()
    return _skbuild.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


if hasattr(_skbuild, "prepare_metadata_for_build_editable"):  # optional PEP 660 hook

    def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
        _configure()
        return _skbuild.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    if not _configure():
        return _skbuild.build_wheel(wheel_directory, config_settings, metadata_directory)
    return _native_build(_skbuild.build_wheel, wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    if not _configure():
        return _skbuild.build_editable(wheel_directory, config_settings, metadata_directory)
    return _native_build(_skbuild.build_editable, wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _skbuild.build_sdist(sdist_directory, config_settings)
