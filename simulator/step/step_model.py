"""The step model's forms: how a context's step is composed, chosen once when the evaluator builds
the context (step/context.build_context), and the model chunks' masks the per-layer terms read.

The step itself -- per layer, per model chunk, per pipeline rank -- is composed in step/compose.py,
which the search, ``autopar simulate``, ``autopar report`` and the plan's ``predicted`` block all
read (evaluator.closed_form_step); this module names its overlapped form (``OVERLAPPED``, a
GPU's streams), cpu_node.py its serial one (``SERIAL``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from autopar.simulator.step.compose import overlapped_chunk_times, overlapped_step


def chunk_masks(starts: np.ndarray, num_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(head, tail, not_tail): the first layer of each model chunk, its last, and the others."""
    head = np.zeros(num_layers, dtype=bool)
    head[starts] = True
    tail = np.zeros(num_layers, dtype=bool)
    tail[np.asarray(starts)[1:] - 1] = True
    tail[num_layers - 1] = True
    return head, tail, ~tail


@dataclass(frozen=True)
class StepForm:
    """How a context's step is composed, chosen once when the evaluator builds the context
    (step/context.build_context): ``step(ctx, rows)`` -> (per-rank ends, bubble); ``chunk_times(ctx,
    rows)`` -> compose.overlapped_chunk_times's five terms, which the trace draws; ``serial``: the
    communication takes turns with compute; ``memo_ok``: the per-layer terms of the form are local
    (step/layer_memo.LayerMemo may serve)."""
    name: str
    step: Callable
    chunk_times: Callable
    serial: bool
    memo_ok: bool


#: a GPU's: communication on its own streams, overlapping compute
OVERLAPPED = StepForm("overlapped", overlapped_step, overlapped_chunk_times, serial=False, memo_ok=True)
