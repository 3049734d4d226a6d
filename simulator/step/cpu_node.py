"""What only a CPU node running gloo needs: shared compute slots, communication that takes turns
with compute, and the waits of ranks that meet.

A GPU runs its kernels on its own streams, so none of this applies there: every function here
returns the neutral answer (stretch 1.0, overlap, rows unchanged) unless a node group of the
cluster declares ``compute_slots`` (the cores its processes share; core/cluster.py) or the
profile measured meeting waits (``CostModel.waits_at_meetings``; profiling/cpu_sync_wait.py).  The
evaluator calls them at one door each: the layer costs' stretch, the plan's serial flag and the
per-plan meeting waits, and the step of a plan whose communication takes turns with compute
(the ``SERIAL`` step form in place of step_model.OVERLAPPED, chosen when the context is built;
its composition: compose.serial_step).
"""
from __future__ import annotations

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.plan import Mesh
from autopar.simulator.step.layer_table import LayerTable
from autopar.simulator.step.compose import serial_chunk_times, serial_step
from autopar.simulator.step.overlap import collectives_per_pass
from autopar.simulator.step.step_model import StepForm
from autopar.simulator.device.topology import busy_devices_per_node


def compute_stretch(cluster: Cluster, mesh: Mesh) -> float:
    """How much slower a device computes because its node has fewer compute slots than busy devices.

    The mesh's ranks fill the cluster's devices in order; on every node, ``busy`` of them
    compute at once.  A node group with ``compute_slots`` s (CPU processes sharing s cores'
    worth of threads) runs ``busy`` single-threaded processes at s / busy of their speed when
    busy > s -- the operating system time-slices the cores fairly (Linux CFS, "CFS Scheduler",
    Documentation/scheduler/sched-design-CFS.rst).  The slowest node sets the pace: 1.0 when no
    node is oversubscribed.
    """
    if not any(g.compute_slots > 0 for g in cluster.groups):
        return 1.0
    busy: dict[int, int] = {}
    for r in range(mesh.world_size):
        node = cluster.device(r).node
        busy[node] = busy.get(node, 0) + 1
    worst = 1.0
    for r in range(mesh.world_size):
        d = cluster.device(r)
        slots = cluster.groups[d.group].compute_slots
        if slots > 0:
            worst = max(worst, busy[d.node] / slots)
    return worst


def serial_communication(cluster: Cluster, mesh: Mesh) -> bool:
    """True when communication cannot overlap computation: a node group with compute slots
    and at least as many busy devices of the plan on a node (one CPU process per core, or more).

    On a CPU "device" a collective is work of the same cores -- gloo copies, reduces and
    moves loopback TCP data on the CPU -- and while a process waits for its peers its core
    has nothing else to run; with no core to spare, its communication and its compute take
    turns.  Oversubscribed (more processes than cores) it is no better: a process blocked in
    a collective frees its core for another process's compute, but that process is one of the
    collective's peers, so the waits do not hide anything (4 gloo ranks on a 2-core machine:
    matmuls and an all-reduce run together take as long as their sum; docs/design.md, "CPU
    nodes").  With fewer busy processes than cores the communication threads find a free core
    (overlap, as on a GPU).
    """
    if not any(g.compute_slots > 0 for g in cluster.groups):
        return False
    busy = busy_devices_per_node(cluster, mesh)
    return any(0 < cluster.groups[g].compute_slots <= busy for g in stage_groups_all(cluster, mesh))


def stage_groups_all(cluster: Cluster, mesh: Mesh) -> set[int]:
    """Indices of the node groups holding any rank of the mesh."""
    if cluster.homogeneous:
        return {0}
    return {cluster.device(r).group for r in range(mesh.world_size)}


def waits_at_meetings(mesh: Mesh, processes: int, cost_models) -> bool:
    """Whether a plan's ranks pay meeting waits: several processes, and a profile that measured them."""
    return mesh.world_size > 1 and processes > 1 and any(cm.waits_at_meetings(processes) for cm in cost_models)


def with_meeting_waits(rows: LayerTable, ctx, processes: int) -> LayerTable:
    """Rows whose own work (forward, backward, recompute, optimizer) is stretched by the waits at
    the meetings of the ranks (CostModel.meeting_wait, measured by profiling/cpu_sync_wait.py).

    Per pipeline rank, per step: the work W (every micro-batch's forward, backward and recompute,
    and the optimizer) and the meetings M -- the layers' blocking collectives (tensor-parallel,
    FSDP) per micro-batch, a receive per micro-batch and model chunk from each neighbouring
    pipeline stage, and one meeting at the end of the step when gradients are all-reduced (DDP,
    ZeRO-1: the ranks wait there for the slowest) -- so the ranks meet on average every W / M
    seconds, and each meeting costs ``meeting_wait(W / M)``: the work stretches by
    1 + M * wait / W.  The collectives keep their in-step rows (their own wake-up).  Rows of a
    single process, or of a profile without meeting waits, are returned unchanged.
    ``ctx``: the evaluator's context of the plan (step/context.Context)."""
    mesh = ctx.mesh
    if not waits_at_meetings(mesh, processes, ctx.rank_cm):
        return rows
    m = ctx.num_microbatches
    rec = rows.recompute_s
    # a full recompute repeats the forward's in-layer collectives (tp, cp, ep)
    tp_in_rec = np.where(rows.recompute == 2, collectives_per_pass(rows)[0], 0.0)
    per_mb = rows.fwd_s + rows.bwd_s + rec - tp_in_rec
    work = ctx.rank_onehot @ (per_mb * m + rows.optimizer_s)
    meetings = ctx.rank_onehot @ rows.meetings * m
    if ctx.p > 1:
        ends = np.array([1.0 if r in (0, ctx.p - 1) else 2.0 for r in range(ctx.p)])
        meetings = meetings + m * ctx.v * ends
    if mesh.dp > 1 and (rows.zero <= 1).any():
        meetings = meetings + 1.0
    scale = np.ones(ctx.p)
    for r in range(ctx.p):
        if meetings[r] > 0 and work[r] > 0:
            gap = work[r] / meetings[r]
            scale[r] = 1.0 + meetings[r] * ctx.rank_cm[r].meeting_wait(processes, gap) / work[r]
    if np.all(scale == 1.0):
        return rows
    s = scale[ctx.layer_rank]
    return rows.with_columns(fwd_s=rows.fwd_s * s, bwd_s=rows.bwd_s * s, optimizer_s=rows.optimizer_s * s,
                             recompute_s=(rec - tp_in_rec) * s + tp_in_rec)


#: a CPU node's whose communication takes turns with compute (``serial_communication``): chosen
#: for the context when the evaluator builds it (step/context.build_context)
SERIAL = StepForm("serial", serial_step, serial_chunk_times, serial=True, memo_ok=False)
