"""Data parallelism: DDP (ZeRO-0), DDP + ZeroRedundancyOptimizer (ZeRO-1), FSDP2 (ZeRO-2/3).

ZeRO stages (Rajbhandari et al. 2020, Sec. 5): 1 shards the optimizer state, 2 also the
gradients, 3 also the parameters.  FSDP2's ``fully_shard`` always shards parameters at rest;
``reshard_after_forward=False`` keeps a layer's gathered parameters from forward to backward
(no second all-gather: the ZeRO-2 communication pattern), ``True`` frees them (ZeRO-3).
Offload goes through ``CPUOffloadPolicy`` (parameters, gradients and optimizer step on the
host), mixed precision through ``MixedPrecisionPolicy`` (bf16/fp16 compute, fp32 master
weights and fp32 gradient reduction).

The moments differ: ``apply_fsdp`` / ``apply_replicate`` run on the meta model (before
materialisation, so no rank ever holds a full layer), ``apply_ddp`` after it (DDP broadcasts
real parameters at construction).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from autopar.core import rules
from autopar.core.plan import Mesh
from autopar.runtime.fused_tp import fsdp_shard_placement

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    if precision in LOW_PRECISION:
        return MixedPrecisionPolicy(param_dtype=LOW_PRECISION[precision], reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload_policy(offload: str, device: torch.device) -> OffloadPolicy:
    if offload == "cpu":
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")   # pinning needs an accelerator
    if offload == "nvme":                 # host offload, AdamW's moments in files (runtime/nvme_tier.py)
        from autopar.runtime.nvme_tier import NvmeOffloadPolicy

        return NvmeOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, units: list[tuple[list[str], int, str]],
               root_zero: int, root_offload: str, precision: str, device: torch.device) -> None:
    """``fully_shard`` each layer unit, then ``module`` itself as the root (its leftover params).

    ``units``: (module paths of one layer inside ``module``, its ZeRO stage 2|3, its offload).
    A multi-module layer (pre/post) is one FSDP group holding all its modules.  A fused
    projection's weight split per part over tp is sharded on its other dim
    (``fused_tp.fsdp_shard_placement``); every other parameter on dim 0.
    """
    mp = mixed_precision_policy(precision)
    for paths, zero, offload in units:
        mods = [module.get_submodule(p) for p in paths]
        fully_shard(mods if len(mods) > 1 else mods[0], mesh=dp_mesh, reshard_after_forward=zero == 3,
                    mp_policy=mp, offload_policy=offload_policy(offload, device),
                    shard_placement_fn=fsdp_shard_placement)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=root_zero == 3, mp_policy=mp,
                offload_policy=offload_policy(root_offload, device), shard_placement_fn=fsdp_shard_placement)


def apply_replicate(module: nn.Module, dp_mesh: DeviceMesh, units: list[list[str]], precision: str) -> None:
    """DDP semantics for a tensor-parallel model: ``replicate`` (the FSDP2-based DDP, which
    takes DTensor parameters; ``DistributedDataParallel`` does not) per layer unit and root.
    Gradients are all-reduced over the dp axis; nothing is sharded.  On meta, like ``apply_fsdp``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp = mixed_precision_policy(precision)
    for paths in units:
        mods = [module.get_submodule(p) for p in paths]
        replicate(mods if len(mods) > 1 else mods[0], mesh=dp_mesh, mp_policy=mp)
    replicate(module, mesh=dp_mesh, mp_policy=mp)


def apply_ddp(module: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Wrap in ``DistributedDataParallel`` over the dp axis (after materialisation)."""
    return DistributedDataParallel(module, process_group=dp_mesh.get_group(),
                                   device_ids=[device.index] if device.type == "cuda" else None)


def data_parallel_kind(zero: int, mesh: Mesh) -> str:
    """Which native part runs the plan's data parallelism: ``ddp``, ``zero1``, ``fsdp``,
    ``replicate`` or ``none`` (the rule and why: core/rules.py ``native_data_parallel``).  The
    context-parallel ranks of a data-parallel rank average their gradients too
    (runtime/apply_cp.py), so the reducing degree is dp x cp.  Expert parallelism (ep > 1) splits
    the model too: its experts are DTensors and reduce over another group than the dense
    weights (runtime/apply_ep.py), which only FSDP2's machinery (fsdp or replicate) takes."""
    return rules.native_data_parallel(zero, mesh.grad_degree, mesh.splits_model or mesh.ep > 1)


def build_optimizer(params: list[nn.Parameter], zero: int, dp_mesh: DeviceMesh, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019); ZeRO-1 partitions its state over the dp ranks."""
    if zero == 1 and dp_mesh.size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                       process_group=dp_mesh.get_group(), lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
