"""A plan's SimResult from its step: memory per pipeline rank and per node, whether it fits,
and the step's work (FLOPs, traffic), read when asked for."""
from __future__ import annotations

from dataclasses import dataclass
from operator import le

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.graph import OpGraph
from autopar.core.plan import Plan
from autopar.simulator.axes import nvme_tier, pp_tied_copies as tied_copies
from autopar.simulator.axes.recompute import recomputed_matmuls
from autopar.simulator.result import SimResult, StepWork
from autopar.simulator.step.context import Context
from autopar.simulator.step.layer_memo import MAX_COLUMNS
from autopar.simulator.step.layer_table import COLUMN_INDEX, LayerTable
from autopar.simulator.step.memory import stage_memory
from autopar.simulator.step.op_work import MATMUL_KINDS

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
_NVME = COLUMN_INDEX["nvme_bytes"]


@dataclass(frozen=True)
class ModelFacts:
    """What ``assemble`` reads of the model: its layers, tied weights and FLOPs."""
    num_layers: int
    tied_uses: object                 # tied weights used by several layers (tied_copies.uses)
    layer_fwd_flops: np.ndarray       # per layer, per sample
    layer_cheap_fwd_flops: np.ndarray     # ... of what a selective recompute reruns
    flops_per_sample: float
    seq_len: int

    @classmethod
    def of(cls, graph: OpGraph, selective_mm_policy: str) -> "ModelFacts":
        """``selective_mm_policy``: the code's (every group runs the same code)."""
        num_layers = len(graph.layers)
        b0 = max(1, graph.batch_size)
        # what a selective recompute reruns: the cheap ops, and the matmuls the code's policy does not
        # save (simulator/axes/recompute.py)
        cheap = np.array(
            [sum(o.fwd_flops for o in ops if o.kind not in MATMUL_KINDS or o.name in rerun)
             for ops in (list(graph.layer_ops(i)) for i in range(num_layers))
             for rerun in (recomputed_matmuls(ops, selective_mm_policy),)]) / b0
        return cls(num_layers=num_layers, tied_uses=tied_copies.uses(graph),
                   layer_fwd_flops=np.array([layer.fwd_flops for layer in graph.layers]) / b0,
                   layer_cheap_fwd_flops=cheap, flops_per_sample=graph.flops_per_sample, seq_len=graph.seq_len or 1)


def assemble(plan: Plan, ctx: Context, rows: LayerTable, step_r: np.ndarray, bubble: float, model: ModelFacts,
             timeline: list | None = None, chunk_terms: tuple | None = None,
             any_ddp: bool | None = None, cluster: Cluster | None = None) -> SimResult:
    """The SimResult of a plan whose step is ``step_r``, ``bubble``; ``chunk_terms``: per model
    chunk (activation bytes, maxima of the MAX_COLUMNS, output bytes of its last layer),
    ``any_ddp``: whether some layer runs ZeRO 0 or 1 (DDP buckets), where the caller has them;
    ``cluster``: whose NVMe tier holds the moments of layers offloaded there."""
    p, m, mesh = ctx.p, ctx.num_microbatches, ctx.mesh
    stage_step = step_r.tolist()
    step = max(stage_step)
    # ---- memory per pipeline rank
    data = rows.data
    sums = ctx.rank_onehot @ data                           # per-rank sums in one product
    if model.tied_uses:
        # the copies of tied weights a later stage keeps (tied_copies.py), at their layer's plan
        if ctx.tied_share is None:
            ctx.tied_share = tied_copies.held_share(model.tied_uses, ctx.starts, model.num_layers)
        sums[:, _STATE] += ctx.rank_onehot @ (data[:, _TIED_STATE] * ctx.tied_share[:, None])
    if chunk_terms is None:
        # per model chunk, one column at a time (cheaper than one reduceat over a 2-D selection)
        transient, param_buf, grad_buf = (np.maximum.reduceat(data[:, c], ctx.starts) for c in MAX_COLUMNS)
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
    # ---- the NVMe tier per node: the moments of every device on the node in its drives
    nvme_need = nvme_cap = 0.0
    nvme_fits = True
    if np.count_nonzero(data[:, _NVME]):
        nvme_need, nvme_cap, nvme_fits = nvme_tier.node_need(ctx.rank_onehot @ data[:, _NVME], ctx.node_counts, cluster)
    totals_list = totals.tolist()
    device_fits = all(map(le, totals_list, ctx.capacity_list))
    samples = plan.global_batch
    world = mesh.world_size
    peak = ctx.peak_flops
    seq = model.seq_len

    def work() -> StepWork:
        # rows.data is never written once built (LayerRows.rows_and_ids copies to change a row)
        rec, tp_wire, dp_wire_mb, dp_wire_step, n_measured, n_estimated, output = rows.data[:, _WORK_COLUMNS].T
        # ---- FLOPs
        model_flops = model.flops_per_sample * samples
        recompute_flops = float(((rec == 2) * model.layer_fwd_flops
                                 + (rec == 1) * model.layer_cheap_fwd_flops).sum()) * samples
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
        fits=device_fits and host_fits and nvme_fits, device_fits=device_fits, host_fits=host_fits,
        nvme_fits=nvme_fits, nvme_bytes_per_node=nvme_need, nvme_capacity_bytes=nvme_cap,
        host_bytes_per_node=float(host_per_node[host_worst]),
        host_capacity_bytes=float(ctx.host_capacity[host_worst]), bubble_fraction=bubble, memory_arrays=memory,
        work_fn=work, timeline=timeline, stage_step_s=stage_step, world_size=world,
        peak_flops_per_gpu=peak)
