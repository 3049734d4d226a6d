"""Bytes of model state each rank really holds: parameters, gradients, optimizer state.

Measured once, after a step's backward and optimizer step and before ``zero_grad`` (so the
gradients and the optimizer state exist), from the tensors themselves:

* a DTensor (tensor parallelism, FSDP2's sharded parameters, their gradients and optimizer
  state) counts its local shard, ``to_local()``; a plain tensor (DDP) counts whole;
* ``params_bytes``  -- this rank's parameters of every local part (pipeline stages);
* ``grads_bytes``   -- their ``.grad`` (sharded under FSDP2, full under DDP / replicate);
* ``optimizer_bytes`` -- the optimizer's per-element state (AdamW: ``exp_avg`` and
  ``exp_avg_sq``, 8 bytes per fp32 parameter element); for ``ZeroRedundancyOptimizer`` only
  this rank's partition (its local optimizer's state).  AdamW's ``step`` counters -- one 0-d
  tensor per parameter tensor, not per element -- are reported apart as
  ``optimizer_step_bytes`` so ``optimizer_bytes`` compares with a per-element memory model.

Shard sizes are the logical ones: FSDP2 pads each rank's dim-0 shard of a parameter (and of
its gradient) to ``ceil(dim0 / dp)`` rows in storage; that padding is not counted.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor


def local_bytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def _inner_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer keeps this rank's partition in a local optimizer, ``.optim``."""
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def model_state_bytes(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    params, seen = [], set()
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    out = {"params_bytes": sum(local_bytes(p) for p in params),
           "grads_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
           "optimizer_bytes": 0, "optimizer_step_bytes": 0}
    for opt in optimizers:
        for name_to_state in _inner_optimizer(opt).state.values():
            for key, value in name_to_state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                out["optimizer_step_bytes" if key == "step" else "optimizer_bytes"] += local_bytes(value)
    return out


def gather_model_state_bytes(mine: dict[str, int]) -> list[dict]:
    """Every rank's ``model_state_bytes`` with its rank, in rank order (a collective: every
    rank calls it)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"rank": dist.get_rank(), **mine})
    return out
