"""The cost of one layer under one layer plan: times and bytes per device, per micro-batch.

This is the unit the fast path caches and the planner's ILP reads.  Times come from the cost
model (measured or roofline), the tensor-parallel split from ``autopar.core.sharding`` and
the state bytes from ``autopar.simulator.memory``.

Conventions: FLOPs and bytes of the captured graph scale linearly with the micro-batch
(``micro_batch / graph.batch_size``); activations and parameters captured in fp32 take
``precision`` bytes per element when training in bf16/fp16.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, fields

from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh
from autopar.core.sharding import TPLayout, dtype_bytes
from autopar.simulator import autocast as _autocast
from autopar.simulator.cost_model import PRECISION_BYTES, CostModel, op_variant
from autopar.simulator.memory import STATE_BYTES, precision_class, state_bytes
from autopar.simulator.topology import MeshLinks

MATMUL_KINDS = frozenset({"linear", "matmul", "attention", "conv"})


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

    @property
    def grad_bytes_per_param(self) -> float:
        return self.dp_grad_bytes / self.param_numel if self.param_numel else 0.0


LAYER_COST_FIELDS = tuple(f.name for f in fields(LayerCost))


def layer_cost_row(c: LayerCost) -> tuple[float, ...]:
    return astuple(c)


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
                       compute_stretch: float = 1.0, node_processes: int | None = None) -> LayerCost:
    """``compute_stretch`` (>= 1) slows the device's own work -- compute, framework overheads,
    the optimizer step -- when more devices of a node compute than it has compute slots
    (``compute_stretch``); collectives are priced from the rows measured with ``node_processes``
    processes busy at once, the plan's busy devices per node (the same sharing)."""
    layer = graph.layers[layer_index]
    ops = graph.layer_ops(layer_index)
    scale = micro_batch / max(1, graph.batch_size)
    prec_bytes = PRECISION_BYTES.get(precision, 4)
    act_scale = prec_bytes / dtype_bytes(graph.param_dtype)
    tp = mesh.tp
    sp_div = tp if (mesh.sequence_parallel and tp > 1) else 1
    measured = estimated = 0

    fwd_s = bwd_s = cheap_fwd_s = 0.0
    fwd_flops = bwd_flops = cheap_fwd_flops = 0.0
    param_numel = 0.0
    saved = 0.0
    matmul_outputs = 0.0
    param_names: set[str] = set()          # parameter tensors of the layer
    dtensor_params: set[str] = set()       # ... held as DTensors by tensor parallelism
    num_tp_modules = 0
    num_sp_norms = 0
    priced_ops = 0                         # ops that run a kernel (views and identities do not)
    autograd_op, autograd_byte = cm.overhead("autograd_fwd_op_s"), cm.overhead("autograd_fwd_per_byte_s")
    autograd_kept_s = 0.0                  # the per-byte part: outputs kept for backward
    sequence_parallel = mesh.sequence_parallel and tp > 1 and bool(lp.tp)
    amp = _autocast.autocast_mode(effective_zero(lp.zero, mesh), mesh.dp, tp, mesh.pp, precision)  # issue 16
    styles = lp.tp_styles
    for op in ops:
        param_names.update(op.params)
        # a module tensor parallelism turned into DTensor: a sharded linear or embedding (the
        # runtime splits a vocabulary table row-wise), or (sequence parallel) a norm whose input
        # and weight are DTensors (runtime/apply_tp.py)
        if tp > 1 and op.kind in ("linear", "embedding") and layout.param_shard.get(op.name, 1) > 1:
            num_tp_modules += 1
            dtensor_params.update(op.params)
        elif sequence_parallel and op.kind == "norm":
            num_sp_norms += 1
            dtensor_params.update(op.params)
        shard = layout.compute_shard.get(op.name, 1)
        floating = op.dtype.replace("torch.", "") in ("float32", "float16", "bfloat16", "float64")
        bscale = prec_bytes / dtype_bytes(op.dtype) if floating else 1.0
        bscale *= _autocast.bytes_factor(op.kind, op_variant(op.kind, str(op.target)), amp) if floating else 1.0  # issue 16
        if op.fwd_flops > 0 or op.bytes_moved > 0 or op.copy_bytes > 0:
            priced_ops += 1
            osh = layout.output_shard.get(op.name, 1)
            t, m = cm.op_time_ex(op, precision, shard, scale=scale, bytes_scale=bscale, out_shard=osh)
            if op.bwd_flops > 0 or op.saved_bytes > 0:
                # recording the autograd graph, and writing outputs kept for backward into memory
                # not in cache (profiling/overheads.py, autograd_fwd_*; the op rows run no_grad)
                kept = autograd_byte * op.output_bytes * scale * act_scale / osh
                t += autograd_op + kept
                autograd_kept_s += kept
            fwd_s += t
            measured += m
            estimated += not m
            if op.kind not in MATMUL_KINDS:
                cheap_fwd_s += t
                cheap_fwd_flops += op.fwd_flops * scale / shard
            t, m = cm.op_time_ex(op, precision, shard, backward=True, scale=scale, bytes_scale=bscale, out_shard=osh)
            bwd_s += t
            measured += m
            estimated += not m
        elif op.kind == "view" and cm.host_dispatch_bound:
            # no kernel, but the host thread dispatches it (and autograd records it) each pass
            fwd_s += cm.overhead("op_launch_s")
            bwd_s += cm.overhead("op_backward_launch_s")
        fwd_flops += op.fwd_flops * scale / shard
        bwd_flops += op.bwd_flops * scale / shard
        param_numel += _local_param_numel(op, layout, styles.get(op.module_path))
        saved += op.saved_bytes * scale * act_scale / layout.saved_shard.get(op.name, 1)
        if op.kind in MATMUL_KINDS:
            matmul_outputs += op.output_bytes * scale * act_scale / layout.output_shard.get(op.name, 1)

    # framework overheads of the modules the runtime wraps (profiling/overheads.py)
    # a column/row-wise split module costs what profiling/overheads_in_step.py measured a pair to
    # cost beyond its arithmetic and all-reduces (dispatch, hooks, the asynchronous collectives'
    # threads); a sequence-parallel norm issues no collective of its own (the sequence is gathered
    # and scattered by the linears around it), so it costs what SequenceParallel adds to a norm on
    # one rank (sp_norm_*; older profiles: a DTensor module's one-rank figure, else the split modules')
    fwd_s += num_tp_modules * cm.overhead("tp_module_fwd_s")
    bwd_s += num_tp_modules * cm.overhead("tp_module_bwd_s")
    if num_sp_norms:
        fwd_s += num_sp_norms * cm.overheads.get(
            "sp_norm_fwd_s", cm.overheads.get("dtensor_module_fwd_s", cm.overhead("tp_module_fwd_s")))
        bwd_s += num_sp_norms * cm.overheads.get(
            "sp_norm_bwd_s", cm.overheads.get("dtensor_module_bwd_s", cm.overhead("tp_module_bwd_s")))
    tp_fwd = tp_bwd = 0.0
    tp_wire_fwd = tp_wire_bwd = 0.0
    tp_meet_fwd = 0                        # forward collectives: the ranks meet at each
    for c in layout.collectives:
        wire = ring_wire_bytes(c.kind, c.bytes * scale * act_scale, tp)
        if c.pass_ == "fwd":
            tp_wire_fwd += wire
        else:
            tp_wire_bwd += wire
        t, m = cm.collective_time_ex(c.kind, c.bytes * scale * act_scale, tp, links.tp.link, links.tp.level,
                                     processes=node_processes)
        measured += m
        estimated += not m
        if c.pass_ == "fwd":
            tp_fwd += t
            tp_meet_fwd += 1
        else:
            tp_bwd += t

    layer_input = layer.input_bytes * scale * act_scale / sp_div
    if lp.recompute == "full":
        recompute_s = fwd_s + tp_fwd
        recompute_flops = fwd_flops
        fwd_s -= autograd_kept_s           # the checkpointed forward keeps nothing: its outputs are freed
        activation = min(saved, layer_input) if saved > 0 else layer_input
        transient = saved
    elif lp.recompute == "selective":
        recompute_s = cheap_fwd_s
        recompute_flops = cheap_fwd_flops
        activation = min(saved, layer_input + matmul_outputs)
        transient = max(0.0, saved - activation)
    else:
        recompute_s = recompute_flops = 0.0
        activation = saved
        transient = 0.0
    if lp.recompute in ("full", "selective"):
        # the checkpoint wrapper's own cost per op of the layer, forward and backward, beyond the
        # recomputed forward (profiling/overheads.py: saved-tensor hooks; the selective policy's
        # dispatch mode on every op)
        fwd_s += priced_ops * cm.overhead(f"recompute_{lp.recompute}_fwd_per_op_s")
        bwd_s += priced_ops * cm.overhead(f"recompute_{lp.recompute}_bwd_per_op_s")

    dp = mesh.dp
    zero = effective_zero(lp.zero, mesh)
    pcls = precision_class(precision)
    p_b, g_b, _ = STATE_BYTES[pcls]
    if zero >= 2 and param_names:          # one FSDP unit per layer with parameters
        unit_bytes = param_numel * p_b     # its full parameters (the per-byte part: flat-buffer copies)
        fwd_s += cm.overhead("fsdp_unit_fwd_s") + cm.overhead("fsdp_unit_fwd_per_byte_s") * unit_bytes
        bwd_s += cm.overhead("fsdp_unit_bwd_s") + cm.overhead("fsdp_unit_bwd_per_byte_s") * unit_bytes
    params_b, grads_b, opt_b = state_bytes(param_numel, precision, zero, dp)
    host = 0.0
    offload = lp.offload == "cpu"
    if offload:
        host = params_b + grads_b + opt_b
        params_b = grads_b = opt_b = 0.0
    grad_sync_bytes = param_numel * g_b
    param_full_bytes = param_numel * p_b
    fsdp_param_buf = param_full_bytes if (zero >= 3 or offload) else 0.0
    fsdp_grad_buf = grad_sync_bytes if zero >= 2 else 0.0

    dpl = links.dp
    ar = ag = rs = h2d = d2h = 0.0
    if dp > 1 or zero >= 2:
        if zero <= 1:
            ar, m = cm.collective_time_ex("all_reduce", grad_sync_bytes, dp, dpl.link, dpl.level,
                                           processes=node_processes)
            measured += m
            estimated += not m
            if zero == 1 and param_names:
                # updated parameters sent from their owners after the step: ZeroRedundancyOptimizer
                # broadcasts each parameter tensor from the rank that owns it (torch.distributed.
                # optim.ZeroRedundancyOptimizer, parameters_as_bucket_view=False, the default), all
                # issued asynchronously and then waited: priced as calls of a chain
                n_t = len(param_names)
                ag, m = cm.collective_time_ex("broadcast", param_full_bytes / n_t, dp, dpl.link, dpl.level,
                                               processes=node_processes, chained=True)
                ag *= n_t
                measured += m
                estimated += not m
        else:
            ag, m = cm.collective_time_ex("all_gather", param_full_bytes, dp, dpl.link, dpl.level,
                                          processes=node_processes)
            rs, m2 = cm.collective_time_ex("reduce_scatter", grad_sync_bytes, dp, dpl.link, dpl.level,
                                           processes=node_processes)
            measured += m + m2
            estimated += (not m) + (not m2)
    if zero <= 1:
        dp_wire_mb = 0.0
        dp_wire_step = ring_wire_bytes("all_reduce", grad_sync_bytes, dp) + \
            (ring_wire_bytes("all_gather", param_full_bytes, dp) if zero == 1 else 0.0)
    else:
        gathers = 2 if zero >= 3 else 1
        dp_wire_mb = gathers * ring_wire_bytes("all_gather", param_full_bytes, dp) + \
            ring_wire_bytes("reduce_scatter", grad_sync_bytes, dp)
        dp_wire_step = 0.0
    shard_params = param_numel / (dp if zero >= 1 else 1)
    if offload:
        h2d = cm.h2d_time(param_full_bytes / dp, links.host)
        d2h = cm.h2d_time(grad_sync_bytes / dp, links.host)
        optimizer_s = cm.host_optimizer_time(shard_params)
    else:
        # FSDP2 holds every parameter as a DTensor; tensor parallelism those of its modules;
        # ZeroRedundancyOptimizer steps 1/dp of the tensors on each rank
        n_tensors = float(len(param_names))
        n_dtensor = n_tensors if zero >= 2 else float(len(dtensor_params))
        owned = 1.0 / dp if zero == 1 else 1.0
        optimizer_s = cm.optimizer_time(shard_params, (n_tensors - n_dtensor) * owned, n_dtensor * owned)
    out_bytes = layer.output_bytes * scale * act_scale / sp_div
    # the device's own work shares the node's compute slots (the host optimizer runs on the host)
    # the ranks meet at every tensor-parallel collective (again in a full recompute) and at every
    # FSDP all-gather and reduce-scatter: the meeting waits are priced per plan, from the work
    # between meetings (evaluator.with_meeting_waits)
    meetings = (len(layout.collectives) + (tp_meet_fwd if lp.recompute == "full" else 0)) if tp > 1 else 0
    if zero >= 2 and param_names and dp > 1:
        meetings += 1 + (1 if zero >= 3 else 0) + 1
    fwd_s *= compute_stretch
    bwd_s *= compute_stretch
    recompute_s = (recompute_s - tp_fwd) * compute_stretch + tp_fwd if lp.recompute == "full" \
        else recompute_s * compute_stretch
    if not offload:
        optimizer_s *= compute_stretch
    return LayerCost(
        fwd_s=fwd_s, bwd_s=bwd_s, recompute_s=recompute_s, tp_comm_fwd_s=tp_fwd, tp_comm_bwd_s=tp_bwd,
        dp_allreduce_s=ar, dp_allgather_s=ag, dp_reducescatter_s=rs, h2d_s=h2d, d2h_s=d2h,
        optimizer_s=optimizer_s, param_numel=param_numel, param_bytes=params_b, grad_bytes=grads_b,
        optimizer_bytes=opt_b, host_bytes=host, activation_bytes=activation, transient_bytes=transient,
        fsdp_param_buffer_bytes=fsdp_param_buf, fsdp_grad_buffer_bytes=fsdp_grad_buf, output_bytes=out_bytes,
        dp_grad_bytes=grad_sync_bytes, fwd_flops=fwd_flops, hw_flops=fwd_flops + bwd_flops + recompute_flops,
        tp_wire_bytes=tp_wire_fwd + tp_wire_bwd + (tp_wire_fwd if lp.recompute == "full" else 0.0),
        dp_wire_bytes_per_mb=dp_wire_mb, dp_wire_bytes_per_step=dp_wire_step, meetings=float(meetings),
        num_measured=measured, num_estimated=estimated)


def _local_param_numel(op, layout: TPLayout, style: str | None) -> float:
    """Parameters of ``op`` on one tensor-parallel rank.

    A row-wise linear (weight split on its input dim, output not split) keeps its bias
    replicated: every rank adds it after the all-reduce (Shoeybi et al. 2019, Megatron-LM,
    Sec. 3; torch.distributed.tensor.parallel.RowwiseParallel distributes the bias as
    Replicate).
    """
    shard = layout.param_shard.get(op.name, 1)
    if shard <= 1:
        return float(op.param_numel)
    if op.kind == "linear" and style == "rowwise" and op.output_shape and any(p.endswith(".bias") for p in op.params):
        bias = float(op.output_shape[-1])
        return (op.param_numel - bias) / shard + bias
    return op.param_numel / shard


def effective_zero(zero: int, mesh: Mesh) -> int:
    """The ZeRO stage that will run.

    With tensor or pipeline parallelism the runtime runs ZeRO-1 as FSDP2 without reshard
    (ZeroRedundancyOptimizer cannot broadcast DTensor parameters; runtime/apply_dp.py,
    data_parallel_kind), i.e. ZeRO-2: the simulator prices what will run.
    """
    return 2 if zero == 1 and (mesh.tp > 1 or mesh.pp > 1) else zero
