"""Megatron-Core's MoE training code as the simulator prices it (TrainingCode.ep_dispatch,
TrainingCode.distributed_optimizer): DeepEP's deduplicated dispatch and the distributed optimizer's
sharded state, against hand-computed cases."""
from __future__ import annotations

from math import comb

import pytest

from autopar.core.capture import capture_model_file
from autopar.core.cluster import load_cluster
from autopar.core.plan import LayerPlan, Mesh
from autopar.core.sharding import propagate
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.axes.ep import RoutedExperts, all_to_all_s, deepep_dispatch_s, group_hit
from autopar.simulator.step.layer_cost import compute_layer_cost
from autopar.simulator.device.topology import mesh_links
from autopar.simulator.device.training_code import TrainingCode

# tests/zoo/hf_mixtral.py: hidden 32, ffn 64, 4 experts, top 2, seq 8
HIDDEN, FFN, EXPERTS, MSEQ = 32, 64, 4, 8
BF16 = 2


@pytest.fixture(scope="module")
def mixtral():
    return capture_model_file("tests/zoo/hf_mixtral.py", {"seq": MSEQ}, 1)


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-16x8"), CostModel.from_profile("h100-sxm")


def _experts(experts: int, top_k: int, hidden: int, tokens: float) -> RoutedExperts:
    return RoutedExperts("m.experts", "stacked", experts, top_k, hidden, tokens, frozenset(), frozenset(), 0,
                         frozenset())


def test_group_hit_by_counting():
    # 4 experts, top 2, a group of 2: of the C(4,2) = 6 pairs only the other group's 1 misses it
    assert group_hit(4, 2, 2) == pytest.approx(5 / 6)
    # Qwen3-30B-A3B's routing (128 experts, top 8) against one node's 64 and one rank's 8 of ep 16
    assert group_hit(128, 8, 64) == pytest.approx(1 - comb(64, 8) / comb(128, 8))
    assert group_hit(128, 8, 8) == pytest.approx(1 - comb(120, 8) / comb(128, 8))
    # top 1: the group's share of the experts; the whole set or none: certain / impossible
    assert group_hit(16, 1, 4) == pytest.approx(4 / 16)
    assert (group_hit(16, 4, 16), group_hit(16, 4, 0)) == (1.0, 0.0)


def test_deepep_dispatch_across_two_nodes_by_hand(h100):
    """ep 16 over 2 nodes of 8, Qwen3-30B-A3B's shapes (4096 tokens, hidden 2048, 128 experts, top
    8): a token crosses the network once if the other node holds one of its experts, and NVLink once
    per destination rank but the one it lands on, on each of the 2 nodes; 15 network latencies."""
    cluster, cm = h100
    links = mesh_links(cluster, Mesh(dp=16, ep=16))
    assert links.ep.level == "inter" and links.ep_ranks_per_node == 8
    T, h = 4096, 2048
    row = T * h * BF16
    net = row * 1 * (1 - comb(64, 8) / comb(128, 8))
    nvl = row * 2 * 7 * (1 - comb(120, 8) / comb(128, 8))
    nv, ib = cluster.groups[0].intra_node, cluster.inter_node
    want = max(nvl / (nv.bandwidth_Bps * cm.collective_efficiency["intra"]),
               net / (ib.bandwidth_Bps * cm.collective_efficiency["inter"])) + 15 * ib.latency_s
    t, sent = deepep_dispatch_s(T, _experts(128, 8, h, T), 16, BF16, cm, links)
    assert t == pytest.approx(want, rel=1e-12) and sent == pytest.approx(net + nvl)
    # the plain all-to-all sends 8 copies of each token, half of them over the network: ~4x the bytes
    a2a, _ = all_to_all_s(T * 8 * h * BF16, 16, cm, links)
    assert t < a2a / 3


def test_deepep_top1_in_one_node_is_the_all_to_all(h100):
    """With top 1 nothing repeats: inside one node the deduplicated dispatch moves the all-to-all's
    (ep - 1)/ep of the buffer, and prices the same as the cost model's ring all-to-all."""
    cluster, cm = h100
    links = mesh_links(cluster, Mesh(dp=16, ep=8))
    assert links.ep.level == "intra"
    T, h = 1000, 512
    t, sent = deepep_dispatch_s(T, _experts(64, 1, h, T), 8, BF16, cm, links)
    a2a, _ = all_to_all_s(T * h * BF16, 8, cm, links)
    assert sent == pytest.approx(7 / 8 * T * h * BF16)
    assert t == pytest.approx(a2a, rel=1e-12)


def test_layer_prices_deepep_dispatch_when_the_code_says(mixtral, h100):
    cluster, base = h100
    mesh = Mesh(dp=4, ep=2)
    i = next(j for j, layer in enumerate(mixtral.layers) if layer.kind not in ("pre", "post"))
    layout = propagate(mixtral, i, {}, 1, False)

    def cost(code, m=mesh):
        return compute_layer_cost(mixtral, i, layout, LayerPlan(layer=i), m, 1, "bf16", base.for_code(code),
                                  mesh_links(cluster, m))

    plain, deep, dense = cost(TrainingCode()), cost(TrainingCode(ep_dispatch="deepep")), cost(TrainingCode(), Mesh(dp=4))
    t, _ = deepep_dispatch_s(MSEQ, _experts(EXPERTS, 2, HIDDEN, MSEQ), 2, BF16, base, mesh_links(cluster, mesh))
    assert deep.ep_comm_fwd_s - dense.ep_comm_fwd_s == pytest.approx(2 * t, rel=1e-9)   # dispatch + combine
    assert deep.ep_comm_bwd_s - dense.ep_comm_bwd_s == pytest.approx(2 * t, rel=1e-9)
    assert deep.ep_comm_fwd_s < plain.ep_comm_fwd_s


def test_distributed_optimizer_shards_state_not_traffic(mixtral, h100):
    """Megatron-Core's distributed optimizer at ZeRO-0: 2 + 2 bytes of parameter and gradient per
    parameter whole, the 12 of fp32 main weight and moments over the parameter's data-parallel ranks
    (dp 4 for the dense ones, dp 4 / ep 2 = 2 for the experts); the gradient all-reduce unchanged."""
    cluster, base = h100
    mesh = Mesh(dp=4, ep=2)
    i = next(j for j, layer in enumerate(mixtral.layers) if layer.kind not in ("pre", "post"))
    layout = propagate(mixtral, i, {}, 1, False)

    def cost(code):
        return compute_layer_cost(mixtral, i, layout, LayerPlan(layer=i), mesh, 1, "bf16", base.for_code(code),
                                  mesh_links(cluster, mesh))

    ddp, dist = cost(TrainingCode()), cost(TrainingCode(distributed_optimizer=True))
    experts = EXPERTS * 3 * HIDDEN * FFN / 2                # this rank's experts
    dense = ddp.param_numel - experts
    assert ddp.optimizer_bytes == pytest.approx(12 * (dense + experts))
    assert dist.optimizer_bytes == pytest.approx(12 * dense / 4 + 12 * experts / 2)
    assert (dist.param_bytes, dist.grad_bytes) == (ddp.param_bytes, ddp.grad_bytes)
    assert dist.dp_allreduce_s == ddp.dp_allreduce_s and dist.dp_wire_bytes_per_step == ddp.dp_wire_bytes_per_step
    assert dist.optimizer_s < ddp.optimizer_s


def test_unknown_dispatcher_refused():
    with pytest.raises(ValueError, match="ep_dispatch"):
        TrainingCode(ep_dispatch="allgather")
