"""The context of a plan on the fast path: everything about it that does not depend on
per-layer choices -- mesh, micro-batch, precision, stages and the ranks that run them, links,
each rank's cost model and memory, the pipeline exchange, the step's form -- built once per value
of those (PlanEvaluator keeps it by that value: evaluator.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError
from autopar.core.graph import OpGraph
from autopar.core.plan import Mesh, Plan
from autopar.core.rules import schedule_microbatches_problem
from autopar.core.dtypes import dtype_bytes, precision_bytes
from autopar.simulator.axes import pp_p2p as pipeline_p2p
from autopar.simulator.axes.pp_zero_bubble import stage_grid
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.topology import MeshLinks, busy_devices_per_node, node_stage_counts, stage_groups, world_link
from autopar.simulator.step import cpu_node, term_registry
from autopar.simulator.step.memory import inflight_microbatches
from autopar.simulator.step.optimizer_step import grad_norm_allreduce_time
from autopar.simulator.step.step_model import OVERLAPPED, StepForm, chunk_masks


@dataclass
class Context:
    """Everything about a plan that does not depend on per-layer choices."""
    mesh: Mesh
    micro_batch: int
    precision: str
    schedule: str
    num_microbatches: int
    p: int
    v: int
    starts: np.ndarray          # first layer of each virtual stage (G,)
    ends: np.ndarray
    layer_rank: np.ndarray      # pipeline rank of each layer (L,)
    grid: np.ndarray            # (v, p): the virtual stage of rank r's chunk c (stage_grid)
    layer_stage: np.ndarray     # virtual stage of each layer (L,)
    stage_start_of_layer: np.ndarray
    head: np.ndarray            # first layer of each model chunk (step_model.chunk_masks)
    tail: np.ndarray            # last layer of each model chunk
    not_tail: np.ndarray
    links: MeshLinks
    rank_cm: list[CostModel]    # slowest device's cost model per pipeline rank
    capacity: np.ndarray        # bytes per pipeline rank
    capacity_list: list         # the same, as floats
    node_counts: np.ndarray     # (distinct nodes, p): devices of each pipeline rank on a node
    host_capacity: np.ndarray   # (distinct nodes,): the node's host memory, bytes
    inflight: np.ndarray
    rank_onehot: np.ndarray     # (p, L): 1 where layer l runs on pipeline rank r
    host_when_empty: tuple      # (host bytes per node, worst node, fits) when nothing is offloaded
    p2p_s: float
    p2p_measured: bool
    p2p_blocking: bool          # the exchange is the last part of each task (pipeline_p2p.task_lengths)
    processes: int              # busy devices per node (topology.busy_devices_per_node)
    serial_comm: bool           # communication takes turns with compute (cpu_node.serial_communication)
    step_form: StepForm         # how the step is composed: step_model.OVERLAPPED or cpu_node.SERIAL
    waits_at_meetings: bool     # the profile prices the waits of ranks that meet (cpu_node.with_meeting_waits)
    row_context: int            # names (mesh, micro-batch, precision) in the row cache's keys
    rows_key: tuple             # (row_context, per-layer cost model names): what a layer's row depends on
    rank_cm_names: list[str]
    layer_cm_names: list[str]   # rank_cm_names of each layer's pipeline rank
    peak_flops: float           # the first pipeline rank's peak at the plan's precision (for MFU)
    last_layers: np.ndarray     # the last layer of each virtual stage (ends - 1)
    no_ddp: np.ndarray          # (p,) False: no pipeline rank holds DDP buckets
    min_capacity: float         # the smallest pipeline rank's device memory, bytes
    compiled: bool = False      # the plan compiles each block (simulator/compile_fusion.py)
    fp8_recipe: str = "tensorwise"  # the plan's float8 recipe (its fp8 layers: simulator/float8.py)
    #: (p,) the gradient norm's all-reduce per pipeline rank when the code clips (TrainingCode.grad_clip,
    #: simulator/optimizer_step.py), else None
    grad_norm_s: np.ndarray | None = None
    #: sharded_dp.with_sharded_dp_costs's arguments, worked out on first use (sharded_dp_table.plan_table_costs)
    sharded_args: tuple | None = None
    #: the per-layer terms are local (layer_memo.LayerMemo): the step form's (no serial communication) and
    #: every registered term acting here (term_registry.memo_safe: no DDP buckets, no CPU meeting
    #: waits, each of which reads the whole table)
    memo_ok: bool = False
    #: per layer, head + 2 tail (chunk_masks): what the step model reads of the layer's position
    position_class: list = field(default_factory=list)
    #: layer_memo.LayerMemo by the calibration the per-layer terms read (memo_settings)
    memos: dict = field(default_factory=dict)
    #: per layer, the share of its tied weights' copies its chunk holds (tied_copies.held_share)
    tied_share: np.ndarray | None = None
    #: a pipeline's micro-batches (pp > 1: torch's schedules gather and reduce-scatter FSDP units
    #: per step, simulator/pipeline_fsdp.py), None without a pipeline
    pipeline_m: int | None = None


@dataclass
class ContextNames:
    """The small integers that name a context's parts in the row caches' keys (cheap to hash),
    each handed out once per value: (mesh, micro-batch, precision, compile, fp8 recipe) ->
    ``row_context``; the layers' cost model names -> an integer."""
    row_contexts: dict = field(default_factory=dict)
    rank_cm_keys: dict = field(default_factory=dict)


def build_context(plan: Plan, key: tuple, graph: OpGraph, cluster: Cluster, links: MeshLinks,
                  rank_cm: list[CostModel], names: ContextNames) -> Context:
    """The context of ``plan`` (``key``: the values it is built from, PlanEvaluator's cache
    key), on ``graph`` and ``cluster``, with the mesh's ``links`` and each pipeline rank's cost
    model ``rank_cm``; ``names`` gives the integers that name its rows' contexts."""
    num_layers = len(graph.layers)
    pl = plan.pipeline
    mesh = plan.mesh
    p = mesh.pp
    stages = pl.stages
    if not stages or len(stages) % p:
        raise InfeasibleError(f"{len(stages)} pipeline stages on {p} pipeline ranks")
    if stages[-1].end != num_layers:
        raise InfeasibleError(f"pipeline stages end at layer {stages[-1].end}, the model has {num_layers}")
    v = len(stages) // p
    problem = schedule_microbatches_problem(pl.schedule, pl.num_microbatches, p, len(stages)) if p > 1 else None
    if problem:
        raise InfeasibleError(f"the pipeline needs {problem}")
    if mesh.world_size > cluster.world_size:
        raise InfeasibleError(f"plan needs {mesh.world_size} devices, the cluster has {cluster.world_size}")
    starts = np.array([s.start for s in stages])
    ends = np.array([s.end for s in stages])
    layer_stage = np.repeat(np.arange(len(stages)), ends - starts)
    capacity = np.array([min(cluster.groups[g].gpu_memory_bytes for g in stage_groups(cluster, mesh, r))
                        for r in range(p)], dtype=float)
    node_counts, host_capacity = node_stage_counts(cluster, mesh)
    inflight = np.array([inflight_microbatches(pl.schedule, p, r, pl.num_microbatches, v) for r in range(p)], dtype=float)
    # activation send between stages, per micro-batch: the largest boundary tensor
    scale = plan.micro_batch / max(1, graph.batch_size)
    act_scale = precision_bytes(plan.precision) / dtype_bytes(graph.param_dtype)
    # stage boundaries carry full (not sequence-sharded) activations: the runtime gathers
    # the sequence on leaving a sequence-parallel run (runtime/apply_tp.py); an axis that
    # splits the sequence itself (parallel_dims.Axis.splits, context parallelism) leaves each
    # rank its share of the tokens to send
    sp_div = mesh.degree("sequence")
    boundary = max((graph.layers[s.end - 1].output_bytes for s in stages[:-1]), default=0)
    p2p_s, p2p_m = (0.0, False)
    busy = busy_devices_per_node(cluster, mesh)
    if len(stages) > 1:
        p2p_s, p2p_m = pipeline_p2p.exchange_time(rank_cm[0], boundary * scale * act_scale / sp_div, mesh.tp,
                                                links.pp.link, links.pp.level, links.tp.link, links.tp.level,
                                                busy)
    grid = stage_grid(pl.schedule, p, v)
    stage_rank = np.empty(len(stages), dtype=int)
    stage_rank[grid] = np.arange(p)[None, :]
    layer_rank = stage_rank[layer_stage]
    serial = cpu_node.serial_communication(cluster, mesh)
    row_context = names.row_contexts.setdefault(key[:3] + (plan.compile, plan.fp8_recipe), len(names.row_contexts))
    rank_cm_names = [cm.name for cm in rank_cm]
    layer_cm_names = [rank_cm_names[r] for r in layer_rank]
    empty = node_counts @ np.zeros(p)
    host_when_empty = (empty, int(np.argmax(empty - host_capacity)), bool((empty <= host_capacity).all()))
    layer_cms = names.rank_cm_keys.setdefault(tuple(layer_cm_names), len(names.rank_cm_keys))
    ctx = Context(mesh=mesh, micro_batch=plan.micro_batch, precision=plan.precision, schedule=pl.schedule,
                   num_microbatches=pl.num_microbatches, p=p, v=v, starts=starts, ends=ends,
                   layer_rank=layer_rank, layer_stage=layer_stage, grid=grid,
                   rank_onehot=(np.arange(p)[:, None] == layer_rank[None, :]).astype(float),
                   stage_start_of_layer=starts[layer_stage], links=links, rank_cm=rank_cm,
                   **dict(zip(("head", "tail", "not_tail"), chunk_masks(starts, num_layers))),
                   capacity=capacity, capacity_list=capacity.tolist(), inflight=inflight,
                   node_counts=node_counts, host_capacity=host_capacity,
                   p2p_s=p2p_s, p2p_measured=p2p_m, p2p_blocking=rank_cm[0].code.p2p.blocking,
                   host_when_empty=host_when_empty,
                   processes=busy, serial_comm=serial,
                   step_form=cpu_node.SERIAL if serial else OVERLAPPED,
                   waits_at_meetings=cpu_node.waits_at_meetings(mesh, busy, rank_cm),
                   row_context=row_context, rows_key=(row_context, layer_cms),
                   rank_cm_names=rank_cm_names, layer_cm_names=layer_cm_names,
                   peak_flops=rank_cm[0].peak(plan.precision), last_layers=ends - 1,
                   no_ddp=np.zeros(p, dtype=bool), min_capacity=float(capacity.min()), compiled=plan.compile,
                   fp8_recipe=plan.fp8_recipe, pipeline_m=pl.num_microbatches if p > 1 else None)
    if any(cm.code.grad_clip for cm in rank_cm):
        world = world_link(cluster, mesh)
        ctx.grad_norm_s = np.array([grad_norm_allreduce_time(cm, mesh.world_size, world.link, world.level)
                                   if cm.code.grad_clip else 0.0 for cm in rank_cm])
    # e.g. DDP buckets (ddp_buckets.py) may apply to a plain data-parallel mesh
    ctx.memo_ok = ctx.step_form.memo_ok and term_registry.memo_safe(ctx)
    ctx.position_class = (ctx.head + 2 * ctx.tail).tolist()
    return ctx


def memo_settings(ctx: Context):
    """What the per-layer terms read besides the rows (layer_memo.LayerMemo's values hold for one value):
    the fitted constants (simulator/calibration.py) of the cost model priced with, which
    benchmarks/published_runs.py --fit varies by passing cost models of other calibrations.  The
    training code they also read is fixed for an evaluator (its cost models' ``code``)."""
    return ctx.rank_cm[0].calibration
