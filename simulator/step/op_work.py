"""The ops' compute of one layer under one layer plan, per micro-batch on one device.

Each op's forward and backward time from the cost model (measured or roofline), with the
autograd recording cost of ops that keep tensors for backward; FLOPs, parameters (after the
tensor-parallel split: ``autopar.core.sharding``) and activations.  layer_cost.py adds to this
work what each axis and technique costs (simulator/axes/).

Conventions: FLOPs and bytes of the captured graph scale linearly with the micro-batch
(``micro_batch / graph.batch_size``); activations and parameters captured in fp32 take
``precision`` bytes per element when training in bf16/fp16.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh, tp_style_parts
from autopar.core.dtypes import dtype_bytes, precision_bytes
from autopar.core.sharding import TPLayout, loss_chain
from autopar.simulator.device import autocast as _autocast
from autopar.simulator.axes import cp as cp_cost
from autopar.simulator.device.cost_model import CostModel, op_variant
from autopar.simulator.axes.recompute import recomputed_matmuls
from autopar.simulator.axes.sharded_dp import effective_zero

MATMUL_KINDS = frozenset({"linear", "matmul", "attention", "conv"})


#: kinds whose backward needs only their inputs (and weight): autograd saves those before the op's
#: kernel runs (the generated ``VariableType`` code builds an op's ``SavedVariable`` inputs, and so
#: calls the saved-tensor pack hook, before it redispatches to the kernel), so a recompute that
#: stops at such an op's saved tensors never runs its kernel (``recompute``)
SAVES_INPUTS_ONLY = frozenset({"linear", "matmul", "conv"})


#: the share of an op's backward that computes its weight's gradient (the W pass of a split
#: backward, Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2): a linear's (conv's,
#: recurrent cell's) backward is two GEMMs of equal FLOPs, dgrad dX = dY W and wgrad dW = dY^T X
#: (2 M N K each), so half; an embedding's input is indices, so all of it is the weight's; ops
#: without a trainable weight (attention, matmuls between activations, activations) have none,
#: and a norm's weight gradient (a reduction over the tokens, a few % of its backward) is left
#: in B
WEIGHT_GRAD_SHARE = {"linear": 0.5, "conv": 0.5, "rnn": 0.5, "embedding": 1.0}


@dataclass
class OpWork:
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


def unfused_ops(graph: OpGraph, layer_index: int, cm: CostModel) -> list:
    """The layer's ops whose backward allocates its own gradients: all of them, less the loss's
    chain where the code runs a fused cross-entropy (TrainingCode.fused_cross_entropy,
    core/sharding.loss_chain)."""
    ops = graph.layer_ops(layer_index)
    if not cm.code.fused_cross_entropy or not any(o.kind == "loss" for o in ops):
        return ops
    chain = loss_chain(graph, layer_index)
    return [o for o in ops if o.name not in chain]


def op_work_key(layer_index: int, layout: TPLayout, lp: LayerPlan, mesh: Mesh, precision: str, cm: CostModel,
                 scale: float, act_scale: float, units: tuple) -> tuple:
    """Everything ``op_work`` reads besides the layer's ops: the layer plan's split (with the
    mesh's tp and sequence parallelism it fixes the layout, evaluator.layer_cost), recompute and
    precision, the mesh's cp, the autocast mode (from the ZeRO stage that runs and the mesh), the
    scales and the cost model."""
    amp = _autocast.autocast_mode(effective_zero(lp.zero, mesh), mesh, precision, cm.code.autocast)
    return (layer_index, lp.tp, lp.recompute, lp.precision, mesh.tp, mesh.cp, mesh.sequence_parallel,
            cm.code.loss_parallel,
            amp, precision, cm.name, scale, act_scale, units)


def copy_work(w: OpWork) -> OpWork:
    """A copy of ``w`` its callers may change (they add to its numbers and rewrite its per-op times)."""
    out = copy.copy(w)                    # (dataclasses.replace re-runs __init__: several times slower)
    out.param_names, out.frozen_names = set(w.param_names), set(w.frozen_names)
    out.dtensor_params, out.op_fwd_s, out.op_bwd_s = set(w.dtensor_params), dict(w.op_fwd_s), dict(w.op_bwd_s)
    return out


def op_work(ops, layout: TPLayout, lp: LayerPlan, mesh: Mesh, precision: str, cm: CostModel,
             scale: float, act_scale: float, units: tuple[str, ...] = ()) -> OpWork:
    """Compute: each op's forward and backward time from the cost model, with the autograd
    recording cost of ops that keep tensors for backward; FLOPs, parameters and activations.
    ``units``: the layer's top-level modules, each of which a recompute wraps on its own, where
    a recompute that stops early applies (the ops it skips are found per unit, ``recompute``;
    none where ``units`` is empty)."""
    w = OpWork()
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
        local_numel = local_param_numel(op, layout, styles.get(op.module_path))
        w.param_numel += local_numel
        tied = op.tied_numel
        if tied:
            tied_shard = layout.param_shard.get(op.name, 1)
            w.tied_numel += tied / tied_shard
            w.tied_frozen_numel += op.tied_frozen_numel / tied_shard
        frozen = op.frozen_numel
        if frozen:
            # the split keeps each tensor's share; a frozen and a trainable tensor of one module split
            # alike except a row-wise bias (local_param_numel), counted here at the weight's share
            w.frozen_numel += local_numel * frozen / op.param_numel if frozen < op.param_numel else local_numel
        w.saved_bytes += op.saved_bytes * scale * act_scale / layout.saved_shard.get(op.name, 1)
        if op.kind in MATMUL_KINDS:
            w.matmul_output_bytes += op.output_bytes * scale * act_scale / layout.output_shard.get(op.name, 1)
    w.early_stop_skipped_s = sum(t[0] for t in tails.values())
    w.early_stop_skipped_flops = sum(t[1] for t in tails.values())
    w.early_stop_skipped_ops = frozenset(n for t in tails.values() for n in t[2])
    return w


def local_param_numel(op, layout: TPLayout, style: str | None) -> float:
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
