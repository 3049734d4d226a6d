"""A selectively recomputed layer keeps its collectives' outputs (autopar's runtime saves them,
runtime/recompute.py; tests/integration/test_collective_counts.py counts that it reruns
none): the layer's saved bytes against closed forms from the model's dimensions, and no
collective added to the layer's backward.  torchtitan's 2024 policy keeps only the
reduce-scatters and reruns the all-gathers (simulator/selective_mm_policy.py): priced so."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.core.capture import capture_model_file
from autopar.core.cluster import load_cluster
from autopar.core.plan import LayerPlan, Mesh
from autopar.core.sharding import propagate
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.step.layer_cost import compute_layer_cost
from autopar.simulator.device.training_code import AUTOPAR
from autopar.simulator.device.topology import mesh_links

# examples/gpt.py, one block: hidden 32, seq 16, micro-batch 2; its linears have biases (addmm)
GPT = {"layers": 1, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64, "dropout": 0.0, "attention": "sdpa"}
B, S, H = 2, 16, 32
STYLES = (("blocks.0.attn.qkv", "colwise"), ("blocks.0.attn.proj", "rowwise"),
          ("blocks.0.mlp.fc", "colwise"), ("blocks.0.mlp.proj", "rowwise"))
# tests/zoo/moe.py: hidden 32, top 2 of 4 experts, seq 8
MOE_H, MOE_K, MOE_S = 32, 2, 8
BF16 = 2


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-16x8"), CostModel.from_profile("h100-sxm")


def _cost(graph, i, mesh, recompute, cluster, cm, styles=(), micro_batch=B):
    layout = propagate(graph, i, dict(styles), mesh.tp, mesh.sequence_parallel)
    return compute_layer_cost(graph, i, layout, LayerPlan(layer=i, tp=styles, recompute=recompute), mesh,
                              micro_batch, "bf16", cm, mesh_links(cluster, mesh))


@pytest.fixture(scope="module")
def gpt():
    return capture_model_file("examples/gpt.py", GPT, 1)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_block_keeps_its_collectives_outputs_by_hand(gpt, h100, sp):
    """One BSH = B x S x H bf16 elements.  Kept: the block's input (1, 1/2 under SP), the matmul
    outputs on the rank -- qkv 3/2, attention 1/2, fc 4/2, and the row-wise projections' partial
    sums 1 each (1/2 each under SP) -- and the collectives' outputs: without SP the two
    all-reduced projections (1 each); with SP the two all-gathered norm outputs (1 each) and the
    two reduce-scattered projections (1/2 each)."""
    cluster, cm = h100
    mesh = Mesh(dp=1, tp=2, sequence_parallel=sp)
    bsh = B * S * H * BF16
    want = (0.5 + 1.5 + 0.5 + 0.5 + 2 + 0.5 + 3.0) if sp else (1 + 1.5 + 0.5 + 1 + 2 + 1 + 2.0)
    sel = _cost(gpt, 1, mesh, "selective", cluster, cm, STYLES)
    assert sel.activation_bytes == pytest.approx(want * bsh)
    # no collective rerun in backward: the same tensor-parallel traffic and meetings as without recompute
    none = _cost(gpt, 1, mesh, "none", cluster, cm, STYLES)
    assert sel.tp_wire_bytes == pytest.approx(none.tp_wire_bytes)
    assert sel.meetings == none.meetings


def test_torchtitan_policy_keeps_the_reduce_scatters_and_reruns_the_all_gathers(gpt, h100):
    """torchtitan 9dec370 (its tp always sequence-parallel): the reduce-scatters' outputs kept
    (1/2 BSH each), the two all-gathers of a full BSH rerun in backward: 2 x (tp-1)/tp x BSH on
    the wire (ring, Patarasuk & Yuan 2009) and two more meetings.  The GPT's linears have biases,
    so its every-other-mm rule reruns none of them (selective_mm_policy.is_plain_mm)."""
    cluster, cm = h100
    tt = cm.for_code(dataclasses.replace(AUTOPAR, selective_mm_policy="every_other"))
    mesh = Mesh(dp=1, tp=2, sequence_parallel=True)
    bsh = B * S * H * BF16
    sel = _cost(gpt, 1, mesh, "selective", cluster, tt, STYLES)
    none = _cost(gpt, 1, mesh, "none", cluster, tt, STYLES)
    assert sel.activation_bytes == pytest.approx((0.5 + 1.5 + 0.5 + 0.5 + 2 + 0.5 + 1.0) * bsh)
    assert sel.tp_wire_bytes - none.tp_wire_bytes == pytest.approx(2 * 0.5 * bsh)
    assert sel.meetings == none.meetings + 2
    assert sel.recompute_s > _cost(gpt, 1, mesh, "selective", cluster, cm, STYLES).recompute_s


def test_ep_block_keeps_dispatch_and_combine_outputs_by_hand(h100):
    """ep 2 adds to a selectively recomputed MoE block what the dispatch and the combine return on
    the rank, T x k rows of h elements each (T = micro-batch x seq tokens); without recompute and
    at ep 1 nothing changes."""
    cluster, cm = h100
    graph = capture_model_file("tests/zoo/moe.py", {}, 1)
    i = next(j for j, layer in enumerate(graph.layers) if layer.kind not in ("pre", "post"))
    one, two = Mesh(dp=2), Mesh(dp=2, ep=2)
    buffers = 2 * (B * MOE_S) * MOE_K * MOE_H * BF16
    sel1, sel2 = (_cost(graph, i, m, "selective", cluster, cm) for m in (one, two))
    assert sel2.activation_bytes - sel1.activation_bytes == pytest.approx(buffers)
    none1, none2 = (_cost(graph, i, m, "none", cluster, cm) for m in (one, two))
    assert none2.activation_bytes == none1.activation_bytes
    assert sel2.tp_wire_bytes == pytest.approx(none2.tp_wire_bytes)
    assert sel2.meetings == none2.meetings
