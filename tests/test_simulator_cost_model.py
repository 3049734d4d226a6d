"""Cost model against the ring formulas (Thakur et al. 2005; Patarasuk & Yuan 2009) and roofline."""
import math

import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.core.plan import Mesh
from autopar.simulator.cost_model import CostModel
from autopar.simulator.topology import mesh_links

PROFILE = dict(name="t", memory_bandwidth_Bps=1e12, peak_flops={"fp32": 1e13, "bf16": 1e14},
               efficiency={"linear": 0.5, "memory_bound": 0.5}, collective_efficiency={"intra": 1.0, "inter": 1.0})
INTRA = Link(bandwidth_GBps=100.0, latency_us=2.0)
INTER = Link(bandwidth_GBps=10.0, latency_us=8.0)


def _cluster(nodes=2, gpus=4):
    g = NodeGroup("n", "t", nodes, gpus, 80 * 2**30, INTRA, 2**40, Link(20.0, 10.0))
    return Cluster("c", (g,), INTER)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_collectives_match_closed_forms(n):
    cm = CostModel.from_profile(PROFILE)
    m = 256e6
    a, b = INTRA.latency_s, 1 / INTRA.bandwidth_Bps
    assert cm.collective_time("all_reduce", m, n, INTRA) == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * m * b)
    for kind in ("all_gather", "reduce_scatter"):
        assert cm.collective_time(kind, m, n, INTRA) == pytest.approx((n - 1) * a + (n - 1) / n * m * b)
    assert cm.collective_time("p2p", m, 2, INTRA) == pytest.approx(a + m * b)
    # tree: 2 log2 N latencies
    assert cm.collective_time("all_reduce", 8, n, INTRA, algorithm="tree") == pytest.approx(
        2 * math.ceil(math.log2(n)) * a + 2 * 8 * b)
    assert cm.collective_time("all_reduce", m, 1, INTRA) == 0.0


def test_group_spanning_two_nodes_pays_inter_node_link():
    cl = _cluster(nodes=2, gpus=4)
    cm = CostModel.from_profile(PROFILE)
    inside = mesh_links(cl, Mesh(dp=1, tp=4, pp=1))
    assert inside.tp.level == "intra" and inside.tp.link == INTRA
    spanning = mesh_links(cl, Mesh(dp=1, tp=8, pp=1))
    # a ring with 4 ranks on each node moves its inter-node traffic through their 4 adapters at
    # once (simulator/network.py), bounded by the node link
    bw_GBps = min(INTRA.bandwidth_GBps, 4 * INTER.bandwidth_GBps)
    assert spanning.tp.level == "inter" and spanning.tp.link == Link(bw_GBps, INTER.latency_us)
    m = 100e6
    t = cm.collective_time("all_reduce", m, 8, spanning.tp.link, spanning.tp.level)
    assert t == pytest.approx(14 * INTER.latency_s + 2 * 7 / 8 * m / (bw_GBps * 1e9))
    # one rank a node (a pipeline pair across nodes) keeps one adapter
    pairs = mesh_links(cl, Mesh(dp=1, tp=1, pp=8))        # ranks 3 -> 4 cross the nodes
    assert pairs.pp.level == "inter" and pairs.pp.link == INTER
    # dp over 2 ranks with tp=4 inside each node crosses the nodes
    dp_links = mesh_links(cl, Mesh(dp=2, tp=4, pp=1))
    assert dp_links.dp.level == "inter" and dp_links.tp.level == "intra"


def test_roofline_and_measured_table_monotone():
    cm = CostModel.from_profile(PROFILE)
    t, measured = cm.compute_time_ex("linear", 1e12, 1e6, "bf16")
    assert not measured and t == pytest.approx(1e12 / (1e14 * 0.5))
    t, _ = cm.compute_time_ex("elementwise", 1e6, 1e9, "bf16")
    assert t == pytest.approx(1e9 / (1e12 * 0.5))
    table = [{"kind": "linear", "dtype": "bf16", "flops": f, "bytes": 0, "seconds": s, "shape": []}
             for f, s in [(1e9, 1e-4), (1e10, 5e-4), (1e11, 4e-4), (1e12, 4e-3)]]  # a noisy dip at 1e11
    cm2 = CostModel.from_profile({**PROFILE, "op_table": table})
    xs = [10 ** (k / 4) for k in range(32, 52)]
    ys = [cm2.compute_time_ex("linear", x, 0, "bf16")[0] for x in xs]
    assert all(b >= a for a, b in zip(ys, ys[1:])), "interpolated op time must not decrease with size"
    assert cm2.compute_time_ex("linear", 1e9, 0, "bf16") == (pytest.approx(1e-4), True)
    assert cm2.compute_time_ex("linear", 2e12, 0, "bf16")[0] == pytest.approx(8e-3)   # constant throughput beyond
    # a kind without rows stays estimated
    assert cm2.compute_time_ex("matmul", 1e9, 0, "bf16")[1] is False


def test_measured_collective_table_wins():
    rows = [{"op": "all_reduce", "bytes": b, "group_size": 8, "level": "intra", "seconds": s}
            for b, s in [(1e6, 1e-4), (1e8, 2e-3)]]
    cm = CostModel.from_profile({**PROFILE, "collective_table": rows})
    t, measured = cm.collective_time_ex("all_reduce", 1e7, 8, INTRA, "intra")
    assert measured and 1e-4 < t < 2e-3
    assert cm.collective_time_ex("all_reduce", 1e7, 4, INTRA, "intra")[1] is False


def test_wave_quantisation():
    cm = CostModel.from_profile({**PROFILE, "num_sms": 108, "gemm_tile": [256, 128]})
    assert cm.wave_efficiency(256 * 108, 128) == pytest.approx(1.0)
    # 109 tiles need two waves: 109 / 216 of the issued work is useful
    assert cm.wave_efficiency(256 * 109, 128) == pytest.approx(109 / 216)
