"""Predicted model-state bytes per rank against a real run's measured ones (measured.json's
``model_state_bytes_per_rank``, read from the tensors themselves: runtime/model_state.py).

The cases are what users hit on models not written for autopar (issue 32): a LoRA fine-tune
whose frozen base weights carry no gradient or optimizer state, an ``nn.LSTM`` whose weights
the forward uses inside one module, and a tied LM head whose copy the last pipeline stage keeps.
All run in one ``torchrun`` launch on 2 gloo ranks (fp32: the simulator's 4 + 4 + 8 bytes per
parameter match AdamW's fp32 parameter, gradient, exp_avg and exp_avg_sq).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from runtime_support import ROOT, run_cases

PLAN_MODELS = ROOT / "tests" / "plan_models"
ZOO = ROOT / "tests" / "zoo"
GLOBAL_BATCH = 4
MICRO_BATCH = 2
STEPS = 2

# name -> (model file, uniform_plan arguments; dp * micro_batch * num_microbatches = 4 on 2 ranks)
CASES = {
    "lora_ddp": (PLAN_MODELS / "lora_lm.py", dict(dp=2)),
    "lora_zero3": (PLAN_MODELS / "lora_lm.py", dict(dp=2, zero=3)),
    "lstm_ddp": (PLAN_MODELS / "lstm_lm.py", dict(dp=2)),
    "tied_pp2": (ZOO / "tied_lm.py", dict(pp=2, num_microbatches=2, schedule="gpipe")),
    "lora_pp2": (PLAN_MODELS / "lora_lm.py", dict(pp=2, num_microbatches=2, schedule="gpipe")),
    "tied_pp2_interleaved": (ZOO / "tied_lm.py", dict(pp=2, num_microbatches=2, schedule="interleaved",
                                                      virtual_stages=2)),
    # a Hugging Face model (captured through torch.export) with tie_word_embeddings=True
    "qwen2_tied_pp2": (ZOO / "hf_qwen2.py", dict(pp=2, num_microbatches=2, schedule="gpipe")),
}


def _graph(model: Path):
    from capture_memo import captured   # the ranks' plan checks read this capture (tests/capture_memo.py)

    return captured(str(model), {}, MICRO_BATCH)


def _plan(model: Path, kw: dict):
    from autopar.core.plan import ModelRef, uniform_plan

    g = _graph(model)
    ref = ModelRef(file=str(model), args={}, name=model.stem, fingerprint=g.fingerprint)
    plan = uniform_plan(model=ref, num_layers=len(g.layers), micro_batch=MICRO_BATCH, precision="fp32", **kw)
    assert plan.global_batch == GLOBAL_BATCH, kw
    return g, plan


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from autopar.core.plan import save_plan

    tmp = tmp_path_factory.mktemp("memory_measured")
    cases = []
    for name, (model, kw) in CASES.items():
        if model.stem.startswith("hf_") and importlib.util.find_spec("transformers") is None:
            continue
        _, plan = _plan(model, kw)
        save_plan(plan, tmp / f"{name}.json")
        cases.append({"name": name, "plan": str(tmp / f"{name}.json"), "measured": str(tmp / f"{name}.measured.json"),
                      "steps": STEPS})
    run_cases(2, cases, tmp, timeout_s=300)
    return {c["name"]: json.loads(Path(c["measured"]).read_text())["model_state_bytes_per_rank"] for c in cases}


def _predicted(name: str) -> list[dict]:
    """The simulator's per-pipeline-rank (params, grads, optimizer) bytes, by global rank (mesh
    order dp, pp, tp: with one of dp and pp at 2 the global rank r is dp rank r or pp rank r)."""
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator
    from sim_graphs import PROFILE, toy_cluster as _cluster

    model, kw = CASES[name]
    g, plan = _plan(model, kw)
    memory = PlanEvaluator(g, _cluster(), CostModel.from_profile(PROFILE)).evaluate(plan).memory
    by_rank = [memory[r if plan.mesh.pp > 1 else 0] for r in range(2)]
    return [{"params_bytes": m.params_bytes, "grads_bytes": m.grads_bytes, "optimizer_bytes": m.optimizer_bytes}
            for m in by_rank]


def _assert_state_matches(measured_rows: list[dict], name: str) -> None:
    assert [r["rank"] for r in measured_rows] == [0, 1], measured_rows
    for rank, (got, want) in enumerate(zip(measured_rows, _predicted(name))):
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert want[key] == pytest.approx(got[key], abs=0.5), (name, rank, key, want, got)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["lora_ddp", "lora_zero3", "lora_pp2"])
def test_lora_frozen_base_has_no_gradient_or_optimizer_state(measured, name):
    rows = measured[name]
    _assert_state_matches(rows, name)
    # the fixture really is mostly frozen: the gradients are a small part of the parameters
    assert all(0 < r["grads_bytes"] < r["params_bytes"] / 10 for r in rows if r["grads_bytes"]), rows


@pytest.mark.multiproc
def test_lstm_weights_are_counted(measured):
    _assert_state_matches(measured["lstm_ddp"], "lstm_ddp")


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["tied_pp2", "tied_pp2_interleaved", "qwen2_tied_pp2"])
def test_tied_head_copy_on_the_last_stage_is_counted(measured, name):
    if name.startswith("qwen2"):
        pytest.importorskip("transformers")
    rows = measured[name]
    _assert_state_matches(rows, name)
    # the embedding (vocabulary 64 x hidden 32) is on both stages: the last holds the head's copy
    assert rows[1]["params_bytes"] >= 64 * 32 * 4, rows


# ---------------------------------------------------------------- capture and planner, no run
def test_capture_records_frozen_parameters_per_op_and_layer():
    import torch

    from autopar.core.modelfile import load_model_file

    g = _graph(PLAN_MODELS / "lora_lm.py")
    with torch.device("meta"):
        model = load_model_file(PLAN_MODELS / "lora_lm.py").build()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert g.trainable_params == trainable == 2 * 2 * (32 * 2 + 2 * 128)     # 2 blocks x 2 adapters (A, B)
    base = g.op("blocks_0_fc_base")
    assert base.frozen_numel == base.param_numel == 128 * 32 + 128
    assert set(base.frozen_params) == {"blocks.0.fc.base.weight", "blocks.0.fc.base.bias"}
    assert g.op("blocks_0_fc_lora_a").frozen_numel == 0
    for layer in g.layers:
        assert layer.frozen_numel == sum(o.frozen_numel for o in g.layer_ops(layer.index))


def test_capture_names_the_tied_weight_in_the_later_layer():
    g = _graph(ZOO / "tied_lm.py")
    assert g.layers[-1].tied_params == (("embed.weight", 0, 64 * 32),)
    assert g.op("head").tied_numel == 64 * 32 and g.op("head").param_numel == 0
    assert all(not layer.tied_params for layer in g.layers[:-1])


@pytest.mark.parametrize("bounds", [(0, 1, 4), (0, 2, 4), (0, 3, 4)])
def test_tied_copy_follows_the_stage_cut(bounds):
    """Wherever the stages are cut, the rank without the embedding holds the head's copy of it;
    one stage (pp 1) holds the weight once."""
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator
    from sim_graphs import PROFILE, toy_cluster as _cluster

    g, plan = _plan(ZOO / "tied_lm.py", dict(pp=2, num_microbatches=2, schedule="gpipe", stage_bounds=bounds))
    ev = PlanEvaluator(g, _cluster(), CostModel.from_profile(PROFILE))
    memory = ev.evaluate(plan).memory
    for rank in range(2):
        own = sum(l.param_numel for l in g.layers[bounds[rank]:bounds[rank + 1]])
        extra = 64 * 32 if rank == 1 else 0
        assert memory[rank].params_bytes == 4 * (own + extra)
        assert memory[rank].optimizer_bytes == 8 * (own + extra)
    _, one = _plan(ZOO / "tied_lm.py", dict(dp=2))
    assert ev.evaluate(one).memory[0].params_bytes == 4 * g.params_total


def test_planner_range_costs_count_the_tied_copy():
    """The stage DP's memory of a layer range holds the copy exactly where the simulator does:
    a range that starts after the embedding and holds the head."""
    import numpy as np

    from autopar.core.plan import Mesh
    from autopar.planner.layer_tables import build_layer_tables
    from autopar.planner.space import LayerChoice
    from autopar.planner.structured import Setting, _range_sums
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator
    from sim_graphs import PROFILE, toy_cluster as _cluster

    g = _graph(ZOO / "tied_lm.py")
    ev = PlanEvaluator(g, _cluster(), CostModel.from_profile(PROFILE))
    mesh = Mesh(dp=1, tp=1, pp=2)
    choices = [LayerChoice(tp=False, zero=0, recompute="none", offload="none")]
    tables = build_layer_tables(ev, styles=[{}] * len(g.layers), signatures=[l.signature for l in g.layers],
                                choices=choices, mesh=mesh, micro_batch=MICRO_BATCH, num_microbatches=2,
                                precision="fp32")
    setting = Setting(mesh, MICRO_BATCH, 2, "gpipe", 1, "ddp")
    starts, ends = np.array([0, 1, 3, 3]), np.array([4, 4, 4, 3 + 1])
    _, base, _ = _range_sums(tables, setting, 2, None, starts, ends)
    _, base_untied, _ = _range_sums(
        type(tables)(**{**tables.__dict__, "tied_uses": ()}), setting, 2, None, starts, ends)
    copy = 16 * 64 * 32                    # fp32 parameter, gradient and AdamW's two moments
    assert (base - base_untied)[:, 0].tolist() == [0, copy, copy, copy]


@pytest.mark.parametrize("zero", [0, 3])
def test_frozen_parameters_send_no_gradient(zero):
    """DDP all-reduces, and FSDP reduce-scatters, only the gradients that exist: a layer of
    frozen weights (the LoRA model's embedding, "pre") sends none; a block only its adapters'.
    FSDP still gathers the frozen weights (they are sharded like the others)."""
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator
    from sim_graphs import PROFILE, toy_cluster as _cluster

    g, plan = _plan(PLAN_MODELS / "lora_lm.py", dict(dp=2, zero=zero))
    ev = PlanEvaluator(g, _cluster(), CostModel.from_profile(PROFILE))
    pre, block = (ev.layer_cost(i, plan.layers[i], plan.mesh, MICRO_BATCH, "fp32") for i in (0, 1))
    assert pre.dp_grad_bytes == 0 and pre.dp_allreduce_s == 0 and pre.dp_reducescatter_s == 0
    assert pre.dp_wire_bytes_per_step == 0
    adapters = 2 * (32 * 2 + 2 * 128)
    assert block.dp_grad_bytes == 4 * adapters
    if zero == 0:
        assert block.dp_allreduce_s > 0
    else:
        assert pre.dp_allgather_s > 0 and block.dp_reducescatter_s > 0
        assert pre.dp_wire_bytes_per_mb == 2 * 0.5 * 4 * g.layers[0].param_numel    # two gathers, no reduce
