"""Argument checks hold under ``torch.compile`` as they do eagerly: same exception type, same words.

While ``torch.compile`` traces, :func:`torch_kda._checks.check_cu_seqlens` leaves the value checks
to the consumer that reads the values (reading them in the trace would break the graph): the
reference checks where it reads them, the native op in C++ (with ``TORCH_CHECK_VALUE``, so a
Python ``ValueError`` like the eager check). Small shapes, ``backend="eager"`` for the compiler
(the checks are Dynamo's business, not Inductor's) plus one Inductor run of the native op.
"""

from __future__ import annotations

import pytest
import torch

import torch_kda

FUNCS = {"chunk_kda": torch_kda.chunk_kda, "fused_recurrent_kda": torch_kda.fused_recurrent_kda}

# The inputs: T=12, H=1, HV=2, K=8, V=4.
BAD_CU = [
    ([0, 5, 9], r"cu_seqlens\[-1\] must equal T = 12, got 9"),
    ([0, 7, 5, 12], r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 7 > cu_seqlens\[2\] = 5"),
    ([2, 5, 12], r"cu_seqlens\[0\] must be 0, got 2"),
]


def _inputs():
    gen = torch.Generator().manual_seed(11)
    T, H, HV, K, V = 12, 1, 2, 8, 4
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -torch.rand(1, T, HV, K, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("fname", FUNCS)
@pytest.mark.parametrize("cu,match", BAD_CU, ids=["last", "decreasing", "first"])
def test_bad_cu_seqlens_raise_the_same_value_error_eager_and_compiled(cu, match, fname, backend):
    fn = FUNCS[fname]

    def f(q, k, v, g, beta, cu_seqlens):
        return fn(q, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, backend=backend)

    ins = _inputs()
    cu_t = torch.tensor(cu)
    with pytest.raises(ValueError, match=match):
        f(*ins, cu_t)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=match):
        torch.compile(f, backend="eager")(*ins, cu_t)


def test_native_op_error_type_survives_inductor():
    ins = _inputs()

    def f(q, k, v, g, beta, cu_seqlens):
        return torch_kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens, backend="native",
                                   use_qk_l2norm_in_kernel=True)

    torch._dynamo.reset()
    compiled = torch.compile(f)
    o, _ = compiled(*ins, torch.tensor([0, 4, 12]))  # a valid call first: compiles the graph
    assert o.shape == ins[2].shape
    with pytest.raises(ValueError, match="non-decreasing"):
        compiled(*ins, torch.tensor([0, 7, 5, 12]))
