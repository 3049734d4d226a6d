"""Which link each parallel group of a mesh crosses on a cluster.

Ranks are laid out over the named axes of ``core/parallel_dims.py``
(``arange(world).view(dp, pp, tp)``), so a tensor-parallel group is a run of consecutive ranks,
a pipeline pair is ``tp`` ranks apart and a data-parallel group strides by ``pp * tp``; the
groups come from ``ParallelDims.group``/``groups``.  A group on one node uses the node's link
(the slowest GPU's link in a heterogeneous node group); a group that spans nodes pays the
inter-node link, which then sets the pace of the whole ring (the alpha-beta model of cost_model.py).
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
    """The slowest link of each axis's groups, keyed by axis name (core/parallel_dims.py): read as
    ``links.axis("tp")`` or ``links.tp``, for whichever axes the mesh declares; ``host``: host <->
    device (PCIe), the slowest in the cluster."""
    axes: dict
    host: Link

    def __post_init__(self):
        for name, group in self.axes.items():      # links.<axis name>: a plain attribute (hot path)
            if name in ("axes", "host", "axis"):
                raise ValueError(f"an axis may not be named {name!r}")
            object.__setattr__(self, name, group)

    def axis(self, name: str) -> GroupLink:
        return self.axes[name]


def _group(cluster: Cluster, ranks: list[int]) -> GroupLink:
    nodes = {cluster.device(r).node for r in ranks}
    level = "inter" if len(nodes) > 1 else "intra"
    link = cluster.link(ranks)
    if level == "inter":   # a ring over nodes uses its ranks' adapters at once (simulator/network.py)
        link = _ring_link(cluster, ranks, link)
    return GroupLink(link, level, len(ranks))


def _ring_link(cluster: Cluster, ranks: list[int], link: Link) -> Link:
    from collections import Counter

    from autopar.simulator.network import ring_bus_bandwidth_GBps

    per_node = min(Counter(cluster.device(r).node for r in ranks).values())
    intra = min(cluster.groups[cluster.device(r).group].intra_node.bandwidth_GBps for r in ranks)
    return Link(ring_bus_bandwidth_GBps(link.bandwidth_GBps, intra, per_node), link.latency_us)


def _slowest(links: list[GroupLink]) -> GroupLink:
    return min(links, key=lambda g: (g.level != "inter", g.link.bandwidth_GBps))


def mesh_links(cluster: Cluster, mesh: Mesh) -> MeshLinks:
    """The slowest link of each axis's groups over the whole mesh, by what the axis splits
    (parallel_dims.Axis.splits): an axis that splits the layers sends between neighbouring
    stages, one that splits the batch reduces over its groups, the others (tensors, sequence)
    talk inside each layer."""
    if mesh.world_size > cluster.world_size:
        raise InfeasibleError(f"mesh {mesh.describe('{name}={size}', layout_order=True)} = {mesh.world_size} ranks "
                              f"exceeds the cluster's {cluster.world_size} devices")
    # On a homogeneous cluster every group of a kind is a translate of the first one, except
    # that groups may straddle node boundaries differently; checking the first of each pipeline
    # rank (and dp replica for tp) covers every distinct placement when gpus_per_node divides
    # the strides, and a bounded sample otherwise.
    batch = next(a.name for a in mesh.axes if a.splits == "batch")
    layers = next(a.name for a in mesh.axes if a.splits == "layers")
    nb, nl = mesh.size(batch), mesh.size(layers)
    dps = range(nb) if not cluster.homogeneous or nb * nl <= 64 else range(0, nb, max(1, nb // 8))
    innermost = {a.name: 0 for a in mesh.axes if a.innermost}
    out = {}
    for a in mesh.axes:
        if a.splits == "layers":
            # a pipeline sends point to point between neighbouring stages: each pair of the first group
            pipe = mesh.group(a.name)
            groups = ([_group(cluster, [x, y]) for x, y in zip(pipe, pipe[1:])]
                      or [GroupLink(cluster.groups[0].intra_node, "intra", 1)])
        elif a.splits == "batch":
            groups = [_group(cluster, list(g)) for g in mesh.groups(a.name, **{k: v for k, v in innermost.items()
                                                                               if k != a.name})]
        else:
            groups = [_group(cluster, list(mesh.group(a.name, mesh.rank_at(**{batch: d, layers: p}))))
                      for d in dps for p in range(nl)]
        out[a.name] = _slowest(groups)
    host = min((g.host_to_device for g in cluster.groups), key=lambda link: link.bandwidth_GBps)
    return MeshLinks(out, host)


def stage_groups(cluster: Cluster, mesh: Mesh, pp_rank: int) -> set[int]:
    """Indices of the cluster's node groups holding ranks of pipeline rank ``pp_rank``."""
    if cluster.homogeneous:
        return {0}
    return {cluster.device(r).group for r in mesh.ranks_where(pp=pp_rank)}


def node_stage_counts(cluster: Cluster, mesh: Mesh) -> tuple[np.ndarray, np.ndarray]:
    """(counts, host_bytes): per distinct node, how many of its devices run each pipeline rank
    (nodes x pp) and the node's host memory.  The mesh's ranks fill the cluster's devices in order
    (``mesh.coord(r, "pp")`` is rank r's pipeline rank); nodes with the same row are listed once, so
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
    pp_rank = mesh.coord(np.arange(world), "pp")
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
