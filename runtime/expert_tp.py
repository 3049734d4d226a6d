"""Tensor parallelism of a mixture of experts' stacked expert weights: split by expert.

transformers 5 stores a layer's experts as one module holding stacked 3-D parameters
(``MixtralExperts``: ``gate_up_proj [experts, 2 * ffn, hidden]``, ``down_proj [experts,
hidden, ffn]``), called as ``experts(hidden_states, top_k_index, top_k_weights)`` after the
router.  Under tensor parallelism the tokens and the router's choice are the same on every tp
rank, so the split is along the expert dim: rank ``r`` of ``tp`` holds experts
``[r * E/tp, (r + 1) * E/tp)`` (each parameter a DTensor ``Shard(0)`` on the tp mesh, so FSDP2,
materialisation and checkpoints see the full shape), runs them on the tokens routed to them,
and the partial outputs are summed over the tp ranks.  That is Megatron-LM's row-parallel
pattern (Shoeybi et al. 2019, Sec. 3, Fig. 3): the ``f`` operator on the inputs (identity
forward, all-reduce of the gradient backward: each rank's gradient of ``hidden_states`` and
of the routing weights covers its own experts only) and the ``g`` operator on the output
(all-reduce forward, identity backward).

Recognition (``core/experts.is_stacked_experts``, the one place that decides it, for expert
parallelism too): a module with an integer
``num_experts`` = E, whose own parameters are all 3-D with E rows (dim 0), whose children hold
no parameters, and which carries transformers' ``_is_expert_parallel`` flag (set by its
``use_experts_implementation`` decorator).  That flag is why the local forward is exact: with
it on, every experts implementation of transformers (eager, batched_mm, grouped_mm) treats an
expert index ``>= num_experts`` as "not on this rank" and adds nothing for it
(transformers/integrations/moe.py).  Each rank sets ``num_experts = E / tp``, re-bases the
indices of its own experts to ``0 .. E/tp - 1`` and maps the others to ``E/tp``; the routing
weights of the others are also multiplied by zero, so their gradient is exactly zero whatever
the implementation.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from autopar.core.experts import is_stacked_experts  # noqa: F401  (the one rule; apply_tp imports it from here)

EXPERT_STYLE = "expert"


class _SumOverGroup(torch.autograd.Function):
    """Megatron's ``g``: output summed over ``group`` forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SumGradOverGroup(torch.autograd.Function):
    """Megatron's ``f``: identity forward, gradient summed over ``group`` backward; on an
    activation, or on a parameter that may be a DTensor (its gradient then one too, summed on its
    local tensor)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        local = (grad.to_local() if isinstance(grad, DTensor) else grad).contiguous().clone()
        dist.all_reduce(local, group=ctx.group)
        if isinstance(grad, DTensor):
            local = DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False,
                                       shape=grad.shape, stride=grad.stride())
        return local, None


def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """The tp ranks' token rows (dim 0) concatenated in rank order; backward: the gradient summed
    over the ranks and this rank's rows kept (a reduce-scatter), Korthikanti et al. 2022, Fig. 5 ``g``."""
    return funcol.all_gather_tensor_autograd(x.contiguous(), 0, group)


def _scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Rows summed over the tp ranks, this rank's share of them kept (dim 0); backward: all-gather
    (Korthikanti et al. 2022, Fig. 5 ``g-bar``)."""
    return funcol.reduce_scatter_tensor_autograd(x.contiguous(), "sum", 0, group)


class ExpertShard(ParallelStyle):
    """Split a stacked-experts module by expert over the tp mesh (module docstring).

    ``sequence_parallel``: the module is called on this rank's sequence shard of the tokens (a
    layer under sequence parallelism): the tokens, their expert indices and routing weights are
    all-gathered over tp on entry, each rank runs its experts on every rank's tokens, and the
    partial outputs are reduce-scattered back to the shard -- Megatron-Core's MoE under
    sequence parallelism (its token dispatchers gather the tokens of the tp group before
    routing them to the local experts and reduce-scatter after: ``gather_from_sequence_parallel_region``
    / ``reduce_scatter_to_sequence_parallel_region``, megatron/core/transformer/moe/token_dispatcher.py),
    instead of ``f`` / ``g``."""

    def __init__(self, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        total = module.num_experts
        if total % tp:
            raise ValueError(f"{total} experts do not divide over tp = {tp}")   # tp_check refuses it first
        local = total // tp
        lo = rank * local
        group = device_mesh.get_group()
        sp = self.sequence_parallel
        names = [n for n, _ in module.named_parameters(recurse=False)]
        for name in names:
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None),
                requires_grad=param.requires_grad))
        module.num_experts = local
        module._is_expert_parallel = True
        order = [n for n, p in inspect.signature(module.forward).parameters.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(order) < 3:
            raise ValueError(f"{type(module).__name__}.forward takes {order}, not (hidden_states, top_k_index, "
                             f"top_k_weights)")
        keys = order[:3]

        def pre(mod, args, kwargs):
            values = dict(zip(keys, args))
            values.update({k: kwargs[k] for k in keys if k in kwargs})
            hidden, index, weights = (values[k] for k in keys)
            if sp:
                hidden, weights = _gather_tokens(hidden, group), _gather_tokens(weights, group)
                index = funcol.all_gather_tensor(index.contiguous(), 0, group)
            else:
                hidden, weights = SumGradOverGroup.apply(hidden, group), SumGradOverGroup.apply(weights, group)
            mine = (index >= lo) & (index < lo + local)
            values[keys[0]] = hidden
            values[keys[1]] = torch.where(mine, index - lo, torch.full_like(index, local))
            values[keys[2]] = weights * mine.to(weights.dtype)
            # the forward reads this rank's experts as plain tensors; to_local keeps autograd
            # (the gradient arrives as a Shard(0) DTensor on the parameter)
            mod.__dict__["_expert_tp_saved"] = saved = {}
            for name in names:
                p = mod._parameters[name]
                if isinstance(p, DTensor):
                    saved[name] = p
                    mod._parameters[name] = p.to_local()
            rest = {k: v for k, v in kwargs.items() if k not in keys}
            return (*(values[k] for k in keys), *args[3:]), rest

        def post(mod, _args, _kwargs, output):
            mod._parameters.update(mod.__dict__.pop("_expert_tp_saved", {}))
            return _scatter_tokens(output, group) if sp else _SumOverGroup.apply(output, group)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)
        return module
