"""Which link each parallel group of a mesh crosses on a cluster.

Ranks are laid out as ``arange(world).view(dp, pp, tp)`` (core/plan.py), so a tensor-parallel
group is a run of consecutive ranks, a pipeline pair is ``tp`` ranks apart and a data-parallel
group strides by ``pp * tp``.  A group on one node uses the node's link (the slowest GPU's
link in a heterogeneous node group); a group that spans nodes pays the inter-node link, which
then sets the pace of the whole ring (DESIGN.md, "Collectives").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.core.cluster import Cluster, Link
from autopar.core.errors import InfeasibleError
from autopar.core.plan import Mesh


@dataclass(frozen=True)
class GroupLink:
    link: Link
    level: str          # "intra" | "inter"
    size: int


@dataclass(frozen=True)
class MeshLinks:
    tp: GroupLink
    dp: GroupLink
    pp: GroupLink
    host: Link          # host <-> device (PCIe), slowest in the cluster


def _group(cluster: Cluster, ranks: list[int]) -> GroupLink:
    nodes = {cluster.device(r).node for r in ranks}
    level = "inter" if len(nodes) > 1 else "intra"
    return GroupLink(cluster.link(ranks), level, len(ranks))


def _slowest(links: list[GroupLink]) -> GroupLink:
    return min(links, key=lambda g: (g.level != "inter", g.link.bandwidth_GBps))


def mesh_links(cluster: Cluster, mesh: Mesh) -> MeshLinks:
    """The slowest link of each kind of group over the whole mesh."""
    if mesh.world_size > cluster.world_size:
        raise InfeasibleError(f"mesh dp={mesh.dp} x pp={mesh.pp} x tp={mesh.tp} = {mesh.world_size} ranks "
                              f"exceeds the cluster's {cluster.world_size} devices")
    # On a homogeneous cluster every group of a kind is a translate of the first one, except
    # that groups may straddle node boundaries differently; checking the first of each pipeline
    # rank (and dp replica for tp) covers every distinct placement when gpus_per_node divides
    # the strides, and a bounded sample otherwise.
    dps = range(mesh.dp) if not cluster.homogeneous or mesh.dp * mesh.pp <= 64 else range(0, mesh.dp, max(1, mesh.dp // 8))
    tp_groups = [_group(cluster, [mesh.rank(d, p, t) for t in range(mesh.tp)]) for d in dps for p in range(mesh.pp)]
    dp_groups = [_group(cluster, [mesh.rank(d, p, 0) for d in range(mesh.dp)]) for p in range(mesh.pp)]
    pp_groups = ([_group(cluster, [mesh.rank(0, p, 0), mesh.rank(0, p + 1, 0)]) for p in range(mesh.pp - 1)]
                 or [GroupLink(cluster.groups[0].intra_node, "intra", 1)])
    host = min((g.host_to_device for g in cluster.groups), key=lambda link: link.bandwidth_GBps)
    return MeshLinks(_slowest(tp_groups), _slowest(dp_groups), _slowest(pp_groups), host)


def stage_groups(cluster: Cluster, mesh: Mesh, pp_rank: int) -> set[int]:
    """Indices of the cluster's node groups holding ranks of pipeline rank ``pp_rank``."""
    if cluster.homogeneous:
        return {0}
    return {cluster.device(mesh.rank(d, pp_rank, t)).group for d in range(mesh.dp) for t in range(mesh.tp)}


def node_stage_counts(cluster: Cluster, mesh: Mesh) -> tuple[np.ndarray, np.ndarray]:
    """(counts, host_bytes): per distinct node, how many of its devices run each pipeline rank
    (nodes x pp) and the node's host memory.  The mesh's ranks fill the cluster's devices in order
    (rank r has pipeline coordinate (r // tp) % pp); nodes with the same row are listed once, so
    the arrays stay small however many nodes the cluster has."""
    world = mesh.world_size
    node_of, host_of = [], []
    first = 0
    for g in cluster.groups:
        n = min(g.num_devices, world - sum(len(x) for x in node_of))
        if n <= 0:
            break
        node_of.append(first + np.arange(n) // g.gpus_per_node)
        host_of.append(np.full(n, float(g.host_memory_bytes)))
        first += g.nodes
    node = np.concatenate(node_of)
    host = np.concatenate(host_of)
    pp_rank = (np.arange(world) // mesh.tp) % mesh.pp
    counts = np.zeros((int(node.max()) + 1, mesh.pp))
    np.add.at(counts, (node, pp_rank), 1.0)
    cap = np.zeros(len(counts))
    cap[node] = host
    used = counts.sum(axis=1) > 0
    rows = np.unique(np.column_stack([counts[used], cap[used]]), axis=0)
    return rows[:, :-1], rows[:, -1]


def busy_devices_per_node(cluster: Cluster, mesh: Mesh) -> int:
    """The most ranks of the mesh on one node (ranks fill the cluster's devices in order)."""
    if cluster.homogeneous:
        return min(mesh.world_size, cluster.groups[0].gpus_per_node)
    busy: dict[int, int] = {}
    for r in range(mesh.world_size):
        node = cluster.device(r).node
        busy[node] = busy.get(node, 0) + 1
    return max(busy.values())


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
    collective's peers, so the waits do not hide anything (measured on the 2-core machine of
    profiles/local-cpu.json, 4 gloo ranks: ~14.5 ms of matmuls and a 128 KiB all-reduce that
    takes ~7 ms alone took 24.3 ms together, no overlap).  With fewer busy processes than
    cores the communication threads find a free core (overlap, as on a GPU).
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
