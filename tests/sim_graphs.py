"""Synthetic OpGraphs for the simulator tests: a GPT whose ops carry Korthikanti's accounting.

Per transformer layer (Korthikanti et al. 2022, Sec. 4.1, 2-byte activations, 1-byte masks):
layer norms 4sbh, attention 11sbh + 5as^2b, MLP 19sbh = 34sbh + 5as^2b bytes kept for backward.
FLOPs: 2mnk per GEMM forward, twice that backward (Narayanan et al. 2021, Appendix).
"""
from __future__ import annotations

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.core.graph import Layer, OpGraph, OpNode


def _op(name, kind, module, layer, inputs, in_shapes, out_shape, fwd, bytes_moved, saved, params=0, bwd=None):
    out_numel = 1
    for d in out_shape:
        out_numel *= d
    return OpNode(name=name, kind=kind, target=kind, module_path=module, layer=layer, inputs=tuple(inputs),
                  input_shapes=tuple(tuple(s) for s in in_shapes), output_shape=tuple(out_shape), dtype="bfloat16",
                  fwd_flops=float(fwd), bwd_flops=float(2 * fwd if bwd is None else bwd), bytes_moved=float(bytes_moved),
                  params=(f"{module}.weight",) if params else (), param_numel=int(params), saved_bytes=int(saved),
                  output_bytes=int(out_numel * 2))


def gpt_graph(layers: int, hidden: int, heads: int, seq: int, vocab: int, batch: int = 1,
              with_embeddings: bool = True, fused_softmax: bool = False) -> OpGraph:
    """A GPT block stack as OpNodes; ``fused_softmax``: the causal mask is applied inside the
    softmax kernel (Megatron-LM's scaled_upper_triang_masked_softmax), not as an op of its own."""
    b, s, h, a = batch, seq, hidden, heads
    d = h // a
    sbh = s * b * h
    ops: list[OpNode] = []
    graph_layers: list[Layer] = []

    def close(index, name, kind, first, sig, module_paths, in_bytes, out_bytes):
        lops = ops[first:]
        graph_layers.append(Layer(index=index, name=name, kind=kind, module_paths=module_paths,
                                  ops=tuple(o.name for o in lops), param_numel=sum(o.param_numel for o in lops),
                                  fwd_flops=sum(o.fwd_flops for o in lops), bwd_flops=sum(o.bwd_flops for o in lops),
                                  saved_bytes=sum(o.saved_bytes for o in lops), input_bytes=in_bytes,
                                  output_bytes=out_bytes, signature=sig))

    li = 0
    prev = "input:idx"
    if with_embeddings:
        first = len(ops)
        ops.append(_op("tok", "embedding", "tok_emb", li, [prev], [(b, s)], (b, s, h), 0, 2 * sbh, 0, params=vocab * h, bwd=0))
        ops.append(_op("pos_arange", "other", "", li, [], [], (s,), 0, 0, 0, bwd=0))
        ops.append(_op("pos", "embedding", "pos_emb", li, ["pos_arange"], [(s,)], (s, h), 0, 2 * s * h, 0, params=s * h, bwd=0))
        ops.append(_op("emb_add", "elementwise", "", li, ["tok", "pos"], [(b, s, h), (s, h)], (b, s, h), sbh, 6 * sbh, 0, bwd=0))
        close(li, "pre", "pre", first, "pre", ("tok_emb", "pos_emb"), 8 * b * s, 2 * sbh)
        prev = "emb_add"
        li += 1
    for i in range(layers):
        first = len(ops)
        m = f"blocks.{i}"
        n = f"l{i}_"
        t = b * s
        ops += [
            _op(n + "ln1", "norm", m + ".ln1", li, [prev], [(b, s, h)], (b, s, h), 7 * sbh, 4 * sbh, 2 * sbh, params=2 * h),
            _op(n + "qkv", "linear", m + ".attn.qkv", li, [n + "ln1"], [(b, s, h)], (b, s, 3 * h), 2 * t * h * 3 * h,
                2 * (sbh + 3 * sbh + 3 * h * h), 2 * sbh, params=3 * h * h + 3 * h),
            _op(n + "heads", "view", m + ".attn", li, [n + "qkv"], [(b, s, 3 * h)], (b, a, s, 3 * d), 0, 0, 0),
            _op(n + "scores", "matmul", m + ".attn", li, [n + "heads", n + "heads"], [(b, a, s, d), (b, a, d, s)],
                (b, a, s, s), 2 * b * s * s * h, 2 * (2 * sbh + a * s * s * b), 4 * sbh),
        ] + ([] if fused_softmax else [
            _op(n + "causal", "other", m + ".attn", li, [n + "ln1"], [(b, s, h)], (s, s), 0, 0, 0),
            _op(n + "mask", "elementwise", m + ".attn", li, [n + "scores", n + "causal"], [(b, a, s, s), (s, s)],
                (b, a, s, s), a * s * s * b, 4 * a * s * s * b, 0),
        ]) + [
            _op(n + "softmax", "softmax", m + ".attn", li, [n + "scores" if fused_softmax else n + "mask"],
                [(b, a, s, s)], (b, a, s, s), 5 * a * s * s * b, 4 * a * s * s * b, 2 * a * s * s * b),
            _op(n + "attn_drop", "dropout", m + ".attn", li, [n + "softmax"], [(b, a, s, s)], (b, a, s, s),
                2 * a * s * s * b, 5 * a * s * s * b, a * s * s * b),
            _op(n + "context", "matmul", m + ".attn", li, [n + "attn_drop", n + "heads"], [(b, a, s, s), (b, a, s, d)],
                (b, a, s, d), 2 * b * s * s * h, 2 * (a * s * s * b + 2 * sbh), 2 * a * s * s * b + 2 * sbh),
            _op(n + "merge", "view", m + ".attn", li, [n + "context"], [(b, a, s, d)], (b, s, h), 0, 0, 0),
            _op(n + "proj", "linear", m + ".attn.proj", li, [n + "merge"], [(b, s, h)], (b, s, h), 2 * t * h * h,
                2 * (2 * sbh + h * h), 2 * sbh, params=h * h + h),
            _op(n + "drop1", "dropout", m + ".drop1", li, [n + "proj"], [(b, s, h)], (b, s, h), 2 * sbh, 5 * sbh, sbh),
            _op(n + "res1", "elementwise", m, li, [prev, n + "drop1"], [(b, s, h), (b, s, h)], (b, s, h), sbh, 6 * sbh, 0),
            _op(n + "ln2", "norm", m + ".ln2", li, [n + "res1"], [(b, s, h)], (b, s, h), 7 * sbh, 4 * sbh, 2 * sbh, params=2 * h),
            _op(n + "fc", "linear", m + ".mlp.fc", li, [n + "ln2"], [(b, s, h)], (b, s, 4 * h), 2 * t * h * 4 * h,
                2 * (sbh + 4 * sbh + 4 * h * h), 2 * sbh, params=4 * h * h + 4 * h),
            _op(n + "gelu", "elementwise", m + ".mlp.act", li, [n + "fc"], [(b, s, 4 * h)], (b, s, 4 * h),
                8 * 4 * sbh, 16 * sbh, 8 * sbh),
            _op(n + "fc2", "linear", m + ".mlp.proj", li, [n + "gelu"], [(b, s, 4 * h)], (b, s, h), 2 * t * 4 * h * h,
                2 * (4 * sbh + sbh + 4 * h * h), 8 * sbh, params=4 * h * h + h),
            _op(n + "drop2", "dropout", m + ".drop2", li, [n + "fc2"], [(b, s, h)], (b, s, h), 2 * sbh, 5 * sbh, sbh),
            _op(n + "res2", "elementwise", m, li, [n + "res1", n + "drop2"], [(b, s, h), (b, s, h)], (b, s, h), sbh, 6 * sbh, 0),
        ]
        close(li, m, "Block", first, "block", (m,), 2 * sbh, 2 * sbh)
        prev = n + "res2"
        li += 1
    if with_embeddings:
        first = len(ops)
        ops.append(_op("ln_f", "norm", "ln_f", li, [prev], [(b, s, h)], (b, s, h), 7 * sbh, 4 * sbh, 2 * sbh, params=2 * h))
        ops.append(_op("head", "linear", "head", li, ["ln_f"], [(b, s, h)], (b, s, vocab), 2 * b * s * h * vocab,
                       2 * (sbh + b * s * vocab + h * vocab), 2 * sbh, params=h * vocab))
        close(li, "post", "post", first, "post", ("ln_f", "head"), 2 * sbh, 2 * b * s * vocab)
    params = sum(o.param_numel for o in ops)
    return OpGraph(model_name=f"gpt-synthetic-{layers}x{hidden}", model_file="<synthetic>",
                   model_args=dict(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab),
                   batch_size=batch, ops=ops, layers=graph_layers, params_total=params, param_dtype="bfloat16",
                   seq_len=seq, sequential_layers=True)


def dense_graph(num_params: float, num_layers: int, batch: int = 1, width: int = 4096,
                fwd_flops_per_layer: float = 1e12, saved_bytes_per_layer: int = 0) -> OpGraph:
    """``num_layers`` identical layers of one Linear each holding num_params / num_layers parameters."""
    per = int(num_params // num_layers)
    ops, layers = [], []
    prev = "input:x"
    for i in range(num_layers):
        name = f"lin{i}"
        ops.append(OpNode(name=name, kind="linear", target="linear", module_path=f"layers.{i}.lin", layer=i,
                          inputs=(prev,), input_shapes=((batch, width),), output_shape=(batch, width), dtype="bfloat16",
                          fwd_flops=fwd_flops_per_layer, bwd_flops=2 * fwd_flops_per_layer, bytes_moved=2.0 * per,
                          params=(f"layers.{i}.lin.weight",), param_numel=per, saved_bytes=saved_bytes_per_layer,
                          output_bytes=2 * batch * width))
        layers.append(Layer(index=i, name=f"layers.{i}", kind="Dense", module_paths=(f"layers.{i}",), ops=(name,),
                            param_numel=per, fwd_flops=fwd_flops_per_layer, bwd_flops=2 * fwd_flops_per_layer,
                            saved_bytes=saved_bytes_per_layer, input_bytes=2 * batch * width,
                            output_bytes=2 * batch * width, signature="dense"))
        prev = name
    return OpGraph(model_name="dense", model_file="<synthetic>", model_args={}, batch_size=batch, ops=ops,
                   layers=layers, params_total=per * num_layers, param_dtype="bfloat16", seq_len=None,
                   sequential_layers=True)


#: a GPU-like profile of round figures for the simulator's closed-form tests (shared by the
#: memory tests in tests/simulator and tests/integration)
PROFILE = dict(name="t", memory_bandwidth_Bps=2e12, peak_flops={"fp32": 20e12, "bf16": 300e12},
               efficiency={"linear": 0.8, "matmul": 0.8, "memory_bound": 0.8},
               collective_efficiency={"intra": 1.0, "inter": 1.0})


#: the same round figures with collectives below the links' peak (intra 0.7, inter 0.9) and a bf16
#: peak of 250 TFLOP/s: the data-parallel reduce tests' closed forms (grad clip, compression)
REDUCE_PROFILE = dict(name="t", memory_bandwidth_Bps=2e12, peak_flops={"fp32": 20e12, "bf16": 250e12},
                      efficiency={"linear": 0.8, "matmul": 0.8, "memory_bound": 0.8},
                      collective_efficiency={"intra": 0.7, "inter": 0.9})


def toy_cluster(nodes=1, gpus=8, mem=80 * 2**30):
    """``nodes`` nodes of ``gpus`` devices of profile ``PROFILE`` ("t"), round link figures."""
    g = NodeGroup("n", "t", nodes, gpus, mem, Link(300.0, 3.0), 2**40, Link(25.0, 10.0))
    return Cluster("c", (g,), Link(25.0, 5.0))


def priced_dp_wire_bytes(graph, plan, cluster=None) -> float:
    """The bytes one rank sends per step in ``plan``'s data-parallel gradient reduce, as the
    simulator prices it (its layer table's ``dp_wire_bytes_per_step``, after the table terms:
    DDP's buckets, gradient compression), on ``toy_cluster(gpus=plan.world_size)`` by default,
    priced as autopar's runtime with the plan's own compression (simulate.plan_cost_models)."""
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator
    from autopar.simulator.simulate import plan_cost_models

    cluster = cluster or toy_cluster(gpus=plan.world_size)
    cms = plan_cost_models(plan, CostModel.from_profile(REDUCE_PROFILE))
    return float(PlanEvaluator(graph, cluster, cms).prepare(plan)[1].dp_wire_bytes_per_step.sum())
