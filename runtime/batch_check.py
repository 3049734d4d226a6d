"""Refuse a ``make_batch`` that does not return the rows it was asked for.

The trainer asks for the global batch and gives each data-parallel rank its own slice of
rows; a ``make_batch`` that ignores ``batch_size`` would otherwise train on fewer (or other)
samples than the plan says without any error (a slice past the end is empty or short).
Every tensor in the inputs (positional or keyword) and the target must have ``batch_size``
rows along dim 0.  The check lives with the model file (``autopar.core.modelfile``), so the
CLI verbs refuse such a file at capture, before any process starts.
"""
from __future__ import annotations

from autopar.core.modelfile import check_batch_rows  # noqa: F401  (the runtime's name for it)
