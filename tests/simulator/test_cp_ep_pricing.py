"""Context and expert parallelism priced (simulator/cp_cost.py, simulator/ep_cost.py, wired into
simulator/layer_cost.py) against closed forms computed here from the model's dimensions, and the
grouped-GEMM FLOP rule (core/op_costs.py) against 2 M K N."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.core.capture import capture_model_file
from autopar.core.cluster import load_cluster
from autopar.core.plan import LayerPlan, Mesh
from autopar.core.sharding import propagate
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.axes.ep import all_to_all_s, ep_refusal, routed_experts
from autopar.simulator.step.layer_cost import compute_layer_cost
from autopar.simulator.device.topology import mesh_links

# examples/llama.py: 2 blocks, hidden 64, 4 heads (K/V repeated to 4 heads before SDPA), head dim 16
LLAMA = {"size": "llama-tiny", "seq": 64}
SEQ, HEADS, HEAD_DIM = 64, 4, 16
# tests/zoo/hf_mixtral.py: hidden 32, ffn 64, 4 experts, top 2, seq 8
MIXTRAL = {"seq": 8}
HIDDEN, FFN, EXPERTS, TOP_K, MSEQ = 32, 64, 4, 2, 8
BF16 = 2


@pytest.fixture(scope="module")
def llama():
    return capture_model_file("examples/llama.py", LLAMA, 1)


@pytest.fixture(scope="module")
def mixtral():
    return capture_model_file("tests/zoo/hf_mixtral.py", MIXTRAL, 1)


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-16x8"), CostModel.from_profile("h100-sxm")


def _block(graph) -> int:
    return next(i for i, layer in enumerate(graph.layers) if layer.kind not in ("pre", "post"))


def _cost(graph, mesh, cluster, cm, i=None, zero=0, micro_batch=1):
    i = _block(graph) if i is None else i
    layout = propagate(graph, i, {}, mesh.tp, mesh.sequence_parallel)
    return compute_layer_cost(graph, i, layout, LayerPlan(layer=i, zero=zero), mesh, micro_batch, "bf16", cm,
                              mesh_links(cluster, mesh))


def _ring(kind_factor: float, message: float, n: int, link, eff: float) -> float:
    """The alpha-beta ring collective (Patarasuk & Yuan 2009): (n-1) latencies + (n-1)/n M / bandwidth."""
    return (n - 1) * link.latency_s + kind_factor * (n - 1) / n * message / (link.bandwidth_Bps * eff)


def test_cp_exchange_compute_and_activations_by_hand(llama, h100):
    cluster, cm = h100
    one = _cost(llama, Mesh(dp=2), cluster, cm)
    two = _cost(llama, Mesh(dp=1, cp=2), cluster, cm)
    # the K/V all-gather: each rank's K and V ([1, 4 heads, 32 tokens, 16] each, bf16) gathered over
    # 2 ranks on one node's NVLink: a message of 2 x 2 x 1 x 4 x 32 x 16 x 2 bytes; backward reduce-scatter
    local_kv = 2 * HEADS * (SEQ // 2) * HEAD_DIM * BF16
    link = cluster.groups[0].intra_node
    eff = cm.collective_efficiency["intra"]
    t = _ring(1.0, 2 * local_kv, 2, link, eff)
    assert two.cp_comm_fwd_s - one.cp_comm_fwd_s == pytest.approx(t, rel=1e-9)     # cp's own columns
    assert two.cp_comm_bwd_s - one.cp_comm_bwd_s == pytest.approx(t, rel=1e-9)
    assert (two.tp_comm_fwd_s, two.tp_comm_bwd_s) == (one.tp_comm_fwd_s, one.tp_comm_bwd_s) == (0.0, 0.0)
    assert two.tp_wire_bytes == pytest.approx(2 * local_kv)          # (cp-1)/cp of the message, each way
    # every op on half the tokens
    assert two.fwd_flops == pytest.approx(one.fwd_flops / 2)
    # activations: half of each op's, plus the gathered other half of K/V (the runtime's causal
    # blocks build no mask; the [32, 64] bf16 mask is kept only by code that passes one)
    assert two.activation_bytes == pytest.approx(one.activation_bytes / 2 + local_kv)
    masked = replace(cm, code=replace(cm.code, cp_attention="explicit_mask"))
    assert _cost(llama, Mesh(dp=1, cp=2), cluster, masked).activation_bytes == pytest.approx(
        one.activation_bytes / 2 + local_kv + (SEQ // 2) * SEQ * BF16)


def test_cp_shards_state_over_dp_x_cp(llama, h100):
    cluster, cm = h100
    # FSDP over dp x cp (ParallelDims.GROUPS["grad"], the runtime's get_mesh("grad")): dp 1 x cp 4 shards as dp 4 does
    a = _cost(llama, Mesh(dp=1, cp=4), cluster, cm, zero=3)
    b = _cost(llama, Mesh(dp=4), cluster, cm, zero=3)
    assert a.param_bytes == pytest.approx(b.param_bytes)
    assert a.optimizer_bytes == pytest.approx(b.optimizer_bytes)
    assert a.param_bytes == pytest.approx(a.param_numel * BF16 / 4)


def test_cp_attention_runs_the_full_square_under_the_explicit_mask(llama, h100):
    """The runtime hands SDPA an explicit head-tail mask: a kernel computes every pair of the
    S/cp x S block, so a cp rank's attention is not the causal half of it."""
    from autopar.simulator.axes.cp import cp_attention_op

    att = next(o for o in llama.ops if o.kind == "attention")
    assert att.causal and not cp_attention_op(att).causal
    assert cp_attention_op(cp_attention_op(att)) == cp_attention_op(att)


def test_grouped_mm_counts_two_m_k_n(mixtral):
    # transformers 5's grouped_mm_fallback: [T*k, hidden] x [E, hidden, 2 ffn] -> 2 (T*k) hidden (2 ffn)
    rows = MSEQ * TOP_K
    gemms = [o for o in mixtral.ops if "grouped_mm" in o.target]
    assert len(gemms) == 2 * 2 and all(o.kind == "matmul" for o in gemms)
    gate_up = [o for o in gemms if o.params[0].endswith("gate_up_proj")][0]
    down = [o for o in gemms if o.params[0].endswith("down_proj")][0]
    assert gate_up.fwd_flops == 2.0 * rows * HIDDEN * 2 * FFN
    assert down.fwd_flops == 2.0 * rows * FFN * HIDDEN
    assert gate_up.bwd_flops == 2 * gate_up.fwd_flops


def test_routed_experts_recognised(mixtral, llama):
    i = _block(mixtral)
    (r,) = routed_experts(mixtral, i)
    assert (r.form, r.experts, r.top_k, r.hidden, r.tokens) == ("stacked", EXPERTS, TOP_K, HIDDEN, MSEQ)
    assert r.param_numel == EXPERTS * (HIDDEN * 2 * FFN + FFN * HIDDEN)
    assert routed_experts(llama, _block(llama)) == ()
    assert ep_refusal(mixtral, 2) is None and ep_refusal(mixtral, 4) is None
    assert "do not split into 3" in ep_refusal(mixtral, 3)
    assert "no routed experts" in ep_refusal(llama, 2)


def test_module_list_experts_recognised(tmp_path):
    """An nn.ModuleList of experts, a router Linear and a topk (the older transformers / DeepSeek
    reference form): the experts module is found from the graph's module paths."""
    src = tmp_path / "ml_moe.py"
    src.write_text('''
import torch, torch.nn as nn, torch.nn.functional as F

class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
    def forward(self, x):
        return self.down(F.relu(self.up(x)))

class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(4))
    def forward(self, x):
        w, idx = self.gate(x).topk(2, dim=-1)
        mask = torch.zeros(x.shape[:-1] + (4,), device=x.device).scatter(-1, idx, F.softmax(w, -1))
        return sum(mask[..., e:e + 1] * ex(x) for e, ex in enumerate(self.experts))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoE()
    def forward(self, x):
        return x + self.moe(x)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 32)
    def forward(self, t):
        x = self.emb(t)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

def build_model():
    return M()

def make_batch(batch_size):
    t = torch.randint(0, 32, (batch_size, 9))
    return t[:, :-1], t[:, 1:]

def loss_fn(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())
''')
    g = capture_model_file(str(src), {}, 2)
    i = _block(g)
    (r,) = routed_experts(g, i)
    assert (r.form, r.experts, r.top_k, r.hidden, r.tokens) == ("module_list", 4, 2, 16, 16)
    assert r.param_numel == 4 * (16 * 32 + 32 + 32 * 16 + 16)


def test_ep_all_to_alls_and_expert_split_by_hand(mixtral, h100):
    cluster, cm = h100
    i = _block(mixtral)
    one = _cost(mixtral, Mesh(dp=4), cluster, cm)
    two = _cost(mixtral, Mesh(dp=4, ep=2), cluster, cm)
    # dispatch and combine in forward, their gradients in backward: each an all-to-all of
    # T x k x h bf16 elements (8 tokens, top 2, hidden 32) over 2 ranks of one node
    message = MSEQ * TOP_K * HIDDEN * BF16
    t = _ring(1.0, message, 2, cluster.groups[0].intra_node, cm.collective_efficiency["intra"])
    assert two.ep_comm_fwd_s - one.ep_comm_fwd_s == pytest.approx(2 * t, rel=1e-9)     # ep's own columns
    assert two.ep_comm_bwd_s - one.ep_comm_bwd_s == pytest.approx(2 * t, rel=1e-9)
    assert (two.tp_comm_fwd_s, two.tp_comm_bwd_s) == (one.tp_comm_fwd_s, one.tp_comm_bwd_s)
    assert two.tp_wire_bytes - one.tp_wire_bytes == pytest.approx(4 * message / 2)
    # the experts split 2 ways
    experts = EXPERTS * (HIDDEN * 2 * FFN + FFN * HIDDEN)
    assert one.param_numel - two.param_numel == pytest.approx(experts / 2)
    # FSDP (ZeRO-3): the dense parameters gathered over dp 4, the experts' (their own unit) over
    # dp 4 / ep 2 = 2 ranks holding the same experts
    z = _cost(mixtral, Mesh(dp=4, ep=2), cluster, cm, zero=3)
    link, eff = cluster.groups[0].intra_node, cm.collective_efficiency["intra"]
    dense = z.param_numel - experts / 2
    want = _ring(1.0, dense * BF16, 4, link, eff) + _ring(1.0, experts / 2 * BF16, 2, link, eff)
    assert z.dp_allgather_s == pytest.approx(want, rel=1e-9)
    assert z.param_bytes == pytest.approx(dense * BF16 / 4 + experts / 2 * BF16 / 2)
    assert i >= 0


def test_ep_layer_costs_through_a_shared_work_cache_equal_fresh_ones(mixtral, h100):
    """expert_work is kept in the work cache by what it reads (ep.ep_layer_work): costs priced
    one after another through one cache, over choices and meshes that share it and some that
    do not, equal each priced alone."""
    cluster, cm = h100
    i = _block(mixtral)
    cache: dict = {}
    for mesh in (Mesh(dp=8, ep=2), Mesh(dp=4, pp=2, ep=2), Mesh(dp=8, ep=4), Mesh(dp=4, tp=2, ep=2)):
        layout = propagate(mixtral, i, {}, mesh.tp, mesh.sequence_parallel)
        links = mesh_links(cluster, mesh)
        for zero, recompute in ((0, "none"), (3, "none"), (1, "full"), (0, "selective")):
            lp = LayerPlan(layer=i, zero=zero, recompute=recompute)
            shared = compute_layer_cost(mixtral, i, layout, lp, mesh, 2, "bf16", cm, links, work_cache=cache)
            assert shared == compute_layer_cost(mixtral, i, layout, lp, mesh, 2, "bf16", cm, links), (mesh, lp)
    assert sum(1 for k in cache if k[0] == "expert_work") == 3     # one per (ep, layout)


def test_ep_all_to_all_across_nodes_by_hand(h100):
    """An ep group of 16 over 2 nodes of 8: 7/16 of the buffer to the node's other ranks over
    NVLink, 8/16 over the rank's share of the network, at once; 15 network latencies."""
    cluster, cm = h100
    mesh = Mesh(dp=16, ep=16)
    links = mesh_links(cluster, mesh)
    assert links.ep.level == "inter" and links.ep_ranks_per_node == 8
    M = 64e6
    nv, net = cluster.groups[0].intra_node, cluster.inter_node
    want = max(7 / 16 * M / (nv.bandwidth_Bps * cm.collective_efficiency["intra"]),
               8 / 16 * M / (net.bandwidth_Bps * cm.collective_efficiency["inter"])) + 15 * net.latency_s
    t, measured = all_to_all_s(M, 16, cm, links)
    assert not measured and t == pytest.approx(want, rel=1e-12)
    # inside one node: the ring formula of the cost model
    links8 = mesh_links(cluster, Mesh(dp=16, ep=8))
    assert links8.ep.level == "intra"
    assert all_to_all_s(M, 8, cm, links8)[0] == pytest.approx(_ring(1.0, M, 8, nv, cm.collective_efficiency["intra"]))


def test_ep_capacity_factor_on_the_expert_gemms(mixtral, h100):
    """With ep > 1 the busiest rank's expert GEMMs run CAPACITY_FACTOR x the mean rows; with ep 1
    the rank computes every expert on its own tokens, no imbalance."""
    from autopar.simulator.axes import ep as ep_cost

    cluster, cm = h100
    i = _block(mixtral)
    layout = propagate(mixtral, i, {}, 1, False)
    (r,) = routed_experts(mixtral, i)
    w1 = ep_cost.expert_work(mixtral, (r,), layout, 1, 1.0, "bf16", cm, {n: 0.0 for n in r.ops}, {})
    w2 = ep_cost.expert_work(mixtral, (r,), layout, 2, 1.0, "bf16", cm, {n: 0.0 for n in r.ops}, {})
    assert (w1.flops_factor, w2.flops_factor) == (1.0, ep_cost.CAPACITY_FACTOR) == (1.0, 1.25)
    assert w1.expert_fwd_flops == w2.expert_fwd_flops == 2.0 * MSEQ * TOP_K * HIDDEN * 3 * FFN
    assert w2.local_numel == r.param_numel / 2 and w1.local_numel == r.param_numel


def test_top1_router_by_max_recognised(tmp_path):
    """A Switch-style router (Fedus et al. 2022): top 1 by a max over the E scores, the experts a
    module of stacked [E, ...] parameters called with the tokens and their choice."""
    src = tmp_path / "switch.py"
    src.write_text('''
import torch, torch.nn as nn, torch.nn.functional as F

class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 16, 32))
        self.w_out = nn.Parameter(torch.randn(4, 32, 16))
    def forward(self, x, idx, w):
        h = torch.bmm(x.unsqueeze(1), self.w_in[idx])
        return torch.bmm(F.gelu(h), self.w_out[idx]).squeeze(1) * w.unsqueeze(-1)

class Switch(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = Experts()
    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(b * s, h)
        p, idx = F.softmax(self.router(x), dim=-1).max(dim=-1)
        return self.experts(x, idx, p).view(b, s, h)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.moe = Switch()
        self.head = nn.Linear(16, 32)
    def forward(self, t):
        x = self.emb(t)
        return self.head(x + self.moe(x))

def build_model():
    return M()

def make_batch(batch_size):
    t = torch.randint(0, 32, (batch_size, 9))
    return t[:, :-1], t[:, 1:]

def loss_fn(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())
''')
    g = capture_model_file(str(src), {}, 2)
    found = [r for i in range(len(g.layers)) for r in routed_experts(g, i)]
    assert [(r.module, r.form, r.experts, r.top_k, r.hidden, r.tokens) for r in found] == [
        ("moe.experts", "stacked", 4, 1, 16, 16)]
    assert found[0].param_numel == 4 * 16 * 32 * 2


def test_cp_exchange_of_tensor_parallel_heads(llama, h100):
    """Under tensor parallelism a rank holds heads / tp of K and V: its cp all-gather moves 1/tp
    of the bytes (the attention op's head split, core/sharding.propagate)."""
    from autopar.core.sharding import megatron_styles
    from autopar.simulator.axes import cp as cp_cost

    cluster, cm = h100
    i = _block(llama)
    styles = megatron_styles(llama, i)
    layout = propagate(llama, i, styles, 2, False)
    att = [o for o in llama.layer_ops(i) if o.kind == "attention"]
    assert [layout.compute_shard.get(o.name, 1) for o in att] == [2]
    link = mesh_links(cluster, Mesh(dp=1, cp=2, tp=2)).cp
    whole = cp_cost.cp_layer_terms(att, 2, 0.5, BF16, cm, link)
    split = cp_cost.cp_layer_terms(att, 2, 0.5, BF16, cm, link, shard=layout.compute_shard)
    local_kv = 2 * HEADS * (SEQ // 2) * HEAD_DIM * BF16
    assert whole.wire_fwd == local_kv and split.wire_fwd == local_kv / 2
    # the mask [S/cp, S] is not split by heads
    assert whole.saved_bytes - split.saved_bytes == pytest.approx(local_kv / 2)


def test_experts_inside_an_opaque_module_recognised_and_split(h100):
    """tests/zoo/deepseek_moe.py routes with a per-expert ``torch.where`` (data-dependent shapes),
    so capture keeps its MoE opaque (a ``leaf`` op holding the router, 4 routed experts and the
    shared expert); the experts are still found from the leaf's parameters and the ``topk`` it
    ran, and ep 2 moves only the routed experts' weights (4 SwiGLUs of 3 x 32 x 16) and adds the
    dispatch / combine all-to-alls."""
    cluster, cm = h100
    g = capture_model_file("tests/zoo/deepseek_moe.py", {}, 1)
    i = next(j for j, layer in enumerate(g.layers) if layer.name == "blocks.1")
    assert [o.kind for o in g.layer_ops(i) if o.module_path == "blocks.1.mlp"] == ["leaf"]
    (r,) = routed_experts(g, i)
    experts_numel = 4 * 3 * 32 * 16
    assert (r.module, r.form, r.experts, r.top_k, r.hidden, r.tokens, r.param_numel) == \
        ("blocks.1.mlp.experts", "module_list", 4, 2, 32, 8, experts_numel)
    assert "blocks.1.mlp.shared_experts.up_proj.weight" not in r.param_names
    assert ep_refusal(g, 2) is None and "do not split" in ep_refusal(g, 3)
    one = _cost(g, Mesh(dp=4), cluster, cm, i=i)
    two = _cost(g, Mesh(dp=4, ep=2), cluster, cm, i=i)
    assert one.param_numel - two.param_numel == pytest.approx(experts_numel / 2)
    message = 8 * 2 * 32 * BF16                     # T x k x h of one micro-batch, bf16
    t = _ring(1.0, message, 2, cluster.groups[0].intra_node, cm.collective_efficiency["intra"])
    assert two.ep_comm_fwd_s - one.ep_comm_fwd_s == pytest.approx(2 * t, rel=1e-9)
    # the dense first block has no experts
    assert routed_experts(g, next(j for j, layer in enumerate(g.layers) if layer.name == "blocks.0")) == ()


def test_cp_gather_reruns_in_recompute(llama, h100, monkeypatch):
    """A recomputed layer under cp reruns its K/V all-gather in backward, full or selective (the
    runtime's selective policy saves matmul outputs, not the gather's): the recompute's
    collective time is the forward gather's, and the bytes it sends count again."""
    import dataclasses

    from autopar.simulator.axes import cp as cp_cost

    cluster, cm = h100
    i = _block(llama)
    mesh = Mesh(dp=1, cp=2)
    layout = propagate(llama, i, {}, 1, False)
    links = mesh_links(cluster, mesh)

    def cost(mode):
        return compute_layer_cost(llama, i, layout, LayerPlan(layer=i, recompute=mode), mesh, 1, "bf16", cm, links)

    none, sel, full = cost("none"), cost("selective"), cost("full")
    local_kv = 2 * HEADS * (SEQ // 2) * HEAD_DIM * BF16
    t = _ring(1.0, 2 * local_kv, 2, cluster.groups[0].intra_node, cm.collective_efficiency["intra"])
    assert sel.tp_wire_bytes - none.tp_wire_bytes == pytest.approx(local_kv)
    assert full.tp_wire_bytes - none.tp_wire_bytes == pytest.approx(local_kv)
    # the same layer with the exchange priced at nothing: its recompute is shorter by the gather
    real = cp_cost.cp_layer_terms
    monkeypatch.setattr(cp_cost, "cp_layer_terms", lambda *a, **k: dataclasses.replace(
        real(*a, **k), fwd_s=0.0, bwd_s=0.0, wire_fwd=0.0, wire_bwd=0.0))
    assert sel.recompute_s - cost("selective").recompute_s == pytest.approx(t, rel=1e-9)
    assert full.recompute_s - cost("full").recompute_s == pytest.approx(t, rel=1e-9)
    assert none.recompute_s == cost("none").recompute_s == 0.0


def test_sequence_parallel_beside_the_router_by_hand(mixtral, h100):
    """tp 2 with sequence parallelism on a Mixtral block (attention split, experts split by
    expert): every replicated parameter read on the sequence shards -- the two RMSNorm weights
    and the router ``Linear(hidden, experts)`` -- has its gradient all-reduced over tp backward,
    a message of its fp32 bytes whatever the batch (runtime/apply_tp._sum_replicated_grads);
    the experts all-gather their token rows and routing weights forward and reduce-scatter their
    output (runtime/expert_tp.ExpertShard), no all-reduce."""
    from autopar.core.sharding import megatron_styles
    from autopar.simulator.axes.tp import tensor_parallel as _tensor_parallel

    cluster, cm = h100
    i = _block(mixtral)
    layout = propagate(mixtral, i, megatron_styles(mixtral, i), 2, True)
    grads = sorted(c.bytes for c in layout.collectives if not c.per_sample)
    fp32 = 4
    assert grads == [HIDDEN * fp32, HIDDEN * fp32, EXPERTS * HIDDEN * fp32]
    assert all(c.kind == "all_reduce" and c.pass_ == "bwd" for c in layout.collectives if not c.per_sample)
    assert not [c for c in layout.collectives if c.per_sample and c.kind == "all_reduce"]
    tokens = MSEQ * HIDDEN * fp32
    gathered = sorted(c.bytes for c in layout.collectives if c.kind == "all_gather" and c.pass_ == "fwd")
    # the attention's input, the experts' token rows (8 x 32) and routing weights (8 x 2)
    assert gathered == [MSEQ * TOP_K * fp32, tokens, tokens]
    only = replace(layout, collectives=tuple(c for c in layout.collectives if not c.per_sample))
    links = mesh_links(cluster, Mesh(tp=2, sequence_parallel=True))
    link, eff = cluster.groups[0].intra_node, cm.collective_efficiency["intra"]
    # ring all-reduce (a reduce-scatter then an all-gather): 2 (n-1) latencies + 2 (n-1)/n M / bandwidth
    want = sum(2 * link.latency_s + 2 * 0.5 * b / (link.bandwidth_Bps * eff) for b in grads)
    for scale in (1.0, 8.0):
        got = _tensor_parallel(only, 2, cm, links, scale, 1.0, None)
        assert got.bwd_s == pytest.approx(want, rel=1e-9) and got.fwd_s == 0.0
