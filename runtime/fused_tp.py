"""Tensor parallelism of a fused projection: a column split per part.

A fused projection computes several projections in one GEMM and cuts its output into k equal
parts along the features: GPT-2's ``c_attn`` (a ``Conv1D``, output ``[q | k | v]``, k = 3),
nanoGPT's ``c_attn`` (an ``nn.Linear``; its forward views q/k/v with the whole hidden size, so
it cannot run split: planner/runtime_check._unfuse), Phi-3's ``qkv_proj`` (3) and
``gate_up_proj`` (2).
The plan names it with the style ``colwise:<k>`` (core/sharding._fused_parts finds it).  Each
tp rank ``r`` of ``tp`` holds, of every part of n features, the rows ``[r*n/tp, (r+1)*n/tp)``;
after the model's own local cut each part is this rank's heads (or hidden units), so the pair
with the row-wise projection that follows is Megatron's column/row pair (Shoeybi et al. 2019,
Sec. 3), exact as for unfused projections.

Design -- the weight is a DTensor whose placement says exactly which rows a rank holds:
``_StridedShard(dim, split_factor=k)`` on the tp mesh (torch's placement for "cut into
split_factor pieces, shard each piece over the mesh dim, concatenate the rank's shards":
torch/distributed/tensor/placement_types.py), so ``full_tensor``, ``distribute_tensor`` and
therefore materialisation (runtime/materialize.py) and the optimizer (element-wise, keeps
the placement) are right as they are.  In the forward a pre-hook relabels the local rows as a
``Shard(dim)`` DTensor (the same local tensor, no copy) for ``ColwiseParallel``'s matmul;
autograd hands the gradient back in the strided placement.

Three places need more than the placement:

* the bias (1-D ``[k*n]``) stays ``Replicate`` over tp, and the forward takes this rank's rows
  of each part from it with its gradient marked ``Partial`` (each rank's covers its own rows),
  summed over tp into the replicated gradient (FSDP2 does that for TP parameters; without it
  the post-accumulate hook of ``apply_tp.keep_embedding_grads_sharded`` does).  A strided
  bias would clash with FSDP2, which must shard a 1-D tensor on the same dim.  It costs each
  rank ``k*n*(1 - 1/tp)`` extra values per projection (the simulator counts it:
  simulator/step/op_work.local_param_numel).
* FSDP2 (ZeRO-2/3) shards the rank's local weight on dim 0 by default; on the dim the parts
  are strided on, its chunk of the rank's rows would cut across the parts and no placement
  pair describes it.  ``fsdp_shard_placement`` has FSDP2 shard such a weight on its other dim
  (``shard_placement_fn``): the two shardings then commute and ``(Shard(other),
  _StridedShard(dim, k))`` is exact.
* DCP writes a DTensor as one block per rank at the offset of its first row, which a strided
  shard is not; ``checkpoint_value`` gives the checkpoint the full tensor instead
  (``full_tensor``: written once, DCP de-duplicates replicated entries) and a full-size buffer
  on load, which checkpointing cuts to the parameter's placements.  So a checkpoint holds the
  fused weight in the model's own row order, as every other layout writes and reads it, and
  resumes under any layout.  (Costs one full copy of each fused weight and its optimizer
  moments per rank while a checkpoint is written or read.)

Rejected: permuting the rows once so that each rank's parts are contiguous (``Shard(0)``)
would write checkpoints in the permuted order; splitting the parameter into k parameters
changes the state-dict keys.  Both break resume under other layouts.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

_SAVED = "_fused_tp_saved"


class PartsColwise(ColwiseParallel):
    """Column split per part of a fused ``nn.Linear`` (weight ``[k*n, in]``, dim 0) or
    ``Conv1D`` (weight ``[in, k*n]``, dim 1); input and output layouts as ``ColwiseParallel``."""

    def __init__(self, parts: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.parts, self.dim = parts, dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parts, dim = self.parts, self.dim

        def partition(_name, mod, mesh):
            for name, placement in (("weight", _StridedShard(dim, split_factor=parts)), ("bias", Replicate())):
                param = getattr(mod, name, None)
                if param is not None:
                    mod.register_parameter(name, nn.Parameter(
                        distribute_tensor(param, mesh, [placement], src_data_rank=self.src_data_rank),
                        requires_grad=param.requires_grad))

        distribute_module(module, device_mesh, partition,
                          partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                          partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
        module.register_forward_pre_hook(partial(_relabel, parts=parts, dim=dim))
        module.register_forward_hook(_restore)
        return module


def _relabel(module: nn.Module, _args, *, parts: int, dim: int) -> None:
    """Swap in, for this forward, the weight's local rows as ``Shard(dim)`` and the bias's
    rows of this rank (``Shard(0)``); ``_restore`` puts the parameters back."""
    saved = module.__dict__[_SAVED] = {}
    weight = module._parameters["weight"]
    if isinstance(weight, DTensor):
        saved["weight"] = weight
        module._parameters["weight"] = DTensor.from_local(weight.to_local(), weight.device_mesh, [Shard(dim)],
                                                          run_check=False)
        bias = module._parameters.get("bias")
        if isinstance(bias, DTensor):
            mesh = bias.device_mesh
            tp, rank = mesh.size(), mesh.get_local_rank()
            full = bias.to_local(grad_placements=[Partial()])
            mine = full.view(parts, tp, -1)[:, rank].reshape(-1)
            saved["bias"] = bias
            module._parameters["bias"] = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)


def _restore(module: nn.Module, _args, _output) -> None:
    module._parameters.update(module.__dict__.pop(_SAVED, {}))


def is_parts_split(module: nn.Module) -> bool:
    """A module whose weight ``PartsColwise`` split (a strided DTensor on the tp mesh)."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, DTensor) and any(isinstance(p, _StridedShard) for p in weight.placements) \
        and _strided_alone(weight.placements)


def _strided_alone(placements) -> bool:
    """A placement list holding a ``_StridedShard`` on a dim no other placement shards: a
    per-part split (FSDP2's own ``_StridedShard`` over a TP ``Shard`` of the same dim is
    contiguous per rank and DCP writes it as it is)."""
    for p in placements:
        if isinstance(p, _StridedShard):
            others = [q for q in placements if q is not p and isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim]
            if not others:
                return True
    return False


def checkpoint_value(value, *, for_save: bool):
    """What DCP gets for one state-dict entry: a per-part split DTensor as its full tensor
    (saving) or a full-size buffer to read into (loading); anything else as it is."""
    if not isinstance(value, DTensor) or not _strided_alone(value.placements):
        return value
    if for_save:
        return value.full_tensor()
    return torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)


def fsdp_shard_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's ``shard_placement_fn``: a per-part split weight is sharded over dp on the dim
    its parts are not strided on; every other parameter takes FSDP2's default (dim 0)."""
    if isinstance(param, DTensor) and param.dim() == 2:
        strided = [p.dim for p in param.placements if isinstance(p, _StridedShard)]
        if strided:
            return Shard(1 - strided[0])
    return None
