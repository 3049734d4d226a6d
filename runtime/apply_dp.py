"""Data parallelism: DDP (ZeRO-0), DDP + ZeroRedundancyOptimizer (ZeRO-1), FSDP2 (ZeRO-2/3).

ZeRO stages (Rajbhandari et al. 2020, Sec. 5): 1 shards the optimizer state, 2 also the
gradients, 3 also the parameters.  FSDP2's ``fully_shard`` always shards parameters at rest;
``reshard_after_forward=False`` keeps a layer's gathered parameters from forward to backward
(no second all-gather: the ZeRO-2 communication pattern), ``True`` frees them (ZeRO-3).
Offload goes through ``CPUOffloadPolicy`` (parameters, gradients and optimizer step on the
host), mixed precision through ``MixedPrecisionPolicy`` (bf16/fp16 compute, fp32 master
weights and fp32 gradient reduction).

Gradient compression (the plan's ``grad_compression``, core/grad_compression.py): bf16 / fp16 on
the wire as FSDP2's ``reduce_dtype`` (fsdp, replicate) or torch's DDP communication hooks
(ddp, zero1); PowerSGD as torch's ``powerSGD_hook`` on DDP only (``register_compression_hook``).

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


def mixed_precision_policy(precision: str, grad_compression: str = "none") -> MixedPrecisionPolicy:
    """Compute in ``precision``; reduce gradients in fp32, or in bf16 / fp16 when the plan's
    ``grad_compression`` casts them (FSDP2 casts each gradient to ``reduce_dtype`` before its
    reduce-scatter and the reduced shard back to the parameter's dtype)."""
    reduce = LOW_PRECISION.get(grad_compression, torch.float32)
    if precision in LOW_PRECISION:
        return MixedPrecisionPolicy(param_dtype=LOW_PRECISION[precision], reduce_dtype=reduce)
    return MixedPrecisionPolicy(reduce_dtype=None if reduce == torch.float32 else reduce)


def offload_policy(offload: str, device: torch.device) -> OffloadPolicy:
    if offload == "cpu":
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")   # pinning needs an accelerator
    states = rules.nvme_states(offload)
    if states:          # host offload, AdamW's moments (and the named states) in files (runtime/nvme_tier.py)
        from autopar.runtime.nvme_tier import NvmeOffloadPolicy

        # parameters in a file are not pinned: FSDP2 would copy a file-backed shard into pinned
        # memory (FSDPParam.reset_sharded_param), and pinning a mapping locks its pages in RAM
        return NvmeOffloadPolicy(pin_memory=device.type == "cuda" and "params" not in states,
                                 params="params" in states, grads="grads" in states)
    return OffloadPolicy()


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, units: list[tuple[list[str], int, str]],
               root_zero: int, root_offload: str, precision: str, device: torch.device,
               grad_compression: str = "none") -> None:
    """``fully_shard`` each layer unit, then ``module`` itself as the root (its leftover params).

    ``units``: (module paths of one layer inside ``module``, its ZeRO stage 2|3, its offload).
    A multi-module layer (pre/post) is one FSDP group holding all its modules.  A fused
    projection's weight split per part over tp is sharded on its other dim
    (``fused_tp.fsdp_shard_placement``); every other parameter on dim 0.
    """
    mp = mixed_precision_policy(precision, grad_compression)
    for paths, zero, offload in units:
        mods = [module.get_submodule(p) for p in paths]
        fully_shard(mods if len(mods) > 1 else mods[0], mesh=dp_mesh, reshard_after_forward=zero == 3,
                    mp_policy=mp, offload_policy=offload_policy(offload, device),
                    shard_placement_fn=fsdp_shard_placement)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=root_zero == 3, mp_policy=mp,
                offload_policy=offload_policy(root_offload, device), shard_placement_fn=fsdp_shard_placement)


def apply_replicate(module: nn.Module, dp_mesh: DeviceMesh, units: list[list[str]], precision: str,
                    grad_compression: str = "none") -> None:
    """DDP semantics for a tensor-parallel model: ``replicate`` (the FSDP2-based DDP, which
    takes DTensor parameters; ``DistributedDataParallel`` does not) per layer unit and root.
    Gradients are all-reduced over the dp axis; nothing is sharded.  On meta, like ``apply_fsdp``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp = mixed_precision_policy(precision, grad_compression)
    for paths in units:
        mods = [module.get_submodule(p) for p in paths]
        replicate(mods if len(mods) > 1 else mods[0], mesh=dp_mesh, mp_policy=mp)
    replicate(module, mesh=dp_mesh, mp_policy=mp)


def apply_ddp(module: nn.Module, dp_mesh: DeviceMesh, device: torch.device,
              grad_compression: str = "none"):
    """Wrap in ``DistributedDataParallel`` over the dp axis (after materialisation), its
    gradient all-reduce compressed as ``grad_compression`` says (``register_compression_hook``).
    Returns (the DDP module, the PowerSGD hook whose state a checkpoint keeps, or None)."""
    ddp = DistributedDataParallel(module, process_group=dp_mesh.get_group(),
                                  device_ids=[device.index] if device.type == "cuda" else None,
                                  **one_bucket_on_gloo(module, grad_compression,
                                                       torch.distributed.get_backend(dp_mesh.get_group())))
    return ddp, register_compression_hook(ddp, grad_compression, dp_mesh.get_group())


def one_bucket_on_gloo(module: nn.Module, grad_compression: str, backend: str) -> dict:
    """DDP's keyword arguments that keep every gradient in one bucket when PowerSGD runs on gloo:
    torch's ``powerSGD_hook`` waits, inside the future callback of a bucket's all-reduce, for the
    next all-reduce of that bucket; on gloo that wait never returns while another bucket's
    collective is queued (seen here: both ranks stopped in ``unpack_uncompressed_tensors_and_
    allreduce_ps`` once the model's gradients exceeded DDP's 1 MiB first bucket).  ``bucket_cap_mb``
    above the gradients' size gives one bucket (an explicit cap also sets the first bucket's)."""
    if not grad_compression.startswith("powersgd") or backend != "gloo":
        return {}
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return {"bucket_cap_mb": grad_bytes / 2**20 + 1}


def _bf16_wire_hook(process_group, bucket):
    """torch's ``bf16_compress_hook`` itself (``default_hooks._compress_hook(torch.bfloat16, ...)``:
    the bucket cast to bf16 and divided by the group size, all-reduced, copied back), under a
    name DDP does not refuse: ``DistributedDataParallel._check_comm_hook`` refuses the hook by
    its name unless NCCL >= 2.10 or XCCL runs it, while gloo reduces bf16 tensors."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def register_compression_hook(ddp: DistributedDataParallel, grad_compression: str, group) -> object | None:
    """Register torch's communication hook for ``grad_compression`` on ``ddp``; returns PowerSGD's
    hook (runtime/powersgd_state.py ``PowerSGDHook``: torch's ``powerSGD_hook`` and its
    ``PowerSGDState``), None otherwise.

    * bf16 / fp16: ``default_hooks.bf16_compress_hook`` / ``fp16_compress_hook`` (bf16 under
      another name off NCCL: ``_bf16_wire_hook``);
    * powersgd:R: ``powerSGD_hook.PowerSGDState(matrix_approximation_rank=R,
      start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)`` and ``powerSGD_hook``
      (Vogels et al. 2019, Algorithm 1).  Its state -- the error feedback, the warm-started P
      and Q, the step count and the generator of the first Q -- is saved per rank with each
      checkpoint and restored on a resume under the same layout (runtime/powersgd_state.py;
      docs/runtime.md)."""
    from autopar.core.grad_compression import (POWERSGD_MIN_COMPRESSION_RATE, POWERSGD_START_ITER,
                                               GradCompression)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    c = GradCompression.parse(grad_compression)
    if c.kind == "none":
        return None
    if c.kind == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return None
    if c.kind == "bf16":
        nccl = torch.distributed.get_backend(group) == "nccl"
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook if nccl else _bf16_wire_hook)
        return None
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=c.rank,
                                        start_powerSGD_iter=POWERSGD_START_ITER,
                                        min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE,
                                        use_error_feedback=True, warm_start=True)
    from autopar.runtime.powersgd_state import PowerSGDHook

    hook = PowerSGDHook(state, {id(p): name for name, p in ddp.module.named_parameters()}, str(c))
    ddp.register_comm_hook(state, hook.hook)
    return hook


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


def compression_note(grad_compression: str, dp_kind: str) -> str:
    """The run's note on how its gradients cross the wire."""
    if grad_compression.startswith("powersgd"):
        from autopar.core.grad_compression import POWERSGD_START_ITER

        return (f"gradient compression {grad_compression}: torch's powerSGD_hook on DDP (error feedback, warm "
                f"start; plain all-reduce for the first {POWERSGD_START_ITER} steps; its state is saved with each "
                f"checkpoint and continues on a resume under the same layout)")
    how = "FSDP2's reduce_dtype" if dp_kind in ("fsdp", "replicate") else "torch's DDP compress hook"
    return f"gradient compression {grad_compression}: gradients reduced in {grad_compression} ({how})"
