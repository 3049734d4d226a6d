"""The plan space the planner searches: meshes, micro-batching, schedules and per-layer choices.

The space is FlexFlow's SOAP (Jia et al. 2019, Sec. 4) -- Sample (data-parallel degree),
Operator (pipeline stage boundaries), Attribute (sequence parallelism: activations split on
the sequence dim across the tp axis, Korthikanti et al. 2022 Sec. 4.2.2) and Parameter
(tensor-parallel column/row splits of weights, Shoeybi et al. 2019) -- plus the memory knobs
(ZeRO stage, Rajbhandari et al. 2020; recompute, Chen et al. 2016; offload, Ren et al. 2021)
and the pipeline knobs (micro-batch size and count, GPipe / 1F1B / interleaved 1F1B,
Narayanan et al. 2021).

Context parallelism (``cp``: the tokens of each sample split, Liu et al. 2023; Dubey et al. 2024,
Sec. 3.3.2) is one more axis where the model takes it, and expert parallelism (``ep``: the routed
experts split, borrowed from the dp x cp ranks; Lepikhin et al. 2021) a degree on each mesh.

Topology: ranks are ``arange(world).view(dp, pp, cp, tp)`` over the named axes of
core/parallel_dims.py, so a tp group is a run of ``tp`` consecutive ranks; it stays inside a
node when tp divides the GPUs per node.  On a heterogeneous cluster (node groups of different
GPUs, ranks numbered group by group) the pipeline coordinate sits between dp and tp, so
different stages may land on different
groups: the stage DP prices each stage position on its own devices.

Pure enumeration: no torch, no simulator.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.parallel_dims import factorisations
from autopar.core.plan import LayerPlan, Mesh
# the ZeRO families and the rules below live in core/rules.py (ZERO_FAMILIES, zero_family_of are
# imported from here too)
from autopar.core.rules import (ZERO_FAMILIES, interleaved_microbatches_ok, offload_allowed, zero1_shards,
                                zero_family_of)
from autopar.planner.axis_rules import MeshLimits, rules_for
from autopar.planner.integers import divisors, powers_of_two_up_to, prime_factors  # noqa: F401 -- re-exported

RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass(frozen=True)
class LayerChoice:
    """One layer's strategy: tensor-parallel split on or off, ZeRO stage, recompute, offload."""

    tp: bool = False
    zero: int = 0
    recompute: str = "none"
    offload: str = "none"

    def label(self) -> str:
        parts = ["tp" if self.tp else "rep", f"z{self.zero}", self.recompute]
        if self.offload != "none":
            parts.append(f"offload-{self.offload}")
        return "/".join(parts)

    def to_layer_plan(self, layer: int, styles: dict[str, str]) -> LayerPlan:
        return LayerPlan(layer=layer, tp=tuple(sorted(styles.items())) if self.tp else (),
                         zero=self.zero, recompute=self.recompute, offload=self.offload)


def mesh_candidates(world_size: int, *, gpus_per_node: int, num_layers: int, global_batch: int,
                    max_tp: int | None = None, tp_inside_node: bool = True,
                    sequence_parallel: bool = True, cp_choices: tuple[int, ...] = (1,),
                    ep_choices: tuple[int, ...] = (1,), mesh_class: type[Mesh] = Mesh) -> list[Mesh]:
    """Every factorisation of world_size over the parallel axes the cluster and the batch admit.

    One rule per axis that ``mesh_class`` declares, registered by name in planner/axis_rules.py
    and enumerated in registration order (core.parallel_dims.factorisations): tp, then pp, cp
    and dp.  tp is a power of two (head and hidden counts are) and at most ``max_tp`` and,
    unless ``tp_inside_node`` is False, at most the GPUs per node and a divisor of it, so a tp
    group never crosses a node; pp is at most the number of layers; dp takes the ranks left and
    divides the global batch, and so do the axes that split the batch together
    (``batch_degree``: every replica takes as many samples).  With tp > 1 each mesh comes with
    and without sequence parallelism.  ``cp_choices``: the context-parallel degrees the model
    takes (core/cp_support.cp_degrees), each on every mesh (the runtime runs cp
    with every other axis); ``ep_choices``: the expert-parallel degrees it takes
    (simulator/ep_cost.ep_degrees), each on every mesh whose gradient group it divides (ep borrows
    those ranks: core/parallel_dims.ParallelDims.problems).
    """
    limits = MeshLimits(gpus_per_node=gpus_per_node, num_layers=num_layers, global_batch=global_batch,
                        max_tp=max_tp, tp_inside_node=tp_inside_node, cp_choices=tuple(cp_choices))
    names = tuple(a.name for a in mesh_class.axes)
    out: list[Mesh] = []
    for degrees in factorisations(world_size, rules_for(names, limits), names):
        mesh = mesh_class(**degrees)
        if global_batch % mesh.batch_degree:
            continue
        for ep in ep_choices:
            if mesh_class(**degrees, ep=ep).problems():        # the ep rule: ParallelDims.problems
                continue
            out.append(mesh_class(**degrees, ep=ep))
            if mesh.tp > 1 and sequence_parallel:
                out.append(mesh_class(**degrees, sequence_parallel=True, ep=ep))
    return out


def microbatch_candidates(global_batch: int, dp: int, *, max_micro_batch: int | None = None,
                          refused: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
    """(micro_batch, num_microbatches) with dp * micro_batch * num_microbatches = global_batch,
    leaving out the micro-batch sizes in ``refused`` (those the model cannot take:
    core/micro_batch_probe.py)."""
    if global_batch % dp:
        return []
    per_replica = global_batch // dp
    return [(mb, per_replica // mb) for mb in divisors(per_replica)
            if (max_micro_batch is None or mb <= max_micro_batch) and mb not in refused]


def schedule_candidates(pp: int, num_layers: int, num_microbatches: int,
                        *, max_virtual_stages: int = 4, split_backward: bool = True) -> list[tuple[str, int]]:
    """(schedule, virtual stages per pipeline rank) for a pipeline of ``pp`` ranks.

    pp == 1 has no pipeline ("1f1b" with one stage is plain gradient accumulation).  The
    interleaved schedule needs a micro-batch count that is a multiple of pp (Narayanan et al.
    2021, Sec. 2.2.2) and, here, layers that split into v * pp equal model chunks: the step
    model's interleaved formula fills the pipeline as if a rank's chunks were equal, and a
    schedule of unequal chunks runs longer than it prices -- by 20% of the step for one
    published layout, and more the more micro-batches (docs/validation.md, "The pipelined
    PTD-P rows") -- so an unequal split would be chosen for a speed it does not have.
    Megatron-LM asks the same of its interleaved schedule (layers divisible by pp * v).  The
    split-backward schedules (interleaved-zb beside interleaved; zbv and dualpipev with v = 2 in
    a V) take equal chunks for the same reason: their formulas are those of equal chunks.
    ``split_backward=False`` leaves them out.
    """
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1)]
    if interleaved_microbatches_ok(num_microbatches, pp):
        for v in range(2, max_virtual_stages + 1):
            if v * pp <= num_layers and num_layers % (v * pp) == 0:
                out += [("interleaved", v)] + ([("interleaved-zb", v)] if split_backward else [])
    # the V schedules: two equal chunks per rank, and (ZB-V's steady state, DualPipeV's floor)
    # at least 2 pp micro-batches (pipeline_zero_bubble.py, core/rules.schedule_microbatches_problem)
    if split_backward and 2 * pp <= num_layers and num_layers % (2 * pp) == 0 and num_microbatches >= 2 * pp:
        out += [("zbv", 2), ("dualpipev", 2)]
    return out


def layer_choices(*, tp: int, dp: int, zero_family: str, can_split: bool,
                  allow_offload: bool = True, offload_tier: str = "cpu") -> list[LayerChoice]:
    """Every strategy of one layer on a mesh for a ZeRO family.

    ``can_split``: the layer has a Megatron split (core.sharding.megatron_styles is not empty).
    Offload goes through FSDP, so it needs ZeRO 2 or 3 (Plan.validate()); ``offload_tier`` is
    where it goes: "cpu", or "nvme" when host memory does not hold the state (planner/nvme_choice.py).
    """
    zeros = ZERO_FAMILIES[zero_family]
    if not zero1_shards(dp) and zero_family != "fsdp":
        zeros = (0,) if zero_family == "ddp" else ()
    splits = (True, False) if tp > 1 and can_split else (False,)
    out = []
    for split in splits:
        for zero in zeros:
            for recompute in RECOMPUTE_CHOICES:
                for offload in ("none", offload_tier) if (allow_offload and offload_allowed(zero)) else ("none",):
                    out.append(LayerChoice(tp=split, zero=zero, recompute=recompute, offload=offload))
    return out


def zero_families(dp: int) -> list[str]:
    """ZeRO-1 with one data-parallel rank shards nothing: it is DDP; FSDP still offloads."""
    return ["ddp", "zero1", "fsdp"] if zero1_shards(dp) else ["ddp", "fsdp"]


def with_sequence_parallel(mesh: Mesh, on: bool) -> Mesh:
    return replace(mesh, sequence_parallel=bool(on and mesh.tp > 1))
