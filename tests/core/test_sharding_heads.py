"""Megatron splits attention by heads: a column/row pair applies at a tp degree only when tp divides
the head count of every column linear (core/sharding._head_counts, read from the captured view
of its output into [..., heads, head_dim]; each key/value projection's own under grouped-query
attention, each part's for a fused projection).  The reference is the head count of the
model's own configuration (closed form); a refused pair is priced whole (``propagate``) and
named (``tp_refusals``), while a pair tp divides is split as before."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from autopar.core.sharding import _fused_parts, _head_counts, _pairs, megatron_styles, propagate, tp_refusals

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "llama.py"


@functools.lru_cache(maxsize=None)
def _llama(heads: int, kv_heads: int):
    from autopar.core.capture import capture_model_file

    # hidden 64 and ffn 128: every width divides by 2 and 4, so only the heads can refuse a pair
    return capture_model_file(LLAMA, dict(layers=2, hidden=64, heads=heads, kv_heads=kv_heads, ffn=128, seq=16,
                                          vocab=64), 2)


def _block(graph) -> int:
    return next(i for i, layer in enumerate(graph.layers) if layer.kind not in ("pre", "post"))


def _heads_by_module(graph, index: int) -> dict[str, set[int]]:
    pairs, _role, _ops, by_name = _pairs(graph, index)
    out: dict[str, set[int]] = {}
    for cols, crossed, _row in pairs:
        parts = _fused_parts(set(cols), set(crossed), by_name)
        for c, found in _head_counts(set(cols), set(crossed), by_name, parts).items():
            out[by_name[c].module_path.rpartition(".")[2]] = {h for h, _view in found}
    return out


def _shard(layout, graph, index: int, leaf: str) -> int:
    op = next(o for o in graph.layer_ops(index) if o.kind == "linear" and o.module_path.endswith("." + leaf))
    return layout.param_shard[op.name]


@pytest.mark.parametrize("heads,kv_heads,tp", [
    (4, 4, 2), (4, 4, 4),          # multi-head attention, heads divide
    (2, 2, 4),                     # multi-head attention, 2 heads over 4 ranks
    (4, 2, 2),                     # grouped-query attention, both counts divide
    (4, 2, 4),                     # grouped-query attention: q's 4 heads divide, k/v's 2 do not
    (8, 2, 4),
])
def test_attention_pair_applies_only_where_tp_divides_every_head_count(heads, kv_heads, tp):
    g = _llama(heads, kv_heads)
    i = _block(g)
    # the head counts the graph shows (views with -1 for the heads) are the configuration's
    assert _heads_by_module(g, i) == {"wq": {heads}, "wk": {kv_heads}, "wv": {kv_heads}}

    styles = megatron_styles(g, i)
    refused = next((name for name, n in (("wq", heads), ("wk", kv_heads), ("wv", kv_heads)) if n % tp), None)
    why = tp_refusals(g, i, styles, tp)
    layout = propagate(g, i, styles, tp)
    attn_split = tp if refused is None else 1
    assert [_shard(layout, g, i, m) for m in ("wq", "wk", "wv", "wo")] == [attn_split] * 4
    assert [_shard(layout, g, i, m) for m in ("w1", "w3", "w2")] == [tp] * 3      # the MLP pair splits
    pairs = 2 if refused is None else 1
    assert sorted(c.pass_ for c in layout.collectives if c.kind == "all_reduce") == ["bwd"] * pairs + ["fwd"] * pairs
    if refused is None:
        assert why == []
    else:
        n = heads if refused == "wq" else kv_heads
        assert len(why) == 1 and f"{g.layers[i].name}.attn.{refused} has {n} heads" in why[0] and \
            f"not divisible by tp={tp}" in why[0], why


def test_a_width_that_does_not_divide_is_named_too():
    """ffn = 172 (llama-tiny's SwiGLU width) over 8 ranks: the MLP pair is refused by its width,
    as ``propagate`` always priced it, and now says so."""
    from autopar.core.capture import capture_model_file

    g = capture_model_file(LLAMA, dict(layers=1, hidden=64, heads=8, kv_heads=8, ffn=172, seq=16, vocab=64), 2)
    i = _block(g)
    why = tp_refusals(g, i, megatron_styles(g, i), 8)
    assert why == [f"{g.layers[i].name}.ffn.w1 has 172 output features, not divisible by tp=8"]
    assert _shard(propagate(g, i, megatron_styles(g, i), 8), g, i, "w1") == 1
    assert _shard(propagate(g, i, megatron_styles(g, i), 8), g, i, "wq") == 8


def test_refusals_only_for_the_pairs_the_styles_ask_for():
    g = _llama(4, 2)
    i = _block(g)
    mlp = {k: v for k, v in megatron_styles(g, i).items() if ".ffn." in k}
    assert tp_refusals(g, i, mlp, 4) == []
    assert tp_refusals(g, i, megatron_styles(g, i), 1) == []


def test_a_fused_mlp_viewed_into_its_parts_has_no_heads():
    """A gate/up projection viewed ``[..., 2, ffn]`` and unbound (a fused SwiGLU): the 2 is its
    parts, not heads, so tp 4 splits it per part (ffn = 64 divides by 4)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from autopar.core.capture import capture

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Linear(32, 128)
            self.down = nn.Linear(64, 32)

        def forward(self, x):
            gate, up = self.gate_up(x).view(*x.shape[:-1], 2, 64).unbind(-2)
            return x + self.down(F.silu(gate) * up)

    with torch.device("meta"):
        model = nn.Sequential(MLP(), MLP())
        x = torch.randn(2, 8, 32)
    g = capture(model, (x,), model_name="glu")
    i = next(i for i, layer in enumerate(g.layers) if layer.name == "1")
    styles = megatron_styles(g, i)
    assert styles == {"1.gate_up": "colwise:2", "1.down": "rowwise"}, styles
    assert _heads_by_module(g, i) == {} and tp_refusals(g, i, styles, 4) == []
    assert _shard(propagate(g, i, styles, 4), g, i, "gate_up") == 4
