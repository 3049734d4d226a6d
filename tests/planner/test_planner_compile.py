"""The planner's compile knob (planner/compile_choice.py): off by default on a gloo cluster (the
compile time a CPU run would pay), fixed by --compile / --no-compile, priced both ways; the
runtime check applies the compile wrapper to every block without running a compiled forward."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt.py")
SMALL = ["--model-arg", "layers=4", "--model-arg", "hidden=32", "--model-arg", "heads=4", "--model-arg", "seq=16",
         "--model-arg", "vocab=64"]


def _plan(capsys, tmp_path, *extra):
    from autopar.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", GPT, *SMALL, "--cluster", "local-cpu", "--global-batch", "4", "--time-budget", "3",
               "--no-runtime-check", "--json", "-o", str(out), *extra])
    text = capsys.readouterr().out
    assert rc == 0, text
    return json.loads(text), json.loads(out.read_text())


@pytest.mark.parametrize("flag, want", [((), False), (("--compile",), True), (("--no-compile",), False)])
def test_compile_knob(capsys, tmp_path, flag, want):
    shown, plan = _plan(capsys, tmp_path, *flag)
    choice = plan["provenance"]["compile_choice"]
    assert plan["compile"] is want and choice["compile"] is want
    if flag:
        assert choice["why"] == flag[0]
    else:
        assert "gloo" in choice["why"]
    # priced both ways: fusion never lengthens the predicted step, and the chosen one is the plan's
    assert choice["compiled_step_s"] <= choice["eager_step_s"]
    chosen = choice["compiled_step_s"] if want else choice["eager_step_s"]
    assert plan["predicted"]["step_time_s"] == pytest.approx(chosen)
    assert "compile " + ("on" if want else "off") in shown["compile"]
    assert choice["distinct_blocks"] == 1 and "1 distinct block graph" in shown["compile"]   # 4 identical blocks


def test_runtime_check_applies_the_compile_wrapper_to_every_block():
    from autopar.core.capture import capture_model_file
    from autopar.core.modelfile import load_model_file
    from autopar.core.plan import ModelRef, uniform_plan
    from autopar.runtime.meta_apply import compile_blocks

    args = {"layers": 4, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64}
    g = capture_model_file(GPT, args, 1)
    plan = uniform_plan(model=ModelRef(GPT, args, "gpt", g.fingerprint), num_layers=len(g.layers), compile=True)
    assert compile_blocks(plan, g, load_model_file(GPT)) == [f"blocks.{i}" for i in range(4)]
