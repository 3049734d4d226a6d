"""Evaluation on a validation token file (``--val-data FILE --eval-every K --eval-batches N``).

The validation loss is the mean, over ``N`` global batches, of each batch's global mean loss --
the model file's loss on the batch, forward only (``torch.no_grad``, the modules in ``eval()``
mode), computed as a training step computes its loss under the same layout: per micro-batch,
averaged over the micro-batches, the data-parallel and the context-parallel ranks
(``train.global_losses``).  Batch ``b`` takes the validation file's samples ``b B + r`` in order
from its start (no shuffle; runtime/token_data.py); each rank reads only its own rows.

A pipeline runs the batch through its schedule's forward-only ``eval`` (torch's
``_PipelineSchedule.eval``: the schedule's ``step`` with ``has_backward`` off, so each stage
skips its backward and torch's stages re-derive their buffers on the switch to and from it).
"""
from __future__ import annotations

import contextlib

import torch

from autopar.runtime.batches import TokenBatches


@contextlib.contextmanager
def eval_mode(parts):
    """The parts in ``eval()`` mode (dropout off) under ``torch.no_grad``; their modes restored."""
    modes = [(m, m.training) for p in parts for m in p.modules()]
    for p in parts:
        p.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def local_eval_loss(pm, checked, ctx, inputs, target, cp_forward, autocast) -> torch.Tensor:
    """This rank's mean loss on its rows (0 off the last stage), forward only.  ``cp_forward(inputs)``:
    context parallelism's (mode, keyword arguments) of a forward; ``autocast()``: the forward's
    autocast context (both from runtime/train.py)."""
    nmb = checked.plan.pipeline.num_microbatches
    loss_fn = checked.model_file.loss
    if pm.schedule is not None:
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if pm.has_last_stage else {}
        if pm.cp is not None and pm.has_first_stage:
            inputs = pm.cp.stage_args(tuple(inputs), ctx.device)
        with autocast():
            pm.schedule.eval(*(inputs if pm.has_first_stage else ()), **kwargs)
        return torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros(())
    part = pm.parts[0]
    out = []
    for chunk_inputs, chunk_target in zip(zip(*(x.chunk(nmb) for x in inputs)), target.chunk(nmb)):
        mode, kwargs = cp_forward(chunk_inputs)
        with autocast(), mode:
            out.append(loss_fn(part(*chunk_inputs, **kwargs), chunk_target).detach().float())
    return torch.stack(out).mean()


class Evaluator:
    """The validation rows of this rank and the evaluation of the model on them."""

    def __init__(self, val: TokenBatches, num_batches: int):
        self.val, self.num_batches = val, num_batches

    def local_losses(self, loss_of_rows) -> list[torch.Tensor]:
        """``loss_of_rows(inputs, target)`` on each of the ``num_batches`` validation batches."""
        return [loss_of_rows(*self.val.get(b)) for b in range(self.num_batches)]

    def close(self) -> None:
        self.val.close()
