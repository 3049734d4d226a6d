"""Weight ties on the meta model, through materialisation and pipeline cuts (one process, no
process group): the pieces the zoo parity runs rely on, checked directly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.core.modelfile import load_model_file
from autopar.runtime.materialize import host_source, materialize, per_module_source
from autopar.runtime.ties import find_ties, retie, untie_across_stages

ZOO = Path(__file__).resolve().parents[1] / "zoo"


def _meta(name: str):
    mf = load_model_file(ZOO / f"{name}.py")
    with torch.device("meta"):
        return mf, mf.build()


def test_find_ties_names_every_alias():
    _, model = _meta("nanogpt")
    assert find_ties(model) == [("transformer.wte.weight", "lm_head.weight")]
    pytest.importorskip("transformers")
    _, t5 = _meta("hf_t5")
    assert [set(g) for g in find_ties(t5)] == [
        {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}]


@pytest.mark.parametrize("source", ["host", "per-module"])
def test_materialize_keeps_the_tie_and_one_value(source):
    mf, model = _meta("nanogpt")
    ties = find_ties(model)
    make = host_source if source == "host" else per_module_source
    materialize(model, torch.device("cpu"), make(mf, {}, 1234), ties)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.device.type == "cpu"
    if source == "host":
        torch.manual_seed(1234)
        want = mf.build().lm_head.weight
        assert torch.equal(model.lm_head.weight, want)


def test_plain_to_empty_would_untie():
    """The failure the swap in materialize prevents (so the test above can fail)."""
    _, model = _meta("nanogpt")
    ties = find_ties(model)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is not model.transformer.wte.weight
    retie(model, ties)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_untie_across_stages_gives_later_stages_a_copy():
    _, model = _meta("tied_lm")
    ties = find_ties(model)
    first = torch.nn.Module()
    first.embed = model.embed
    last = torch.nn.Module()
    last.head = model.head
    cross = untie_across_stages([first, last], ties)
    assert cross == [(("embed.weight", "head.weight"), [0, 1])]
    assert last.head.weight is not first.embed.weight and last.head.weight.shape == first.embed.weight.shape


def test_layer_units_leave_out_parent_modules():
    pytest.importorskip("transformers")
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import LayerPlan
    from autopar.runtime.parallelize import layer_module_paths
    from autopar.runtime.plan_check import LayerSpec

    g = capture_model_file(str(ZOO / "hf_llama.py"), {}, 1)
    _, model = _meta("hf_llama")
    # capture names no parent module in pre/post any more; a plan that does (hand-written, or an
    # older capture listing the HF base model "model" with the embeddings) must still build
    paths = [tuple(l.module_paths) + (("model",) if i == 0 else ()) for i, l in enumerate(g.layers)]
    held = [LayerSpec(i, l.name, paths[i], LayerPlan(layer=i)) for i, l in enumerate(g.layers)]
    units = layer_module_paths(model, held)
    assert "model" in held[0].module_paths and "model" not in units[0]
    assert units[1] == ["model.layers.0"] and "lm_head" in units[-1]
