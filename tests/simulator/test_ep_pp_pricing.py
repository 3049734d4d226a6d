"""Expert parallelism priced under a pipeline (simulator/ep_cost.py through layer_cost and
topology): ep borrows the dp ranks of one pipeline stage (core/parallel_dims.ParallelDims.ep_group:
same pp and tp coordinates), so its all-to-alls run between ranks a pipeline's stride apart --
checked against closed forms computed here from the model's dimensions and the cluster's links."""
from __future__ import annotations

import pytest

from autopar.core.capture import capture_model_file
from autopar.core.cluster import load_cluster
from autopar.core.plan import LayerPlan, Mesh
from autopar.core.sharding import propagate
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.step.layer_cost import compute_layer_cost
from autopar.simulator.device.topology import mesh_links

# tests/zoo/hf_mixtral.py: hidden 32, ffn 64, 4 experts, top 2, seq 8
HIDDEN, FFN, EXPERTS, TOP_K, SEQ = 32, 64, 4, 2, 8
BF16 = 2


@pytest.fixture(scope="module")
def mixtral():
    return capture_model_file("tests/zoo/hf_mixtral.py", {"seq": SEQ}, 1)


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-16x8"), CostModel.from_profile("h100-sxm")


def _cost(graph, mesh, cluster, cm):
    i = next(i for i, layer in enumerate(graph.layers) if layer.kind not in ("pre", "post"))
    layout = propagate(graph, i, {}, mesh.tp, mesh.sequence_parallel)
    return compute_layer_cost(graph, i, layout, LayerPlan(layer=i), mesh, 1, "bf16", cm, mesh_links(cluster, mesh))


def test_ep_pairs_a_pipeline_stride_apart_cross_the_network(mixtral, h100):
    """dp 2 x pp 8 on h100-16x8 (ranks arange(16).view(dp, pp)): stage p's ep pair is {p, 8 + p},
    one rank on each node, so each dispatch / combine sends half of its T x k x h buffer to the
    peer over the rank's share of the network with one network latency (ep_cost.all_to_all_s with
    no peer on the node); the same pair without a pipeline (dp 2, ep 2) shares a node."""
    cluster, cm = h100
    mesh = Mesh(dp=2, pp=8, ep=2)
    assert mesh.ep_group(0) == (0, 8) and mesh.ep_group(3) == (3, 11)
    links = mesh_links(cluster, mesh)
    assert links.ep.level == "inter" and links.ep_ranks_per_node == 1
    assert mesh_links(cluster, Mesh(dp=2, ep=2)).ep.level == "intra"
    message = SEQ * TOP_K * HIDDEN * BF16
    net = cluster.inter_node
    t = 0.5 * message / (net.bandwidth_Bps * cm.collective_efficiency["inter"]) + net.latency_s
    one, two = _cost(mixtral, Mesh(dp=2, pp=8), cluster, cm), _cost(mixtral, mesh, cluster, cm)
    assert two.ep_comm_fwd_s - one.ep_comm_fwd_s == pytest.approx(2 * t, rel=1e-9)
    assert two.ep_comm_bwd_s - one.ep_comm_bwd_s == pytest.approx(2 * t, rel=1e-9)
    assert two.tp_wire_bytes - one.tp_wire_bytes == pytest.approx(4 * message / 2)
    # the all-to-alls apart, for DualPipeV's pairs (axes/pp.expert_all_to_all_times)
    assert (one.ep_comm_fwd_s, one.ep_a2a_bwd_s) == (0.0, 0.0)
    assert (two.ep_comm_fwd_s, two.ep_a2a_bwd_s) == (pytest.approx(2 * t, rel=1e-9), pytest.approx(2 * t, rel=1e-9))
    # the stage's rank holds half of its layer's experts
    experts = EXPERTS * (HIDDEN * 2 * FFN + FFN * HIDDEN)
    assert one.param_numel - two.param_numel == pytest.approx(experts / 2)


def test_a_layers_ep_terms_do_not_depend_on_the_pipeline_inside_a_node(mixtral, h100):
    """Where the ep pair stays on one node (dp 2 x pp 2 x ep 2 on 4 ranks of a node of 8), a
    layer's all-to-alls and expert split per micro-batch are those of dp 2 x ep 2: the pipeline
    only decides which stage's rank runs the layer."""
    cluster, cm = h100
    flat, piped = _cost(mixtral, Mesh(dp=2, ep=2), cluster, cm), _cost(mixtral, Mesh(dp=2, pp=2, ep=2), cluster, cm)
    for field in ("ep_comm_fwd_s", "ep_comm_bwd_s", "tp_comm_fwd_s", "tp_comm_bwd_s", "tp_wire_bytes", "param_numel"):
        assert getattr(piped, field) == pytest.approx(getattr(flat, field), rel=1e-12), field


def test_a_full_recompute_reruns_the_forward_all_to_alls_in_backward(mixtral, h100):
    """Of a fully recomputed layer's backward, the all-to-alls are its own two and the rerun
    forward's two (runtime: the recomputed forward exchanges its tokens again)."""
    cluster, cm = h100
    mesh = Mesh(dp=2, pp=8, ep=2)
    i = next(i for i, layer in enumerate(mixtral.layers) if layer.kind not in ("pre", "post"))
    layout = propagate(mixtral, i, {}, 1, False)
    full = compute_layer_cost(mixtral, i, layout, LayerPlan(layer=i, recompute="full"), mesh, 1, "bf16", cm,
                              mesh_links(cluster, mesh))
    assert full.ep_a2a_bwd_s == pytest.approx(2 * full.ep_comm_fwd_s, rel=1e-12) and full.ep_comm_fwd_s > 0


@pytest.fixture(scope="module")
def moe4():
    """tests/zoo/moe.py with four blocks: one per model chunk of pp 2 in a V."""
    return capture_model_file("tests/zoo/moe.py", {"layers": 4}, 1)


def test_dualpipev_prices_its_pairs_with_the_all_to_alls_hidden(moe4, h100, monkeypatch):
    """The evaluator hands DualPipeV's pipeline the chunks' all-to-alls (the layer table's
    ep_a2a columns summed per chunk) and prices the pairs overlapped: the step is shorter than
    with the pairs' passes one after the other by exactly what pp_zero_bubble.split_backward_time
    says of the same chunks; other schedules and plans without ep get none."""
    import autopar.simulator.axes.pp as pp_axis
    import autopar.simulator.step.compose as compose
    from autopar.simulator.configure import config_plan
    from autopar.simulator.simulate import simulate_plan

    cluster, cm = h100
    calls = []
    real = pp_axis.split_backward_time

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(pp_axis, "split_backward_time", spy)
    kw = dict(micro_batch=1, global_batch=8, virtual_stages=2, zero=0, recompute="none", offload="none",
              precision="bf16", sequence_parallel=False)
    plan = config_plan(moe4, degrees={"dp": 2, "pp": 2, "ep": 2}, schedule="dualpipev", **kw)
    on = simulate_plan(moe4, plan, cluster, cm).step_time_s
    args, kwargs = calls[-1]
    assert kwargs["overlap_a2a"] and kwargs["a2a_f_vp"].min() >= 0 and kwargs["a2a_f_vp"].sum() > 0
    monkeypatch.setattr(compose, "expert_all_to_all_times", lambda ctx, rows: None)
    off = simulate_plan(moe4, plan, cluster, cm).step_time_s
    assert not calls[-1][1]["overlap_a2a"]
    hidden = real(*args, **kwargs) - real(*args, **{**kwargs, "overlap_a2a": False})
    assert hidden < 0 and on - off == pytest.approx(hidden, rel=1e-9)
    monkeypatch.undo()
    monkeypatch.setattr(pp_axis, "split_backward_time", spy)
    for other in (config_plan(moe4, degrees={"dp": 2, "pp": 2}, schedule="dualpipev", **kw),
                  config_plan(moe4, degrees={"dp": 2, "pp": 2, "ep": 2}, schedule="zbv", **kw)):
        simulate_plan(moe4, other, cluster, cm)
        assert not calls[-1][1]["overlap_a2a"]
