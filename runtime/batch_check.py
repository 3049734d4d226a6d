"""Refuse a ``make_batch`` that does not return the rows it was asked for.

The trainer asks for the global batch and gives each data-parallel rank its own slice of
rows; a ``make_batch`` that ignores ``batch_size`` would otherwise train on fewer (or other)
samples than the plan says without any error (a slice past the end is empty or short).
Every tensor in the inputs (positional or keyword) and the target must have ``batch_size``
rows along dim 0.
"""
from __future__ import annotations

from typing import Any

import torch

from autopar.core.errors import ModelFileError


def _tensors(obj: Any, where: str):
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{where}[{k!r}]")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{where}[{i}]")


def check_batch_rows(inputs: Any, target: Any, batch_size: int, model_path: Any) -> None:
    for where, t in [*_tensors(inputs, "inputs"), *_tensors(target, "target")]:
        rows = t.shape[0] if t.dim() else None
        if rows != batch_size:
            got = "a 0-d tensor" if rows is None else f"{rows} rows"
            raise ModelFileError(
                f"{model_path}: make_batch({batch_size}) returned {where} with {got} (shape {tuple(t.shape)}); "
                f"every input and the target must have batch_size = {batch_size} rows along dim 0. Make "
                f"make_batch build its tensors from its batch_size argument.")
