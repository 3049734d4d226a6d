"""Which link each parallel group of a mesh crosses on a cluster.

Ranks are laid out over the named axes of ``core/parallel_dims.py``
(``arange(world).view(dp, pp, cp, tp)``), so a tensor-parallel group is a run of consecutive ranks,
a context-parallel group strides by ``tp``, a pipeline pair is ``cp * tp`` ranks apart and a
data-parallel group strides by ``pp * cp * tp``; the groups come from ``ParallelDims.group``/
``groups``.  Gradients and FSDP shards span dp x cp (ParallelDims.GROUPS["grad"], the runtime's get_mesh("grad"), as
torchtitan shards), so ``dp`` is that flattened group; an expert-parallel group is
``ParallelDims.ep_group`` and the experts' own data-parallel group (``ep_dp``) the dp x cp
ranks with the same place in their ep groups.  A group on one node uses the node's link
(the slowest GPU's link in a heterogeneous node group); a group that spans nodes pays the
inter-node link, which then sets the pace of the whole ring (the alpha-beta model of cost_model.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.core.cluster import Cluster, Link
from autopar.core.errors import InfeasibleError
from autopar.core.plan import Mesh
from autopar.simulator.device.network import ring_bus_bandwidth_GBps


@dataclass(frozen=True)
class GroupLink:
    link: Link
    level: str          # "intra" | "inter"
    size: int


@dataclass(frozen=True)
class MeshLinks:
    """The slowest link of each axis's groups, keyed by axis name (core/parallel_dims.py): read as
    ``links.axis("tp")`` or ``links.tp``, for whichever axes the mesh declares; ``host``: host <->
    device (PCIe), the slowest in the cluster.  The batch axis's link is that of the groups the
    gradients and FSDP shards span: dp x cp flattened when a sequence axis splits too
    (ParallelDims.GROUPS["grad"], the runtime's get_mesh("grad")).  Expert parallelism borrows dp x cp ranks (no axis of its own,
    ``ParallelDims.ep``): its links are the optional fields, None when ep = 1."""
    axes: dict
    host: Link
    ep: GroupLink | None = None        # the expert-parallel group (all-to-all); None when ep = 1
    ep_dp: GroupLink | None = None     # the experts' gradient / FSDP group (dp x cp / ep ranks)
    ep_ranks_per_node: int = 1         # ranks of one ep group on one node (the fewest over nodes)
    ep_intra: Link | None = None       # the node link of the ep group's ranks
    ep_network: Link | None = None     # one GPU's share of the network, where an ep group spans nodes

    def __post_init__(self):
        reserved = {"axes", "host", "axis"} | {f for f in self.__dataclass_fields__}
        for name, group in self.axes.items():      # links.<axis name>: a plain attribute (hot path)
            if name in reserved:
                raise ValueError(f"an axis may not be named {name!r}")
            object.__setattr__(self, name, group)

    def axis(self, name: str) -> GroupLink:
        return self.axes[name]


def world_link(cluster: Cluster, mesh: Mesh) -> GroupLink:
    """The link of one group of every rank of the mesh (e.g. the gradient norm's all-reduce,
    runtime/grad_norm.py): the inter-node link when the mesh spans nodes."""
    return _group(cluster, list(range(mesh.world_size)))


def _group(cluster: Cluster, ranks: list[int]) -> GroupLink:
    return _uniform_group(cluster, ranks) if cluster.homogeneous else _device_group(cluster, ranks)


def _device_group(cluster: Cluster, ranks: list[int]) -> GroupLink:
    """The link of the group ``ranks`` from each rank's device (any cluster)."""
    devs = [cluster.device(r) for r in ranks]
    nodes = {d.node for d in devs}
    if len(nodes) == 1:
        return GroupLink(cluster.link(ranks), "intra", len(ranks))
    # a ring over nodes uses its ranks' adapters at once (simulator/network.py); the group's
    # slowest link is the inter-node one (Cluster.link)
    return GroupLink(_ring_link(cluster, devs, cluster.inter_node), "inter", len(ranks))


def _uniform_group(cluster: Cluster, ranks: list[int]) -> GroupLink:
    """``_group`` on a cluster of one node group, by arithmetic: rank r is on node
    r // gpus_per_node (ranks fill the nodes in order: Cluster.devices), every device has the
    group's node link, so a group on one node has that link and one over nodes the ring's
    (``_ring_link``)."""
    g = cluster.groups[0]
    gpn = g.gpus_per_node
    lo, hi = min(ranks), max(ranks)
    if lo < 0 or hi >= g.num_devices:
        cluster.device(hi if lo >= 0 else lo)           # raises Cluster.device's IndexError
    if lo // gpn == hi // gpn:
        return GroupLink(g.intra_node, "intra", len(ranks))
    link = cluster.inter_node
    bw = ring_bus_bandwidth_GBps(link.bandwidth_GBps, g.intra_node.bandwidth_GBps, _fewest_per_node(ranks, gpn))
    return GroupLink(Link(bw, link.latency_us), "inter", len(ranks))


def _fewest_per_node(ranks, gpus_per_node: int) -> int:
    """The fewest of ``ranks`` on one of the nodes they use (a cluster of one node group)."""
    from collections import Counter

    return min(Counter(r // gpus_per_node for r in ranks).values())


def _ring_link(cluster: Cluster, devs: list, link: Link) -> Link:
    from collections import Counter

    from autopar.simulator.device.network import ring_bus_bandwidth_GBps

    per_node = min(Counter(d.node for d in devs).values())
    intra = min(cluster.groups[g].intra_node.bandwidth_GBps for g in {d.group for d in devs})
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
        elif a.name == mesh.GROUPS["grad"][0] and mesh.grad_degree > mesh.size(a.name):
            # gradients and FSDP shards over the gradient group's axes flattened (dp x cp:
            # ParallelDims.GROUPS["grad"], the runtime's get_mesh("grad")), one group per pipeline stage
            groups = [_group(cluster, list(mesh.get_group("grad", mesh.rank_at(**{layers: p})))) for p in range(nl)]
        elif a.splits == "batch":
            groups = [_group(cluster, list(g)) for g in mesh.groups(a.name, **{k: v for k, v in innermost.items()
                                                                               if k != a.name})]
        else:
            groups = [_group(cluster, list(mesh.group(a.name, mesh.rank_at(**{batch: d, layers: p}))))
                      for d in dps for p in range(nl)]
        out[a.name] = _slowest(groups)
    host = min((g.host_to_device for g in cluster.groups), key=lambda link: link.bandwidth_GBps)
    return MeshLinks(out, host, **(_ep_links(cluster, mesh, dps) if mesh.ep > 1 else {}))


def _ep_links(cluster: Cluster, mesh: Mesh, dps) -> dict:
    """The ep groups' links (``ParallelDims.ep_group``), the experts' data-parallel groups (the
    dp x cp ranks at one place of their ep groups) and how many of an ep group's ranks share a
    node (an all-to-all's traffic to ranks on the node stays on the node link: ep_cost.py)."""
    from collections import Counter

    firsts = [mesh.rank_at(dp=d, pp=p) for d in dps for p in range(mesh.pp)]
    groups = {mesh.ep_group(r) for r in firsts}
    ep = _slowest([_group(cluster, list(g)) for g in groups])
    if cluster.homogeneous:         # every device has the one group's node link (_uniform_group)
        gpn = cluster.groups[0].gpus_per_node
        per_node = min(_fewest_per_node(g, gpn) for g in groups)
        intra = cluster.groups[0].intra_node
    else:
        per_node = min(min(Counter(cluster.device(r).node for r in g).values()) for g in groups)
        intra = min((cluster.groups[cluster.device(r).group].intra_node for g in groups for r in g),
                    key=lambda link: link.bandwidth_GBps)
    out = {"ep": ep, "ep_ranks_per_node": per_node, "ep_intra": intra}
    if ep.level == "inter":
        out["ep_network"] = cluster.inter_node
    flat = mesh.grad_degree
    if flat > mesh.ep:
        rows = []
        for p in range(mesh.pp):
            ranks = mesh.ranks_where(pp=p, tp=0)      # dp x cp order: flat coordinate dp * cp + cp
            rows.append(_group(cluster, ranks[0::mesh.ep]))
        out["ep_dp"] = _slowest(rows)
    return out


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
