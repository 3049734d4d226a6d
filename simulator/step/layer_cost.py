"""The cost of one layer under one layer plan: times and bytes per device, per micro-batch.

This is the unit the fast path caches and the planner's ILP reads.  ``compute_layer_cost``
composes it: the ops' compute (op_work.py), then what each axis and technique adds, each from
its module in simulator/axes/ -- float8 (float8.py), regional compile (compile_fusion.py), tensor
parallelism (tp.py), context and expert parallelism's in-layer collectives (cp.py, ep.py),
recompute (recompute.py), and data parallelism with ZeRO (dp.py) and host offload (offload.py) -- with the state
bytes from step/memory.py.

Context parallelism (``mesh.cp``) divides every op's tokens by cp (the micro-batch scale) and adds
the attention ops' K/V exchange (axes/cp.py); expert parallelism (``mesh.ep``) adds the routed
experts' dispatch and combine all-to-alls, prices the expert GEMMs at their per-expert shapes and
splits the expert weights ep ways (axes/ep.py).  Both exchanges are in-layer collectives on the
critical path, each in its own columns (``cp_comm_*``, ``ep_comm_*``, beside tensor
parallelism's ``tp_comm_*``; the step sums the three per pass: overlap.compute_per_pass); their
bytes on the wire and their rerun in a recompute count with tensor parallelism's
(``tp_wire_bytes``, ``recompute_s``: tp.fold_into_tp); data parallelism spans dp x cp (the
experts: dp x cp / ep).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh
from autopar.core.dtypes import dtype_bytes, precision_bytes
from autopar.core.sharding import TPLayout
from autopar.simulator.axes import ep as ep_cost
from autopar.simulator.axes.compile_fusion import compiled_work
from autopar.simulator.axes.cp import cp_layer_work
from autopar.simulator.axes.dp import data_parallel_parts
from autopar.simulator.axes.float8 import float8_work, fp8_all_gather
from autopar.simulator.axes.offload import offloaded
from autopar.simulator.axes.recompute import recompute, saves_collective
from autopar.simulator.axes.sharded_dp import effective_zero
from autopar.simulator.axes.tp import add_module_overheads, tensor_parallel
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.topology import MeshLinks
from autopar.simulator.step.memory import STATE_BYTES, backward_gradient_bytes, precision_class, state_bytes
from autopar.simulator.step.op_work import OpWork, copy_work, op_work, op_work_key, unfused_ops


@dataclass(frozen=True)
class LayerCost:
    """One layer on one device: seconds per micro-batch, bytes per device."""
    fwd_s: float                 # forward compute
    bwd_s: float                 # backward compute (input + weight gradients)
    recompute_s: float           # extra forward inside backward, with its tp collectives
    tp_comm_fwd_s: float         # tensor-parallel collectives in forward (on the critical path)
    tp_comm_bwd_s: float         # ... in backward (cp_comm_*, ep_comm_*: context and expert parallelism's)
    dp_allreduce_s: float        # DDP / ZeRO-1 gradient all-reduce (once per step)
    dp_allgather_s: float        # FSDP parameter all-gather (per micro-batch, per use)
    dp_reducescatter_s: float    # FSDP gradient reduce-scatter (per micro-batch)
    h2d_s: float                 # offload: sharded parameters host -> device, per use
    d2h_s: float                 # offload: sharded gradients device -> host, per micro-batch
    optimizer_s: float           # Adam on this device's share (device or host)
    param_numel: float           # parameters on this device after the tp split (before ZeRO)
    param_bytes: float           # on the device after ZeRO (0 when offloaded)
    grad_bytes: float
    optimizer_bytes: float
    host_bytes: float            # offloaded state in host memory
    activation_bytes: float      # kept for backward per micro-batch (after recompute policy)
    transient_bytes: float       # extra during this layer's backward when recomputed
    fsdp_param_buffer_bytes: float   # unsharded parameters while the layer runs (ZeRO-3 / offload)
    fsdp_grad_buffer_bytes: float    # unsharded gradients before reduce-scatter (ZeRO-2/3)
    output_bytes: float          # activation sent to the next stage, per micro-batch
    dp_grad_bytes: float         # gradient bytes synchronised across data parallel
    fwd_flops: float             # per micro-batch on this device
    hw_flops: float              # fwd + bwd + recompute per micro-batch on this device
    tp_wire_bytes: float         # sent per micro-batch by this device for tp, cp and ep collectives (incl. recompute)
    dp_wire_bytes_per_mb: float  # sent per micro-batch for FSDP all-gather / reduce-scatter
    dp_wire_bytes_per_step: float    # sent once per step for DDP / ZeRO-1
    meetings: float = 0.0        # blocking collectives per micro-batch where the ranks meet (tp, FSDP)
    num_measured: int = 0
    num_estimated: int = 0
    # a copy of the tied weights this layer uses and an earlier layer holds (simulator/tied_copies.py):
    # its state on the device, under this layer's plan, where the layer's pipeline stage keeps one
    tied_param_bytes: float = 0.0
    tied_grad_bytes: float = 0.0
    tied_optimizer_bytes: float = 0.0
    tied_host_bytes: float = 0.0
    tied_dp_grad_bytes: float = 0.0
    # of bwd_s, the weight gradients (WEIGHT_GRAD_SHARE): what a split-backward schedule runs as its
    # W pass (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2); the rest is B
    bwd_weight_s: float = 0.0
    # offload "nvme...": AdamW's moments (and the parameters and gradients it names) of this
    # device's shard in files on the node's NVMe tier (not in host_bytes; simulator/axes/nvme_tier.py
    # prices their read and write each step)
    nvme_bytes: float = 0.0
    # context parallelism's K/V all-gather (forward) and reduce-scatter (backward) of the layer's
    # attention, on the critical path (axes/cp.py cp_layer_terms)
    cp_comm_fwd_s: float = 0.0
    cp_comm_bwd_s: float = 0.0
    # expert parallelism's dispatch and combine all-to-alls, each pass (axes/ep.py ep_layer_terms)
    ep_comm_fwd_s: float = 0.0
    ep_comm_bwd_s: float = 0.0
    # the expert-parallel all-to-alls of the backward: ep_comm_bwd_s, and the forward's again where a
    # recompute reruns them -- with ep_comm_fwd_s what DualPipeV's pairs hide behind compute
    # (axes/pp_zero_bubble.overlapped_pair)
    ep_a2a_bwd_s: float = 0.0

    @property
    def grad_bytes_per_param(self) -> float:
        return self.dp_grad_bytes / self.param_numel if self.param_numel else 0.0


LAYER_COST_FIELDS = tuple(f.name for f in fields(LayerCost))


_ROW_OF = __import__("operator").attrgetter(*LAYER_COST_FIELDS)


def layer_cost_row(c: LayerCost) -> tuple[float, ...]:
    """The LayerCost's fields in order (``astuple``'s values: the fields are plain numbers, which
    it would deep-copy one by one)."""
    return _ROW_OF(c)


def compute_layer_cost(graph: OpGraph, layer_index: int, layout: TPLayout, lp: LayerPlan, mesh: Mesh,
                       micro_batch: int, precision: str, cm: CostModel, links: MeshLinks,
                       compute_stretch: float = 1.0, node_processes: int | None = None,
                       compiled: bool = False, fp8_recipe: str = "tensorwise",
                       work_cache: dict | None = None) -> LayerCost:
    """The cost of layer ``layer_index`` under ``lp``, in parts: the ops' compute
    (``op_work``), the framework overheads of the modules tensor parallelism wraps
    (``add_module_overheads``), the tensor-parallel collectives (``tensor_parallel``),
    recompute (``recompute``) and data parallelism with ZeRO and offload (``data_parallel``).

    ``compute_stretch`` (>= 1) slows the device's own work -- compute, framework overheads,
    the optimizer step -- when more devices of a node compute than it has compute slots
    (cpu_node.compute_stretch); collectives are priced from the rows measured with
    ``node_processes`` processes busy at once, the plan's busy devices per node (the same sharing).
    ``compiled``: the plan compiles each block (runtime/apply_compile.py): a block layer's fused
    memory-bound ops cost their fused kernels (``compiled_work``, simulator/axes/compile_fusion.py).
    ``fp8_recipe``: the plan's float8 recipe, for a layer with ``precision: fp8`` (``float8_work``).
    ``work_cache``: a dict the caller keeps for one graph, layout and cost model name, where the
    ops' compute is kept by what it reads (``op_work_key``) -- the same for meshes that differ in
    dp or pp only -- and copied out."""
    layer = graph.layers[layer_index]
    # context parallelism: each rank holds 1/cp of every sample's tokens (cp_cost.py)
    scale = micro_batch / max(1, graph.batch_size) / mesh.cp
    act_scale = precision_bytes(precision) / dtype_bytes(graph.param_dtype)
    tp = mesh.tp
    sp_div = tp if (mesh.sequence_parallel and tp > 1) else 1

    # a full recompute that stops early (recompute): what it skips is found only where it applies
    early_stop = lp.recompute == "full" and cm.code.recompute_early_stop
    units = layer.module_paths if early_stop else ()
    if work_cache is None:
        work = op_work(graph.layer_ops(layer_index), layout, lp, mesh, precision, cm, scale, act_scale, units)
    else:
        key = op_work_key(layer_index, layout, lp, mesh, precision, cm, scale, act_scale, units)
        kept = work_cache.get(key)
        if kept is None:
            kept = work_cache[key] = op_work(graph.layer_ops(layer_index), layout, lp, mesh, precision, cm, scale,
                                             act_scale, units)
        work = copy_work(kept)
    if lp.precision == "fp8":
        float8_work(graph, layer_index, work, layout, cm, scale, fp8_recipe,
                    gathered_dp=mesh.dp if fp8_all_gather(lp, mesh, fp8_recipe) else None)
    if compiled and layer.kind not in ("pre", "post"):
        compiled_work(graph, layer_index, work, layout, lp, mesh, precision, cm, scale)
    add_module_overheads(work, cm)
    # a selective recompute keeps the outputs of the collectives its policy saves (selective_mm_policy.py)
    selective = cm.code.selective_mm_policy if lp.recompute == "selective" else None
    experts = ep_cost.routed_experts(graph, layer_index)
    # expert ops split ep ways: a gradient sum of their replicated weights (sequence parallel)
    # carries this rank's E / ep experts
    ep_ops = frozenset(n for r in experts for n in r.ops) if mesh.ep > 1 else frozenset()
    tpc = tensor_parallel(layout, tp, cm, links, scale, act_scale, node_processes, work.early_stop_skipped_ops,
                           selective, ep_ops, mesh.ep)
    tp_fwd_s, tp_bwd_s = tpc.fwd_s, tpc.bwd_s
    # context and expert parallelism's in-layer collectives, in their own columns; tpc takes them
    # too, for the recompute's rerun and the wire bytes (axes/cp.py, axes/ep.py)
    elem = float(precision_bytes(precision))
    extra_meetings = 0
    cp_c = ep_c = None
    if mesh.cp > 1:
        attention = _attention_ops(graph, layer_index)
        cp_c = cp_layer_work(attention, work, tpc, layout, mesh.cp, scale, elem, cm, links.cp, node_processes)
        extra_meetings += cp_c.meetings
    if experts:
        ep_c = ep_cost.ep_layer_work(graph, experts, work, tpc, layout, mesh.ep, scale, precision, elem,
                                     cm, links, node_processes, selective, work_cache,
                                     (layer_index, lp.tp, tp, mesh.sequence_parallel, cm.code.loss_parallel))
        extra_meetings += ep_c.meetings
    rec = recompute(lp, work, tpc, layer.input_bytes * scale * act_scale / sp_div, cm)
    dp = data_parallel_parts(lp, mesh, precision, work, cm, links, node_processes, fp8_recipe)

    # the ranks meet at every tensor-parallel collective (again in a full recompute) and at every
    # FSDP all-gather and reduce-scatter: the meeting waits are priced per plan, from the work
    # between meetings (cpu_node.with_meeting_waits)
    meetings = (len(layout.collectives) if tp > 1 else 0) + rec.tp_meetings
    meetings += dp.meetings + extra_meetings
    # the device's own work shares the node's compute slots (the host optimizer runs on the host)
    fwd_s = work.fwd_s * compute_stretch
    bwd_s = work.bwd_s * compute_stretch
    recompute_s = (rec.recompute_s - rec.tp_s) * compute_stretch + rec.tp_s
    optimizer_s = dp.optimizer_s if offloaded(lp) else dp.optimizer_s * compute_stretch
    # a full recompute reruns the forward's all-to-alls in backward; a selective one those its
    # policy does not save (ep.ep_layer_work)
    rerun = lp.recompute == "full" or (selective is not None and not saves_collective("all_to_all", selective))
    return LayerCost(
        fwd_s=fwd_s, bwd_s=bwd_s, bwd_weight_s=min(work.bwd_weight_s * compute_stretch, bwd_s),
        recompute_s=recompute_s, tp_comm_fwd_s=tp_fwd_s, tp_comm_bwd_s=tp_bwd_s,
        cp_comm_fwd_s=cp_c.fwd_s if cp_c else 0.0, cp_comm_bwd_s=cp_c.bwd_s if cp_c else 0.0,
        ep_comm_fwd_s=ep_c.fwd_s if ep_c else 0.0, ep_comm_bwd_s=ep_c.bwd_s if ep_c else 0.0,
        dp_allreduce_s=dp.allreduce_s, dp_allgather_s=dp.allgather_s, dp_reducescatter_s=dp.reducescatter_s,
        h2d_s=dp.h2d_s, d2h_s=dp.d2h_s, optimizer_s=optimizer_s, param_numel=work.param_numel,
        param_bytes=dp.param_bytes, grad_bytes=dp.grad_bytes, optimizer_bytes=dp.optimizer_bytes,
        host_bytes=dp.host_bytes, nvme_bytes=dp.nvme_bytes, activation_bytes=rec.activation_bytes,
        transient_bytes=rec.transient_bytes + work.fp8_transient_bytes + _gradient_transient(
            graph, layer_index, layout, lp, mesh, cm, scale, act_scale, work_cache),
        fsdp_param_buffer_bytes=dp.fsdp_param_buffer_bytes, fsdp_grad_buffer_bytes=dp.fsdp_grad_buffer_bytes,
        output_bytes=layer.output_bytes * scale * act_scale / sp_div, dp_grad_bytes=dp.grad_sync_bytes,
        fwd_flops=work.fwd_flops, hw_flops=work.fwd_flops + work.bwd_flops + rec.recompute_flops,
        tp_wire_bytes=tpc.wire_fwd + tpc.wire_bwd + rec.tp_wire,
        dp_wire_bytes_per_mb=dp.wire_bytes_per_mb, dp_wire_bytes_per_step=dp.wire_bytes_per_step,
        meetings=float(meetings), num_measured=work.measured + tpc.measured + dp.measured,
        ep_a2a_bwd_s=(ep_c.bwd_s + (ep_c.fwd_s if rerun else 0.0)) if ep_c else 0.0,
        num_estimated=work.estimated + tpc.estimated + dp.estimated, **_tied_copy(work, lp, mesh, precision))


def _attention_ops(graph: OpGraph, layer_index: int) -> list:
    """The layer's attention ops (those context parallelism exchanges K/V for), found once per
    layer and kept on the graph (as ep.routed_experts keeps its experts)."""
    cache = graph.__dict__.setdefault("_attention_ops", {})
    if layer_index not in cache:
        cache[layer_index] = [o for o in graph.layer_ops(layer_index) if o.kind == "attention"]
    return cache[layer_index]


def _gradient_transient(graph: OpGraph, layer_index: int, layout: TPLayout, lp: LayerPlan, mesh: Mesh,
                        cm: CostModel, scale: float, act_scale: float, work_cache: dict | None) -> float:
    """The largest pair of gradients one op's backward holds (memory.backward_gradient_bytes),
    kept in ``work_cache`` by what it reads: the layer, its layout (fixed by the layer plan's
    split, the mesh's tp and sequence parallelism and the code's loss parallelism), the cost
    model (whose code says whether the loss is fused) and the scales -- the same for every ZeRO,
    recompute, offload, dp, pp and ep choice."""
    key = ("backward_gradient_bytes", layer_index, lp.tp, mesh.tp, mesh.sequence_parallel, cm.code.loss_parallel,
           cm.code.fused_cross_entropy, cm.name, scale, act_scale)
    kept = work_cache.get(key) if work_cache is not None else None
    if kept is None:
        kept = backward_gradient_bytes(
            unfused_ops(graph, layer_index, cm),
            lambda o: o.output_bytes * scale * act_scale / layout.output_shard.get(o.name, 1))
        if work_cache is not None:
            work_cache[key] = kept
    return kept


def _tied_copy(w: "OpWork", lp: LayerPlan, mesh: Mesh, precision: str) -> dict[str, float]:
    """The state of a copy of the layer's tied weights (``tied_*`` fields): split by tensor
    parallelism like the op that uses it, sharded by ZeRO and offloaded like the layer's own."""
    if not w.tied_numel:
        return {}
    trainable = max(0.0, w.tied_numel - w.tied_frozen_numel)
    p, g, o = state_bytes(w.tied_numel, precision, effective_zero(lp.zero, mesh), mesh.grad_degree, trainable)
    host = 0.0
    if offloaded(lp):
        p, g, o, host = 0.0, 0.0, 0.0, p + g + o
    return dict(tied_param_bytes=p, tied_grad_bytes=g, tied_optimizer_bytes=o, tied_host_bytes=host,
                tied_dp_grad_bytes=trainable * STATE_BYTES[precision_class(precision)][1])  # (nvme: on the host)
