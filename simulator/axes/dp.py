"""Data parallelism's costs in a layer: DDP's gradient all-reduce, ZeRO-1's broadcasts, FSDP's
all-gather and reduce-scatter, the state bytes each keeps and the optimizer step on the rank's
share, with CPU offload's state, copies and host optimizer from offload.py (runtime/apply_dp.py's
twin).  The ranks that share the weights are dp x cp; the routed experts' are dp x cp / ep
(ep.py)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields

from autopar.core.plan import LayerPlan, Mesh
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.network import ring_wire_bytes
from autopar.simulator.device.topology import MeshLinks
from autopar.simulator.axes.float8 import FP8_BYTES, fp8_all_gather
from autopar.simulator.axes.offload import host_copies, host_optimizer_s, host_state, offloaded
from autopar.simulator.axes.sharded_dp import effective_zero
from autopar.simulator.step.memory import STATE_BYTES, precision_class, state_bytes
from autopar.simulator.step.optimizer_step import grad_clip_pass_time


@dataclass
class DataParallel:
    param_bytes: float = 0.0               # state on the device after ZeRO (0 when offloaded)
    grad_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    host_bytes: float = 0.0                # offloaded state
    nvme_bytes: float = 0.0                # offload "nvme...": the states in files (of host_bytes' share)
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


def data_parallel_parts(lp: LayerPlan, mesh: Mesh, precision: str, w: "OpWork", cm: CostModel, links: MeshLinks,
                         node_processes: int | None, fp8_recipe: str = "tensorwise") -> DataParallel:
    """Data parallelism over dp x cp (the cp ranks hold the same weights and average their
    gradients: ParallelDims.GROUPS["grad"], the runtime's get_mesh("grad"), as torchtitan shards); with ep > 1 the routed
    experts are a second unit over the dp x cp / ep ranks holding the same experts (ep_cost.py),
    its collectives after the dense unit's."""
    flat = mesh.grad_degree
    if mesh.ep <= 1 or not w.expert_names:
        return data_parallel(lp, mesh, precision, w, cm, links, node_processes, flat, links.dp, fp8_recipe)
    dense = _with(w, param_numel=w.param_numel - w.expert_numel, frozen_numel=w.frozen_numel - w.expert_frozen_numel,
                  param_names=w.param_names - w.expert_names, frozen_names=w.frozen_names - w.expert_names)
    expert = _with(w, param_numel=w.expert_numel, frozen_numel=w.expert_frozen_numel,
                   param_names=set(w.expert_names), frozen_names=w.frozen_names & w.expert_names)
    a = data_parallel(lp, mesh, precision, dense, cm, links, node_processes, flat, links.dp, fp8_recipe)
    b = data_parallel(lp, mesh, precision, expert, cm, links, node_processes, flat // mesh.ep, links.ep_dp or links.dp,
                       fp8_recipe)
    # each part added its FSDP unit's overhead to its copy of the work
    w.fwd_s += (dense.fwd_s - w.fwd_s) + (expert.fwd_s - w.fwd_s)
    w.bwd_s += (dense.bwd_s - w.bwd_s) + (expert.bwd_s - w.bwd_s)
    return DataParallel(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(DataParallel)})


def ddp_reduce_bytes(precision: str, code) -> float:
    """Bytes of one gradient element in the all-reduce of a ZeRO-0/1 layer (DDP, or FSDP2's
    ``replicate`` beside tp / pp), uncompressed, under training code ``code``
    (simulator/device/training_code.py): the larger of the training precision's gradient bytes
    (memory.STATE_BYTES) and the code's reduce dtype (``TrainingCode.reduce_bytes``).

    autopar's runtime reduces fp32 (``reduce_bytes`` 4) under every precision: DDP and ZeRO-1 run
    mixed precision as ``torch.autocast`` over fp32 parameters (runtime/parallelize.py), so
    autograd accumulates fp32 gradients and DDP's buckets take the parameters' dtype
    (``torch.nn.parallel.DistributedDataParallel``: each bucket is allocated like its
    gradients); ``replicate`` reduces in its ``MixedPrecisionPolicy.reduce_dtype``, fp32
    (runtime/apply_dp.py ``mixed_precision_policy``).  A ``--grad-compression`` cast or PowerSGD
    is priced over these bytes by grad_compression.py.  Published runs reduce as their code did
    (``reduce_bytes`` 2: Megatron-LM 2021's fp16 gradients, Megatron Bridge's
    ``grad_reduce_in_fp32 = False``; benchmarks/published_runs.py)."""
    return max(STATE_BYTES[precision_class(precision)][1], float(code.reduce_bytes))


def _with(w: "OpWork", **changes) -> "OpWork":
    """``dataclasses.replace(w, **changes)``: a shallow copy with ``changes`` set (OpWork has no
    ``__post_init__``; replace would re-run ``__init__``, several times slower)."""
    out = copy.copy(w)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def data_parallel(lp: LayerPlan, mesh: Mesh, precision: str, w: "OpWork", cm: CostModel, links: MeshLinks,
                   node_processes: int | None, dp: int | None = None, dpl=None,
                   fp8_recipe: str = "tensorwise") -> DataParallel:
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
    d = DataParallel()
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
    offload = offloaded(lp)
    if offload:                            # the state on the host (offload.py)
        d.host_bytes, d.nvme_bytes = host_state(d.param_bytes, d.grad_bytes, d.optimizer_bytes, lp,
                                                param_numel / dp, trainable / dp)
        d.param_bytes = d.grad_bytes = d.optimizer_bytes = 0.0
    # the bytes a layer's gradients put into the data-parallel reduce: DDP's all-reduce (ZeRO-0/1)
    # sends them as the code reduces them (``ddp_reduce_bytes``); FSDP's reduce-scatter is priced
    # at the training precision's here and scaled to the reduce dtype by sharded_dp.py
    d.grad_sync_bytes = grad_sync_bytes = trainable * (ddp_reduce_bytes(precision, cm.code) if zero <= 1 else g_b)
    param_full_bytes = param_numel * p_b
    if fp8_all_gather(lp, mesh, fp8_recipe):
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
    if offload:                            # the copies and the host's Adam (offload.py)
        d.h2d_s, d.d2h_s = host_copies(cm, links.host, param_full_bytes, grad_sync_bytes, dp)
        d.optimizer_s = host_optimizer_s(cm, shard_params, node_processes)
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
