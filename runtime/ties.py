"""Weight ties: found on the meta model, kept through every parallelisation step.

A tie is one ``nn.Parameter`` reachable under several fully-qualified names (an LM head whose
weight is the token embedding's: nanoGPT's ``lm_head.weight = transformer.wte.weight``, Hugging
Face ``tie_word_embeddings``, T5's ``shared`` used by the encoder, the decoder and the head).
Several steps replace parameter objects module by module and so would untie them:
``parallelize_module`` registers a new DTensor parameter per module, and ``to_empty`` from the
meta device builds a new tensor per module entry.  This module

* finds the ties on the meta model before any wrapping (``find_ties``: FQN groups, the first
  name of each is the one ``named_parameters()`` reports, the *canonical* name);
* points every member of a group back at one parameter inside a module (``retie``), refusing
  a tensor-parallel plan that splits the members differently;
* for pipeline stages, gives each stage that holds members of a group its own copy
  (``untie_across_stages``): the copies start from the same value and, before every optimizer
  step, each copy's gradient is replaced by the sum of the copies' gradients over the pp ranks
  that hold them (``TiedGradSum``), so every copy takes the same step as the single parameter
  would (Megatron-LM keeps its first- and last-stage word embeddings in sync the same way;
  Shoeybi et al. 2019 / Narayanan et al. 2021, "embedding group").  A frozen group
  (``requires_grad=False``) has no gradient and is left alone: a zero gradient would let
  AdamW's weight decay move it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.core.errors import PlanFileError

TieGroup = tuple[str, ...]
# FQN pieces that wrappers insert and that are not part of the model's own names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def canonical_fqn(name: str) -> str:
    """The model's own name of a parameter inside wrapped modules (checkpoint wrapper, DDP)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name[len("module."):] if name.startswith("module.") else name


def find_ties(model: nn.Module) -> list[TieGroup]:
    """Groups of two or more names of one Parameter, in ``named_parameters`` order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def aliases(groups: list[TieGroup]) -> dict[str, str]:
    """Every tied name -> its group's canonical (first) name."""
    return {name: g[0] for g in groups for name in g}


def _slots(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Canonical parameter name -> (module holding it, attribute name), every entry (no dedup)."""
    out = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for leaf, p in mod._parameters.items():
            if p is not None:
                out[canonical_fqn(f"{mod_name}.{leaf}" if mod_name else leaf)] = (mod, leaf)
    return out


def retie(module: nn.Module, groups: list[TieGroup]) -> None:
    """Make the members of each group present in ``module`` one parameter again (the first
    present member's).  Members split differently by tensor parallelism cannot be one
    parameter: that is refused."""
    slots = _slots(module)
    for group in groups:
        present = [n for n in group if n in slots]
        if len(present) < 2:
            continue
        mod0, leaf0 = slots[present[0]]
        keep = mod0._parameters[leaf0]
        for name in present[1:]:
            mod, leaf = slots[name]
            other = mod._parameters[leaf]
            if other is keep:
                continue
            if _layout(other) != _layout(keep):
                raise PlanFileError(
                    f"tensor parallelism: {present[0]} and {name} are one tied parameter, but the plan splits "
                    f"them differently ({_describe(keep)} vs {_describe(other)}). Split both the same way "
                    f"(a row-wise embedding with a column-wise LM head: both shard the vocabulary) or neither.")
            mod._parameters[leaf] = keep


def _layout(p: torch.Tensor):
    return (tuple(p.shape), tuple(p.placements) if isinstance(p, DTensor) else None)


def _describe(p: torch.Tensor) -> str:
    return f"placements {tuple(p.placements)}" if isinstance(p, DTensor) else "not split"


def untie_across_stages(stages: list[nn.Module], groups: list[TieGroup]) -> list[tuple[TieGroup, list[int]]]:
    """Give every stage after the first that holds members of a group its own parameter.

    Returns, for each group held by two or more stages, (the group, the stages holding it)."""
    out = []
    for group in groups:
        holders = []
        for index, stage in enumerate(stages):
            slots = _slots(stage)
            present = [n for n in group if n in slots]
            if not present:
                continue
            if holders:
                mod0, leaf0 = slots[present[0]]
                old = mod0._parameters[leaf0]
                copy = nn.Parameter(torch.empty_like(old), requires_grad=old.requires_grad)
                for name in present:
                    mod, leaf = slots[name]
                    mod._parameters[leaf] = copy
            holders.append(index)
        if len(holders) > 1:
            out.append((group, holders))
    return out


@dataclass
class TiedGradSum:
    """Sums the gradients of the copies of tied parameters held by several pipeline stages.

    ``groups``: per cross-stage group, (its names, the process group over the pp ranks holding
    it -- None when this rank holds none -- ).  All ranks create the process groups together
    (``dist.new_group`` is collective), in the same order."""
    groups: list[tuple[TieGroup, dist.ProcessGroup | None]]

    @classmethod
    def build(cls, cross: list[tuple[TieGroup, list[int]]], stage_rank, ranks_by_pp: torch.Tensor,
              my_rank: int, pp_group: dist.ProcessGroup) -> "TiedGradSum":
        """``ranks_by_pp``: global ranks as [every coordinate of the other axes, pp] (``pp_rows``);
        ``stage_rank(stage)``: its pp rank."""
        out = []
        pp = ranks_by_pp.shape[-1]
        for group, stages in cross:
            holders = sorted({stage_rank(s) for s in stages})
            if len(holders) == pp:
                mine = pp_group
            else:
                mine = None
                for row in ranks_by_pp:          # the same order on every rank (new_group is collective)
                    ranks = [int(row[r]) for r in holders]
                    g = dist.new_group(ranks)
                    if my_rank in ranks:
                        mine = g
            out.append((group, mine))
        return cls(out)

    @staticmethod
    def pp_rows(mesh_ranks: torch.Tensor, dim_names: tuple[str, ...]) -> torch.Tensor:
        """The device mesh's global ranks with the pp axis last and the other axes flattened,
        whatever axes the mesh declares (core/parallel_dims.py)."""
        pp_dim = dim_names.index("pp")
        return mesh_ranks.movedim(pp_dim, -1).reshape(-1, mesh_ranks.shape[pp_dim])

    @torch.no_grad()
    def __call__(self, parts: list[nn.Module]) -> None:
        slots: dict[str, tuple[nn.Module, str]] = {}
        for part in parts:
            slots.update(_slots(part))
        for group, pg in self.groups:
            if pg is None:
                continue
            params = []
            for name in group:
                if name in slots:
                    mod, leaf = slots[name]
                    p = mod._parameters[leaf]
                    if all(p is not q for q in params):
                        params.append(p)
            if not any(p.requires_grad for p in params):
                continue            # frozen (the same on every holder): no gradient to sum
            grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
            total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
            dist.all_reduce(total, group=pg)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _local(p.grad).copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
