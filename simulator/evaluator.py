"""The fast path for search: price a plan from cached per-layer costs.

``PlanEvaluator.evaluate(plan)`` prices a plan without an event timeline:

1. per layer, a ``LayerCost`` cached by (layer signature, the layer's tp styles relative to
   the layer, ZeRO, recompute, offload) within a context (mesh, micro-batch, precision), so a
   plan that differs from the last one in a few layers recomputes only those rows
   (a LayerTable: layer_table.py);
2. the registered "table" cost terms rewrite the rows (term_registry.py, builtin_terms.py): DDP's
   buckets where the runtime runs plain DDP, sharded data parallelism's copies, on CPU nodes the
   waits of ranks that meet (``_derive``);
3. the step in closed form by the context's step form (step_model.OVERLAPPED, or
   cpu_node.SERIAL where communication takes turns with compute, chosen when the context is
   built), and memory per pipeline rank (memory.py) from per-rank sums.

Where every term acting on the plan's context is local (term_registry.memo_safe) and the step
form allows (a GPU plan: no DDP buckets, no CPU waits) ``evaluate`` keeps, per context, the last plan's
derived table and a memo of each layer's derived row by its neighbourhood (``_LayerMemo``), so
a plan that changes a few layers looks up a few rows and redoes only the reductions over
layers; the numbers are the same bits as ``prepare`` + ``closed_form_step`` + ``assemble``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from operator import is_not, le
from typing import Mapping

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError
from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh, Plan
from autopar.core.rules import schedule_microbatches_problem
from autopar.core.dtypes import dtype_bytes, precision_bytes
from autopar.core.sharding import propagate
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.step import cpu_node, layer_table, term_registry
from autopar.simulator.axes import pp_p2p as pipeline_p2p, pp_tied_copies as tied_copies
from autopar.simulator.axes.dp_buckets import DDP_FIRST_BUCKET_BYTES, ddp_bucketed_all_reduces  # noqa: F401
from autopar.simulator.axes.sharded_dp_zero3_spans import layer_units
from autopar.simulator.axes.recompute import recomputed_matmuls
from autopar.simulator.axes.sharded_dp import effective_zero
from autopar.simulator.step.layer_cost import LayerCost, compute_layer_cost
from autopar.simulator.step.op_work import MATMUL_KINDS
from autopar.simulator.step.layer_table import COLUMN_INDEX, RECOMPUTE_CODE, LayerTable
from autopar.simulator.step.memory import inflight_microbatches, stage_memory
from autopar.simulator.axes.pp_zero_bubble import stage_grid
from autopar.simulator.result import SimResult, StepWork
from autopar.simulator.step.step_model import (OVERLAPPED, StepForm, chunk_masks, last_reduce_scatter,
                                         layer_effective_times, step_from_chunk_times)
from autopar.simulator.device.topology import (MeshLinks, busy_devices_per_node, mesh_links, node_stage_counts, stage_groups,
                                       world_link)
from autopar.simulator.step.optimizer_step import grad_norm_allreduce_time

#: columns whose maximum over a model chunk's layers enters memory (transient and FSDP buffers)
_MAX_COLUMNS = [COLUMN_INDEX[c] for c in ("transient_bytes", "fsdp_param_buffer_bytes", "fsdp_grad_buffer_bytes")]
#: columns a step's work and traffic are summed from (SimResult.work, read when asked for)
_WORK_COLUMNS = [COLUMN_INDEX[c] for c in ("recompute", "tp_wire_bytes", "dp_wire_bytes_per_mb", "dp_wire_bytes_per_step",
                                           "num_measured", "num_estimated", "output_bytes")]

#: columns assemble reads by index (a LayerTable's named columns, without building one)
_PARAM, _GRAD, _OPTIMIZER, _HOST, _DP_GRAD, _ACTIVATION, _OUTPUT, _ZERO = (
    COLUMN_INDEX[c] for c in ("param_bytes", "grad_bytes", "optimizer_bytes", "host_bytes", "dp_grad_bytes",
                              "activation_bytes", "output_bytes", "zero"))
#: the state columns and, in the same order, those of a tied weight's copy (tied_copies.py)
_STATE = [_PARAM, _GRAD, _OPTIMIZER, _HOST, _DP_GRAD]
_TIED_STATE = [COLUMN_INDEX[f"tied_{c}"] for c in ("param_bytes", "grad_bytes", "optimizer_bytes", "host_bytes",
                                                   "dp_grad_bytes")]

_OFFLOAD, _RS, _D2H = (COLUMN_INDEX[c] for c in ("offload", "dp_reducescatter_s", "d2h_s"))
#: the fast path's derived table (PlanEvaluator._derived_table): per layer the effective forward
#: and backward time, the activation bytes, the three _MAX_COLUMNS, the
#: step_model.last_reduce_scatter term on the first layer of each model chunk (zero elsewhere) and
#: the output bytes on its last layer (zero elsewhere) -- both nonnegative, so a chunk's maximum of
#: them is the value at its first / last layer -- then the columns (as many as the registered
#: terms make: PlanEvaluator._table_width)
_FWD, _BWD, _ACT, _MAXIMA, _LAST_RS, _OUT_END = 0, 1, 2, 3, 6, 7
_NUM_DERIVED = 8

#: entries an identity-keyed cache holds before it starts afresh: each entry keeps an object
#: alive, and a caller that never hands the same object twice would otherwise grow it for nothing
_IDENTITY_ENTRIES = 4096


@dataclass
class _Context:
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
    row_slots: list[int]        # per layer, an integer naming (row_context, its cost model name)
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
    #: the per-layer terms are local (_LayerMemo): the step form's (no serial communication) and
    #: every registered term acting here (term_registry.memo_safe: no DDP buckets, no CPU meeting
    #: waits, each of which reads the whole table)
    memo_ok: bool = False
    #: per layer, head + 2 tail (chunk_masks): what the step model reads of the layer's position
    position_class: list = field(default_factory=list)
    #: _LayerMemo by the calibration the per-layer terms read (_memo_settings)
    memos: dict = field(default_factory=dict)
    #: per layer, the share of its tied weights' copies its chunk holds (tied_copies.held_share)
    tied_share: np.ndarray | None = None
    #: a pipeline's micro-batches (pp > 1: torch's schedules gather and reduce-scatter FSDP units
    #: per step, simulator/pipeline_fsdp.py), None without a pipeline
    pipeline_m: int | None = None


class _LayerMemo:
    """What ``prepare`` and ``layer_effective_times`` derive per layer, kept for later plans.

    Layer k's derived row (its row after sharded_dp, then its effective forward and backward
    time and the other per-layer terms of PlanEvaluator._derived_table) is a function of the rows
    of layers k-1, k, k+1 and of k's place in its model chunk: sharded_dp.with_sharded_dp_costs
    reads the neighbours k-1 and k+1 and leaves the columns layer_effective_times reads of a
    layer's successor (its forward communication: dp_allgather_s, h2d_s, zero, offload) a function
    of the layer's own row (both say so; tests/simulator/test_simulator_fast_path.py holds them to it).
    Both apply elementwise IEEE operations to each layer, so layer k's numbers are the same bits
    whatever the other layers hold.  Two whole-table tests choose what is computed at all -- does any layer run
    sharded (ZeRO >= 2), is any offloaded -- so the values are kept per answer to both.
    ``values`` maps (those two answers and k's position class in one integer, the row ids of
    k-1, k, k+1) to the derived row; ``layers``, ``ids``, ``table``, ``counts``: the last plan's
    layer plans, row ids, derived table and its numbers of sharded, of offloaded and of ZeRO-1
    layers.
    """
    __slots__ = ("values", "layers", "ids", "table", "counts")

    #: entries kept before the memo starts afresh (each holds one row of about 40 floats)
    ENTRIES = 1 << 14

    def __init__(self):
        self.values: dict[tuple, np.ndarray] = {}
        self.layers: tuple | None = None
        self.ids: list[int] | None = None
        self.table: np.ndarray | None = None
        self.counts = (0, 0, 0)


class PlanEvaluator:
    """Prices plans for the search; ``layer_cost`` is the table the planner's ILP reads."""

    def __init__(self, graph: OpGraph, cluster: Cluster, cost_model: CostModel | Mapping[str, CostModel]):
        self.graph = graph
        self.cluster = cluster
        if isinstance(cost_model, CostModel):
            self._cms = {g.gpu: cost_model for g in cluster.groups}
        else:
            missing = [g.gpu for g in cluster.groups if g.gpu not in cost_model]
            if missing:
                raise ValueError(f"no cost model for GPU types {missing}")
            self._cms = dict(cost_model)
        self.num_layers = len(graph.layers)
        # the layer table's columns as the registered terms make them (term_registry.py)
        self._table_width = _NUM_DERIVED + len(layer_table.COLUMNS)
        self._tied_uses = tied_copies.uses(graph)        # tied weights used by several layers
        self._prefix = [layer.name + "." for layer in graph.layers]
        self._sig = [layer.signature for layer in graph.layers]
        b0 = max(1, graph.batch_size)
        self._layer_fwd_flops = np.array([layer.fwd_flops for layer in graph.layers]) / b0
        # what a selective recompute reruns: the cheap ops, and the matmuls the code's policy does not
        # save (simulator/selective_mm_policy.py; every group runs the same code)
        policy = next(iter(self._cms.values())).code.selective_mm_policy
        self._layer_cheap_fwd_flops = np.array(
            [sum(o.fwd_flops for o in ops if o.kind not in MATMUL_KINDS or o.name in rerun)
             for ops in (list(graph.layer_ops(i)) for i in range(self.num_layers))
             for rerun in (recomputed_matmuls(ops, policy),)]) / b0
        self._flops_per_sample = graph.flops_per_sample
        self._cost_cache: dict[tuple, LayerCost] = {}
        #: the ops' compute of a layer by what it reads (step/op_work.op_work_key): shared between
        #: meshes that differ in dp or pp only
        self._work_cache: dict[tuple, object] = {}
        self._row_cache: dict[tuple, tuple[np.ndarray, int]] = {}   # key -> (row, row id)
        self._row_flags: list[tuple[int, int, int]] = []  # per row id: (sharded, offloaded, ZeRO-1)
        self._row_contexts: dict[tuple, int] = {}
        self._relkey_cache: dict[tuple, tuple] = {}
        self._rel_ids: dict[tuple, int] = {}
        self._row_slots: dict[tuple, int] = {}          # (row context, cost model name) -> int
        self._row_by_id: dict[tuple, tuple] = {}        # (id(layer plan), row slot) -> (layer plan, row)
        self._ctx_cache: dict[tuple, _Context] = {}
        self._links_cache: dict[Mesh, MeshLinks] = {}
        self._layouts: dict[tuple, object] = {}
        self._rank_cm_keys: dict[tuple, int] = {}
        # the last rows built per _Context.rows_key: rows_key -> (layer plans, rows)
        self._last_rows: dict[tuple, tuple] = {}
        # contexts by the identity of the plan's pipeline and mesh objects (a search reuses them):
        # (id(pipeline), id(mesh), micro-batch, precision) -> (pipeline, mesh, ctx, key); holding
        # the objects keeps their ids from being reused while the entry lives
        self._ctx_by_identity: dict[tuple, tuple] = {}
        self.num_layer_costs_computed = 0
        self._units: list | None = None                 # _fetch_units

    # ------------------------------------------------------------------ layer table
    def _fetch_units(self) -> list:
        """Each layer's gathered sub-modules (zero3_fetch_spans.layer_units), worked out once."""
        if self._units is None:
            self._units = [layer_units(self.graph.layer_ops(i)) for i in range(self.num_layers)]
        return self._units

    def _relative_key(self, index: int, lp: LayerPlan) -> int:
        """The layer's choice relative to the layer (its signature, styles by path within the layer,
        ZeRO, recompute, offload, own precision), as an integer: identical blocks under the same
        choice share it."""
        k = (index, lp.tp, lp.zero, lp.recompute, lp.offload, lp.precision)
        rel = self._relkey_cache.get(k)
        if rel is None:
            prefix = self._prefix[index]
            styles = tuple(sorted((m[len(prefix):] if m.startswith(prefix) else m, s) for m, s in lp.tp))
            # a small integer names the relative key in the caches' keys (cheap to hash)
            rel = self._rel_ids.setdefault((self._sig[index], styles, lp.zero, lp.recompute, lp.offload,
                                            lp.precision), len(self._rel_ids))
            self._relkey_cache[k] = rel
        return rel

    def links(self, mesh: Mesh) -> MeshLinks:
        links = self._links_cache.get(mesh)
        if links is None:
            links = mesh_links(self.cluster, mesh)
            self._links_cache[mesh] = links
        return links

    def rank_cost_models(self, mesh: Mesh) -> list[CostModel]:
        """The cost model that prices each pipeline rank (its slowest device type)."""
        out = []
        for r in range(mesh.pp):
            cms = [self._cms[self.cluster.groups[g].gpu] for g in stage_groups(self.cluster, mesh, r)]
            # the slowest device of the stage sets its pace: lowest matmul throughput
            out.append(min(cms, key=lambda cm: cm.peak("bf16") * cm.efficiency.get("matmul", 1.0)))
        return out

    def layer_cost(self, layer_index: int, layer_plan: LayerPlan, mesh: Mesh, micro_batch: int,
                   precision: str, cost_model: CostModel | None = None, compiled: bool = False,
                   fp8_recipe: str = "tensorwise") -> LayerCost:
        """Cost of one layer under one choice, per device and micro-batch (cached); ``compiled``:
        the plan's ``compile`` (simulator/compile_fusion.py), ``fp8_recipe`` its float8 recipe."""
        cm = cost_model or self.rank_cost_models(mesh)[0]
        key = (self._relative_key(layer_index, layer_plan), mesh, micro_batch, precision, cm.name, compiled,
               fp8_recipe if layer_plan.precision == "fp8" else "")
        cost = self._cost_cache.get(key)
        if cost is None:
            # the layout depends on the layer, its styles and the tp axis only: shared between
            # the costs of every ZeRO / recompute / offload choice, micro-batch and dp x pp
            loss_parallel = cm.code.loss_parallel
            layout_key = (layer_index, layer_plan.tp, mesh.tp, mesh.sequence_parallel, loss_parallel)
            layout = self._layouts.get(layout_key)
            if layout is None:
                layout = propagate(self.graph, layer_index, layer_plan.tp_styles, mesh.tp, mesh.sequence_parallel,
                                   loss_parallel)
                self._layouts[layout_key] = layout
            cost = compute_layer_cost(self.graph, layer_index, layout, layer_plan, mesh, micro_batch,
                                      precision, cm, self.links(mesh),
                                      # CPU nodes: oversubscribed compute slots; the waits of ranks
                                      # that meet are added per plan (cpu_node.with_meeting_waits)
                                      cpu_node.compute_stretch(self.cluster, mesh),
                                      busy_devices_per_node(self.cluster, mesh), compiled=compiled,
                                      fp8_recipe=fp8_recipe, work_cache=self._work_cache)
            self._cost_cache[key] = cost
            self.num_layer_costs_computed += 1
        return cost

    def _row(self, index: int, lp: LayerPlan, ctx: _Context) -> tuple[np.ndarray, int]:
        """(the layer's row, an integer naming that row: equal integers, equal rows)."""
        # a search hands the same LayerPlan objects again: by identity first
        by_id = (id(lp), ctx.row_slots[index])
        hit = self._row_by_id.get(by_id)
        if hit is not None and hit[0] is lp:
            return hit[1]
        rel = self._relative_key(index, lp)
        key = (rel, ctx.row_context, ctx.layer_cm_names[index])
        row_id = self._row_cache.get(key)
        if row_id is None:
            cm = ctx.rank_cm[ctx.layer_rank[index]]
            c = self.layer_cost(index, lp, ctx.mesh, ctx.micro_batch, ctx.precision, cm, ctx.compiled, ctx.fp8_recipe)
            row = np.array(term_registry.layer_row(c, float(effective_zero(lp.zero, ctx.mesh)),
                                                   1.0 if lp.offload == "cpu" else 0.0,
                                                   float(RECOMPUTE_CODE[lp.recompute]), lp, ctx.mesh), dtype=float)
            row_id = self._row_cache[key] = (row, len(self._row_cache))
            # (runs sharded, is offloaded, runs ZeRO-1)
            self._row_flags.append((int(row[_ZERO] >= 2), int(row[_OFFLOAD] != 0), int(row[_ZERO] == 1)))
        if len(self._row_by_id) >= _IDENTITY_ENTRIES:
            self._row_by_id.clear()
        self._row_by_id[by_id] = (lp, row_id)              # holding lp keeps its id from reuse
        return row_id

    # -------------------------------------------------------------------- context
    def _context(self, plan: Plan) -> tuple[_Context, tuple]:
        pl = plan.pipeline
        # a search that keeps the plan's mesh and pipeline objects: skip hashing the stages
        ident = (id(pl), id(plan.mesh), plan.micro_batch, plan.precision, plan.compile, plan.fp8_recipe)
        hit = self._ctx_by_identity.get(ident)
        if hit is not None and hit[0] is pl and hit[1] is plan.mesh:
            return hit[2], hit[3]
        key = (plan.mesh, plan.micro_batch, plan.precision, pl.stages, pl.schedule, pl.num_microbatches, plan.compile,
               plan.fp8_recipe)
        ctx = self._ctx_cache.get(key)
        if ctx is None:
            ctx = self._new_context(plan, key)
            self._ctx_cache[key] = ctx
        if len(self._ctx_by_identity) >= _IDENTITY_ENTRIES:
            self._ctx_by_identity.clear()
        self._ctx_by_identity[ident] = (pl, plan.mesh, ctx, key)
        return ctx, key

    def _new_context(self, plan: Plan, key: tuple) -> _Context:
        pl = plan.pipeline
        mesh = plan.mesh
        p = mesh.pp
        stages = pl.stages
        if not stages or len(stages) % p:
            raise InfeasibleError(f"{len(stages)} pipeline stages on {p} pipeline ranks")
        if stages[-1].end != self.num_layers:
            raise InfeasibleError(f"pipeline stages end at layer {stages[-1].end}, the model has {self.num_layers}")
        v = len(stages) // p
        problem = schedule_microbatches_problem(pl.schedule, pl.num_microbatches, p, len(stages)) if p > 1 else None
        if problem:
            raise InfeasibleError(f"the pipeline needs {problem}")
        if mesh.world_size > self.cluster.world_size:
            raise InfeasibleError(f"plan needs {mesh.world_size} devices, the cluster has {self.cluster.world_size}")
        starts = np.array([s.start for s in stages])
        ends = np.array([s.end for s in stages])
        layer_stage = np.repeat(np.arange(len(stages)), ends - starts)
        links = self.links(mesh)
        rank_cm = self.rank_cost_models(mesh)
        capacity = np.array([min(self.cluster.groups[g].gpu_memory_bytes for g in stage_groups(self.cluster, mesh, r))
                             for r in range(p)], dtype=float)
        node_counts, host_capacity = node_stage_counts(self.cluster, mesh)
        inflight = np.array([inflight_microbatches(pl.schedule, p, r, pl.num_microbatches, v) for r in range(p)], dtype=float)
        # activation send between stages, per micro-batch: the largest boundary tensor
        scale = plan.micro_batch / max(1, self.graph.batch_size)
        act_scale = precision_bytes(plan.precision) / dtype_bytes(self.graph.param_dtype)
        # stage boundaries carry full (not sequence-sharded) activations: the runtime gathers
        # the sequence on leaving a sequence-parallel run (runtime/apply_tp.py); an axis that
        # splits the sequence itself (parallel_dims.Axis.splits, context parallelism) leaves each
        # rank its share of the tokens to send
        sp_div = mesh.degree("sequence")
        boundary = max((self.graph.layers[s.end - 1].output_bytes for s in stages[:-1]), default=0)
        p2p_s, p2p_m = (0.0, False)
        busy = busy_devices_per_node(self.cluster, mesh)
        if len(stages) > 1:
            p2p_s, p2p_m = pipeline_p2p.exchange_time(rank_cm[0], boundary * scale * act_scale / sp_div, mesh.tp,
                                                      links.pp.link, links.pp.level, links.tp.link, links.tp.level,
                                                      busy)
        grid = stage_grid(pl.schedule, p, v)
        stage_rank = np.empty(len(stages), dtype=int)
        stage_rank[grid] = np.arange(p)[None, :]
        layer_rank = stage_rank[layer_stage]
        serial = cpu_node.serial_communication(self.cluster, mesh)
        row_context = self._row_contexts.setdefault(key[:3] + (plan.compile, plan.fp8_recipe), len(self._row_contexts))
        rank_cm_names = [cm.name for cm in rank_cm]
        layer_cm_names = [rank_cm_names[r] for r in layer_rank]
        row_slots = [self._row_slots.setdefault((row_context, name), len(self._row_slots)) for name in layer_cm_names]
        empty = node_counts @ np.zeros(p)
        host_when_empty = (empty, int(np.argmax(empty - host_capacity)), bool((empty <= host_capacity).all()))
        layer_cms = self._rank_cm_keys.setdefault(tuple(layer_cm_names), len(self._rank_cm_keys))
        ctx = _Context(mesh=mesh, micro_batch=plan.micro_batch, precision=plan.precision, schedule=pl.schedule,
                       num_microbatches=pl.num_microbatches, p=p, v=v, starts=starts, ends=ends,
                       layer_rank=layer_rank, layer_stage=layer_stage, grid=grid,
                       rank_onehot=(np.arange(p)[:, None] == layer_rank[None, :]).astype(float),
                       stage_start_of_layer=starts[layer_stage], links=links, rank_cm=rank_cm,
                       **dict(zip(("head", "tail", "not_tail"), chunk_masks(starts, self.num_layers))),
                       capacity=capacity, capacity_list=capacity.tolist(), inflight=inflight,
                       node_counts=node_counts, host_capacity=host_capacity,
                       p2p_s=p2p_s, p2p_measured=p2p_m, p2p_blocking=rank_cm[0].code.p2p.blocking,
                       host_when_empty=host_when_empty,
                       processes=busy, serial_comm=serial,
                       step_form=cpu_node.SERIAL if serial else OVERLAPPED,
                       waits_at_meetings=cpu_node.waits_at_meetings(mesh, busy, rank_cm),
                       row_context=row_context, rows_key=(row_context, layer_cms),
                       rank_cm_names=rank_cm_names, layer_cm_names=layer_cm_names, row_slots=row_slots,
                       peak_flops=rank_cm[0].peak(plan.precision), last_layers=ends - 1,
                       no_ddp=np.zeros(p, dtype=bool), min_capacity=float(capacity.min()), compiled=plan.compile,
                       fp8_recipe=plan.fp8_recipe, pipeline_m=pl.num_microbatches if p > 1 else None)
        if any(cm.code.grad_clip for cm in rank_cm):
            world = world_link(self.cluster, mesh)
            ctx.grad_norm_s = np.array([grad_norm_allreduce_time(cm, mesh.world_size, world.link, world.level)
                                        if cm.code.grad_clip else 0.0 for cm in rank_cm])
        # e.g. DDP buckets (ddp_buckets.py) may apply to a plain data-parallel mesh
        ctx.memo_ok = ctx.step_form.memo_ok and term_registry.memo_safe(ctx)
        ctx.position_class = (ctx.head + 2 * ctx.tail).tolist()
        return ctx

    def _rows(self, plan: Plan, ctx: _Context, key: tuple) -> LayerTable:
        return LayerTable(self._rows_and_ids(plan, ctx)[0])

    def _rows_and_ids(self, plan: Plan, ctx: _Context) -> tuple[np.ndarray, list[int]]:
        """The plan's (layers, columns) rows and the integer naming each layer's row (_row)."""
        layers = plan.layers
        if len(layers) != self.num_layers:
            raise InfeasibleError(f"plan has {len(layers)} layer entries, the model {self.num_layers} layers")
        # a layer's row depends on its plan, the mesh, micro-batch and precision and its rank's
        # cost model (_row): rows built for another context with the same rows_key serve
        last = self._last_rows.pop(ctx.rows_key, None)
        if last is not None:
            old_layers, rows, ids = last
            if layers is not old_layers:   # rows and ids are never written after this: copies only to change them
                # the layers that are other objects (in C: a search keeps the unchanged ones), then
                # those of them that differ
                moved = compress(range(len(layers)), map(is_not, layers, old_layers))
                changed = [i for i in moved if layers[i] != old_layers[i]]
                if changed:
                    rows = rows.copy()
                    ids = ids.copy()
                    for i in changed:
                        rows[i], ids[i] = self._row(i, layers[i], ctx)
        else:
            built = [self._row(i, lp, ctx) for i, lp in enumerate(layers)]
            rows = np.array([r for r, _ in built], dtype=float)
            ids = [i for _, i in built]
        if len(self._last_rows) >= 64:
            self._last_rows.pop(next(iter(self._last_rows)))      # the least recently used
        self._last_rows[ctx.rows_key] = (layers, rows, ids)
        return rows, ids

    # ------------------------------------------------------------------ evaluation
    def prepare(self, plan: Plan) -> tuple[_Context, LayerTable]:
        """The plan's context and its per-layer table, as the step model reads them."""
        ctx, key = self._context(plan)
        return ctx, self._derive(self._rows(plan, ctx, key), ctx)

    def _derive(self, rows: LayerTable, ctx: _Context) -> LayerTable:
        """The plan's rows rewritten by the registered "table" terms, in order (builtin_terms.py:
        DDP buckets, sharded data parallelism's copies and overlap, the waits of CPU ranks that
        meet): the terms that depend on other layers."""
        for term in term_registry.table_terms():
            rows = term.derive(rows, ctx, self)
        return rows

    def evaluate(self, plan: Plan) -> SimResult:
        ctx, key = self._context(plan)
        if not ctx.memo_ok:
            rows = self._derive(self._rows(plan, ctx, key), ctx)
            step_r, bubble = ctx.step_form.step(ctx, rows)
            return self.assemble(plan, ctx, rows, step_r, bubble)
        table, (n_sharded, _, n_zero1) = self._derived_table(plan, ctx)
        rows = LayerTable(table[:, _NUM_DERIVED:])
        # per model chunk, in one call each: the sums of (forward, backward, activation) and the
        # maxima of the _MAX_COLUMNS (the same numbers as one column at a time)
        sums = np.add.reduceat(table[:, _FWD:_ACT + 1], ctx.starts, axis=0)
        maxima = np.maximum.reduceat(table[:, _MAXIMA:_OUT_END + 1], ctx.starts, axis=0)
        any_ddp = n_sharded < self.num_layers             # (ZeRO stages are 0 .. 3)
        # (under a pipeline the reduce-scatters of each rank's first chunk end its step:
        # step_model.fsdp_tails sums them from the rows)
        step_r, bubble = step_from_chunk_times(ctx, rows, table[:, _BWD], sums[:, 0], sums[:, 1],
                                               maxima[:ctx.p, 3] if ctx.pipeline_m is None else None,
                                               any_ddp, n_zero1 > 0)
        return self.assemble(plan, ctx, rows, step_r, bubble, chunk_terms=(sums[:, 2], maxima[:, :3].T, maxima[:, 4]),
                             any_ddp=any_ddp)

    def _derived_table(self, plan: Plan, ctx: _Context) -> tuple[np.ndarray, tuple[int, int, int]]:
        """((layers, _table_width) table, (layers that run sharded, are offloaded, run ZeRO-1)): the plan's derived
        rows (``_derive``), then per layer its effective forward and backward time
        (layer_effective_times), its activation bytes, its _MAX_COLUMNS and its
        step_model.last_reduce_scatter -- the layers unchanged since the last plan of this context
        taken from it and the changed ones' neighbourhoods from the memo (_LayerMemo): the same
        numbers as computing them all."""
        layers = plan.layers
        num_layers = self.num_layers
        if len(layers) != num_layers:
            raise InfeasibleError(f"plan has {len(layers)} layer entries, the model {num_layers} layers")
        settings = _memo_settings(ctx)
        memo = ctx.memos.get(settings)
        if memo is None:
            memo = ctx.memos[settings] = _LayerMemo()
        old_layers = memo.layers
        row_flags = self._row_flags
        changed = rows = None
        if old_layers is None:
            # (the rows of the last plan of another context with the same rows_key serve)
            rows, ids = self._rows_and_ids(plan, ctx)
            counts = tuple(sum(row_flags[i][j] for i in ids) for j in range(3))
        elif layers is old_layers:
            return memo.table, memo.counts
        else:
            # the layers that are other objects (in C: a search keeps the unchanged ones), then
            # those of them whose row differs
            moved = compress(range(num_layers), map(is_not, layers, old_layers))
            last = memo.ids
            ids = None
            changed = []
            for i in moved:
                row_id = self._row(i, layers[i], ctx)[1]
                if row_id != last[i]:
                    if ids is None:
                        ids = last.copy()             # the last plan's ids are never written
                    ids[i] = row_id
                    changed.append(i)
            if ids is None:
                memo.layers = layers
                return memo.table, memo.counts
            n_sharded, n_offloaded, n_zero1 = memo.counts
            for k in changed:
                new, old = row_flags[ids[k]], row_flags[last[k]]
                n_sharded += new[0] - old[0]
                n_offloaded += new[1] - old[1]
                n_zero1 += new[2] - old[2]
            counts = (n_sharded, n_offloaded, n_zero1)
        # the two whole-table answers and the position class in one small integer
        code = 16 * (counts[0] > 0) + 8 * (counts[1] > 0)
        table = None
        wanted = []
        if changed is not None and len(changed) <= num_layers // 4:
            # (a layer named twice is looked up twice: the same value)
            affected = [j for k in changed for j in (k - 1, k, k + 1) if 0 <= j < num_layers]
            values = memo.values
            cls = ctx.position_class
            last_layer = num_layers - 1
            table = memo.table.copy()
            for k in affected:
                key = (code + cls[k], ids[k - 1] if k else -1, ids[k], ids[k + 1] if k < last_layer else -1)
                vec = values.get(key)
                if vec is None:
                    wanted.append((k, key))
                else:
                    table[k] = vec
        if table is None or wanted:
            if rows is None:
                rows, _ = self._rows_and_ids(plan, ctx)
            derived = self._derive(LayerTable(rows), ctx)
            fwd, bwd = layer_effective_times(derived, ctx.head, ctx.tail, ctx.not_tail, ctx.pipeline_m)
            data = derived.data
            table = np.empty((num_layers, self._table_width))
            table[:, _NUM_DERIVED:] = data
            table[:, _FWD] = fwd
            table[:, _BWD] = bwd
            table[:, _ACT] = data[:, _ACTIVATION]
            table[:, _MAXIMA:_MAXIMA + 3] = data[:, _MAX_COLUMNS]
            last_rs = last_reduce_scatter(data[:, _RS], data[:, _D2H], data[:, _OFFLOAD], data[:, _ZERO])
            table[:, _LAST_RS] = last_rs * ctx.head
            table[:, _OUT_END] = data[:, _OUTPUT] * ctx.tail
            if len(memo.values) + len(wanted) > _LayerMemo.ENTRIES:
                memo.values.clear()
            for k, key in wanted:
                memo.values[key] = table[k].copy()
        memo.layers, memo.ids, memo.table, memo.counts = layers, ids, table, counts
        return table, counts

    def assemble(self, plan: Plan, ctx: _Context, rows: LayerTable, step_r: np.ndarray, bubble: float,
                 timeline: list | None = None, chunk_terms: tuple | None = None,
                 any_ddp: bool | None = None) -> SimResult:
        """The SimResult of a plan whose step is ``step_r``, ``bubble``; ``chunk_terms``: per model
        chunk (activation bytes, maxima of the _MAX_COLUMNS, output bytes of its last layer),
        ``any_ddp``: whether some layer runs ZeRO 0 or 1 (DDP buckets), where the caller has them."""
        p, m, mesh = ctx.p, ctx.num_microbatches, ctx.mesh
        stage_step = step_r.tolist()
        step = max(stage_step)
        # ---- memory per pipeline rank
        data = rows.data
        sums = ctx.rank_onehot @ data                           # per-rank sums in one product
        if self._tied_uses:
            # the copies of tied weights a later stage keeps (tied_copies.py), at their layer's plan
            if ctx.tied_share is None:
                ctx.tied_share = tied_copies.held_share(self._tied_uses, ctx.starts, self.num_layers)
            sums[:, _STATE] += ctx.rank_onehot @ (data[:, _TIED_STATE] * ctx.tied_share[:, None])
        if chunk_terms is None:
            # per model chunk, one column at a time (cheaper than one reduceat over a 2-D selection)
            transient, param_buf, grad_buf = (np.maximum.reduceat(data[:, c], ctx.starts) for c in _MAX_COLUMNS)
            act_g = np.add.reduceat(data[:, _ACTIVATION], ctx.starts)[ctx.grid]
            out_end = data[ctx.last_layers, _OUTPUT] if p > 1 else 0.0
        else:
            act_g, (transient, param_buf, grad_buf), out_end = chunk_terms
            act_g = act_g[ctx.grid]
            if p == 1:
                out_end = 0.0
        if ctx.v > 1:                                           # the largest over each rank's chunks
            transient, param_buf, grad_buf = (a[ctx.grid].max(axis=0) for a in (transient, param_buf, grad_buf))
            out_end = out_end[ctx.grid].max(axis=0) if p > 1 else 0.0
        ddp_active = ctx.no_ddp
        if mesh.dp > 1 and any_ddp is not False:
            ddp_layers = data[:, _ZERO] <= 1
            if np.count_nonzero(ddp_layers):            # (count_nonzero: a cheaper any)
                ddp_active = ctx.rank_onehot @ ddp_layers > 0
        memory = stage_memory(
            params=sums[:, _PARAM], grads=sums[:, _GRAD], optimizer=sums[:, _OPTIMIZER], host=sums[:, _HOST],
            activation_per_chunk=act_g, transient_max=transient, inflight=ctx.inflight, num_chunks=ctx.v,
            ddp_active=ddp_active, grad_bytes_total=sums[:, _DP_GRAD],
            fsdp_param_buffer_max=param_buf, fsdp_grad_buffer_max=grad_buf, p2p_bytes=out_end)
        totals = memory[5]
        # ---- host memory per node: the offloaded state of every device on the node (FSDP's
        # CPUOffloadPolicy keeps each device's sharded parameters, gradients and optimizer state in
        # the host memory of its own node), against the node's host_memory_bytes
        if np.count_nonzero(memory[6]):
            host_per_node = ctx.node_counts @ memory[6]
            host_worst = int(np.argmax(host_per_node - ctx.host_capacity))
            host_fits = bool((host_per_node <= ctx.host_capacity).all())
        else:                                                   # nothing offloaded: the same, known
            host_per_node, host_worst, host_fits = ctx.host_when_empty
        totals_list = totals.tolist()
        device_fits = all(map(le, totals_list, ctx.capacity_list))
        samples = plan.global_batch
        world = mesh.world_size
        peak = ctx.peak_flops
        seq = self.graph.seq_len or 1

        def work() -> StepWork:
            # rows.data is never written once built (PlanEvaluator._rows copies to change a row)
            rec, tp_wire, dp_wire_mb, dp_wire_step, n_measured, n_estimated, output = rows.data[:, _WORK_COLUMNS].T
            # ---- FLOPs
            model_flops = self._flops_per_sample * samples
            recompute_flops = float(((rec == 2) * self._layer_fwd_flops
                                     + (rec == 1) * self._layer_cheap_fwd_flops).sum()) * samples
            hw_flops = model_flops + recompute_flops
            tflops = model_flops / step / world / 1e12 if step > 0 else 0.0
            hw_tflops = hw_flops / step / world / 1e12 if step > 0 else 0.0
            # ---- communication volume (bytes sent per step, all devices)
            replicas = mesh.world_size // mesh.degree("layers")     # the devices of one pipeline rank
            tp_bytes = float(tp_wire.sum()) * m * replicas
            dp_bytes = float(dp_wire_mb.sum() * m + dp_wire_step.sum()) * replicas
            pp_bytes = 0.0
            if len(ctx.starts) > 1:
                pp_bytes = float(output[ctx.ends[:-1] - 1].sum()) * 2 * m * replicas
            comm = {"intra": 0.0, "inter": 0.0}
            comm[ctx.links.tp.level] += tp_bytes
            comm[ctx.links.dp.level] += dp_bytes
            comm[ctx.links.pp.level] += pp_bytes
            measured = int(n_measured.sum()) + int(ctx.p2p_measured)
            estimated = int(n_estimated.sum()) + int(len(ctx.starts) > 1 and not ctx.p2p_measured)
            return StepWork(model_flops_per_step=model_flops, hardware_flops_per_step=hw_flops,
                            tflops_per_gpu=tflops, hw_tflops_per_gpu=hw_tflops,
                            mfu=tflops * 1e12 / peak if peak else 0.0, comm_bytes=comm,
                            sources={"measured": measured, "estimated": estimated})

        return SimResult(
            step_time_s=step, samples_per_s=samples / step if step > 0 else 0.0,
            tokens_per_s=samples * seq / step if step > 0 else 0.0,
            max_memory_bytes=max(totals_list), capacity_bytes=ctx.min_capacity,
            fits=device_fits and host_fits, device_fits=device_fits, host_fits=host_fits,
            host_bytes_per_node=float(host_per_node[host_worst]),
            host_capacity_bytes=float(ctx.host_capacity[host_worst]), bubble_fraction=bubble, memory_arrays=memory,
            work_fn=work, timeline=timeline, stage_step_s=stage_step, world_size=world,
            peak_flops_per_gpu=peak)


def _memo_settings(ctx: _Context):
    """What the per-layer terms read besides the rows (_LayerMemo's values hold for one value):
    the fitted constants (simulator/calibration.py) of the cost model priced with, which
    benchmarks/published_runs.py --fit varies by passing cost models of other calibrations.  The
    training code they also read is fixed for an evaluator (its cost models' ``code``)."""
    return ctx.rank_cm[0].calibration


def closed_form_step(ctx: _Context, rows: LayerTable) -> tuple[np.ndarray, float]:
    """(time at which each pipeline rank finishes the step, bubble fraction): the step model in
    the context's form (step_model.OVERLAPPED, or cpu_node.SERIAL on CPU nodes whose
    communication takes turns with compute), chosen when the context was built."""
    return ctx.step_form.step(ctx, rows)
