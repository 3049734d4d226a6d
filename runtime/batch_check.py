"""Refuse a ``make_batch`` that does not return the rows it was asked for, or no data at all.

The trainer asks for the global batch and gives each data-parallel rank its own slice of
rows; a ``make_batch`` that ignores ``batch_size`` would otherwise train on fewer (or other)
samples than the plan says without any error (a slice past the end is empty or short).
Every tensor in the inputs (positional or keyword) and the target must have ``batch_size``
rows along dim 0.  A batch of meta tensors (shapes without data) is refused too, with the
message the plan-time check gives (``autopar.core.model_check``).  Both checks live with the
model file, so the CLI verbs refuse such a file before any process starts.
"""
from __future__ import annotations

from typing import Any

from autopar.core.modelfile import check_batch_rows


def check_batch(inputs: Any, target: Any, batch_size: int, model_path: Any) -> None:
    """Rows (``check_batch_rows``), then data: a ``ModelFileError`` for a batch that has neither."""
    from autopar.core.model_check import meta_batch_error

    check_batch_rows(inputs, target, batch_size, model_path)
    error = meta_batch_error(model_path, batch_size, inputs, target)
    if error is not None:
        raise error
