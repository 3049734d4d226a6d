"""The fast path for search: price a plan from cached per-layer costs in closed form.

``PlanEvaluator.evaluate(plan)`` prices a plan without an event timeline:

1. per layer, a ``LayerCost`` cached by (layer signature, the layer's tp styles relative to
   the layer, ZeRO, recompute, offload) within a context (mesh, micro-batch, precision), so a
   plan that differs from the last one in a few layers recomputes only those rows;
2. per pipeline rank, sums over its layers (numpy ``reduceat`` over the stage boundaries);
3. the step in closed form -- the same model the event engine (engine.py) plays out:

   * per micro-batch and model chunk, forward = sum over layers of max(compute + tp
     collectives, FSDP all-gather [+ offload copy]) -- prefetch hides the shorter of the two;
     backward likewise with recompute and the reduce-scatter;
   * pipeline (rank times T_r = forward + backward of all its chunks, one micro-batch):
     GPipe and 1F1B: sum_r T_r + (m - 1) max_r T_r (the fill/drain of Huang et al. 2019 and
     Narayanan et al. 2021 Sec. 2.2.1; for equal stages (m + p - 1) T, bubble (p-1)/(m+p-1));
     interleaved with v chunks: m max_r T_r + (sum_r T_r - max_r T_r) / v (bubble divided by v,
     Narayanan et al. 2021 Sec. 2.2.2); plus 2 (p - 1) activation sends for fill and drain;
   * data parallel after the last backward: DDP all-reduces each layer's gradients as soon as
     its last backward ends, one after another on the communication stream, so the step ends
     at max_k(ready_k + sum of the all-reduces launched from k on) (Li et al. 2020, "PyTorch
     Distributed", Sec. 3.2); FSDP's last reduce-scatter is exposed; then the optimizer step
     (and ZeRO-1's parameter all-gather).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError
from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh, Plan
from autopar.core.sharding import dtype_bytes, propagate
from autopar.simulator.cost_model import PRECISION_BYTES, CostModel
from autopar.simulator.layer_cost import (LAYER_COST_FIELDS, MATMUL_KINDS, LayerCost, compute_layer_cost, effective_zero,
                                          layer_cost_row)
from autopar.simulator.memory import DDP_BUCKET_BYTES, inflight_microbatches, stage_memory
from autopar.simulator.result import SimResult
from autopar.simulator.topology import (MeshLinks, busy_devices_per_node, compute_stretch, mesh_links,
                                        node_stage_counts, serial_communication, stage_groups)

_COL = {name: i for i, name in enumerate(LAYER_COST_FIELDS)}
_NF = len(LAYER_COST_FIELDS)
# extra columns appended to each row: zero stage, offload flag, recompute code
_ZERO, _OFF, _REC = _NF, _NF + 1, _NF + 2
_RECOMPUTE_CODE = {"none": 0, "selective": 1, "full": 2}
_MAX_COLS = [_COL["transient_bytes"], _COL["fsdp_param_buffer_bytes"], _COL["fsdp_grad_buffer_bytes"]]


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
    layer_stage: np.ndarray     # virtual stage of each layer (L,)
    stage_start_of_layer: np.ndarray
    links: MeshLinks
    rank_cm: list[CostModel]    # slowest device's cost model per pipeline rank
    capacity: np.ndarray        # bytes per pipeline rank
    node_counts: np.ndarray     # (distinct nodes, p): devices of each pipeline rank on a node
    host_capacity: np.ndarray   # (distinct nodes,): the node's host memory, bytes
    inflight: np.ndarray
    rank_onehot: np.ndarray     # (p, L): 1 where layer l runs on pipeline rank r
    p2p_s: float
    p2p_measured: bool
    serial_comm: bool = False   # communication takes turns with compute (topology.serial_communication)


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
        self._prefix = [layer.name + "." for layer in graph.layers]
        self._sig = [layer.signature for layer in graph.layers]
        b0 = max(1, graph.batch_size)
        self._layer_fwd_flops = np.array([layer.fwd_flops for layer in graph.layers]) / b0
        self._layer_cheap_fwd_flops = np.array(
            [sum(o.fwd_flops for o in graph.layer_ops(i) if o.kind not in MATMUL_KINDS)
             for i in range(self.num_layers)]) / b0
        self._flops_per_sample = graph.flops_per_step / b0
        self._cost_cache: dict[tuple, LayerCost] = {}
        self._row_cache: dict[tuple, tuple] = {}
        self._relkey_cache: dict[tuple, tuple] = {}
        self._ctx_cache: dict[tuple, _Context] = {}
        self._links_cache: dict[Mesh, MeshLinks] = {}
        self._last: tuple | None = None      # (ctx key, layer plans, rows)
        self.num_layer_costs_computed = 0

    # ------------------------------------------------------------------ layer table
    def _relative_key(self, index: int, lp: LayerPlan) -> tuple:
        k = (index, lp.tp, lp.zero, lp.recompute, lp.offload)
        rel = self._relkey_cache.get(k)
        if rel is None:
            prefix = self._prefix[index]
            styles = tuple(sorted((m[len(prefix):] if m.startswith(prefix) else m, s) for m, s in lp.tp))
            rel = (self._sig[index], styles, lp.zero, lp.recompute, lp.offload)
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
                   precision: str, cost_model: CostModel | None = None) -> LayerCost:
        """Cost of one layer under one choice, per device and micro-batch (cached)."""
        cm = cost_model or self.rank_cost_models(mesh)[0]
        key = (self._relative_key(layer_index, layer_plan), mesh, micro_batch, precision, cm.name)
        cost = self._cost_cache.get(key)
        if cost is None:
            layout = propagate(self.graph, layer_index, layer_plan.tp_styles, mesh.tp, mesh.sequence_parallel)
            cost = compute_layer_cost(self.graph, layer_index, layout, layer_plan, mesh, micro_batch,
                                      precision, cm, self.links(mesh),
                                      # oversubscribed compute slots; the waits of ranks that meet
                                      # are added per plan (with_meeting_waits)
                                      compute_stretch(self.cluster, mesh),
                                      busy_devices_per_node(self.cluster, mesh))
            self._cost_cache[key] = cost
            self.num_layer_costs_computed += 1
        return cost

    def _row(self, index: int, lp: LayerPlan, ctx: _Context, ctx_key: tuple) -> tuple:
        rel = self._relative_key(index, lp)
        cm = ctx.rank_cm[ctx.layer_rank[index]]
        key = (rel, ctx_key[:4], cm.name)
        row = self._row_cache.get(key)
        if row is None:
            c = self.layer_cost(index, lp, ctx.mesh, ctx.micro_batch, ctx.precision, cm)
            row = layer_cost_row(c) + (float(effective_zero(lp.zero, ctx.mesh)), 1.0 if lp.offload == "cpu" else 0.0,
                                       float(_RECOMPUTE_CODE[lp.recompute]))
            self._row_cache[key] = row
        return row

    # -------------------------------------------------------------------- context
    def _context(self, plan: Plan) -> tuple[_Context, tuple]:
        pl = plan.pipeline
        key = (plan.mesh, plan.micro_batch, plan.precision, pl.stages, pl.schedule, pl.num_microbatches)
        ctx = self._ctx_cache.get(key)
        if ctx is not None:
            return ctx, key
        mesh = plan.mesh
        p = mesh.pp
        stages = pl.stages
        if not stages or len(stages) % p:
            raise InfeasibleError(f"{len(stages)} pipeline stages on {p} pipeline ranks")
        if stages[-1].end != self.num_layers:
            raise InfeasibleError(f"pipeline stages end at layer {stages[-1].end}, the model has {self.num_layers}")
        v = len(stages) // p
        if v > 1 and pl.schedule == "interleaved" and pl.num_microbatches % p:
            raise InfeasibleError(f"the interleaved schedule needs micro-batches ({pl.num_microbatches}) "
                                  f"divisible by pipeline ranks ({p})")
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
        act_scale = PRECISION_BYTES.get(plan.precision, 4) / dtype_bytes(self.graph.param_dtype)
        # stage boundaries carry full (not sequence-sharded) activations: the runtime gathers
        # the sequence on leaving a sequence-parallel run (runtime/apply_tp.py)
        sp_div = 1
        boundary = max((self.graph.layers[s.end - 1].output_bytes for s in stages[:-1]), default=0)
        p2p_s, p2p_m = (0.0, False)
        if len(stages) > 1:
            p2p_s, p2p_m = rank_cm[0].collective_time_ex("p2p", boundary * scale * act_scale / sp_div, 2,
                                                         links.pp.link, links.pp.level,
                                                         processes=busy_devices_per_node(self.cluster, mesh))
        ctx = _Context(mesh=mesh, micro_batch=plan.micro_batch, precision=plan.precision, schedule=pl.schedule,
                       num_microbatches=pl.num_microbatches, p=p, v=v, starts=starts, ends=ends,
                       layer_rank=layer_stage % p, layer_stage=layer_stage,
                       rank_onehot=(np.arange(p)[:, None] == (layer_stage % p)[None, :]).astype(float),
                       stage_start_of_layer=starts[layer_stage], links=links, rank_cm=rank_cm,
                       capacity=capacity, inflight=inflight,
                       node_counts=node_counts, host_capacity=host_capacity, p2p_s=p2p_s, p2p_measured=p2p_m,
                       serial_comm=serial_communication(self.cluster, mesh))
        self._ctx_cache[key] = ctx
        return ctx, key

    def _rows(self, plan: Plan, ctx: _Context, key: tuple) -> np.ndarray:
        layers = plan.layers
        if len(layers) != self.num_layers:
            raise InfeasibleError(f"plan has {len(layers)} layer entries, the model {self.num_layers} layers")
        last = self._last
        if last is not None and last[0] == key:
            _, old_layers, old_rows = last
            rows = old_rows.copy()
            for i, (a, b) in enumerate(zip(layers, old_layers)):
                if a is not b and a != b:
                    rows[i] = self._row(i, a, ctx, key)
        else:
            rows = np.array([self._row(i, lp, ctx, key) for i, lp in enumerate(layers)], dtype=float)
        self._last = (key, layers, rows)
        return rows

    # ------------------------------------------------------------------ evaluation
    def prepare(self, plan: Plan) -> tuple[_Context, np.ndarray]:
        ctx, key = self._context(plan)
        busy = busy_devices_per_node(self.cluster, ctx.mesh)
        rows = ddp_bucketed_all_reduces(self._rows(plan, ctx, key), ctx, busy)
        return ctx, with_meeting_waits(rows, ctx, busy)

    def evaluate(self, plan: Plan) -> SimResult:
        ctx, rows = self.prepare(plan)
        step_r, bubble = closed_form_step(ctx, rows)
        return self.assemble(plan, ctx, rows, step_r, bubble)

    def assemble(self, plan: Plan, ctx: _Context, rows: np.ndarray, step_r: np.ndarray, bubble: float,
                 timeline: list | None = None) -> SimResult:
        p, m, mesh = ctx.p, ctx.num_microbatches, ctx.mesh
        step = float(step_r.max())
        # ---- memory per pipeline rank
        sums = ctx.rank_onehot @ rows                     # (p, columns): per-rank sums in one product
        mx = np.maximum.reduceat(rows[:, _MAX_COLS], ctx.starts, axis=0).reshape(ctx.v, p, len(_MAX_COLS)).max(axis=0)
        act_g = np.add.reduceat(rows[:, _COL["activation_bytes"]], ctx.starts).reshape(ctx.v, p)
        out_end = rows[ctx.ends - 1, _COL["output_bytes"]].reshape(ctx.v, p).max(axis=0) if p > 1 else 0.0
        ddp_active = (ctx.rank_onehot @ (rows[:, _ZERO] <= 1) > 0) & (mesh.dp > 1)
        memory = stage_memory(
            params=sums[:, _COL["param_bytes"]], grads=sums[:, _COL["grad_bytes"]],
            optimizer=sums[:, _COL["optimizer_bytes"]], host=sums[:, _COL["host_bytes"]],
            activation_per_chunk=act_g, transient_max=mx[:, 0], inflight=ctx.inflight, num_chunks=ctx.v,
            ddp_active=ddp_active, grad_bytes_total=sums[:, _COL["dp_grad_bytes"]],
            fsdp_param_buffer_max=mx[:, 1], fsdp_grad_buffer_max=mx[:, 2], p2p_bytes=out_end)
        totals = np.array([mb.total_bytes for mb in memory])
        # ---- host memory per node: the offloaded state of every device on the node (FSDP's
        # CPUOffloadPolicy keeps each device's sharded parameters, gradients and optimizer state in
        # the host memory of its own node), against the node's host_memory_bytes
        host_per_node = ctx.node_counts @ np.array([mb.host_bytes for mb in memory])
        host_worst = int(np.argmax(host_per_node - ctx.host_capacity))
        host_fits = bool((host_per_node <= ctx.host_capacity).all())
        # ---- FLOPs and throughput
        samples = plan.global_batch
        model_flops = self._flops_per_sample * samples
        rec = rows[:, _REC]
        recompute_flops = float(((rec == 2) * self._layer_fwd_flops + (rec == 1) * self._layer_cheap_fwd_flops).sum()) * samples
        hw_flops = model_flops + recompute_flops
        world = mesh.world_size
        peak = ctx.rank_cm[0].peak(plan.precision)
        tflops = model_flops / step / world / 1e12 if step > 0 else 0.0
        hw_tflops = hw_flops / step / world / 1e12 if step > 0 else 0.0
        seq = self.graph.seq_len or 1
        # ---- communication volume (bytes sent per step, all devices)
        replicas = mesh.dp * mesh.tp
        tp_bytes = float(rows[:, _COL["tp_wire_bytes"]].sum()) * m * replicas
        dp_bytes = float(rows[:, _COL["dp_wire_bytes_per_mb"]].sum() * m + rows[:, _COL["dp_wire_bytes_per_step"]].sum()) * replicas
        pp_bytes = 0.0
        if len(ctx.starts) > 1:
            bnd = rows[ctx.ends[:-1] - 1, _COL["output_bytes"]]
            pp_bytes = float(bnd.sum()) * 2 * m * replicas
        comm = {"intra": 0.0, "inter": 0.0}
        comm[ctx.links.tp.level] += tp_bytes
        comm[ctx.links.dp.level] += dp_bytes
        comm[ctx.links.pp.level] += pp_bytes
        measured = int(rows[:, _COL["num_measured"]].sum()) + int(ctx.p2p_measured)
        estimated = int(rows[:, _COL["num_estimated"]].sum()) + int(len(ctx.starts) > 1 and not ctx.p2p_measured)
        return SimResult(
            step_time_s=step, samples_per_s=samples / step if step > 0 else 0.0,
            tokens_per_s=samples * seq / step if step > 0 else 0.0,
            model_flops_per_step=model_flops, hardware_flops_per_step=hw_flops,
            tflops_per_gpu=tflops, hw_tflops_per_gpu=hw_tflops, mfu=tflops * 1e12 / peak if peak else 0.0,
            max_memory_bytes=float(totals.max()), memory=memory, capacity_bytes=float(ctx.capacity.min()),
            fits=bool((totals <= ctx.capacity).all()) and host_fits, comm_bytes=comm,
            device_fits=bool((totals <= ctx.capacity).all()), host_fits=host_fits,
            host_bytes_per_node=float(host_per_node[host_worst]),
            host_capacity_bytes=float(ctx.host_capacity[host_worst]), bubble_fraction=bubble,
            sources={"measured": measured, "estimated": estimated}, timeline=timeline,
            stage_step_s=[float(x) for x in step_r], world_size=world, peak_flops_per_gpu=peak)


#: the columns of a rank's own work, stretched by its meeting waits (``with_meeting_waits``)
_WORK_COLS = [_COL["fwd_s"], _COL["bwd_s"], _COL["optimizer_s"]]


def with_meeting_waits(rows: np.ndarray, ctx: _Context, processes: int) -> np.ndarray:
    """Rows whose own work (forward, backward, recompute, optimizer) is stretched by the waits at
    the meetings of the ranks (CostModel.meeting_wait, measured by profiling/sync_wait.py).

    Per pipeline rank, per step: the work W (every micro-batch's forward, backward and recompute,
    and the optimizer) and the meetings M -- the layers' blocking collectives (tensor-parallel,
    FSDP) per micro-batch, a receive per micro-batch and model chunk from each neighbouring
    pipeline stage, and one meeting at the end of the step when gradients are all-reduced (DDP,
    ZeRO-1: the ranks wait there for the slowest) -- so the ranks meet on average every W / M
    seconds, and each meeting costs ``meeting_wait(W / M)``: the work stretches by
    1 + M * wait / W.  The collectives keep their in-step rows (their own wake-up).  Rows of a
    single process, or of a profile without meeting waits, are returned unchanged."""
    mesh = ctx.mesh
    if mesh.world_size <= 1 or processes <= 1 or not any(cm.waits_at_meetings(processes) for cm in ctx.rank_cm):
        return rows
    m = ctx.num_microbatches
    rec = rows[:, _COL["recompute_s"]]
    tp_in_rec = np.where(rows[:, _REC] == 2, rows[:, _COL["tp_comm_fwd_s"]], 0.0)   # full recompute repeats them
    per_mb = rows[:, _COL["fwd_s"]] + rows[:, _COL["bwd_s"]] + rec - tp_in_rec
    work = ctx.rank_onehot @ (per_mb * m + rows[:, _COL["optimizer_s"]])
    meetings = ctx.rank_onehot @ rows[:, _COL["meetings"]] * m
    if ctx.p > 1:
        ends = np.array([1.0 if r in (0, ctx.p - 1) else 2.0 for r in range(ctx.p)])
        meetings = meetings + m * ctx.v * ends
    if mesh.dp > 1 and (rows[:, _ZERO] <= 1).any():
        meetings = meetings + 1.0
    scale = np.ones(ctx.p)
    for r in range(ctx.p):
        if meetings[r] > 0 and work[r] > 0:
            gap = work[r] / meetings[r]
            scale[r] = 1.0 + meetings[r] * ctx.rank_cm[r].meeting_wait(processes, gap) / work[r]
    if np.all(scale == 1.0):
        return rows
    s = scale[ctx.layer_rank]
    out = rows.copy()
    for c in _WORK_COLS:
        out[:, c] = rows[:, c] * s
    out[:, _COL["recompute_s"]] = (rec - tp_in_rec) * s + tp_in_rec
    return out


#: DistributedDataParallel's first gradient bucket holds about 1 MiB, the others DDP_BUCKET_BYTES
#: (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)
DDP_FIRST_BUCKET_BYTES = 1 << 20


def ddp_bucketed_all_reduces(rows: np.ndarray, ctx: _Context, processes: int) -> np.ndarray:
    """Rows whose per-layer DDP all-reduces are priced as the calls the runtime makes: a plain
    data-parallel plan (no tensor or pipeline parallelism, every layer
    ZeRO-0 or 1; runtime/apply_dp.py runs it on ``DistributedDataParallel``) all-reduces its
    gradients in buckets, filled in backward order (the last layer first) and all-reduced when
    the bucket's last gradient is ready (Li et al. 2020, "PyTorch Distributed", Sec. 3.2.3), so
    a bucket's all-reduce is priced once, on the layer that closes it, at the bucket's size
    (the buckets are cut at layer boundaries here, at tensor boundaries in DDP).  Where a call's
    latency is small (NCCL) this changes little; on a CPU, where each call that must wake gloo's
    threads costs milliseconds (profiling/collectives.py), it is most of the data-parallel
    cost.  Other plans are returned unchanged."""
    mesh = ctx.mesh
    zero = rows[:, _ZERO]
    if mesh.dp <= 1 or mesh.tp > 1 or mesh.pp > 1 or not (zero <= 1).all():
        return rows
    cm, link, level = ctx.rank_cm[0], ctx.links.dp.link, ctx.links.dp.level
    out = rows.copy()
    grad = rows[:, _COL["dp_grad_bytes"]]
    ar = np.zeros(len(rows))
    cap, filled = DDP_FIRST_BUCKET_BYTES, 0.0
    for k in range(len(rows) - 1, -1, -1):
        filled += grad[k]
        if filled > 0 and (filled >= cap or k == 0):
            ar[k] = cm.collective_time("all_reduce", filled, mesh.dp, link, level, processes=processes)
            cap, filled = DDP_BUCKET_BYTES, 0.0
    out[:, _COL["dp_allreduce_s"]] = ar
    return out


def layer_effective_times(rows: np.ndarray, starts: np.ndarray | None = None,
                          serial: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and micro-batch: forward and backward time with FSDP traffic overlapped.

    FSDP prefetches one layer ahead: while layer k computes, layer k+1's all-gather (and
    offload copy) runs, so a layer takes max(its compute, the next layer's gather) -- and the
    first layer of each model chunk (``starts``) waits for its own gather, which nothing
    precedes (Zhao et al. 2023, "PyTorch FSDP", Sec. 3.3; engine.py plays the same out).  In
    backward the communication stream carries the next gather and this layer's
    reduce-scatter; the chunk's first backward layer (its last layer) waits for its gather.
    ``serial``: communication and compute take turns (no spare core), so they add up.
    """
    c = _COL
    zero, off = rows[:, _ZERO], rows[:, _OFF]
    fwd_comm = rows[:, c["dp_allgather_s"]] * (zero >= 2) + rows[:, c["h2d_s"]] * off
    bwd_gather = (rows[:, c["dp_allgather_s"]] + rows[:, c["h2d_s"]] * off) * (zero >= 3)
    bwd_comm = bwd_gather + (rows[:, c["dp_reducescatter_s"]] + rows[:, c["d2h_s"]] * off) * (zero >= 2)
    fwd_c = rows[:, c["fwd_s"]] + rows[:, c["tp_comm_fwd_s"]]
    bwd_c = rows[:, c["recompute_s"]] + rows[:, c["bwd_s"]] + rows[:, c["tp_comm_bwd_s"]]
    if serial:
        return fwd_c + fwd_comm, bwd_c + bwd_comm
    if starts is None:
        return np.maximum(fwd_c, fwd_comm), np.maximum(bwd_c, bwd_comm)
    n = len(rows)
    head = np.zeros(n, dtype=bool)
    head[starts] = True
    tail = np.zeros(n, dtype=bool)
    tail[np.asarray(starts)[1:] - 1] = True
    tail[n - 1] = True
    next_comm = np.append(fwd_comm[1:], 0.0) * ~tail         # the gather prefetched while k runs
    fwd = np.maximum(fwd_c, next_comm) + fwd_comm * head
    bwd = np.maximum(bwd_c, bwd_comm) + bwd_gather * tail
    return fwd, bwd


def closed_form_step(ctx: _Context, rows: np.ndarray) -> tuple[np.ndarray, float]:
    """(time at which each pipeline rank finishes the step, bubble fraction)."""
    p, v, m = ctx.p, ctx.v, ctx.num_microbatches
    fwd, bwd = layer_effective_times(rows, ctx.starts, ctx.serial_comm)
    f_g = np.add.reduceat(fwd, ctx.starts)
    b_g = np.add.reduceat(bwd, ctx.starts)
    if ctx.serial_comm and len(ctx.starts) > 1:
        # each chunk's send (activation forward, gradient backward) blocks its compute
        f_g[:-1] += ctx.p2p_s
        b_g[1:] += ctx.p2p_s
    t_r = (f_g + b_g).reshape(v, p).sum(axis=0)
    t_max = float(t_r.max())
    c = 0.0 if ctx.serial_comm else ctx.p2p_s   # serial: the sends are inside the chunk times
    if v == 1:
        pipe = float(t_r.sum()) + (m - 1) * t_max + 2 * (p - 1) * c
    else:
        pipe = m * t_max + (float(t_r.sum()) - t_max) / v + 2 * (p - 1) * c
    bubble = 1.0 - m * t_max / pipe if pipe > 0 else 0.0
    b_last = b_g[:p]                                    # chunk 0 of each rank finishes last
    end_r = pipe - np.concatenate(([0.0], np.cumsum(b_last[:-1] + c)))
    # ---- DDP: gradients all-reduced as each layer's last backward ends
    col = _COL
    zero = rows[:, _ZERO]
    ar = rows[:, col["dp_allreduce_s"]] * (zero <= 1)
    layer_rank = ctx.layer_rank
    excess = np.zeros(p)
    if ar.any() and ctx.serial_comm:
        # the all-reduces take turns with the last backward: all of them add up
        excess = np.bincount(layer_rank, weights=ar, minlength=p)
    elif ar.any():
        # time before the end of its chunk's last backward at which a layer's gradient is ready
        cum = np.cumsum(bwd)
        before = cum - bwd - (cum[ctx.starts] - bwd[ctx.starts])[ctx.layer_stage]
        chunk_off = np.zeros(len(ctx.starts))
        if v > 1:
            b_vp = b_g.reshape(v, p)
            # the cool-down runs p backward passes of each later chunk before the next one's
            chunk_off = (np.cumsum(b_vp, axis=0) - b_vp).reshape(-1) * p
        rel = -(before + chunk_off[ctx.layer_stage])
        order = np.lexsort((rel, layer_rank))
        rel_s, ar_s, rank_s = rel[order], ar[order], layer_rank[order]
        total = np.bincount(rank_s, weights=ar_s, minlength=p)
        cum_ar = np.cumsum(ar_s)
        first_idx = np.searchsorted(rank_s, np.arange(p))
        before_in_rank = cum_ar - ar_s - (cum_ar - ar_s)[np.minimum(first_idx, len(ar_s) - 1)][rank_s]
        suffix = total[rank_s] - before_in_rank
        val = np.where(ar_s > 0, rel_s + suffix, -np.inf)
        excess = np.maximum(0.0, np.maximum.reduceat(val, np.minimum(first_idx, len(val) - 1)))
    # ---- FSDP: the reduce-scatter of the last layer to finish (first layer of chunk 0)
    first = ctx.starts[:p]
    fsdp_tail = (rows[first, col["dp_reducescatter_s"]] + rows[first, col["d2h_s"]] * rows[first, _OFF]) * (rows[first, _ZERO] >= 2)
    if ctx.serial_comm:
        fsdp_tail = np.zeros(p)             # already inside the serial backward
    sync = end_r + np.maximum(excess, fsdp_tail)
    opt = np.bincount(layer_rank, weights=rows[:, col["optimizer_s"]], minlength=p)
    ag1 = np.bincount(layer_rank, weights=rows[:, col["dp_allgather_s"]] * (zero == 1), minlength=p)
    return sync + opt + ag1, bubble
