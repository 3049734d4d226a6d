"""The bandwidth a ring collective reaches when its group spans nodes.

NCCL runs a collective over several channels, each a ring of its own that enters and leaves
every node through a different network adapter (NCCL picks the NIC closest to the GPU of the
ring's hop; NVIDIA, "NCCL: Environment Variables", NCCL_MIN_NCHANNELS / NCCL_CROSS_NIC; nccl-tests
doc/PERFORMANCE.md, "bus bandwidth").  The data is split over the channels, so a ring that has
``r`` ranks on a node moves its inter-node traffic through those ranks' ``r`` adapters at once:
its bus bandwidth is the group's share of the node's network, ``r`` times one GPU's share,
not one GPU's share.  nccl-tests measure exactly this: an all-reduce over 3 nodes of 8 A100 with
4 HDR adapters (100 GB/s a node, 12.5 GB/s a GPU) reached 84.8 GB/s of bus bandwidth
(NVIDIA/nccl-tests issue #119), 0.85 of the node's network and 6.8 times one GPU's share.

Inside the node the ring's hops run over NVLink, so the node link bounds it too.  Groups that
place one rank per node (data parallel across tensor-parallel replicas, a pipeline send) keep
one GPU's share, as before.
"""
from __future__ import annotations


def ring_bus_bandwidth_GBps(per_gpu_network_GBps: float, intra_node_GBps: float, ranks_per_node: int) -> float:
    """Per-direction bandwidth of a ring over nodes with ``ranks_per_node`` of its ranks on each:
    min(node link, ranks_per_node x one GPU's share of the node network)."""
    if ranks_per_node <= 1:
        return per_gpu_network_GBps
    return min(intra_node_GBps, ranks_per_node * per_gpu_network_GBps)


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
