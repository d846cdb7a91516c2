"""Thin adapters that plug torch-kda into other libraries; each imports its library only when used.

- :mod:`torch_kda.integrations.fla`: ``register()`` makes torch-kda the CPU backend of
  flash-linear-attention's dispatch registry, so ``fla.ops.kda.chunk_kda`` /
  ``fused_recurrent_kda`` / ``fused_recurrent_kda_fwd`` run the native operator on CPU tensors.
- :mod:`torch_kda.integrations.transformers`: ``use_torch_kda(model)`` makes a Hugging Face
  ``transformers`` Kimi-Linear model run its KDA through torch-kda on CPU.

Importing this package (or ``torch_kda``) never imports ``fla``, ``transformers`` or ``kernels``.
docs/integrations.md describes both, what runs where, and the versions tested.
"""

__all__ = ["fla", "transformers"]


def __getattr__(name: str):
    # Submodules load on first access, so `torch_kda.integrations.fla` works without an explicit
    # import while `import torch_kda.integrations` stays free of third-party imports.
    if name in __all__:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
