"""Stop a run whose loss or weights stop being finite, before anything non-finite is saved.

Two checks, both agreed by every rank so all of them stop together:

* ``check_losses`` reads the global losses (already all-reduced over the ranks by
  ``Trainer.flush_losses``, so every rank holds the same values) each time they are flushed;
* ``check_state_finite`` runs before each checkpoint: every rank looks at its own parameter
  shards and the verdict is all-reduced (MIN of a 0/1 flag), because a step's update can make
  the weights non-finite while the loss that step computed, before the update, was finite.

Either raises ``NonFiniteError`` (a user error: exit code 2, like every refusal the run makes).  The checkpoint folder then still names the
last checkpoint saved before the failure as the newest, so rerunning resumes from good state.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.core.errors import UserError

NON_FINITE_EXIT_CODE = 2   # the run's settings (learning rate, data, loss) are what to change


class NonFiniteError(UserError):
    """Training produced a non-finite loss or weights; the run stopped without saving them."""

    exit_code = NON_FINITE_EXIT_CODE


def _advice(checkpoint_dir: Path | None) -> str:
    from autopar.runtime.checkpointing import latest_checkpoint

    found = latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    kept = (f"The newest checkpoint, {found[1]}, was saved before this and is kept; a rerun resumes from it. "
            if found else "No checkpoint was saved. ")
    return kept + ("Lower --lr, or check the model file's loss_fn and make_batch for values that overflow "
                   "(inf, nan, division by zero, log of zero).")


def check_losses(losses: list[float], first_index_step: int, checkpoint_dir: Path | None) -> None:
    """``losses[i]`` is the loss of step ``first_index_step + i + 1`` (1-based, as logged)."""
    for i, value in enumerate(losses):
        if not math.isfinite(value):
            raise NonFiniteError(f"step {first_index_step + i + 1}: the loss is {value}; training stopped there "
                                 f"and nothing after it was saved. {_advice(checkpoint_dir)}")


def check_state_finite(parts: list[nn.Module], step: int, checkpoint_dir: Path | None,
                       device: torch.device) -> None:
    bad = [n for part in parts for n, p in part.named_parameters() if not _finite(p)]
    flag = torch.tensor([0 if bad else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()) == 0:
        where = f" (on this rank: {', '.join(bad[:3])})" if bad else ""
        raise NonFiniteError(f"after step {step} the weights hold non-finite values{where}; training stopped "
                             f"before saving them. {_advice(checkpoint_dir)}")


def _finite(p: torch.Tensor) -> bool:
    t = p.to_local() if isinstance(p, DTensor) else p
    return bool(torch.isfinite(t.detach()).all()) if t.numel() else True
