"""The global gradient norm of a parallel model, and clipping by it, as
``torch.nn.utils.clip_grad_norm_`` on the whole single-process model would compute them.

Every rank holds pieces of the model's gradients: FSDP2 and ZeRO shards (DTensor ``Shard``),
tensor-parallel shards and replicas (DTensor ``Shard`` / ``Replicate``), data-parallel replicas
(DDP, ``replicate``, ZeRO-1: whole gradients, already averaged, the same on every dp x cp rank),
pipeline stages (different parameters on each pp rank), tied copies on several stages (made
equal by ``ties.TiedGradSum`` before the step) and experts (each on the ranks of its ep
coordinate).  The norm counts every distinct piece once:

* at setup (``GradNorm.build``, one ``all_gather_object``) each rank names each of its pieces
  by the parameter's canonical name (``ties.canonical_fqn`` and ``state_names``: the model's own
  name, a tied parameter's first name) and its coordinates on the mesh dims its DTensor is
  sharded over; the lowest rank holding a piece *owns* it -- a replica (a ``Replicate`` dim, the
  ranks of a data-parallel group, the tp ranks of an unsplit norm weight, the stages holding a
  tied copy) has another owner than itself only when it is not the first copy;
* per step each rank sums the squares of its owned pieces' local gradients
  (``GradNorm.local_squares``, ``torch._foreach_norm`` as ``torch.nn.utils.get_total_norm``);
  one all-reduce (SUM) of that fp32 scalar over the world gives the square of the global norm
  (``GradNorm.__call__``; the trainer, when it does not clip, sums it with the losses' all-reduce
  instead).

torchtitan (``torchtitan/distributed/utils.py`` ``clip_grad_norm_``) reaches the same number by
another road: ``get_total_norm`` over DTensor gradients on one mesh, ``full_tensor()`` of the
norm, then an all-reduce over the pp mesh; the gradients here live on several meshes (the dp x
cp mesh of FSDP2, the tp mesh, the experts' meshes), which the ownership rule covers at once.

Clipping multiplies every local gradient by ``min(1, max_norm / (norm + 1e-6))`` without a
branch on the host, as ``torch.nn.utils.clip_grads_with_norm_`` does (torch/nn/utils/clip_grad.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.runtime.state_names import StateNames
from autopar.runtime.ties import canonical_fqn

# torch.nn.utils.clip_grads_with_norm_: clip_coef = max_norm / (total_norm + 1e-6)
CLIP_EPS = 1e-6


def _piece_key(name: str, p: torch.Tensor) -> tuple:
    """A parameter piece's name on every rank: the same for identical copies, distinct otherwise."""
    if not isinstance(p, DTensor):
        return (name,)
    mesh = p.device_mesh
    # every placement but Replicate splits the tensor over its mesh dim: Shard, and FSDP2's
    # _StridedShard (a tp-sharded dim sharded again), which is no Shard subclass in torch 2.13
    shards = tuple((d, mesh.get_local_rank(d)) for d, pl in enumerate(p.placements) if not pl.is_replicate())
    return (name, mesh.mesh_dim_names, shards)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class GradNorm:
    """This rank's parameters and which of them it counts (module docstring)."""
    params: list[nn.Parameter]           # every parameter of this rank's parts, each once
    owned: list[bool]                    # whether this rank counts it in the norm
    device: torch.device

    @classmethod
    def build(cls, parts: list[nn.Module], names: StateNames, device: torch.device) -> "GradNorm":
        params, keys, seen = [], [], set()
        for part in parts:
            for name, p in part.named_parameters():
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                params.append(p)
                keys.append(_piece_key(names.canonical_fqn(canonical_fqn(name)), p))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, keys)
        owner: dict[tuple, int] = {}
        for rank, held in enumerate(everyone):
            for key in held:
                owner.setdefault(key, rank)
        me = dist.get_rank()
        return cls(params=params, owned=[owner[k] == me for k in keys], device=device)

    def _grads(self) -> list[tuple[torch.Tensor, bool]]:
        out = []
        for p, owned in zip(self.params, self.owned):
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                g = g.redistribute(p.device_mesh, p.placements)   # e.g. a Partial gradient
                p.grad = g
            out.append((_local(g), owned))
        return out

    @torch.no_grad()
    def local_squares(self) -> torch.Tensor:
        """The sum of squares of this rank's owned gradient pieces (0-d fp32 on the device; no
        collective): summed over the world, the square of the global norm."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g, owned in self._grads():
            if owned and g.numel():
                by_kind.setdefault((g.device, g.dtype), []).append(g)
        for gs in by_kind.values():
            squares += torch.stack(torch._foreach_norm(gs)).float().square().sum().to(self.device)
        return squares

    @torch.no_grad()
    def __call__(self, max_norm: float | None = None) -> torch.Tensor:
        """The global 2-norm of the gradients (a 0-d fp32 tensor on the device, identical on every
        rank; one all-reduce); with ``max_norm``, every gradient is then scaled by
        ``min(1, max_norm / (norm + 1e-6))``."""
        squares = self.local_squares()
        dist.all_reduce(squares)
        total = squares.sqrt()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
            by_kind: dict[tuple, list[torch.Tensor]] = {}
            for g, _ in self._grads():
                by_kind.setdefault((g.device, g.dtype), []).append(g)
            for (dev, _), gs in by_kind.items():
                torch._foreach_mul_(gs, coef.to(dev))
        return total
