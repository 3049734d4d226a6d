"""A tensor-parallel plan that leaves layers whole says which, and why (planner/whole_layers.py).

On two CPU ranks ``autopar plan --tp 2`` of a tiny transformers 5 Mistral (GQA, 4 query / 2
key-value heads, two layers) keeps most layers whole: their all-reduces cost more than the
compute they divide.  The summary and plan.json name exactly the layers the plan leaves whole,
each with the simulator's step-time change and memory change of splitting it and its
parameter bytes (checked against the model's own parameter count); a plan that splits every
layer says nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MISTRAL = ROOT / "tests" / "plan_models" / "hf_mistral.py"


def _two_device_cluster(tmp_path: Path) -> Path:
    text = (ROOT / "examples" / "clusters" / "local-cpu.yaml").read_text()
    assert "gpus_per_node: 4" in text
    path = tmp_path / "cpu2.yaml"
    path.write_text(text.replace("gpus_per_node: 4", "gpus_per_node: 2").replace("name: local-cpu", "name: cpu2"))
    return path


def _layer_param_bytes() -> dict[str, int]:
    """fp32 parameter bytes of each captured layer of the tiny Mistral, counted on the model."""
    from autopar.core.modelfile import load_model_file

    model = load_model_file(MISTRAL).build()
    out = {f"model.layers.{i}": 4 * sum(p.numel() for p in block.parameters())
           for i, block in enumerate(model.model.layers)}
    out["pre"] = 4 * model.model.embed_tokens.weight.numel()
    return out


def test_mistral_tp2_names_its_whole_layers_with_cost_and_memory(tmp_path, capsys):
    """The search ends by its MCMC chains' patience (about 3 s of CPU), well inside the 20 s
    budget, so the plan does not depend on the machine's load: the embedding and both decoder
    layers stay whole, only the LM head is split."""
    pytest.importorskip("transformers")
    from autopar.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", str(MISTRAL), "--tp", "2", "--cluster", str(_two_device_cluster(tmp_path)),
               "--global-batch", "4", "--time-budget", "20", "-o", str(out)])
    summary = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["mesh"]["tp"] == 2
    unsplit = {plan_layer["layer"] for plan_layer in plan["layers"] if not plan_layer["tp"]}
    assert unsplit, "the plan splits every layer: this test's scenario (layers left whole) is gone"
    whole = plan["provenance"]["whole_layers"]
    assert {w["layer"] for w in whole} == unsplit
    assert {w["name"] for w in whole} == {"pre", "model.layers.0", "model.layers.1"}, whole
    params = _layer_param_bytes()
    assert f"whole under tp 2: {len(unsplit)} of {len(plan['layers'])} layers" in summary, summary
    for w in whole:
        assert w["name"] in summary
        if w["name"] in params:
            assert w["param_bytes"] == params[w["name"]], w
        # every layer of this model has a split that runs: each is priced
        assert isinstance(w["split_step_delta_s"], float) and isinstance(w["split_memory_delta_bytes"], float), w
        assert w["split_memory_delta_bytes"] < 0, w          # splitting saves memory
        assert "--tp 2" in w["reason"] and "on the fullest device" in w["reason"], w
        assert w["reason"] in summary


def test_a_plan_that_splits_every_layer_says_nothing(tmp_path):
    """Priced directly: the plan with every layer split has no whole layers; the same plan with
    one layer kind left whole names those layers, with the simulator's figures."""
    pytest.importorskip("transformers")
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.core.plan import ModelRef, uniform_plan
    from autopar.core.sharding import megatron_styles
    from autopar.planner.whole_layers import lines, whole_layers
    from autopar.simulator.device.cost_model import CostModel

    graph = capture_model_file(MISTRAL, {}, 4)
    cluster = load_cluster(str(_two_device_cluster(tmp_path)))
    cms = {"local-cpu": CostModel.from_profile("local-cpu")}
    ref = ModelRef(file=str(MISTRAL), args={}, name="hf_mistral", fingerprint=graph.fingerprint)
    styles = {i: megatron_styles(graph, i) for i in range(len(graph.layers))}
    assert all(styles.values())
    every = uniform_plan(model=ref, num_layers=len(graph.layers), tp=2, micro_batch=4, tp_styles_per_layer=styles,
                         precision="fp32")
    assert whole_layers(every, graph, cluster, cms, fixed=True) == [] and lines([], every) == []
    blocks = {i for i, layer in enumerate(graph.layers) if layer.name.startswith("model.layers.")}
    part = uniform_plan(model=ref, num_layers=len(graph.layers), tp=2, micro_batch=4, precision="fp32",
                        tp_styles_per_layer={i: s for i, s in styles.items() if i not in blocks})
    got = whole_layers(part, graph, cluster, cms, fixed=True)
    assert {w.layer for w in got} == blocks
    assert all(w.split_step_delta_s is not None and w.split_memory_delta_bytes < 0 for w in got)
    assert lines(got, part)[0].startswith(f"whole under tp 2: {len(blocks)} of {len(graph.layers)} layers")
