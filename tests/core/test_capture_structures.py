"""Capture of structures beyond a plain transformer stack: ``nn.MultiheadAttention`` (a tuple
output holding ``None``), a routed top-k mixture of experts, and layer grouping for
encoder-decoder models, CNN stages and two-input models."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autopar.core.capture import capture, capture_model_file
from autopar.core.modelfile import load_model_file

MODELS = Path(__file__).parents[1] / "plan_models"


def _real(name: str, batch: int, **args):
    mf = load_model_file(MODELS / f"{name}.py")
    torch.manual_seed(0)
    model = mf.build(**args)
    return model, mf.make_batch(batch, **args)


def test_multihead_attention_is_kept_and_priced_like_torch_counts_it():
    graph = capture_model_file(MODELS / "mha_dict.py", {}, 4)
    attn = [o for o in graph.ops if o.module_path.endswith(".attn")]
    assert [o.module_path for o in attn] == ["blocks.0.attn", "blocks.1.attn"]
    model, idx = _real("mha_dict", 4)
    assert graph.params_total == sum(p.numel() for p in model.parameters())
    # every parameter is used by some captured op (the MHA projections included)
    assert sum(o.param_numel for o in graph.ops) == graph.params_total
    # independent count: torch's FlopCounterMode on a real CPU forward of the same module
    mha = model.blocks[0].attn
    h = torch.randn(4, 8, 32)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the math backend spells attention as matmuls, which the counter counts on every build
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        mha(h, h, h, need_weights=False)
    assert attn[0].fwd_flops == pytest.approx(counter.get_total_flops(), rel=1e-9)
    assert attn[0].kind == "attention" and attn[0].saved_bytes > 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_routed_moe_is_priced_by_the_experts_that_run(top_k):
    experts, hidden, batch, seq = 4, 16, 4, 8
    graph = capture_model_file(MODELS / "moe.py", {"top_k": top_k, "experts": experts}, batch)
    block = graph.layers[1]
    tokens = batch * seq
    router = hidden * experts
    expert = (hidden * 4 * hidden + 4 * hidden) + (4 * hidden * hidden + hidden)
    # closed form: every token runs the router and top_k experts (Shazeer et al. 2017, Sec. 2.1)
    assert block.fwd_flops == pytest.approx(2 * tokens * (router + top_k * expert))
    # a real routed forward, counted by torch (matmuls only: biases are not counted there,
    # 80 of each expert's 2128 parameters), agrees within that difference
    model, (idx, _) = _real("moe", batch, top_k=top_k, experts=experts)
    x = model.emb(idx[0] if isinstance(idx, tuple) else idx)
    with FlopCounterMode(display=False) as counter:
        model.blocks[0](x)
    counted = counter.get_total_flops()
    assert counted == pytest.approx(2 * tokens * (router + top_k * (expert - 5 * hidden)), rel=1e-9)
    assert block.fwd_flops == pytest.approx(counted, rel=0.04)


def test_moe_with_every_expert_chosen_prices_them_all():
    graph = capture_model_file(MODELS / "moe.py", {"top_k": 4, "experts": 4}, 4)
    params_block = sum(o.param_numel for o in graph.layer_ops(1))
    assert graph.layers[1].fwd_flops == pytest.approx(2 * 32 * params_block)


def test_cnn_stages_are_layers():
    graph = capture_model_file(MODELS / "resnet_like.py", {}, 2)
    names = [layer.name for layer in graph.layers]
    assert names == ["pre", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "post"]
    assert graph.sequential_layers
    assert graph.layers[0].module_paths == ("stem",)


def test_two_towers_each_get_their_layers():
    graph = capture_model_file(MODELS / "two_tower.py", {}, 4)
    names = [layer.name for layer in graph.layers]
    assert names == ["pre", "left.blocks.0", "left.blocks.1", "right.blocks.0", "right.blocks.1", "post"]
    assert not graph.sequential_layers           # the towers do not pass one activation


def test_encoder_decoder_blocks_are_layers_and_pre_holds_no_parent_module():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                use_cache=False)
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(cfg)
        ids = torch.zeros(2, 8, dtype=torch.long)
    graph = capture(model, (ids, None, ids), model_name="t5")
    names = [layer.name for layer in graph.layers]
    assert names[1:5] == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    block_paths = set(names[1:5])
    for layer in (graph.layers[0], graph.layers[-1]):
        for p in layer.module_paths:
            assert not any(b.startswith(p + ".") for b in block_paths), (layer.name, p)


def test_hf_parent_module_is_not_a_pre_layer_unit():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.zeros(2, 8, dtype=torch.long)
    graph = capture(model, (ids,), model_name="llama")
    assert "model" not in graph.layers[0].module_paths
    assert "model.embed_tokens" in graph.layers[0].module_paths
