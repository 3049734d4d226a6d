"""Which captured models can take context parallelism (core/cp_support.py), and the exit-2
refusals of ``autopar plan --cp 2`` and of the runtime's plan check for those that cannot.

The references are the model files themselves: the zoo's nanoGPT and examples/gpt.py's default
``attention="math"`` compute attention by explicit matmul + softmax; examples/gpt.py with
``attention="sdpa"`` and the zoo's HF Llama call ``F.scaled_dot_product_attention``; an MLP
has no sequence at all.
"""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPT_ARGS = {"layers": 1, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64}


def _graph(path, args):
    from autopar.core.capture import capture_model_file

    return capture_model_file(str(ROOT / path), dict(args), 1)


@pytest.mark.parametrize("path, args, says", [
    ("tests/zoo/nanogpt.py", {}, "explicit matmul and softmax"),
    ("examples/gpt.py", GPT_ARGS, "explicit matmul and softmax"),
    ("examples/mlp.py", {}, "no sequence dimension"),
    ("examples/gpt.py", {**GPT_ARGS, "seq": 12, "attention": "sdpa"}, "2 x cp = 8 equal chunks"),
])
def test_models_that_cannot_take_cp_say_why(path, args, says):
    from autopar.core.cp_support import cp_refusal

    g = _graph(path, args)
    assert says in cp_refusal(g, 4 if "chunks" in says else 2)
    assert cp_refusal(g, 1) is None


@pytest.mark.parametrize("path, args", [("examples/gpt.py", {**GPT_ARGS, "attention": "sdpa"}),
                                        ("tests/zoo/hf_llama.py", {})])
def test_sdpa_models_take_cp(path, args):
    from autopar.core.cp_support import attention_ops, cp_refusal

    g = _graph(path, args)
    assert attention_ops(g) and g.seq_len is not None
    assert cp_refusal(g, 2) is None


def test_plan_cp2_for_nanogpt_exits_2_with_the_reason(tmp_path):
    from cli_inprocess import run_cli

    out = tmp_path / "plan.json"
    r = run_cli("plan", "tests/zoo/nanogpt.py", "--cluster", "local-cpu", "--global-batch", "4", "--cp", "2",
                "--time-budget", "4", "-o", out, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--cp 2" in r.stderr and "explicit matmul and softmax" in " ".join(r.stderr.split())
    assert not out.exists()


def test_runtime_plan_check_refuses_cp_for_nanogpt(tmp_path):
    from autopar.core.errors import PlanFileError
    from autopar.core.plan import ModelRef, save_plan, uniform_plan
    from autopar.runtime.plan_check import check_plan

    path = ROOT / "tests/zoo/nanogpt.py"
    g = _graph("tests/zoo/nanogpt.py", {})
    plan = uniform_plan(model=ModelRef(str(path), {}, "nanogpt", g.fingerprint), num_layers=len(g.layers),
                        cp=2, micro_batch=1)
    save_plan(plan, tmp_path / "plan.json")
    with pytest.raises(PlanFileError, match="explicit matmul and softmax"):
        check_plan(tmp_path / "plan.json", 2)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_planner_dry_run_runs_cp_x_tp_with_recompute(recompute):
    """The planner's runtime check (runtime/dry_run.py, fake ranks) runs a cp plan's forward as
    training does -- the rank's tokens under the context-parallel attention --, so a recomputed
    layer, whose rerun in backward enters that attention (runtime/recompute.py), sees the rank's
    tokens: ``autopar plan --cp 2 --tp 2 --recompute full`` refused every plan before
    (AssertionError (torch.Size([4, 4, 8, 8]), 4) from a forward on the whole sequence)."""
    from autopar.core.modelfile import load_model_file
    from autopar.core.plan import ModelRef, uniform_plan
    from autopar.runtime.dry_run import dry_run

    path = ROOT / "tests/zoo/hf_llama.py"
    pytest.importorskip("transformers")
    g = _graph("tests/zoo/hf_llama.py", {})
    styles = {i: {f"{layer.name}.self_attn.{p}": s for p, s in (("q_proj", "colwise"), ("k_proj", "colwise"),
                                                                ("v_proj", "colwise"), ("o_proj", "rowwise"))}
              for i, layer in enumerate(g.layers) if layer.name not in ("pre", "post")}
    plan = uniform_plan(model=ModelRef(str(path), {}, "hf_llama", g.fingerprint), num_layers=len(g.layers),
                        cp=2, tp=2, micro_batch=2, recompute=recompute, tp_styles_per_layer=styles)
    assert dry_run(plan, g, load_model_file(path)) is None


@pytest.mark.parametrize("model,schedule", [("examples/gpt.py", "1f1b"), ("tests/zoo/hf_llama.py", "gpipe")])
def test_planner_dry_run_runs_cp_x_pp_with_recompute(model, schedule):
    """The runtime check on fake ranks (runtime/dry_run.py) runs a cp 2 x pp 2 plan as training
    does: the first stage given the position ids positionally, every stage's forward in cp's
    attention (Llama's stages are cut from the torch.export graph on the rank's tokens, their
    traced causal mask taken by the mode), a recomputed stage rerun in it."""
    from autopar.core.modelfile import load_model_file
    from autopar.core.plan import ModelRef, uniform_plan
    from autopar.runtime.dry_run import dry_run

    if "hf_" in model:
        pytest.importorskip("transformers")
    args = {**GPT_ARGS, "layers": 2, "attention": "sdpa"} if "gpt" in model else {}
    g = _graph(model, args)
    plan = uniform_plan(model=ModelRef(str(ROOT / model), args, "m", g.fingerprint), num_layers=len(g.layers),
                        cp=2, pp=2, micro_batch=2, num_microbatches=2, schedule=schedule, recompute="full")
    assert dry_run(plan, g, load_model_file(ROOT / model)) is None
