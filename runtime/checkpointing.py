"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), and resuming from the latest.

Layout under ``--checkpoint-dir``::

    step_00000010/        one DCP checkpoint: {"model": ..., "optim": ...} (.distcp shards + .metadata)
    latest.json           {"step": 10, "path": "step_00000010"}, written by rank 0 after the save

The model and optimizer state dicts come from ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict``): keys are the model's own FQNs and
sharded tensors are DTensors, so a checkpoint written under one layout loads under another.
Pipeline ranks each hold their stages' keys; DCP merges them into one checkpoint.  One
special case: ZeRO-1's ``ZeroRedundancyOptimizer`` has no DCP state dict; each rank's optimizer partition
is saved beside the DCP files as ``zero1_rank<R>.pt`` (resumable under the same layout only).

The step number and the batches are functions of the step (batches are seeded by step), so a
resumed run continues exactly where the checkpoint was taken.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from autopar.core.plan import write_text_atomic

LATEST = "latest.json"
# flat optimizer keys ("state.blocks.0.attn.qkv.weight.exp_avg") so several stage modules' and
# optimizers' states merge into one checkpoint without clashing
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def latest_checkpoint(directory: Path) -> tuple[int, Path] | None:
    f = Path(directory) / LATEST
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    return int(d["step"]), Path(directory) / d["path"]


def _is_zero1(opt: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(opt, ZeroRedundancyOptimizer)


def _state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    model_sd: dict = {}
    optim_sd: dict = {}
    for part, opt in zip(parts, optimizers):
        model_sd.update(get_model_state_dict(part))
        if not _is_zero1(opt):
            optim_sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(directory: Path, step: int, parts: list[nn.Module],
                    optimizers: list[torch.optim.Optimizer], extra: dict | None = None) -> Path:
    """Save a DCP checkpoint of step ``step``; ``extra`` (JSON) goes into latest.json."""
    path = Path(directory) / f"step_{step:08d}"
    dcp.save(_state(parts, optimizers), checkpoint_id=str(path))
    for opt in optimizers:
        if _is_zero1(opt):
            torch.save(opt.optim.state_dict(), path / f"zero1_rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        latest = {"step": step, "path": path.name, **(extra or {})}
        write_text_atomic(Path(directory) / LATEST, json.dumps(latest) + "\n")
    dist.barrier()
    return path


def load_checkpoint(path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    state = _state(parts, optimizers)
    dcp.load(state, checkpoint_id=str(path))
    for part, opt in zip(parts, optimizers):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if _is_zero1(opt):
            opt.optim.load_state_dict(torch.load(path / f"zero1_rank{dist.get_rank()}.pt", weights_only=True))
        else:
            set_optimizer_state_dict(part, opt, state["optim"], options=_FLAT)
