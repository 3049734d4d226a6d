"""The cluster's data classes: node groups of GPUs and the links between them.

Data classes only; ``core/cluster_file.py`` reads and validates a YAML file into them, and
``core/cluster.py`` offers both under one name.  Units are spelled in the names: ``*_GBps`` is
10^9 bytes per second in one direction, ``*_us`` microseconds, ``*_bytes`` bytes.

Ranks are numbered group by group, node by node, GPU by GPU: rank r sits on node
``r // gpus_per_node`` of a homogeneous cluster.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, replace
from typing import Iterator

BACKENDS = ("nccl", "gloo")
#: the most devices a cluster may have (2^17 = 131072): above the largest training clusters
#: built (~10^5 GPUs), and a bound on every per-rank loop of the simulator and the planner,
#: so a typo like ``nodes: 1000000000000`` is refused instead of exhausting memory.
MAX_DEVICES = 2**17


@dataclass(frozen=True)
class Link:
    bandwidth_GBps: float     # per GPU, per direction
    latency_us: float

    @property
    def bandwidth_Bps(self) -> float:
        return self.bandwidth_GBps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class Nvme:
    """A node's local NVMe tier (cluster file ``nvme:``; runtime/nvme_tier.py keeps optimizer
    states in files there): its folder, capacity and sequential bandwidths, per node -- all the
    node's drives together (a RAID 0 or the drives' sum), as ``autopar profile --disk`` measures."""
    path: str                 # the folder on every node of the group (the runtime's --nvme-path)
    capacity_bytes: int       # per node
    read_GBps: float          # per node, sequential
    write_GBps: float         # per node, sequential

    @property
    def read_Bps(self) -> float:
        return self.read_GBps * 1e9

    @property
    def write_Bps(self) -> float:
        return self.write_GBps * 1e9


@dataclass(frozen=True)
class NodeGroup:
    name: str
    gpu: str                  # key into profiles/ ("a100-80gb-sxm", "h100-sxm", "h200", "local-cpu")
    nodes: int
    gpus_per_node: int
    gpu_memory_bytes: int     # usable memory per device
    intra_node: Link          # GPU <-> GPU inside a node (NVLink / NVSwitch, or shared memory for CPU)
    host_memory_bytes: int    # per node
    host_to_device: Link      # per GPU (PCIe), for offload
    # devices of one node that can compute at the same time; 0 = all of them (a GPU each).
    # A CPU group whose "devices" are processes sharing the node's cores sets
    # physical cores / threads per process: more busy devices than this share the cores.
    compute_slots: int = 0
    # environment variables the launch scripts export on this group's nodes (network interfaces,
    # NCCL settings): (name, value) pairs, in the file's order; they override the cluster's own
    env: tuple[tuple[str, str], ...] = ()
    nvme: Nvme | None = None  # the node's NVMe tier, when the cluster file gives one

    @property
    def num_devices(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Device:
    rank: int
    group: int                # index into Cluster.groups
    node: int                 # global node index
    local_rank: int


@dataclass(frozen=True)
class Cluster:
    name: str
    groups: tuple[NodeGroup, ...]
    inter_node: Link          # per GPU share of the node's network (InfiniBand / Ethernet)
    backend: str = "nccl"     # "nccl" on GPUs, "gloo" on CPU
    source: str = ""          # the file it was read from
    env: tuple[tuple[str, str], ...] = ()   # exported on every node by the launch scripts (cluster file 'env')

    @property
    def world_size(self) -> int:
        return sum(g.num_devices for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def homogeneous(self) -> bool:
        return len(self.groups) == 1

    @property
    def gpus_per_node(self) -> int:
        """GPUs per node; for a heterogeneous cluster the smallest node's count."""
        return min(g.gpus_per_node for g in self.groups)

    def node_env(self, group: int = 0) -> dict[str, str]:
        """The environment a node of ``groups[group]`` runs with: the cluster's ``env``, then
        the group's own (which wins where both name a variable)."""
        return {**dict(self.env), **dict(self.groups[group].env)}

    def ranks_per_node(self, world_size: int) -> list[int] | None:
        """Ranks on each node a job of ``world_size`` ranks uses -- ranks fill the devices in
        order, so it uses the first nodes, the last one perhaps partly -- or None when the
        cluster has fewer devices."""
        counts: list[int] = []
        left = world_size
        for g in self.groups:
            take = min(g.nodes, -(-left // g.gpus_per_node)) if left > 0 else 0
            counts += [g.gpus_per_node] * take
            left -= take * g.gpus_per_node
        if left > 0:
            return None
        if counts:
            counts[-1] += left                       # left <= 0: the last node is partly used
        return counts

    def nvme_missing(self) -> str | None:
        """Why the cluster has no NVMe tier to plan on (a node group without an ``nvme`` entry),
        or None when every group has one."""
        missing = [g.name for g in self.groups if g.nvme is None]
        if not missing:
            return None
        return (f"cluster {self.name} gives no nvme entry for node group {missing[0]!r}; add "
                f"'nvme: {{path: ..., capacity_GB: ..., read_GBps: ..., write_GBps: ...}}' to each group "
                f"(autopar profile --disk PATH measures a disk; docs/cluster-file.md)")

    @property
    def min_gpu_memory_bytes(self) -> int:
        return min(g.gpu_memory_bytes for g in self.groups)

    def devices(self) -> Iterator[Device]:
        rank = node = 0
        for gi, g in enumerate(self.groups):
            for _ in range(g.nodes):
                for local in range(g.gpus_per_node):
                    yield Device(rank, gi, node, local)
                    rank += 1
                node += 1

    @functools.cached_property
    def _device_table(self) -> tuple[Device, ...]:
        """Every device by rank (``devices``), built once: the simulator's topology asks for
        thousands of ranks per mesh (simulator/topology.py)."""
        return tuple(self.devices())

    def device(self, rank: int) -> Device:
        table = self._device_table
        if not 0 <= rank < len(table):
            raise IndexError(f"rank {rank} outside a cluster of {self.world_size} devices")
        return table[rank]

    def group_of(self, rank: int) -> NodeGroup:
        return self.groups[self.device(rank).group]

    def link(self, ranks: "list[int] | tuple[int, ...]") -> Link:
        """The slowest link a collective over ``ranks`` crosses (it sets the pace)."""
        devs = [self.device(r) for r in ranks]
        if len({d.node for d in devs}) > 1:
            return self.inter_node
        return min((self.groups[d.group].intra_node for d in devs), key=lambda link: link.bandwidth_GBps)

    def with_memory_headroom(self, fraction: float) -> "Cluster":
        """The cluster as a plan is searched and priced against: each device's memory less
        ``fraction`` of it (planner/headroom.py says why and how much)."""
        if fraction <= 0:
            return self
        return replace(self, groups=tuple(replace(g, gpu_memory_bytes=int(g.gpu_memory_bytes * (1.0 - fraction)))
                                          for g in self.groups))

    def scaled(self, nodes: int) -> "Cluster":
        """The same homogeneous cluster with ``nodes`` nodes (for what-if questions, --nodes)."""
        from autopar.core.errors import ClusterFileError

        if not self.homogeneous:
            raise ClusterFileError(
                f"cluster {self.name} ({self.source}) has {len(self.groups)} node groups; --nodes scales only a "
                f"cluster with one group. Edit the groups' 'nodes' fields in the file instead.")
        if nodes < 1:
            raise ClusterFileError(f"--nodes is {nodes}; it must be a positive number of nodes.")
        if nodes * self.groups[0].gpus_per_node > MAX_DEVICES:
            raise ClusterFileError(
                f"--nodes {nodes} gives {nodes * self.groups[0].gpus_per_node} devices "
                f"({self.groups[0].gpus_per_node} per node); autopar plans clusters of at most {MAX_DEVICES} "
                f"devices, i.e. --nodes up to {MAX_DEVICES // self.groups[0].gpus_per_node} here.")
        return replace(self, groups=(replace(self.groups[0], nodes=nodes),), name=f"{self.name}@{nodes}nodes")

