"""The step's built-in cost terms, registered in the order the step model composes them
(term_registry.py says what each field means).

The "compute" terms are registered recompute, compute, then the in-layer collectives tp, cp,
ep: a layer's forward is ``fwd_s + (tp_comm_fwd_s + cp_comm_fwd_s + ep_comm_fwd_s)`` and its
backward ``recompute_s + bwd_s + (tp_comm_bwd_s + cp_comm_bwd_s + ep_comm_bwd_s)``, summed in
that order, the collectives first among themselves (overlap.compute_per_pass).  The "traffic"
terms are summed FSDP, then offload
(overlap.fsdp_traffic).  The "table" terms rewrite the plan's table in the order
DDP buckets, sharded data parallelism, gradient compression, CPU meeting waits (evaluator._derive).  The math of each
term lives where ``source`` says; this module only declares it.
"""
from __future__ import annotations

from autopar.simulator.step import cpu_node, overlap
from autopar.simulator.axes import dp_buckets as ddp_buckets, grad_compression, nvme_tier, offload, sharded_dp_table
from autopar.simulator.step.term_registry import Term, register

#: a recomputed forward runs inside backward, with its tp collectives (axes/recompute.recompute)
register(Term("recompute", "compute", reads=("recompute_s", "recompute"), bwd="recompute_s", bwd_label="recompute",
              source="simulator/axes/recompute.py recompute"))
#: the layer's own kernels (step/op_work.op_work, cost_model.py)
register(Term("compute", "compute", reads=("fwd_s", "bwd_s"), fwd="fwd_s", bwd="bwd_s", fwd_label="fwd",
              bwd_label="bwd", source="simulator/step/op_work.py op_work"))
#: Megatron's f/g all-reduces, synchronous: on the critical path (Shoeybi et al. 2019, Sec. 3)
register(Term("tp", "compute", reads=("tp_comm_fwd_s", "tp_comm_bwd_s"), fwd="tp_comm_fwd_s", bwd="tp_comm_bwd_s",
              stream="tp", collective=True, fwd_label="tp fwd", bwd_label="tp bwd",
              source="simulator/axes/tp.py tensor_parallel"))
#: context parallelism's K/V all-gather and its gradient's reduce-scatter, synchronous in the
#: layer's attention (runtime/apply_cp.py): on the critical path
register(Term("cp", "compute", reads=("cp_comm_fwd_s", "cp_comm_bwd_s"), fwd="cp_comm_fwd_s", bwd="cp_comm_bwd_s",
              stream="cp", collective=True, fwd_label="cp fwd", bwd_label="cp bwd",
              source="simulator/axes/cp.py cp_layer_terms"))
#: expert parallelism's dispatch and combine all-to-alls, synchronous in the layer (GShard,
#: Lepikhin et al. 2021, Sec. 2.2 and 3.2): on the critical path
register(Term("ep", "compute", reads=("ep_comm_fwd_s", "ep_comm_bwd_s"), fwd="ep_comm_fwd_s", bwd="ep_comm_bwd_s",
              stream="ep", collective=True, fwd_label="ep fwd", bwd_label="ep bwd",
              source="simulator/axes/ep.py ep_layer_terms"))
#: DDP's buckets: a plain data-parallel plan's all-reduces as the runtime's calls; reads the whole
#: table (which layer closes a bucket), so not local
register(Term("ddp_buckets", "table", local=False, reads=("dp_grad_bytes", "dp_allreduce_s", "zero"),
              derive=lambda rows, ctx, ev: ddp_buckets.ddp_bucketed_all_reduces(rows, ctx, ctx.processes),
              acts=ddp_buckets.ddp_buckets_act, source="simulator/axes/dp_buckets.py"))
#: FSDP2's copies, the overlap slowdown, the fp32 reduce-scatter: reads layers k-1, k, k+1 (local)
register(Term("sharded_dp", "table", reads=("dp_allgather_s", "dp_reducescatter_s", "zero", "fwd_s", "bwd_s"),
              derive=lambda rows, ctx, ev: sharded_dp_table.plan_table_costs(
                  rows, ctx, ev.cluster.inter_node.bandwidth_GBps, ev._fetch_units),
              source="simulator/axes/sharded_dp.py"))
#: the NVMe tier's read and write of the moments beyond what the step's compute hides, on the
#: optimizer step (ZeRO-Infinity, Rajbhandari et al. 2021; per layer: local)
register(Term("nvme_tier", "table", reads=("nvme_bytes", "optimizer_s", "fwd_s", "bwd_s", "recompute_s"),
              derive=lambda rows, ctx, ev: nvme_tier.with_tier_stalls(rows, ctx, ev.cluster),
              source="simulator/axes/nvme_tier.py"))
#: gradient compression (bf16 / fp16 on the wire, PowerSGD): the dp reduce's bytes and the
#: compression's own work; re-buckets DDP's all-reduces, so not local
register(Term("grad_compression", "table", local=False, reads=("dp_grad_bytes", "dp_allreduce_s", "dp_reducescatter_s",
                                                                "grad_bytes", "zero"),
              derive=lambda rows, ctx, ev: grad_compression.with_compression(
                  rows, ctx, ev.per_graph(grad_compression.graph_matrices), ev.cluster.backend == "gloo"),
              acts=grad_compression.compression_acts, source="simulator/axes/grad_compression.py"))
#: CPU ranks that meet wait for each other: a per-rank stretch from the whole rank's work (not local)
register(Term("cpu_waits", "table", local=False, reads=("fwd_s", "bwd_s", "recompute_s", "optimizer_s", "meetings"),
              derive=lambda rows, ctx, ev: (cpu_node.with_meeting_waits(rows, ctx, ctx.processes)
                                            if ctx.waits_at_meetings else rows),
              acts=lambda ctx: ctx.waits_at_meetings, source="simulator/step/cpu_node.py with_meeting_waits"))
#: FSDP's all-gather before a pass and reduce-scatter after backward, beside compute (Zhao et al.
#: 2023, "PyTorch FSDP", Sec. 3.3)
register(Term("fsdp", "traffic", reads=("dp_allgather_s", "dp_reducescatter_s", "zero"), traffic=overlap.fsdp_parts,
              stream="fsdp", gather_label="all_gather", scatter_label="reduce_scatter",
              source="simulator/step/overlap.py fsdp_parts"))
#: the offloaded state's copies in and out, on the same stream
register(Term("offload", "traffic", reads=("h2d_s", "d2h_s", "offload"), traffic=offload.offload_parts,
              stream="fsdp", gather_label="h2d", scatter_label="d2h", source="simulator/axes/offload.py offload_parts"))
#: the schedule over the model chunks and the activation sends of its fill and drain
register(Term("pipeline", "pipeline", reads=("output_bytes",),
              source="simulator/axes/pp.py pipeline_time, interleaved_time"))
#: DDP's all-reduces queued after each gradient is ready, FSDP's exposed last reduce-scatter, the
#: optimizer step and ZeRO-1's parameter all-gather
register(Term("gradient_sync", "after_backward", reads=("dp_allreduce_s", "dp_reducescatter_s", "optimizer_s",
                                                       "dp_allgather_s", "zero"),
              source="simulator/axes/dp_sync.py ddp_excess, fsdp_tails, after_backward"))
