"""The cost of one layer under one layer plan: times and bytes per device, per micro-batch.

This is the unit the fast path caches and the planner's ILP reads.  Times come from the cost
model (measured or roofline), the tensor-parallel split from ``autopar.core.sharding`` and
the state bytes from ``autopar.simulator.step.memory``.

Conventions: FLOPs and bytes of the captured graph scale linearly with the micro-batch
(``micro_batch / graph.batch_size``); activations and parameters captured in fp32 take
``precision`` bytes per element when training in bf16/fp16.

Context parallelism (``mesh.cp``) divides every op's tokens by cp (the micro-batch scale) and adds
the attention ops' K/V exchange (simulator/cp_cost.py); expert parallelism (``mesh.ep``) adds the
routed experts' dispatch and combine all-to-alls, prices the expert GEMMs at their per-expert
shapes and splits the expert weights ep ways (simulator/ep_cost.py).  Both exchanges are
in-layer collectives on the critical path, folded into the tensor-parallel communication
columns (``tp_comm_*``, ``tp_wire_bytes``); data parallelism spans dp x cp (the experts: dp x
cp / ep).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from autopar.core import rules as _rules
from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh, tp_style_parts
from autopar.core.dtypes import dtype_bytes, precision_bytes
from autopar.core.sharding import TPLayout, loss_chain
from autopar.simulator.device import autocast as _autocast
from autopar.simulator.axes import cp as cp_cost, ep as ep_cost
from autopar.simulator.axes.compile_fusion import compile_saving, fused_regions, graph_consumers
from autopar.simulator.device.cost_model import CostModel, op_variant
from autopar.simulator.step.memory import STATE_BYTES, backward_gradient_bytes, precision_class, state_bytes
from autopar.simulator.step.optimizer_step import grad_clip_pass_time
from autopar.simulator.axes.recompute import collective_output_bytes, recomputed_matmuls, saves_collective
from autopar.simulator.device.topology import MeshLinks

MATMUL_KINDS = frozenset({"linear", "matmul", "attention", "conv"})
#: kinds whose backward needs only their inputs (and weight): autograd saves those before the op's
#: kernel runs (the generated ``VariableType`` code builds an op's ``SavedVariable`` inputs, and so
#: calls the saved-tensor pack hook, before it redispatches to the kernel), so a recompute that
#: stops at such an op's saved tensors never runs its kernel (``_recompute``)
SAVES_INPUTS_ONLY = frozenset({"linear", "matmul", "conv"})
#: the share of an op's backward that computes its weight's gradient (the W pass of a split
#: backward, Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2): a linear's (conv's,
#: recurrent cell's) backward is two GEMMs of equal FLOPs, dgrad dX = dY W and wgrad dW = dY^T X
#: (2 M N K each), so half; an embedding's input is indices, so all of it is the weight's; ops
#: without a trainable weight (attention, matmuls between activations, activations) have none,
#: and a norm's weight gradient (a reduction over the tokens, a few % of its backward) is left
#: in B
WEIGHT_GRAD_SHARE = {"linear": 0.5, "conv": 0.5, "rnn": 0.5, "embedding": 1.0}


@dataclass(frozen=True)
class LayerCost:
    """One layer on one device: seconds per micro-batch, bytes per device."""
    fwd_s: float                 # forward compute
    bwd_s: float                 # backward compute (input + weight gradients)
    recompute_s: float           # extra forward inside backward, with its tp collectives
    tp_comm_fwd_s: float         # tensor-parallel collectives in forward (on the critical path)
    tp_comm_bwd_s: float         # ... in backward
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
    tp_wire_bytes: float         # sent per micro-batch by this device for tp collectives (incl. recompute)
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

    @property
    def grad_bytes_per_param(self) -> float:
        return self.dp_grad_bytes / self.param_numel if self.param_numel else 0.0


LAYER_COST_FIELDS = tuple(f.name for f in fields(LayerCost))


_ROW_OF = __import__("operator").attrgetter(*LAYER_COST_FIELDS)


def layer_cost_row(c: LayerCost) -> tuple[float, ...]:
    """The LayerCost's fields in order (``astuple``'s values: the fields are plain numbers, which
    it would deep-copy one by one)."""
    return _ROW_OF(c)


def ring_wire_bytes(kind: str, message_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring collective (Patarasuk & Yuan 2009): all-reduce
    2(N-1)/N M, all-gather / reduce-scatter / all-to-all (N-1)/N M, broadcast and p2p M."""
    n = group_size
    if n <= 1 and kind != "p2p":
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * message_bytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * message_bytes
    return float(message_bytes)


def compute_layer_cost(graph: OpGraph, layer_index: int, layout: TPLayout, lp: LayerPlan, mesh: Mesh,
                       micro_batch: int, precision: str, cm: CostModel, links: MeshLinks,
                       compute_stretch: float = 1.0, node_processes: int | None = None,
                       compiled: bool = False, fp8_recipe: str = "tensorwise",
                       work_cache: dict | None = None) -> LayerCost:
    """The cost of layer ``layer_index`` under ``lp``, in parts: the ops' compute
    (``_op_work``), the framework overheads of the modules tensor parallelism wraps
    (``_add_module_overheads``), the tensor-parallel collectives (``_tensor_parallel``),
    recompute (``_recompute``) and data parallelism with ZeRO and offload (``_data_parallel``).

    ``compute_stretch`` (>= 1) slows the device's own work -- compute, framework overheads,
    the optimizer step -- when more devices of a node compute than it has compute slots
    (cpu_node.compute_stretch); collectives are priced from the rows measured with
    ``node_processes`` processes busy at once, the plan's busy devices per node (the same sharing).
    ``compiled``: the plan compiles each block (runtime/apply_compile.py): a block layer's fused
    memory-bound ops cost their fused kernels (``_compiled``, simulator/compile_fusion.py).
    ``fp8_recipe``: the plan's float8 recipe, for a layer with ``precision: fp8`` (``_float8``).
    ``work_cache``: a dict the caller keeps for one graph, layout and cost model name, where the
    ops' compute is kept by what it reads (``_op_work_key``) -- the same for meshes that differ in
    dp or pp only -- and copied out."""
    layer = graph.layers[layer_index]
    # context parallelism: each rank holds 1/cp of every sample's tokens (cp_cost.py)
    scale = micro_batch / max(1, graph.batch_size) / mesh.cp
    act_scale = precision_bytes(precision) / dtype_bytes(graph.param_dtype)
    tp = mesh.tp
    sp_div = tp if (mesh.sequence_parallel and tp > 1) else 1

    # a full recompute that stops early (_recompute): what it skips is found only where it applies
    early_stop = lp.recompute == "full" and cm.code.recompute_early_stop
    units = layer.module_paths if early_stop else ()
    if work_cache is None:
        work = _op_work(graph.layer_ops(layer_index), layout, lp, mesh, precision, cm, scale, act_scale, units)
    else:
        key = _op_work_key(layer_index, layout, lp, mesh, precision, cm, scale, act_scale, units)
        kept = work_cache.get(key)
        if kept is None:
            kept = work_cache[key] = _op_work(graph.layer_ops(layer_index), layout, lp, mesh, precision, cm, scale,
                                              act_scale, units)
        work = _copy_work(kept)
    if lp.precision == "fp8":
        _float8(graph, layer_index, work, layout, cm, scale, fp8_recipe,
                gathered_dp=mesh.dp if fp8_all_gather(lp, mesh, fp8_recipe) else None)
    if compiled and layer.kind not in ("pre", "post"):
        _compiled(graph, layer_index, work, layout, lp, mesh, precision, cm, scale)
    _add_module_overheads(work, cm)
    # a selective recompute keeps the outputs of the collectives its policy saves (selective_mm_policy.py)
    selective = cm.code.selective_mm_policy if lp.recompute == "selective" else None
    experts = ep_cost.routed_experts(graph, layer_index)
    # expert ops split ep ways: a gradient sum of their replicated weights (sequence parallel)
    # carries this rank's E / ep experts
    ep_ops = frozenset(n for r in experts for n in r.ops) if mesh.ep > 1 else frozenset()
    tpc = _tensor_parallel(layout, tp, cm, links, scale, act_scale, node_processes, work.early_stop_skipped_ops,
                           selective, ep_ops, mesh.ep)
    extra_meetings = _sequence_and_experts(graph, layer_index, work, tpc, layout, mesh, precision, cm, links, scale,
                                           node_processes, experts, selective)
    rec = _recompute(lp, work, tpc, layer.input_bytes * scale * act_scale / sp_div, cm)
    dp = _data_parallel_parts(lp, mesh, precision, work, cm, links, node_processes, fp8_recipe)

    # the ranks meet at every tensor-parallel collective (again in a full recompute) and at every
    # FSDP all-gather and reduce-scatter: the meeting waits are priced per plan, from the work
    # between meetings (cpu_node.with_meeting_waits)
    meetings = (len(layout.collectives) if tp > 1 else 0) + rec.tp_meetings
    meetings += dp.meetings + extra_meetings
    # the device's own work shares the node's compute slots (the host optimizer runs on the host)
    fwd_s = work.fwd_s * compute_stretch
    bwd_s = work.bwd_s * compute_stretch
    recompute_s = (rec.recompute_s - rec.tp_s) * compute_stretch + rec.tp_s
    optimizer_s = dp.optimizer_s if lp.offload == "cpu" else dp.optimizer_s * compute_stretch
    return LayerCost(
        fwd_s=fwd_s, bwd_s=bwd_s, bwd_weight_s=min(work.bwd_weight_s * compute_stretch, bwd_s),
        recompute_s=recompute_s, tp_comm_fwd_s=tpc.fwd_s, tp_comm_bwd_s=tpc.bwd_s,
        dp_allreduce_s=dp.allreduce_s, dp_allgather_s=dp.allgather_s, dp_reducescatter_s=dp.reducescatter_s,
        h2d_s=dp.h2d_s, d2h_s=dp.d2h_s, optimizer_s=optimizer_s, param_numel=work.param_numel,
        param_bytes=dp.param_bytes, grad_bytes=dp.grad_bytes, optimizer_bytes=dp.optimizer_bytes,
        host_bytes=dp.host_bytes, activation_bytes=rec.activation_bytes,
        transient_bytes=rec.transient_bytes + work.fp8_transient_bytes + backward_gradient_bytes(
            _unfused_ops(graph, layer_index, cm),
            lambda o: o.output_bytes * scale * act_scale / layout.output_shard.get(o.name, 1)),
        fsdp_param_buffer_bytes=dp.fsdp_param_buffer_bytes, fsdp_grad_buffer_bytes=dp.fsdp_grad_buffer_bytes,
        output_bytes=layer.output_bytes * scale * act_scale / sp_div, dp_grad_bytes=dp.grad_sync_bytes,
        fwd_flops=work.fwd_flops, hw_flops=work.fwd_flops + work.bwd_flops + rec.recompute_flops,
        tp_wire_bytes=tpc.wire_fwd + tpc.wire_bwd + rec.tp_wire,
        dp_wire_bytes_per_mb=dp.wire_bytes_per_mb, dp_wire_bytes_per_step=dp.wire_bytes_per_step,
        meetings=float(meetings), num_measured=work.measured + tpc.measured + dp.measured,
        num_estimated=work.estimated + tpc.estimated + dp.estimated, **_tied_copy(work, lp, mesh, precision))


def _tied_copy(w: "_OpWork", lp: LayerPlan, mesh: Mesh, precision: str) -> dict[str, float]:
    """The state of a copy of the layer's tied weights (``tied_*`` fields): split by tensor
    parallelism like the op that uses it, sharded by ZeRO and offloaded like the layer's own."""
    if not w.tied_numel:
        return {}
    trainable = max(0.0, w.tied_numel - w.tied_frozen_numel)
    p, g, o = state_bytes(w.tied_numel, precision, effective_zero(lp.zero, mesh), mesh.dp * mesh.cp, trainable)
    host = 0.0
    if lp.offload == "cpu":
        p, g, o, host = 0.0, 0.0, 0.0, p + g + o
    return dict(tied_param_bytes=p, tied_grad_bytes=g, tied_optimizer_bytes=o, tied_host_bytes=host,
                tied_dp_grad_bytes=trainable * STATE_BYTES[precision_class(precision)][1])


@dataclass
class _OpWork:
    """Sums over a layer's ops, per micro-batch on one device."""
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    cheap_fwd_s: float = 0.0               # the ops outside MATMUL_KINDS (what selective recompute reruns)
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    cheap_fwd_flops: float = 0.0
    param_numel: float = 0.0               # after the tensor-parallel split
    frozen_numel: float = 0.0              # ... of which requires_grad=False (no gradient, no optimizer state)
    tied_numel: float = 0.0                # tied weights an earlier layer holds (after the split)
    tied_frozen_numel: float = 0.0
    saved_bytes: float = 0.0               # kept for backward
    matmul_output_bytes: float = 0.0       # outputs of MATMUL_KINDS (what selective recompute keeps)
    autograd_kept_s: float = 0.0           # the per-byte autograd part: outputs kept for backward
    early_stop_skipped_s: float = 0.0      # forward time of the ops a recompute that stops early skips
    early_stop_skipped_flops: float = 0.0
    early_stop_skipped_ops: frozenset = frozenset()
    expert_numel: float = 0.0              # routed experts' parameters on the device (after the tp and ep splits)
    expert_frozen_numel: float = 0.0
    expert_names: frozenset = frozenset()  # ... their tensors (their own FSDP unit when ep > 1)
    rerun_mm_fwd_s: float = 0.0            # matmuls a selective recompute reruns (selective_mm_policy.py)
    rerun_mm_fwd_flops: float = 0.0
    rerun_mm_output_bytes: float = 0.0
    bwd_weight_s: float = 0.0              # of bwd_s, the weight gradients (WEIGHT_GRAD_SHARE)
    param_names: set[str] = field(default_factory=set)       # parameter tensors of the layer
    frozen_names: set[str] = field(default_factory=set)      # ... those with requires_grad=False
    dtensor_params: set[str] = field(default_factory=set)    # ... held as DTensors by tensor parallelism
    num_tp_modules: int = 0
    num_sp_norms: int = 0
    priced_ops: int = 0                    # ops that run a kernel (views and identities do not)
    op_fwd_s: dict[str, float] = field(default_factory=dict)   # each op's eager forward seconds
    op_bwd_s: dict[str, float] = field(default_factory=dict)   # ... and backward
    fp8_weight_numel: float = 0.0          # weights of the linears trained in float8 (after the split)
    fp8_transient_bytes: float = 0.0       # the largest of their fp8 copies alive at once (float8.py)
    fp8_shard_cast_s: float = 0.0          # FSDP2 fp8 all-gather: the shards' casts, per all-gather
    fp8_precompute_s: float = 0.0          # ... and the scales' amax pass over them, per step
    compile_regions: int = 0               # compiled: fused kernels replacing ...
    compile_fused_ops: int = 0             # ... this many eager ops
    measured: int = 0
    estimated: int = 0


def _unfused_ops(graph: OpGraph, layer_index: int, cm: CostModel) -> list:
    """The layer's ops whose backward allocates its own gradients: all of them, less the loss's
    chain where the code runs a fused cross-entropy (TrainingCode.fused_cross_entropy,
    core/sharding.loss_chain)."""
    ops = graph.layer_ops(layer_index)
    if not cm.code.fused_cross_entropy or not any(o.kind == "loss" for o in ops):
        return ops
    chain = loss_chain(graph, layer_index)
    return [o for o in ops if o.name not in chain]


def _op_work_key(layer_index: int, layout: TPLayout, lp: LayerPlan, mesh: Mesh, precision: str, cm: CostModel,
                 scale: float, act_scale: float, units: tuple) -> tuple:
    """Everything ``_op_work`` reads besides the layer's ops: the layer plan's split (with the
    mesh's tp and sequence parallelism it fixes the layout, evaluator.layer_cost), recompute and
    precision, the mesh's cp, the autocast mode (from the ZeRO stage that runs and the mesh), the
    scales and the cost model."""
    amp = _autocast.autocast_mode(effective_zero(lp.zero, mesh), mesh, precision, cm.code.autocast)
    return (layer_index, lp.tp, lp.recompute, lp.precision, mesh.tp, mesh.cp, mesh.sequence_parallel,
            cm.code.loss_parallel,
            amp, precision, cm.name, scale, act_scale, units)


def _copy_work(w: _OpWork) -> _OpWork:
    """A copy of ``w`` its callers may change (they add to its numbers and rewrite its per-op times)."""
    out = copy.copy(w)                    # (dataclasses.replace re-runs __init__: several times slower)
    out.param_names, out.frozen_names = set(w.param_names), set(w.frozen_names)
    out.dtensor_params, out.op_fwd_s, out.op_bwd_s = set(w.dtensor_params), dict(w.op_fwd_s), dict(w.op_bwd_s)
    return out


def _op_work(ops, layout: TPLayout, lp: LayerPlan, mesh: Mesh, precision: str, cm: CostModel,
             scale: float, act_scale: float, units: tuple[str, ...] = ()) -> _OpWork:
    """Compute: each op's forward and backward time from the cost model, with the autograd
    recording cost of ops that keep tensors for backward; FLOPs, parameters and activations.
    ``units``: the layer's top-level modules, each of which a recompute wraps on its own, where
    a recompute that stops early applies (the ops it skips are found per unit, ``_recompute``;
    none where ``units`` is empty)."""
    w = _OpWork()
    tails: dict[str, list] = {}            # unit -> [seconds, FLOPs, op names] since its last saver
    tp, cp = mesh.tp, mesh.cp
    prec_bytes = precision_bytes(precision)
    autograd_op, autograd_byte = cm.overhead("autograd_fwd_op_s"), cm.overhead("autograd_fwd_per_byte_s")
    sequence_parallel = mesh.sequence_parallel and tp > 1 and bool(lp.tp)
    amp = _autocast.autocast_mode(effective_zero(lp.zero, mesh), mesh, precision, cm.code.autocast)  # autocast.py
    styles = lp.tp_styles
    ops = list(ops)
    rerun_mms = recomputed_matmuls(ops, cm.code.selective_mm_policy) if lp.recompute == "selective" else frozenset()
    for op in ops:
        if cp > 1 and op.kind == "attention":
            op = cp_cost.cp_attention_op(op, cm.code.cp_attention)     # as a cp rank runs it
        w.param_names.update(op.params)
        w.frozen_names.update(op.frozen_params)
        # a module tensor parallelism turned into DTensor: a sharded linear or embedding (the
        # runtime splits a vocabulary table row-wise), or (sequence parallel) a norm whose input
        # and weight are DTensors (runtime/apply_tp.py)
        if tp > 1 and op.kind in ("linear", "embedding") and layout.param_shard.get(op.name, 1) > 1:
            w.num_tp_modules += 1
            w.dtensor_params.update(op.params)
        elif sequence_parallel and op.kind == "norm":
            w.num_sp_norms += 1
            w.dtensor_params.update(op.params)
        elif tp > 1 and op.params and layout.param_shard.get(op.name, 1) > 1:
            # stacked experts split by expert: Shard(0) DTensor parameters, but the module runs
            # on their local tensors (runtime/expert_tp.py), so no DTensor module overhead
            w.dtensor_params.update(op.params)
        shard = layout.compute_shard.get(op.name, 1)
        floating = op.dtype.replace("torch.", "") in ("float32", "float16", "bfloat16", "float64")
        bscale = prec_bytes / dtype_bytes(op.dtype) if floating else 1.0
        bscale *= _autocast.bytes_factor(op.kind, op_variant(op.kind, str(op.target)), amp) if floating else 1.0  # autocast bytes
        t_fwd = 0.0
        if op.fwd_flops > 0 or op.bytes_moved > 0 or op.copy_bytes > 0:
            w.priced_ops += 1
            osh = layout.output_shard.get(op.name, 1)
            t, m = cm.op_time_ex(op, precision, shard, scale=scale, bytes_scale=bscale, out_shard=osh)
            if op.bwd_flops > 0 or op.saved_bytes > 0:
                # recording the autograd graph, and writing outputs kept for backward into memory
                # not in cache (profiling/overheads.py, autograd_fwd_*; the op rows run no_grad)
                kept = autograd_byte * op.output_bytes * scale * act_scale / osh
                t += autograd_op + kept
                w.autograd_kept_s += kept
            w.fwd_s += t
            t_fwd = t
            w.op_fwd_s[op.name] = t
            w.measured += m
            w.estimated += not m
            if op.kind not in MATMUL_KINDS:
                w.cheap_fwd_s += t
                w.cheap_fwd_flops += op.fwd_flops * scale / shard
            elif op.name in rerun_mms:
                w.rerun_mm_fwd_s += t
                w.rerun_mm_fwd_flops += op.fwd_flops * scale / shard
                w.rerun_mm_output_bytes += op.output_bytes * scale * act_scale / osh
            t, m = cm.op_time_ex(op, precision, shard, backward=True, scale=scale, bytes_scale=bscale, out_shard=osh)
            w.bwd_s += t
            if op.params and len(op.frozen_params) < len(op.params):
                w.bwd_weight_s += t * WEIGHT_GRAD_SHARE.get(op.kind, 0.0)
            w.op_bwd_s[op.name] = t
            w.measured += m
            w.estimated += not m
        elif op.kind == "view" and cm.host_dispatch_bound:
            # no kernel, but the host thread dispatches it (and autograd records it) each pass
            t_fwd = cm.overhead("op_launch_s")
            w.fwd_s += t_fwd
            w.bwd_s += cm.overhead("op_backward_launch_s")
            w.op_fwd_s[op.name] = t_fwd
            w.op_bwd_s[op.name] = cm.overhead("op_backward_launch_s")
        unit = next((u for u in units if op.module_path == u or op.module_path.startswith(u + ".")), None)
        if unit is not None:
            # the tail of the unit since its last op that saves tensors for backward, that op included
            # where it saves only its inputs (SAVES_INPUTS_ONLY): what an early-stopped recompute skips
            flops = op.fwd_flops * scale / shard
            # (a matmul saves its operands even where the graph counts their bytes at another op)
            if getattr(op, "requires_grad", True) and (op.kind in SAVES_INPUTS_ONLY or op.saved_bytes > 0):
                tails[unit] = [t_fwd, flops, [op.name]] if op.kind in SAVES_INPUTS_ONLY else [0.0, 0.0, []]
            else:
                tail = tails.setdefault(unit, [0.0, 0.0, []])
                tail[0] += t_fwd
                tail[1] += flops
                tail[2].append(op.name)
        w.fwd_flops += op.fwd_flops * scale / shard
        w.bwd_flops += op.bwd_flops * scale / shard
        local_numel = _local_param_numel(op, layout, styles.get(op.module_path))
        w.param_numel += local_numel
        tied = op.tied_numel
        if tied:
            tied_shard = layout.param_shard.get(op.name, 1)
            w.tied_numel += tied / tied_shard
            w.tied_frozen_numel += op.tied_frozen_numel / tied_shard
        frozen = op.frozen_numel
        if frozen:
            # the split keeps each tensor's share; a frozen and a trainable tensor of one module split
            # alike except a row-wise bias (_local_param_numel), counted here at the weight's share
            w.frozen_numel += local_numel * frozen / op.param_numel if frozen < op.param_numel else local_numel
        w.saved_bytes += op.saved_bytes * scale * act_scale / layout.saved_shard.get(op.name, 1)
        if op.kind in MATMUL_KINDS:
            w.matmul_output_bytes += op.output_bytes * scale * act_scale / layout.output_shard.get(op.name, 1)
    w.early_stop_skipped_s = sum(t[0] for t in tails.values())
    w.early_stop_skipped_flops = sum(t[1] for t in tails.values())
    w.early_stop_skipped_ops = frozenset(n for t in tails.values() for n in t[2])
    return w


def fp8_all_gather(lp: LayerPlan, mesh: Mesh, recipe: str) -> bool:
    """Whether FSDP2 all-gathers this layer's float8 weights in fp8 (runtime/apply_fp8.py:
    tensorwise, sharded by FSDP2, not offloaded, no tensor parallelism)."""
    return (lp.precision == "fp8" and recipe == "tensorwise" and effective_zero(lp.zero, mesh) >= 2
            and lp.offload == "none" and mesh.tp == 1)


def _float8(graph: OpGraph, layer_index: int, w: _OpWork, layout: TPLayout, cm: CostModel, scale: float,
            recipe: str = "tensorwise", gathered_dp: int | None = None) -> None:
    """A layer with ``precision: fp8``: each linear with a weight that the runtime converts (both
    dims divisible by 16: float8.converts) costs torchao's float8 GEMMs and casts
    (simulator/float8.py) at the plan's recipe instead of its bf16 time; on this device's share
    of the GEMM (the tp split divides its output or input features).  Its weight elements and
    fp8 copies go to ``w`` for the FSDP all-gather and memory terms.  ``gathered_dp``: FSDP2
    all-gathers the weights in fp8 over that many ranks (``fp8_all_gather``): the shard's cast
    runs before each all-gather (forward, and backward again under ZeRO-3) and the scales'
    precompute reads the fp32 shard once per step (simulator/float8.py)."""
    from autopar.simulator.axes.float8 import FP32_BYTES, converts, float8_linear_cost

    for op in graph.layer_ops(layer_index):
        if op.kind != "linear" or not op.params or op.name not in w.op_fwd_s or not op.input_shapes:
            continue
        n, k = op.output_shape[-1], op.input_shapes[0][-1]
        shard = layout.compute_shard.get(op.name, 1)
        if not converts(k, n, int(shard)):
            continue                     # left in bf16 by the runtime (runtime/apply_fp8.py)
        m = max(1.0, op.fwd_flops / (2.0 * n * k)) * scale
        n_local = n / shard
        shard = None if gathered_dp is None else n_local * k / gathered_dp
        c = float8_linear_cost(int(round(m)), k, n_local, cm, recipe, gathered_shard=shard)
        if shard is not None:
            w.fp8_shard_cast_s += c.shard_cast_s
            w.fp8_precompute_s += shard * FP32_BYTES / cm.achievable_memory_Bps
        w.fp8_weight_numel += n_local * k
        w.fp8_transient_bytes = max(w.fp8_transient_bytes, c.transient_bytes)
        w.fwd_s += c.fwd_s - w.op_fwd_s[op.name]
        w.bwd_s += (c.total_s - c.fwd_s) - w.op_bwd_s.get(op.name, 0.0)
        w.op_fwd_s[op.name], w.op_bwd_s[op.name] = c.fwd_s, c.total_s - c.fwd_s


def _compiled(graph: OpGraph, layer_index: int, w: _OpWork, layout: TPLayout, lp: LayerPlan, mesh: Mesh,
              precision: str, cm: CostModel, scale: float) -> None:
    """Take off ``w`` what regional compile removes (simulator/compile_fusion.py): each fused
    region's eager ops cost one kernel moving the region's fused bytes, at the bytes per element
    the eager ops were priced at (the plan's precision, and fp32 where autocast runs an op in
    fp32: the region's largest such factor); selective recompute reruns the fused kernels, not
    the eager ops."""
    ops = graph.layer_ops(layer_index)
    by_name = {op.name: op for op in ops}
    every = graph._ops_by_name()
    regions = fused_regions(ops, graph_consumers(graph), lambda n: every[n].output_bytes if n in every else None)
    prec_bytes = precision_bytes(precision)
    amp = _autocast.autocast_mode(effective_zero(lp.zero, mesh), mesh, precision, cm.code.autocast)

    def fused_time(r, backward: bool) -> float:
        first = by_name[r.ops[0]]
        shard = layout.compute_shard.get(first.name, 1)
        bscale = prec_bytes / dtype_bytes(first.dtype) * max(
            _autocast.bytes_factor(by_name[n].kind, op_variant(by_name[n].kind, str(by_name[n].target)), amp)
            for n in r.ops)
        nbytes = (r.read_bytes + r.write_bytes) * bscale * scale / shard * (2.0 if backward else 1.0)
        flops = (r.bwd_flops if backward else r.fwd_flops) * scale / shard
        t, _ = cm.compute_time_ex("elementwise", flops, nbytes, precision)
        return max(t, cm.overhead("op_backward_launch_s" if backward else "op_launch_s"))

    saving = compile_saving(regions, w.op_fwd_s, w.op_bwd_s, fused_time, cm.overhead("autograd_fwd_op_s"))
    w.fwd_s -= saving.fwd_s
    w.bwd_s -= saving.bwd_s
    w.cheap_fwd_s = max(0.0, w.cheap_fwd_s - saving.fwd_s)
    w.compile_regions, w.compile_fused_ops = saving.regions, saving.fused_ops


def _add_module_overheads(w: _OpWork, cm: CostModel) -> None:
    """Framework overheads of the modules the runtime wraps for tensor parallelism
    (profiling/overheads.py).

    A column/row-wise split module costs what profiling/cpu_overheads_in_step.py measured a pair to
    cost beyond its arithmetic and all-reduces (dispatch, hooks, the asynchronous collectives'
    threads); a sequence-parallel norm issues no collective of its own (the sequence is gathered
    and scattered by the linears around it), so it costs what SequenceParallel adds to a norm on
    one rank (sp_norm_*; older profiles: a DTensor module's one-rank figure, else the split modules')."""
    w.fwd_s += w.num_tp_modules * cm.overhead("tp_module_fwd_s")
    w.bwd_s += w.num_tp_modules * cm.overhead("tp_module_bwd_s")
    if w.num_sp_norms:
        w.fwd_s += w.num_sp_norms * cm.overheads.get(
            "sp_norm_fwd_s", cm.overheads.get("dtensor_module_fwd_s", cm.overhead("tp_module_fwd_s")))
        w.bwd_s += w.num_sp_norms * cm.overheads.get(
            "sp_norm_bwd_s", cm.overheads.get("dtensor_module_bwd_s", cm.overhead("tp_module_bwd_s")))


@dataclass
class _TensorParallelComm:
    fwd_s: float = 0.0                     # collectives in forward, per micro-batch
    bwd_s: float = 0.0
    wire_fwd: float = 0.0                  # bytes this device sends for them
    wire_bwd: float = 0.0
    fwd_meetings: int = 0                  # forward collectives: the ranks meet at each
    # the forward collectives on the outputs of the ops an early-stopped recompute skips
    skipped_fwd_s: float = 0.0
    skipped_wire: float = 0.0
    skipped_meetings: int = 0
    # the forward collectives a selective recompute reruns: context parallelism's K/V all-gather
    # (the runtime's policy reruns it, runtime/recompute.py -- counted in backward on a cp 2 run
    # of the zoo's Llama, one gather per attention in each direction:
    # tests/integration/test_collective_counts.py), and those the code's policy does not save
    # (selective_mm_policy.saves_collective)
    selective_fwd_s: float = 0.0
    selective_wire: float = 0.0
    selective_meetings: int = 0
    # ... the outputs of those it saves, on the device: kept from forward to backward
    selective_saved_bytes: float = 0.0
    measured: int = 0
    estimated: int = 0


def _tensor_parallel(layout: TPLayout, tp: int, cm: CostModel, links: MeshLinks, scale: float, act_scale: float,
                     node_processes: int | None, skipped_ops: frozenset = frozenset(),
                     selective: str | None = None, ep_ops: frozenset = frozenset(), ep: int = 1) -> _TensorParallelComm:
    """Tensor parallelism: the collectives the layout puts after the split modules (Shoeybi et
    al. 2019, Sec. 3: f/g all-reduces; with sequence parallelism all-gather/reduce-scatter pairs,
    Korthikanti et al. 2022, Sec. 4.2.2), on the tensor-parallel group's link.  ``skipped_ops``:
    the ops a recompute that stops early does not run; the all-reduce or reduce-scatter of such
    an op's output does not run in it either (an all-gather of its input, issued before the op,
    does).  ``selective``: the code's selective policy where the layer is selectively recomputed:
    a forward collective it saves keeps its output (``selective_saved_bytes``), one it does not
    reruns in backward (``selective_fwd_s``; simulator/selective_mm_policy.py).  A parameter
    gradient's sum (``per_sample`` False) does not grow with the batch; at an op of ``ep_ops``
    it holds 1 / ``ep`` of the experts."""
    c = _TensorParallelComm()
    for coll in layout.collectives:
        if coll.per_sample:
            nbytes = coll.bytes * scale * act_scale
        else:
            nbytes = coll.bytes / (ep if coll.at in ep_ops else 1)
        wire = ring_wire_bytes(coll.kind, nbytes, tp)
        t, m = cm.collective_time_ex(coll.kind, nbytes, tp, links.tp.link, links.tp.level, processes=node_processes)
        c.measured += m
        c.estimated += not m
        if coll.pass_ == "fwd":
            c.wire_fwd += wire
            c.fwd_s += t
            c.fwd_meetings += 1
            if coll.at in skipped_ops and coll.kind in ("all_reduce", "reduce_scatter"):
                c.skipped_fwd_s += t
                c.skipped_wire += wire
                c.skipped_meetings += 1
            if selective is not None and saves_collective(coll.kind, selective):
                c.selective_saved_bytes += collective_output_bytes(coll.kind, nbytes, tp)
            elif selective is not None:
                c.selective_fwd_s += t
                c.selective_wire += wire
                c.selective_meetings += 1
        else:
            c.wire_bwd += wire
            c.bwd_s += t
    return c


def _fold_into_tp(tpc, terms) -> int:
    """Add an in-layer collective's terms (cp_cost.cp_layer_terms, ep_cost.ep_layer_terms) to the
    layer's tensor-parallel communication -- the same mechanism: collectives on the critical path
    inside the layer; returns the ranks' meetings it adds."""
    tpc.fwd_s += terms.fwd_s
    tpc.bwd_s += terms.bwd_s
    tpc.wire_fwd += terms.wire_fwd
    tpc.wire_bwd += terms.wire_bwd
    tpc.fwd_meetings += terms.meetings
    tpc.measured += terms.measured
    tpc.estimated += terms.estimated
    return terms.meetings


def _sequence_and_experts(graph: OpGraph, layer_index: int, w: _OpWork, tpc: _TensorParallelComm, layout: TPLayout,
                          mesh: Mesh, precision: str, cm: CostModel, links: MeshLinks, scale: float,
                          node_processes: int | None, experts, selective: str | None = None) -> int:
    """Context and expert parallelism's in-layer terms, folded into ``w`` and ``tpc``: the K/V
    all-gather / reduce-scatter of the attention ops (cp_cost.cp_layer_terms) and the experts'
    dispatch / combine all-to-alls (ep_cost.ep_layer_terms) are collectives on the critical path
    inside the layer, as the tensor-parallel ones; the gathered K/V add to what attention keeps
    for backward; the expert GEMMs are priced at their per-expert shapes and their parameters
    split ep ways (ep_cost.expert_work).  ``selective``: as ``_tensor_parallel``, for the
    all-to-alls (the K/V gather reruns under every policy).  Returns the collectives where the
    ranks meet."""
    elem = float(precision_bytes(precision))
    meetings = 0
    if mesh.cp > 1:
        ops = [o for o in graph.layer_ops(layer_index) if o.kind == "attention"]
        c = cp_cost.cp_layer_terms(ops, mesh.cp, scale, elem, cm, links.cp, node_processes, cm.code.cp_attention,
                                   layout.compute_shard)
        meetings += _fold_into_tp(tpc, c)
        tpc.selective_fwd_s += c.fwd_s
        tpc.selective_wire += c.wire_fwd
        tpc.selective_meetings += c.meetings
        w.saved_bytes += c.saved_bytes
    if experts:
        e = ep_cost.ep_layer_terms(experts, mesh.ep, scale, elem, cm, links, node_processes)
        meetings += _fold_into_tp(tpc, e)
        if selective is not None and mesh.ep > 1 and saves_collective("all_to_all", selective):
            # the dispatch's and the combine's output per experts module: the rank's T x k rows of
            # h elements each (ep_cost.ep_layer_terms's message)
            tpc.selective_saved_bytes += sum(
                2 * collective_output_bytes("all_to_all", r.tokens * scale * r.top_k * r.hidden * elem, mesh.ep)
                for r in experts)
        elif selective is not None:
            tpc.selective_fwd_s += e.fwd_s
            tpc.selective_wire += e.wire_fwd
            tpc.selective_meetings += e.meetings
        x = ep_cost.expert_work(graph, experts, layout, mesh.ep, scale, precision, cm, w.op_fwd_s, w.op_bwd_s,
                                capacity_factor=cm.code.expert_load)
        w.fwd_s += x.fwd_delta_s
        w.bwd_s += x.bwd_delta_s
        w.param_numel -= x.removed_numel
        w.frozen_numel -= x.removed_frozen_numel
        w.expert_numel, w.expert_frozen_numel, w.expert_names = x.local_numel, x.local_frozen_numel, x.param_names
    return meetings


@dataclass
class _Recompute:
    recompute_s: float                     # the forward rerun inside backward (full: with its tp collectives)
    recompute_flops: float
    activation_bytes: float                # kept for backward per micro-batch
    transient_bytes: float                 # materialised again during this layer's backward
    tp_s: float = 0.0                      # the tp collectives in recompute_s
    tp_wire: float = 0.0                   # ... the bytes this device sends for them
    tp_meetings: int = 0                   # ... where the ranks meet


def _recompute(lp: LayerPlan, w: _OpWork, tpc: _TensorParallelComm, layer_input_bytes: float,
               cm: CostModel) -> _Recompute:
    """Recompute (Chen et al. 2016; Korthikanti et al. 2022, Sec. 5): "full" keeps the layer's
    input and reruns its forward with its collectives; "selective" keeps the matmul outputs and
    the outputs of the collectives the code's policy saves (``selective_saved_bytes``), and reruns
    the cheap ops between them, context parallelism's K/V all-gather and the collectives the
    policy does not save (``_TensorParallelComm.selective_fwd_s``).  Adjusts ``w``: a
    checkpointed forward keeps nothing, and the checkpoint wrapper costs per op (profiling/overheads.py: saved-tensor hooks; the
    selective policy's dispatch mode on every op).

    A full recompute by non-reentrant ``torch.utils.checkpoint`` (``cm.code.recompute_early_stop``)
    stops once it has rebuilt the last tensor the forward saved for backward: its recomputation
    hook counts the tensors packed and raises ``_StopRecomputationError`` at the last
    (torch/utils/checkpoint.py, ``_recomputation_hook``; on by default since PyTorch 2.1,
    pytorch/pytorch PR #96866, "Make early stop the default for checkpoint").  So the ops after a
    wrapped module's last saving op never rerun, nor does that op's kernel where it saves only its
    inputs (SAVES_INPUTS_ONLY): in a transformer block the MLP's output projection and the residual
    add after it -- a third of the block's matmul FLOPs at an MLP ratio of 4.  A reentrant
    checkpoint (an ``autograd.Function`` that reruns the forward under ``enable_grad``) has no such
    stop."""
    saved = w.saved_bytes
    if lp.recompute == "full":
        # (the skipped figures are zero where the recompute does not stop early: compute_layer_cost)
        tp_s = tpc.fwd_s - tpc.skipped_fwd_s
        out = _Recompute(w.fwd_s - w.early_stop_skipped_s + tp_s, w.fwd_flops - w.early_stop_skipped_flops,
                         min(saved, layer_input_bytes) if saved > 0 else layer_input_bytes, saved,
                         tp_s=tp_s, tp_wire=tpc.wire_fwd - tpc.skipped_wire,
                         tp_meetings=tpc.fwd_meetings - tpc.skipped_meetings)
        w.fwd_s -= w.autograd_kept_s       # the checkpointed forward keeps nothing: its outputs are freed
    elif lp.recompute == "selective":
        # the matmuls the code's policy does not save rerun too (simulator/selective_mm_policy.py)
        # the kept collectives' outputs on top: the checkpoint's cache holds them whether or not
        # autograd would keep them without recompute (an all-reduced output feeds a residual add,
        # which keeps nothing)
        activation = (min(saved, layer_input_bytes + w.matmul_output_bytes - w.rerun_mm_output_bytes)
                      + tpc.selective_saved_bytes)
        out = _Recompute(w.cheap_fwd_s + w.rerun_mm_fwd_s + tpc.selective_fwd_s,
                         w.cheap_fwd_flops + w.rerun_mm_fwd_flops, activation, max(0.0, saved - activation),
                         tp_s=tpc.selective_fwd_s, tp_wire=tpc.selective_wire, tp_meetings=tpc.selective_meetings)
    else:
        out = _Recompute(0.0, 0.0, saved, 0.0)
    if lp.recompute in ("full", "selective"):
        w.fwd_s += w.priced_ops * cm.overhead(f"recompute_{lp.recompute}_fwd_per_op_s")
        w.bwd_s += w.priced_ops * cm.overhead(f"recompute_{lp.recompute}_bwd_per_op_s")
    return out


@dataclass
class _DataParallel:
    param_bytes: float = 0.0               # state on the device after ZeRO (0 when offloaded)
    grad_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    host_bytes: float = 0.0                # offloaded state
    grad_sync_bytes: float = 0.0           # gradients synchronised across data parallel
    fsdp_param_buffer_bytes: float = 0.0
    fsdp_grad_buffer_bytes: float = 0.0
    allreduce_s: float = 0.0
    allgather_s: float = 0.0
    reducescatter_s: float = 0.0
    h2d_s: float = 0.0
    d2h_s: float = 0.0
    optimizer_s: float = 0.0
    wire_bytes_per_mb: float = 0.0
    wire_bytes_per_step: float = 0.0
    meetings: int = 0                      # FSDP collectives per micro-batch where the ranks meet
    measured: int = 0
    estimated: int = 0


def _data_parallel_parts(lp: LayerPlan, mesh: Mesh, precision: str, w: _OpWork, cm: CostModel, links: MeshLinks,
                         node_processes: int | None, fp8_recipe: str = "tensorwise") -> _DataParallel:
    """Data parallelism over dp x cp (the cp ranks hold the same weights and average their
    gradients: runtime/apply_cp.gradient_mesh, as torchtitan shards); with ep > 1 the routed
    experts are a second unit over the dp x cp / ep ranks holding the same experts (ep_cost.py),
    its collectives after the dense unit's."""
    flat = mesh.dp * mesh.cp
    if mesh.ep <= 1 or not w.expert_names:
        return _data_parallel(lp, mesh, precision, w, cm, links, node_processes, flat, links.dp, fp8_recipe)
    from dataclasses import replace as _replace

    dense = _replace(w, param_numel=w.param_numel - w.expert_numel, frozen_numel=w.frozen_numel - w.expert_frozen_numel,
                     param_names=w.param_names - w.expert_names, frozen_names=w.frozen_names - w.expert_names)
    expert = _replace(w, param_numel=w.expert_numel, frozen_numel=w.expert_frozen_numel,
                      param_names=set(w.expert_names), frozen_names=w.frozen_names & w.expert_names)
    a = _data_parallel(lp, mesh, precision, dense, cm, links, node_processes, flat, links.dp, fp8_recipe)
    b = _data_parallel(lp, mesh, precision, expert, cm, links, node_processes, flat // mesh.ep, links.ep_dp or links.dp,
                       fp8_recipe)
    # each part added its FSDP unit's overhead to its copy of the work
    w.fwd_s += (dense.fwd_s - w.fwd_s) + (expert.fwd_s - w.fwd_s)
    w.bwd_s += (dense.bwd_s - w.bwd_s) + (expert.bwd_s - w.bwd_s)
    return _DataParallel(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(_DataParallel)})


def _data_parallel(lp: LayerPlan, mesh: Mesh, precision: str, w: _OpWork, cm: CostModel, links: MeshLinks,
                   node_processes: int | None, dp: int | None = None, dpl=None,
                   fp8_recipe: str = "tensorwise") -> _DataParallel:
    """Data parallelism with ZeRO and offload: state bytes (memory.state_bytes), the gradient
    all-reduce (DDP, ZeRO-1) or FSDP's all-gather and reduce-scatter, ZeroRedundancyOptimizer's
    parameter broadcasts, host copies and the optimizer step.  Adds FSDP's per-unit overhead to
    ``w`` (profiling/overheads.py, fsdp_unit_*).

    Frozen parameters (requires_grad=False: a LoRA base weight) are held, gathered and broadcast
    like the others but have no gradient and no optimizer state: autograd gives them no
    ``.grad``, so DDP leaves them out of its buckets (DistributedDataParallel registers
    reducer hooks only on parameters that require grad), FSDP2 reduce-scatters only the
    gradients that exist, and AdamW creates state lazily, on the first step that finds a
    gradient (torch.optim.AdamW ``_init_group`` skips ``p.grad is None``).

    A float8 layer under FSDP2 with the tensorwise recipe all-gathers its converted weights in
    fp8 (runtime/apply_fp8.py; simulator/float8.py): 1 byte per such weight element on the wire
    and in the unsharded buffer instead of the plan's 2 (not with offload or tp > 1: the runtime
    keeps bf16 there, runtime/apply_fp8.py)."""
    d = _DataParallel()
    dp = mesh.dp if dp is None else dp           # the ranks that share the weights (dp x cp, or the experts')
    zero = effective_zero(lp.zero, mesh)
    p_b, g_b, _ = STATE_BYTES[precision_class(precision)]
    param_numel, param_names = w.param_numel, w.param_names
    trainable = max(0.0, param_numel - w.frozen_numel)
    trainable_names = param_names - w.frozen_names
    if zero >= 2 and param_names:          # one FSDP unit per layer with parameters
        unit_bytes = param_numel * p_b     # its full parameters (the per-byte part: flat-buffer copies)
        w.fwd_s += cm.overhead("fsdp_unit_fwd_s") + cm.overhead("fsdp_unit_fwd_per_byte_s") * unit_bytes
        w.bwd_s += cm.overhead("fsdp_unit_bwd_s") + cm.overhead("fsdp_unit_bwd_per_byte_s") * unit_bytes
    d.param_bytes, d.grad_bytes, d.optimizer_bytes = state_bytes(param_numel, precision, zero, dp, trainable)
    # Megatron-Core's distributed optimizer (TrainingCode.distributed_optimizer): ZeRO-1's state
    # bytes (NVIDIA/Megatron-LM docs/user-guide/features/dist_optimizer.md: 16-bit parameters and
    # gradients whole, the fp32 main weights and moments over d) and a step on 1/d of the
    # parameters, with DDP's once-per-step traffic priced below as it is
    dist_opt = zero == 0 and cm.code.distributed_optimizer and dp > 1
    if dist_opt:
        d.optimizer_bytes = state_bytes(param_numel, precision, 1, dp, trainable)[2]
    offload = lp.offload == "cpu"
    if offload:
        d.host_bytes = d.param_bytes + d.grad_bytes + d.optimizer_bytes
        d.param_bytes = d.grad_bytes = d.optimizer_bytes = 0.0
    d.grad_sync_bytes = grad_sync_bytes = trainable * g_b
    param_full_bytes = param_numel * p_b
    if fp8_all_gather(lp, mesh, fp8_recipe):
        from autopar.simulator.axes.float8 import FP8_BYTES

        param_full_bytes -= w.fp8_weight_numel * max(0.0, p_b - FP8_BYTES)   # the fp8 all-gather
        # the shards' cast before each all-gather (forward; backward again under ZeRO-3), the
        # scales' precompute once per step with the optimizer (simulator/float8.py)
        w.fwd_s += w.fp8_shard_cast_s
        w.bwd_s += w.fp8_shard_cast_s if zero >= 3 else 0.0
    d.fsdp_param_buffer_bytes = param_full_bytes if (zero >= 3 or offload) else 0.0
    d.fsdp_grad_buffer_bytes = grad_sync_bytes if zero >= 2 else 0.0
    if zero >= 2 and mesh.pp > 1 and dp > 1:
        # a pipeline's backwards run without gradient sync or reshard until the last one
        # (simulator/pipeline_fsdp.py): every unit of the stage keeps its unsharded gradient,
        # upcast to the reduce dtype when it differs (FSDPParam.to_accumulated_grad_if_needed,
        # torch.distributed.fsdp._fully_shard._fsdp_param: the accumulated gradient in
        # MixedPrecisionPolicy.reduce_dtype; TrainingCode.reduce_bytes), and under ZeRO-3 its
        # unsharded parameters from a backward to the next forward -- in 1F1B's steady state all
        # of them at once.  Held on top of the sharded state, for the whole step.
        d.grad_bytes += trainable * max(g_b, cm.code.reduce_bytes)
        if zero >= 3:
            d.param_bytes += param_full_bytes

    dpl = links.dp if dpl is None else dpl
    if dp > 1 or zero >= 2:
        if zero <= 1:
            if grad_sync_bytes:            # (a layer of frozen parameters only: nothing to reduce)
                d.allreduce_s, m = cm.collective_time_ex("all_reduce", grad_sync_bytes, dp, dpl.link, dpl.level,
                                                         processes=node_processes)
                d.measured += m
                d.estimated += not m
            if zero == 1 and param_names:
                # updated parameters sent from their owners after the step: ZeroRedundancyOptimizer
                # broadcasts each parameter tensor from the rank that owns it (torch.distributed.
                # optim.ZeroRedundancyOptimizer, parameters_as_bucket_view=False, the default), all
                # issued asynchronously and then waited: priced as calls of a chain
                n_t = len(param_names)
                ag, m = cm.collective_time_ex("broadcast", param_full_bytes / n_t, dp, dpl.link, dpl.level,
                                              processes=node_processes, chained=True)
                d.allgather_s = ag * n_t
                d.measured += m
                d.estimated += not m
        else:
            d.allgather_s, m = cm.collective_time_ex("all_gather", param_full_bytes, dp, dpl.link, dpl.level,
                                                     processes=node_processes)
            d.measured += m
            d.estimated += not m
            if grad_sync_bytes:
                d.reducescatter_s, m2 = cm.collective_time_ex("reduce_scatter", grad_sync_bytes, dp, dpl.link,
                                                              dpl.level, processes=node_processes)
                d.measured += m2
                d.estimated += not m2
    if zero <= 1:
        d.wire_bytes_per_step = ring_wire_bytes("all_reduce", grad_sync_bytes, dp) + \
            (ring_wire_bytes("all_gather", param_full_bytes, dp) if zero == 1 else 0.0)
    elif mesh.pp > 1:
        # under a pipeline one gather and one reduce-scatter a step, and ZeRO-3's forward gather
        # each micro-batch (simulator/pipeline_fsdp.py: m + 1 gathers in all)
        gather = ring_wire_bytes("all_gather", param_full_bytes, dp)
        d.wire_bytes_per_mb = gather if zero >= 3 else 0.0
        d.wire_bytes_per_step = gather + ring_wire_bytes("reduce_scatter", grad_sync_bytes, dp)
    else:
        gathers = 2 if zero >= 3 else 1
        d.wire_bytes_per_mb = gathers * ring_wire_bytes("all_gather", param_full_bytes, dp) + \
            ring_wire_bytes("reduce_scatter", grad_sync_bytes, dp)
    shard_params = trainable / (dp if zero >= 1 or dist_opt else 1)   # the optimizer steps trainable ones only
    if offload:
        d.h2d_s = cm.h2d_time(param_full_bytes / dp, links.host)
        d.d2h_s = cm.h2d_time(grad_sync_bytes / dp, links.host)
        d.optimizer_s = cm.host_optimizer_time(shard_params)
    else:
        # FSDP2 holds every parameter as a DTensor; tensor parallelism those of its modules;
        # ZeroRedundancyOptimizer steps 1/dp of the tensors on each rank
        n_tensors = float(len(trainable_names))
        n_dtensor = n_tensors if zero >= 2 else float(len(w.dtensor_params & trainable_names))
        owned = 1.0 / dp if zero == 1 or dist_opt else 1.0
        d.optimizer_s = cm.optimizer_time(shard_params, (n_tensors - n_dtensor) * owned, n_dtensor * owned)
    if cm.code.grad_clip and trainable:
        # the clip's passes over the gradients this rank holds once they are reduced: FSDP2's
        # shards under ZeRO-2/3, whole under DDP and ZeRO-1 (ZeroRedundancyOptimizer shards the
        # state, not the gradients), in the gradient dtype (runtime/grad_norm.py; optimizer_step.py)
        d.optimizer_s += grad_clip_pass_time(cm, trainable / (dp if zero >= 2 else 1), g_b)
    if fp8_all_gather(lp, mesh, fp8_recipe):
        d.optimizer_s += w.fp8_precompute_s       # the fp8 weights' scales, after the step
    if cm.code.optimizer.sync_after_flush and zero <= 1 and d.allreduce_s:
        # the training code all-reduces the gradients after the last backward, before its
        # optimizer step, with nothing to overlap (optimizer_step.py): the serial tail of the step
        d.optimizer_s += d.allreduce_s
        d.allreduce_s = 0.0
    if zero >= 2 and param_names and dp > 1:
        d.meetings = 1 + (1 if zero >= 3 else 0) + (1 if grad_sync_bytes else 0)
    return d


def _local_param_numel(op, layout: TPLayout, style: str | None) -> float:
    """Parameters of ``op`` on one tensor-parallel rank.

    A row-wise linear (weight split on its input dim, output not split) keeps its bias
    replicated: every rank adds it after the all-reduce (Shoeybi et al. 2019, Megatron-LM,
    Sec. 3; torch.distributed.tensor.parallel.RowwiseParallel distributes the bias as
    Replicate).  So does a fused projection split per part ("colwise:<k>"): runtime/fused_tp.py
    keeps its bias whole on every rank and adds this rank's rows of it.
    """
    shard = layout.param_shard.get(op.name, 1)
    if shard <= 1:
        return float(op.param_numel)
    replicated_bias = style == "rowwise" or tp_style_parts(style or "")[1] > 1
    if op.kind == "linear" and replicated_bias and op.output_shape and any(p.endswith(".bias") for p in op.params):
        bias = float(op.output_shape[-1])
        return (op.param_numel - bias) / shard + bias
    return op.param_numel / shard


def effective_zero(zero: int, mesh: Mesh) -> int:
    """The ZeRO stage that will run.

    When another axis splits the model (tensor or pipeline parallelism: ``mesh.splits_model``)
    the runtime runs ZeRO-1 as FSDP2 without reshard
    (ZeroRedundancyOptimizer cannot broadcast DTensor parameters; core/rules.py,
    data_parallel_kind), i.e. ZeRO-2: the simulator prices what will run (core/rules.effective_zero).
    """
    return _rules.effective_zero(zero, mesh.splits_model)
