"""A hand-written configuration (dp, tp, pp, ...) turned into a Plan, Megatron style.

Stages hold equal numbers of repeated blocks; the layers before the first block (embeddings)
join the first stage and those after the last block (final norm, output head, loss) the last
stage, as Megatron-LM places them (Narayanan et al. 2021, Sec. 2.2).  Tensor parallelism uses
the Megatron column/row pairs found in each layer (autopar.core.sharding.megatron_styles).
Recompute applies to the repeated blocks (what Megatron's and torchtitan's activation
checkpointing wrap).
"""
from __future__ import annotations

from typing import Mapping

from autopar.core.rules import V_SCHEDULES
from autopar.core.errors import UserError
from autopar.core.graph import OpGraph
from autopar.core.plan import Mesh, ModelRef, Plan, equal_bounds, uniform_plan
from autopar.core.sharding import megatron_styles


def block_stage_bounds(graph: OpGraph, num_stages: int) -> list[int]:
    """[0, b1, ..., num_layers]: equal blocks per stage, pre/post layers on the end stages."""
    n = len(graph.layers)
    blocks = [i for i, layer in enumerate(graph.layers) if layer.kind not in ("pre", "post")]
    if not blocks:
        blocks = list(range(n))
    first, last = blocks[0], blocks[-1] + 1
    nb = last - first
    if num_stages > nb:
        raise UserError(f"{num_stages} pipeline stages for {nb} repeated blocks of {graph.model_name}; "
                        f"use at most {nb} stages (pp x virtual stages).")
    bounds = [0] + [first + b for b in equal_bounds(nb, num_stages)[1:]]
    bounds[-1] = n
    return bounds


def config_plan(graph: OpGraph, *, degrees: Mapping[str, int], micro_batch: int, global_batch: int | None,
                schedule: str, virtual_stages: int, zero: int, recompute: str, offload: str, precision: str,
                sequence_parallel: bool, cluster_name: str = "", mesh_class: type = Mesh) -> Plan:
    """The plan of ``degrees`` -- a degree per declared axis by name (``{"dp": 2, "tp": 2}``; an
    axis not named is 1) of ``Mesh`` or of ``mesh_class`` -- with the same choices on every
    layer.  The global batch splits ``batch_degree`` ways (``None``: one micro-batch per replica
    and pipeline stage)."""
    mesh = mesh_class(**degrees, sequence_parallel=sequence_parallel)
    replicas, pp, tp = mesh.batch_degree, mesh.degree("layers"), mesh.degree("tensors")
    if global_batch is None:
        global_batch = replicas * micro_batch * max(1, pp)
    if global_batch % (replicas * micro_batch):
        raise UserError(f"--global-batch {global_batch} is not a multiple of dp x micro-batch = "
                        f"{replicas} x {micro_batch}; choose a global batch divisible by {replicas * micro_batch}.")
    num_micro = global_batch // (replicas * micro_batch)
    if schedule in V_SCHEDULES:
        virtual_stages = 2                # two chunks per rank in a V (core/rules.py)
    elif schedule not in ("interleaved", "interleaved-zb"):
        virtual_stages = 1
    bounds = block_stage_bounds(graph, pp * virtual_stages)
    styles = {i: megatron_styles(graph, i) for i in range(len(graph.layers))} if tp > 1 else None
    plan = uniform_plan(model=ModelRef(graph.model_file, dict(graph.model_args), graph.model_name, graph.fingerprint),
                        num_layers=len(graph.layers), mesh_class=mesh_class, **degrees, micro_batch=micro_batch,
                        num_microbatches=num_micro, schedule=schedule, virtual_stages=virtual_stages,
                        tp_styles_per_layer=styles, sequence_parallel=sequence_parallel, zero=zero,
                        recompute="none", offload=offload, precision=precision, cluster=cluster_name,
                        stage_bounds=bounds)
    if recompute != "none":
        from dataclasses import replace

        layers = tuple(replace(lp, recompute=recompute) if graph.layers[lp.layer].kind not in ("pre", "post") else lp
                       for lp in plan.layers)
        plan = replace(plan, layers=layers)
    return plan
