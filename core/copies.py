"""Bytes an op copies beyond its own arithmetic, read off the meta tensors of a trace.

Strides decide these, so only a capture that ran the graph on meta tensors (the fx path)
can see them:

* ``reshape`` / ``flatten`` return a view when the strides allow one and a contiguous copy
  otherwise; ``contiguous`` copies a non-contiguous tensor (PyTorch docs, ``torch.reshape``:
  "a view if possible, otherwise a copy").  Whether a view is possible is asked of torch
  itself: ``Tensor.view`` raises exactly when it is not.
* ``torch.matmul`` with a batched operand folds the batch dimensions before calling ``bmm``
  (or ``mm``): each operand, expanded to the common batch shape, is reshaped to
  ``(batch, rows, cols)`` -- a copy when that reshape cannot be a view, as for the
  ``q`` / ``k`` / ``v`` of hand-written attention, which are transposed views of one ``qkv``
  projection (ATen ``LinearAlgebra.cpp``, ``_matmul_impl``).
* out-of-place ``masked_fill`` is ``clone`` then the in-place fill (ATen
  ``TensorAdvancedIndexing.cpp``, ``masked_fill``).

The result is the bytes of the tensors written by those copies; the cost model prices them as
copies of that size (a read and a write each) from the profile's ``copy`` rows.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

RESHAPES = ("reshape", "flatten")
MATMULS = ("matmul", "__matmul__")


def copied_bytes(name: str, args: tuple, kwargs: dict, results: dict[str, Any]) -> int:
    """Bytes written by the hidden copies of the traced call ``name(*args)`` (0: none)."""
    args, kwargs = fx.node.map_aggregate((tuple(args), dict(kwargs)), lambda a: _meta(a, results))
    tensors = list(args)
    first = tensors[0] if tensors else None
    if not isinstance(first, torch.Tensor):
        return 0
    if name in RESHAPES:
        out = _meta_result(name, first, args[1:], kwargs)
        return 0 if out is None or _viewable(first, tuple(out.shape)) else _nbytes(out)
    if name == "contiguous":
        return 0 if first.is_contiguous() else _nbytes(first)
    if name == "masked_fill":
        return _nbytes(first)
    if name in MATMULS and len(tensors) > 1 and isinstance(tensors[1], torch.Tensor):
        return _matmul_copies(first, tensors[1])
    return 0


def _matmul_copies(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.dim() < 2 or b.dim() < 2 or max(a.dim(), b.dim()) < 3:
        return 0                          # vectors and plain matrices: mm / mv, no folding
    if b.dim() == 2:                      # (..., n, k) @ (k, m): a folded to (-1, k)
        return 0 if _viewable(a, (a.numel() // a.shape[-1], a.shape[-1])) else _nbytes(a)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    total = 0
    for t in (a, b):
        expanded = t.expand(*batch, *t.shape[-2:])
        folded = (max(1, expanded.numel() // max(1, t.shape[-2] * t.shape[-1])), t.shape[-2], t.shape[-1])
        if not _viewable(expanded, folded):
            total += _nbytes(expanded)
    return total


def _viewable(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    try:
        t.view(shape)
    except RuntimeError:
        return False
    return True


def _meta_result(name: str, t: torch.Tensor, rest: tuple, kwargs: dict) -> torch.Tensor | None:
    try:
        out = getattr(t, name)(*rest, **kwargs)
    except Exception:                     # arguments the meta run could not resolve
        return None
    return out if isinstance(out, torch.Tensor) else None


def _meta(a: Any, results: dict[str, Any]) -> Any:
    return results.get(a.name) if isinstance(a, fx.Node) else a


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()
