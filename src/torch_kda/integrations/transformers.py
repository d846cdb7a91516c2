"""Hugging Face ``transformers`` Kimi-Linear models with their KDA computed by torch-kda on CPU.

``transformers`` (tested: 5.24.0) ships ``KimiLinearForCausalLM``. Its KDA layer,
``KimiLinearDeltaAttention``, calls two functions of
``transformers.models.kimi_linear.modeling_kimi_linear``: ``chunk_kimi_delta_attention`` (prefill
and training) and ``recurrent_kimi_delta_attention`` (one-token decoding with the cache). When the
module is imported, transformers binds each to flash-linear-attention's kernel if ``fla`` imports,
else to its own pure-PyTorch loops (correct, but ~100x slower than torch-kda's native operator;
docs/benchmarks.md). On a CPU machine with ``fla-core`` and ``triton`` installed it binds FLA's
Triton kernels, which then fail on CPU tensors.

:func:`use_torch_kda` routes those two calls, for the KDA layers of one model, to
:func:`torch_kda.chunk_kda` and :func:`torch_kda.fused_recurrent_kda` (forward and backward, so
training works, and ``model.generate`` with its cache). How: the two module-level names are
replaced, once per process, by routers that keep the function transformers bound; each KDA layer
of the model gets a ``forward`` that marks (in a context variable) which implementation its calls
use. Layers of other models, and tensors not on the CPU, keep what transformers bound. The
weights, the config, ``save_pretrained`` and ``from_pretrained`` are untouched: call
:func:`use_torch_kda` again after loading.

``implementation="transformers"`` routes the same calls to transformers' own pure-PyTorch
functions instead (what it runs where FLA does not import): the baseline the ``hf`` command and
the tests compare with, which also works where FLA + Triton are installed.

Importing this module does not import ``transformers``; :func:`use_torch_kda` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
import time
import types
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

__all__ = ["use_torch_kda", "kda_layers", "kda_clock", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("torch_kda", "transformers")

_CHUNK = "chunk_kimi_delta_attention"
_RECURRENT = "recurrent_kimi_delta_attention"
_LAYER_CLASS = "KimiLinearDeltaAttention"

# Which implementation the KDA calls of the layer whose forward is running use (None: not routed).
_ROUTE: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("torch_kda_hf_route", default=None)


def kda_layers(model: torch.nn.Module) -> list:
    """The ``KimiLinearDeltaAttention`` modules of ``model`` (in ``model.modules()`` order)."""
    return [m for m in model.modules() if type(m).__name__ == _LAYER_CLASS
            and type(m).__module__.startswith("transformers.models.kimi_linear")]


def use_torch_kda(model: torch.nn.Module, implementation: str = "torch_kda") -> torch.nn.Module:
    """Run the KDA of a transformers Kimi-Linear model through torch-kda on CPU; returns ``model``.

    Args:
        model: a ``transformers`` model containing ``KimiLinearDeltaAttention`` layers
            (``KimiLinearForCausalLM``, ``KimiLinearModel``, or a single layer). Modified in place.
        implementation: ``"torch_kda"`` (default): :func:`torch_kda.chunk_kda` for prefill and
            training, :func:`torch_kda.fused_recurrent_kda` for one-token decoding (the native
            operator; arithmetic and state in fp32). ``"transformers"``: transformers' own
            pure-PyTorch KDA functions, whatever transformers bound at import (FLA or not).
            Calling again switches; CUDA tensors always keep what transformers bound.

    Returns:
        ``model`` itself (for chaining: ``model = use_torch_kda(AutoModelForCausalLM...)``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: unknown ``implementation``, or ``model`` has no Kimi-Linear KDA layer.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    layers = kda_layers(model)
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) has no transformers {_LAYER_CLASS} layer; "
                         "use_torch_kda works on Hugging Face Kimi-Linear models")
    forward = _forward_torch_kda if implementation == "torch_kda" else _forward_transformers
    for layer in layers:
        _install_routers(sys.modules[type(layer).__module__])
        # A bound method (not a closure) so that copy.deepcopy rebinds it to the copy.
        layer.forward = types.MethodType(forward, layer)
    return model


# --------------------------------------------------------------------------------------------
# Layer forwards: mark the route, run the class's own forward
# --------------------------------------------------------------------------------------------

def _run_routed(layer: torch.nn.Module, route: str, args: tuple, kwargs: dict):
    token = _ROUTE.set(route)
    try:
        return type(layer).forward(layer, *args, **kwargs)
    finally:
        _ROUTE.reset(token)


def _forward_torch_kda(self, *args, **kwargs):
    return _run_routed(self, "torch_kda", args, kwargs)


def _forward_transformers(self, *args, **kwargs):
    return _run_routed(self, "transformers", args, kwargs)


# --------------------------------------------------------------------------------------------
# Routers in place of transformers' two module-level KDA functions
# --------------------------------------------------------------------------------------------

def _install_routers(module: types.ModuleType) -> None:
    originals: Dict[str, Callable] = module.__dict__.setdefault("_torch_kda_originals", {})
    for name, router in ((_CHUNK, _chunk_router), (_RECURRENT, _recurrent_router)):
        current = getattr(module, name)
        if not getattr(current, "_torch_kda_router", False):  # first call, or the module was reloaded
            originals[name] = current
            setattr(module, name, _bind_router(router, module, current))


def _bind_router(router: Callable, module: types.ModuleType, original: Callable) -> Callable:
    # Bound to its module, so a reloaded module (new originals) gets routers of its own.
    def routed(*args, **kwargs):
        return router(module, *args, **kwargs)

    routed._torch_kda_router = True
    routed.__name__ = getattr(original, "__name__", router.__name__)
    routed.__doc__ = getattr(original, "__doc__", None)
    return routed


def _original(module: types.ModuleType, name: str) -> Callable:
    return module._torch_kda_originals[name]


def _pure_torch(fn: Callable) -> Callable:
    """transformers' own pure-PyTorch function behind the wrapper it bound (FLA's or its own)."""
    if isinstance(fn, torch.nn.Module):  # with `kernels` installed: a module whose forward calls it
        closure = type(fn).forward.__closure__ or ()
        fn = next((c.cell_contents for c in closure if callable(c.cell_contents)), fn)
    return inspect.unwrap(fn)


def _chunk_router(module, *args, **kwargs):
    route = _ROUTE.get()
    original = _original(module, _CHUNK)
    if route is None or not _on_cpu(args, kwargs):
        return original(*args, **kwargs)
    fn = _pure_torch(original) if route == "transformers" else _chunk_torch_kda
    return _timed(fn, args, kwargs)


def _recurrent_router(module, *args, **kwargs):
    route = _ROUTE.get()
    original = _original(module, _RECURRENT)
    if route is None or not _on_cpu(args, kwargs):
        return original(*args, **kwargs)
    fn = _pure_torch(original) if route == "transformers" else _recurrent_torch_kda
    return _timed(fn, args, kwargs)


# --------------------------------------------------------------------------------------------
# Timing of the routed KDA calls inside a model (for the `hf --bench` benchmark)
# --------------------------------------------------------------------------------------------

_CLOCK: Optional[List[float]] = None  # [forward seconds, backward seconds] while kda_clock() is open


@contextlib.contextmanager
def kda_clock() -> Iterator[List[float]]:
    """Accumulate the time spent in routed KDA calls: yields ``[forward_s, backward_s]``.

    Forward: wall time of each call. Backward: from the moment autograd reaches the call's output
    to the moment it has produced every input's gradient (the autograd engine may run a few small
    unrelated nodes in between, so this is an upper bound). Only calls of models routed by
    :func:`use_torch_kda` are counted; not thread-safe (benchmark use).
    """
    global _CLOCK
    previous, _CLOCK = _CLOCK, [0.0, 0.0]
    try:
        yield _CLOCK
    finally:
        _CLOCK = previous


class _BackwardStart(torch.autograd.Function):
    # Identity on the output; its backward runs just before the KDA call's backward.
    @staticmethod
    def forward(ctx, marks, x):
        ctx.marks = marks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.marks.append(time.perf_counter())
        return None, grad


class _BackwardEnd(torch.autograd.Function):
    # Identity on the inputs; its backward runs once every input's gradient is ready.
    @staticmethod
    def forward(ctx, clock, marks, *xs):
        ctx.clock, ctx.marks = clock, marks
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.marks:
            ctx.clock[1] += time.perf_counter() - ctx.marks.pop()
        return (None, None, *grads)


def _timed(fn: Callable, args: tuple, kwargs: dict):
    clock = _CLOCK
    if clock is None:
        return fn(*args, **kwargs)
    names = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    keys = [k for k, a in kwargs.items() if isinstance(a, torch.Tensor) and a.requires_grad]
    marks: List[float] = []
    track = torch.is_grad_enabled() and bool(names or keys)
    if track:
        args, kwargs = list(args), dict(kwargs)
        wrapped = _BackwardEnd.apply(clock, marks, *[args[i] for i in names], *[kwargs[k] for k in keys])
        for i, w in zip(names, wrapped[:len(names)]):
            args[i] = w
        for k, w in zip(keys, wrapped[len(names):]):
            kwargs[k] = w
    start = time.perf_counter()
    o, state = fn(*args, **kwargs)
    clock[0] += time.perf_counter() - start
    if track and o.requires_grad:
        o = _BackwardStart.apply(marks, o)
    return o, state


def _on_cpu(args: tuple, kwargs: dict) -> bool:
    first = args[0] if args else kwargs.get("query")
    return isinstance(first, torch.Tensor) and first.device.type == "cpu"


def _chunk_torch_kda(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                     cu_seqlens: Optional[torch.Tensor] = None, **_: Any):
    # transformers' signature: [B, T, H, K] tensors, g the log-decay already computed by the layer
    # (fp32), beta after the sigmoid; the scale is K ** -0.5 in both.
    import torch_kda

    return torch_kda.chunk_kda(query, key, value, g, beta, initial_state=initial_state,
                               output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                               chunk_size=chunk_size)


def _recurrent_torch_kda(query, key, value, g, beta, initial_state=None, output_final_state: bool = False,
                         use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                         **_: Any):
    import torch_kda

    return torch_kda.fused_recurrent_kda(query, key, value, g, beta, initial_state=initial_state,
                                         output_final_state=output_final_state,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                         cu_seqlens=cu_seqlens)
