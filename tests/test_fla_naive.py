"""An independent oracle from outside the project: flash-linear-attention's own naive KDA.

``fla-core`` is a pure-Python wheel that installs on CPU machines (``make test`` installs it);
importing the ``fla`` package needs Triton, so only its torch-only ``ops/kda/naive.py`` file is
loaded, by path, without importing ``fla`` itself.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kda_testing import make_problem, rel_err
from torch_kda import reference


def _load_fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None:
        raise RuntimeError("fla-core is not installed; `make test` installs it (pip install --no-deps fla-core einops)")
    path = os.path.join(spec.submodule_search_locations[0], "ops", "kda", "naive.py")
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fla_naive():
    return _load_fla_naive()


@pytest.mark.parametrize("group", [1, 2])
def test_reference_matches_fla_naive_recurrent(fla_naive, group):
    p = make_problem(B=2, T=33, H=2, HV=2 * group, K=8, V=6, gate="none", l2norm=False,
                     beta_sigmoid=False, seed=21, dtype=torch.float32)
    o_fla, s_fla = fla_naive.naive_recurrent_kda(*p.args, initial_state=p.kwargs["initial_state"],
                                                 output_final_state=True)
    o, s = reference.fused_recurrent_kda(*p.args, **p.kwargs)
    assert rel_err(o, o_fla) < 1e-5 and rel_err(s, s_fla) < 1e-5


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_reference_chunk_matches_fla_naive_chunk(fla_naive, chunk_size):
    p = make_problem(B=1, T=128, H=2, HV=4, K=8, V=6, gate="none", l2norm=False, beta_sigmoid=False,
                     seed=22, dtype=torch.float32)
    o_fla, s_fla = fla_naive.naive_chunk_kda(*p.args, initial_state=p.kwargs["initial_state"],
                                             output_final_state=True, chunk_size=chunk_size)
    o, s = reference.chunk_kda(*p.args, **p.kwargs, chunk_size=chunk_size)
    assert rel_err(o, o_fla) < 1e-5 and rel_err(s, s_fla) < 1e-5
