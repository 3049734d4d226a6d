"""Megatron column/row detection and tp propagation on a captured GPT (examples/gpt.py)."""
from pathlib import Path

import pytest

from autopar.core.sharding import megatron_styles, propagate

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
ARGS = dict(layers=2, hidden=256, heads=8, seq=128, vocab=1000)


@pytest.fixture(scope="module")
def graph():
    capture = pytest.importorskip("autopar.core.capture")
    return capture.capture_model_file(str(GPT), ARGS, 2)


def _block(graph):
    return next(i for i, layer in enumerate(graph.layers) if layer.kind not in ("pre", "post"))


def test_megatron_pairs(graph):
    i = _block(graph)
    p = graph.layers[i].name
    assert megatron_styles(graph, i) == {f"{p}.attn.qkv": "colwise", f"{p}.attn.proj": "rowwise",
                                         f"{p}.mlp.fc": "colwise", f"{p}.mlp.proj": "rowwise"}
    post = len(graph.layers) - 1
    assert megatron_styles(graph, post).get("head") == "colwise"
    assert megatron_styles(graph, 0).get("tok_emb") == "rowwise"


@pytest.mark.parametrize("sp", [False, True])
def test_propagate_collectives_and_shards(graph, sp):
    i = _block(graph)
    tp, b, s, h = 4, 2, ARGS["seq"], ARGS["hidden"]
    layout = propagate(graph, i, megatron_styles(graph, i), tp, sp)
    act = b * s * h * 4                                  # fp32 capture: one [b, s, h] activation
    kinds = sorted((c.kind, c.pass_, c.bytes) for c in layout.collectives)
    if not sp:   # Shoeybi et al. 2019, Sec. 3: one all-reduce fwd and one bwd per attention and per MLP
        assert kinds == sorted([("all_reduce", "fwd", act)] * 2 + [("all_reduce", "bwd", act)] * 2)
    else:        # Korthikanti et al. 2022, Sec. 4.2.2: all-gather + reduce-scatter in each pass
        # and each LayerNorm, which sees a sequence shard, has its weight and bias gradients summed
        # over the tp ranks (Megatron-LM: finalize_model_grads all-reduces the sequence-parallel
        # parameters' gradients): 2 x hidden fp32 elements per norm, two norms per block
        norm_grads = 2 * h * 4
        assert kinds == sorted([("all_gather", "fwd", act), ("reduce_scatter", "fwd", act),
                                ("reduce_scatter", "bwd", act), ("all_gather", "bwd", act),
                                ("all_reduce", "bwd", norm_grads)] * 2)
    ops = graph.layer_ops(i)
    matmul_flops = sum(o.fwd_flops for o in ops if o.kind in ("linear", "matmul", "attention"))
    sharded = sum(o.fwd_flops / layout.compute_shard[o.name] for o in ops if o.kind in ("linear", "matmul", "attention"))
    assert sharded == pytest.approx(matmul_flops / tp)   # every GEMM of the block runs on 1/tp
    params = sum(o.param_numel / layout.param_shard[o.name] for o in ops)
    norms = sum(o.param_numel for o in ops if o.kind == "norm")
    assert params == pytest.approx((graph.layers[i].param_numel - norms) / tp + norms, rel=0.01)


def test_capture_flops_match_closed_form(graph):
    """Per block forward FLOPs: 24 b s h^2 + 4 b s^2 h (Narayanan et al. 2021, Appendix)."""
    i = _block(graph)
    b, s, h = 2, ARGS["seq"], ARGS["hidden"]
    ops = graph.layer_ops(i)
    gemm = sum(o.fwd_flops for o in ops if o.kind in ("linear", "matmul", "attention"))
    assert gemm == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h, rel=0.01)
