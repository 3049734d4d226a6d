"""The Megatron split analysis (core/sharding.megatron_styles) on tiny transformers 5 models built
from their config classes (no download): the attention's q/k/v -> o pair and the MLP's pair are
found through transformers' attention-interface functions, grouped-query projections, rotary
tables and per-head q/k norms; a fused projection cut into equal parts (GPT-2's Conv1D ``c_attn``,
Phi-3's ``qkv_proj`` and ``gate_up_proj``) is split per part, one cut into unequal parts is left
whole with its module named; a mixture of experts' stacked expert parameters
(Mixtral) are split by expert."""
from __future__ import annotations

import functools

import pytest

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=16, use_cache=False, bos_token_id=0, eos_token_id=1,
              pad_token_id=None, tie_word_embeddings=False)


def _build(kind: str):
    T = transformers
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**COMMON))
    if kind == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=None))
    if kind == "gemma":
        return T.GemmaForCausalLM(T.GemmaConfig(**COMMON, head_dim=8))
    if kind == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, use_sliding_window=False))
    if kind == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=8, use_sliding_window=False))
    if kind == "olmo2":
        return T.Olmo2ForCausalLM(T.Olmo2Config(**COMMON))
    if kind == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                    sliding_window=None))
    if kind in ("phi3", "phi3_gqa"):
        return T.Phi3ForCausalLM(T.Phi3Config(**{**COMMON, "num_key_value_heads": 4 if kind == "phi3" else 2}))
    if kind == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                              use_cache=False, bos_token_id=0, eos_token_id=1))
    raise ValueError(kind)


@functools.lru_cache(maxsize=None)
def _graph(kind: str):
    import torch

    from autopar.core.capture import capture

    with torch.device("meta"):
        model = _build(kind)
        model.config._attn_implementation = "sdpa"
        tokens = torch.randint(0, 64, (2, 8))
    return capture(model, (tokens,), model_name=kind)


def _block_styles(kind: str, index: int = 1) -> tuple[str, dict[str, str]]:
    from autopar.core.sharding import megatron_styles

    g = _graph(kind)
    layer = g.layers[index]
    return layer.name, {k.removeprefix(layer.name + "."): v for k, v in megatron_styles(g, index).items()}


ATTENTION = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.o_proj": "rowwise"}
SWIGLU = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma", "qwen2"])
def test_llama_family_splits_attention_and_mlp(kind):
    name, styles = _block_styles(kind)
    assert name == "model.layers.0"
    assert styles == {**ATTENTION, **SWIGLU}


def test_per_head_qk_norm_keeps_the_attention_pair():
    """Qwen3 normalises q and k per head (RMSNorm over head_dim after the heads are viewed out):
    each rank's heads are whole, so the attention splits.  OLMo 2 normalises the whole q_proj
    output (over every head's features): that norm needs all ranks' features, so it does not."""
    assert _block_styles("qwen3")[1] == {**ATTENTION, **SWIGLU}
    assert _block_styles("olmo2")[1] == SWIGLU


def test_mixtral_splits_attention_and_the_stacked_experts_by_expert():
    """The router Linear is no pair (it feeds top-k, not a Linear); MixtralExperts' stacked
    gate_up_proj [4, 128, 32] / down_proj [4, 32, 64] are split by expert, and the module the
    graph names is the one the runtime recognises (runtime/expert_tp.is_stacked_experts)."""
    from autopar.core.sharding import fused_projections, propagate, stacked_experts
    from autopar.runtime.expert_tp import is_stacked_experts

    g = _graph("mixtral")
    name, styles = _block_styles("mixtral")
    assert styles == {**ATTENTION, "mlp.experts": "expert"}
    assert fused_projections(g, 1) == []
    assert stacked_experts(g, 1) == {"model.layers.0.mlp.experts": 4}
    model = _build("mixtral")
    assert is_stacked_experts(model.get_submodule("model.layers.0.mlp.experts"))
    assert not any(is_stacked_experts(m) for n, m in model.named_modules() if not n.endswith("mlp.experts"))

    # priced: the experts' parameters halve at tp 2, and their output is all-reduced forward
    # (2 * 8 tokens x 32 hidden fp32 = 2048 bytes) and the tokens' and routing weights'
    # gradients backward (2048 bytes; 16 tokens x top-2 fp32 = 128 bytes)
    lay = propagate(g, 1, {f"{name}.{k}": v for k, v in styles.items()}, 2)
    ops = {o.name: o for o in g.layer_ops(1) if o.module_path == f"{name}.mlp.experts" and o.params}
    expert_params = sum(o.param_numel for o in ops.values())
    assert expert_params == 4 * 128 * 32 + 4 * 32 * 64
    assert all(lay.param_shard[n] == 2 and lay.compute_shard[n] == 2 for n in ops)
    experts_colls = sorted((c.kind, c.pass_, c.bytes) for c in lay.collectives
                           if c.at not in ("mul_4", "linear_3"))   # the attention pair's f and g
    assert experts_colls == [("all_reduce", "bwd", 128.0), ("all_reduce", "bwd", 2048.0),
                             ("all_reduce", "fwd", 2048.0)], lay.collectives
    # 4 experts do not divide over 3 ranks: left replicated, nothing priced for them
    odd = propagate(g, 1, {f"{name}.mlp.experts": "expert"}, 3)
    assert all(odd.param_shard[n] == 1 for n in ops) and odd.collectives == ()


def test_gpt2_fused_qkv_split_per_part_with_its_mlp():
    """GPT-2's Conv1D ``c_attn`` output [.., 3C] is ``split(C)`` into q, k, v, each viewed to
    heads: a fused projection of 3 equal parts, split per part ("colwise:3") and paired with
    c_proj; priced exactly like an unfused pair, while a plain "colwise" on it (an even split,
    which would mix q/k/v across ranks) applies no pair and is priced whole."""
    from autopar.core.sharding import fused_part_counts, fused_projections, megatron_styles, propagate

    g = _graph("gpt2")
    name, styles = _block_styles("gpt2")
    assert name == "transformer.h.0"
    assert styles == {"attn.c_attn": "colwise:3", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                      "mlp.c_proj": "rowwise"}
    assert fused_projections(g, 1) == [] and fused_part_counts(g, 1) == {"transformer.h.0.attn.c_attn": 3}
    assert megatron_styles(g, 1, fused=False) == {"transformer.h.0.mlp.c_fc": "colwise",
                                                  "transformer.h.0.mlp.c_proj": "rowwise"}
    assert fused_projections(g, 1, fused=False) == ["transformer.h.0.attn.c_attn"]
    assert megatron_styles(g, 0) == {"transformer.wte": "rowwise"}
    assert megatron_styles(g, len(g.layers) - 1) == {"lm_head": "colwise"}

    full = {f"{name}.{k}": v for k, v in styles.items()}
    lay = propagate(g, 1, full, 2)
    attn = [o for o in g.layer_ops(1) if o.module_path in (f"{name}.attn.c_attn", f"{name}.attn.c_proj")
            and o.kind == "linear"]
    assert len(attn) == 2 and all(lay.param_shard[o.name] == 2 and lay.compute_shard[o.name] == 2 for o in attn)
    # two pairs: each an all-reduce of its output forward and of its input's gradient backward;
    # c_attn's bias, whole on every rank, has its gradient (96 fp32 values) summed backward
    assert sorted((c.kind, c.pass_, c.at) for c in lay.collectives if c.bytes == 96 * 4) == \
        [("all_reduce", "bwd", attn[0].name)]
    assert sorted((c.kind, c.pass_) for c in lay.collectives if c.bytes != 96 * 4) == \
        [("all_reduce", "bwd")] * 2 + [("all_reduce", "fwd")] * 2
    even = propagate(g, 1, {**full, f"{name}.attn.c_attn": "colwise"}, 2)
    assert all(even.param_shard[o.name] == 1 for o in attn) and len(even.collectives) == 2
    # 3 parts of 32 features do not split over tp = 3 (32 % 3): priced whole
    assert all(propagate(g, 1, full, 3).param_shard[o.name] == 1 for o in attn)


def test_phi3_fused_projections_split_per_part_unless_their_parts_differ():
    """Phi-3 slices ``qkv_proj``'s output into q, k, v and chunks ``gate_up_proj``'s in two:
    with as many key/value heads as query heads the parts are equal (3 and 2 parts); with
    grouped-query attention (2 key/value heads of 4) q is twice as wide as k and v, so the
    attention stays whole and is named, while the MLP still splits per part."""
    from autopar.core.sharding import fused_projections

    assert _block_styles("phi3")[1] == {"self_attn.qkv_proj": "colwise:3", "self_attn.o_proj": "rowwise",
                                        "mlp.gate_up_proj": "colwise:2", "mlp.down_proj": "rowwise"}
    assert _block_styles("phi3_gqa")[1] == {"mlp.gate_up_proj": "colwise:2", "mlp.down_proj": "rowwise"}
    assert fused_projections(_graph("phi3_gqa"), 1) == ["model.layers.0.self_attn.qkv_proj"]


def _heads(kind: str, index: int = 1) -> dict[str, set[int]]:
    from autopar.core.sharding import _fused_parts, _head_counts, _pairs

    pairs, _role, _ops, by_name = _pairs(_graph(kind), index)
    out: dict[str, set[int]] = {}
    for cols, crossed, _row in pairs:
        parts = _fused_parts(set(cols), set(crossed), by_name)
        for c, found in _head_counts(set(cols), set(crossed), by_name, parts).items():
            out[by_name[c].module_path.rpartition(".")[2]] = {h for h, _view in found}
    return out


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3"])
def test_grouped_query_attention_splits_over_2_not_4(kind):
    """COMMON's 4 query heads and 2 key/value heads (the config's num_attention_heads and
    num_key_value_heads): tp = 2 divides both and the attention pair splits; tp = 4 divides q's
    heads but not k's and v's, so the pair is refused, named, and priced whole while the MLP
    pair still splits."""
    from autopar.core.sharding import megatron_styles, propagate, tp_refusals

    heads, kv = COMMON["num_attention_heads"], COMMON["num_key_value_heads"]
    assert _heads(kind) == {"q_proj": {heads}, "k_proj": {kv}, "v_proj": {kv}}
    g = _graph(kind)
    styles = megatron_styles(g, 1)
    assert tp_refusals(g, 1, styles, 2) == []
    why = tp_refusals(g, 1, styles, 4)
    assert len(why) == 1 and why[0].startswith(f"model.layers.0.self_attn.k_proj has {kv} heads") and \
        "not divisible by tp=4" in why[0], why
    linears = {o.module_path.rpartition(".")[2]: o.name for o in g.layer_ops(1) if o.kind == "linear"}
    for tp, attn in ((2, 2), (4, 1)):
        lay = propagate(g, 1, styles, tp)
        assert [lay.param_shard[linears[m]] for m in ("q_proj", "k_proj", "v_proj", "o_proj")] == [attn] * 4
        assert [lay.param_shard[linears[m]] for m in ("gate_proj", "up_proj", "down_proj")] == [tp] * 3


def test_fused_qkv_split_per_part_where_tp_divides_its_heads():
    """GPT-2's c_attn (colwise:3) and Phi-3's qkv_proj (colwise:3, as many key/value heads as
    query heads): each part is viewed into the config's 4 heads; tp 2 and 4 split them, tp 8
    would leave each rank half a head and is refused per part."""
    from autopar.core.sharding import megatron_styles, propagate, tp_refusals

    assert _heads("gpt2") == {"c_attn": {4}}
    assert _heads("phi3") == {"qkv_proj": {4}}
    for kind, fused in (("gpt2", "transformer.h.0.attn.c_attn"), ("phi3", "model.layers.0.self_attn.qkv_proj")):
        g = _graph(kind)
        styles = megatron_styles(g, 1)
        assert styles[fused] == "colwise:3"
        op = next(o.name for o in g.layer_ops(1) if o.module_path == fused and o.kind == "linear")
        for tp in (2, 4):
            assert tp_refusals(g, 1, styles, tp) == [] and propagate(g, 1, styles, tp).param_shard[op] == tp
        why = tp_refusals(g, 1, styles, 8)
        assert why and why[0].startswith(f"{fused} has 4 heads per part (of 3)"), why
        assert propagate(g, 1, styles, 8).param_shard[op] == 1


class _Fused:
    """Tiny attention blocks with a fused q/k/v nn.Linear, cut in different ways."""

    @staticmethod
    def build(cut: str):
        import torch
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(32, 96)
                self.proj = nn.Linear(32, 32)

            def forward(self, x):
                B, T, C = x.shape
                y = self.qkv(x)
                if cut == "unbind":       # view to [B, T, 3, heads, head_dim], parts taken apart
                    q, k, v = y.view(B, T, 3, 4, 8).unbind(2)
                elif cut == "scaled":     # an element-wise op on the whole output before the split
                    q, k, v = (y * 0.5).split(32, dim=-1)
                elif cut == "uneven":     # widths 48, 24, 24 (GQA-like): not equal parts
                    q, k, v = y.split([48, 24, 24], dim=-1)
                    q, k, v = q[..., :32], k[..., :16].repeat(1, 1, 2), v[..., :16].repeat(1, 1, 2)
                else:
                    raise ValueError(cut)
                q, k, v = (t.reshape(B, T, 4, 8).transpose(1, 2) for t in (q, k, v))
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                return x + self.proj(o.transpose(1, 2).reshape(B, T, C))

        return nn.Sequential(Block(), Block())


@pytest.mark.parametrize("cut,want", [("unbind", "colwise:3"), ("scaled", "colwise:3"), ("uneven", None)])
def test_fused_projection_cuts_recognised_or_left_whole(cut, want):
    """view + unbind into 3 equal parts, and a split after an element-wise op, are split per
    part; a cut into unequal widths is not
    recognised: the fused projection stays whole (named), the pair is not offered."""
    import torch

    from autopar.core.capture import capture
    from autopar.core.sharding import fused_projections, megatron_styles

    with torch.device("meta"):
        model = _Fused.build(cut)
        x = torch.randn(2, 8, 32)
    g = capture(model, (x,), model_name=cut)
    i = next(i for i, layer in enumerate(g.layers) if layer.name == "1")
    styles = megatron_styles(g, i)
    if want:
        assert styles == {"1.qkv": want, "1.proj": "rowwise"}, styles
        # each part holds 4 heads of 8 ([B, T, 3, 4, 8]: the parts come before the heads)
        from autopar.core.sharding import tp_refusals

        assert tp_refusals(g, i, styles, 4) == []
        assert tp_refusals(g, i, styles, 8)[0].startswith("1.qkv has 4 heads per part (of 3)")
    else:
        assert styles == {} and fused_projections(g, i) == ["1.qkv"], styles


def test_experts_that_tp_does_not_divide_are_refused_before_launch():
    """4 experts split by expert over tp = 3: refused by the runtime's pre-launch check
    (runtime/tp_check.py) with the experts' count named; tp = 2 passes."""
    from types import SimpleNamespace

    from autopar.core.errors import PlanFileError
    from autopar.runtime.tp_check import check_tp_divisibility

    def checked(tp: int):
        layers = [SimpleNamespace(name=f"model.layers.{i}", plan=SimpleNamespace(tp_styles={"mlp.experts": "expert"}))
                  for i in range(2)]
        return SimpleNamespace(plan=SimpleNamespace(mesh=SimpleNamespace(tp=tp), model=SimpleNamespace(args={})),
                               model_file=SimpleNamespace(build=lambda: _build("mixtral")), layers=layers,
                               plan_path="plan.json")

    check_tp_divisibility(checked(2))
    with pytest.raises(PlanFileError, match=r"model.layers.0.mlp.experts is split expert over tp = 3 ranks, but its "
                                            r"num_experts = 4 does not divide by 3"):
        check_tp_divisibility(checked(3))
    # a Linear named with the expert style is refused by name and class
    bad = checked(2)
    bad.layers[0].plan.tp_styles = {"mlp.gate": "expert"}
    with pytest.raises(PlanFileError, match="not a module of stacked expert parameters"):
        check_tp_divisibility(bad)


@functools.lru_cache(maxsize=None)
def _zoo_gpt2_graph():
    """tests/zoo/hf_gpt2.py captured once for the runtime plan-check cases."""
    from pathlib import Path

    from autopar.core.capture import capture_model_file

    path = Path(__file__).resolve().parents[1] / "zoo" / "hf_gpt2.py"
    return path, capture_model_file(str(path), {}, 2)


@pytest.mark.parametrize("style,message", [("colwise", "'colwise:3'"), ("colwise:2", "into 3 equal parts"),
                                           ("colwise:3", None)])
def test_runtime_plan_check_wants_the_parts_of_a_fused_projection(tmp_path, style, message):
    """The runtime's pre-launch check refuses a plan that splits GPT-2's c_attn evenly
    ("colwise": rank 0 would get all of q and half of k) or in the wrong number of parts, and
    takes "colwise:3"; "colwise:2" on the MLP's c_fc, which is not cut, is refused too."""
    from autopar.core.errors import PlanFileError
    from autopar.core.plan import ModelRef, save_plan, uniform_plan
    from autopar.runtime.plan_check import check_plan

    path, g = _zoo_gpt2_graph()
    styles = {i: {f"{layer.name}.attn.c_attn": style, f"{layer.name}.attn.c_proj": "rowwise"}
              for i, layer in enumerate(g.layers) if layer.name.startswith("transformer.h.")}
    plan = uniform_plan(model=ModelRef(str(path), {}, "hf_gpt2", g.fingerprint), num_layers=len(g.layers), tp=2,
                        micro_batch=2, tp_styles_per_layer=styles)
    save_plan(plan, tmp_path / "plan.json")
    if message is None:
        check_plan(tmp_path / "plan.json", 2)
        styles = {i: {f"{g.layers[i].name}.mlp.c_fc": "colwise:2", f"{g.layers[i].name}.mlp.c_proj": "rowwise"}
                  for i in styles}
        save_plan(uniform_plan(model=plan.model, num_layers=len(g.layers), tp=2, micro_batch=2,
                               tp_styles_per_layer=styles), tmp_path / "mlp.json")
        with pytest.raises(PlanFileError, match="does not cut its output into 2 parts"):
            check_plan(tmp_path / "mlp.json", 2)
    else:
        with pytest.raises(PlanFileError, match=message):
            check_plan(tmp_path / "plan.json", 2)
