"""autopar: plan a model's parallel layout, simulate it, run it (docs/runtime.md, README).

The package's Python functions are loaded on first use, so ``import autopar`` stays cheap
(no torch import):

* ``autopar.prepare(plan, ...)`` -- a plan applied to a model inside your own training loop,
  under torchrun (``autopar.runtime.api.prepare``; docs/runtime.md, "Your own loop").
"""
from __future__ import annotations

_LAZY = {"prepare": ("autopar.runtime.api", "prepare"), "PreparedJob": ("autopar.runtime.api", "PreparedJob")}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
