"""The suite tests the installed package, native operator included: nothing is skipped.

It imports the installed ``torch_kda`` (regular or editable install; the package lives in
``src/``, so running from the repository root does not shadow it). A package without the native
library (``TORCH_KDA_BUILD_EXT=0``) fails here at once, with the reason, instead of skipping tests.
"""

import pytest

import torch_kda
from torch_kda import _native


def pytest_configure(config):
    config.addinivalue_line("markers", "native: needs the native C++ operator (always built by make test)")


def pytest_sessionstart(session):
    if _native.LOAD_ERROR is not None:
        raise pytest.UsageError(
            f"the native operator is unavailable ({_native.LOAD_ERROR}); the test suite needs it. "
            f"Imported torch_kda from {torch_kda.__file__}: run `make test`, or pytest after "
            "`pip install --no-build-isolation .`")
