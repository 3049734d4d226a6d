"""`autopar simulate`: --json keys, a plan.json priced the same as the flags that made it, --nodes."""
import json
from pathlib import Path

import pytest

from autopar.cli import main as cli_main

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
MODEL = ["--model-arg", "layers=4", "--model-arg", "hidden=256", "--model-arg", "heads=8", "--model-arg", "seq=128",
         "--model-arg", "vocab=1000"]


def _run(capsys, argv):
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_json_and_plan_file(capsys, tmp_path):
    pytest.importorskip("autopar.core.cluster_file")
    argv = ["simulate", GPT, *MODEL, "--cluster", "dgx-a100-1x8", "--dp", "2", "--tp", "2", "--pp", "2",
            "--micro-batch", "2", "--global-batch", "16", "--recompute", "selective", "--json",
            "--trace", str(tmp_path / "t.json")]
    out = _run(capsys, argv)
    for key in ("step_time_s", "tflops_per_gpu", "mfu", "max_memory_bytes", "samples_per_s", "tokens_per_s",
                "memory_breakdown", "hw_tflops_per_gpu"):
        assert key in out
    assert out["plan"]["num_microbatches"] == 4 and out["plan"]["precision"] == "bf16"
    assert out["tokens_per_s"] == pytest.approx(out["samples_per_s"] * 128)
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]

    # the same configuration written as a plan.json is priced identically
    from autopar.core.capture import capture_model_file
    from autopar.core.modelfile import parse_model_args
    from autopar.core.plan import save_plan
    from autopar.simulator.configure import config_plan

    g = capture_model_file(GPT, parse_model_args(MODEL[1::2]), 2)
    plan = config_plan(g, dp=2, tp=2, pp=2, micro_batch=2, global_batch=16, schedule="1f1b", virtual_stages=1,
                       zero=0, recompute="selective", offload="none", precision="bf16", sequence_parallel=False)
    save_plan(plan, tmp_path / "plan.json")
    again = _run(capsys, ["simulate", str(tmp_path / "plan.json"), "--cluster", "dgx-a100-1x8", "--json"])
    assert again["step_time_s"] == pytest.approx(out["step_time_s"], rel=1e-9)


def test_nodes_scales_cluster(capsys):
    pytest.importorskip("autopar.core.cluster_file")
    base = ["simulate", GPT, *MODEL, "--cluster", "dgx-a100-1x8", "--tp", "8", "--json"]
    one = _run(capsys, base)
    four = _run(capsys, base + ["--nodes", "4"])
    assert one["world_size"] == 8 and four["world_size"] == 32
    assert four["plan"]["dp"] == 4


def test_plan_file_needs_no_cluster_and_matches_predicted(capsys, tmp_path):
    """'autopar simulate plan.json' finds the plan's cluster and prices it as 'autopar plan' predicted."""
    from autopar.core.plan import load_plan

    out = tmp_path / "plan.json"
    assert cli_main(["plan", GPT, *MODEL, "--cluster", "dgx-a100-1x8", "--nodes", "2", "--global-batch", "32",
                     "--time-budget", "3", "-o", str(out), "--json"]) == 0
    capsys.readouterr()
    predicted = load_plan(out).predicted
    again = _run(capsys, ["simulate", str(out), "--json"])
    assert again["world_size"] == 16 and again["cluster"].startswith("dgx-a100-1x8")
    # (FLOP figures such as MFU are left out: 'plan' captures the model at batch 1, 'simulate' at
    # the plan's micro-batch, and a captured graph's FLOPs per sample shift slightly with it)
    for key in ("step_time_s", "bubble_fraction", "max_memory_bytes", "fits"):
        assert again[key] == pytest.approx(predicted[key], rel=1e-9, abs=1e-15), key


def test_model_file_without_cluster_is_a_user_error(capsys):
    assert cli_main(["simulate", GPT, *MODEL, "--dp", "2"]) == 2
    assert "--cluster" in capsys.readouterr().err


def test_help_does_not_import_torch():
    """'autopar --help' registers every verb without importing torch (verbs import it when they run)."""
    import subprocess
    import sys

    code = ("import sys\nfrom autopar.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
