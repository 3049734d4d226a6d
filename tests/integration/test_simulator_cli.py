"""`autopar simulate`: --json keys, a plan.json priced the same as the flags that made it, --nodes."""
import json
from pathlib import Path

import pytest

from autopar.cli import main as cli_main

GPT = str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
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
    plan = config_plan(g, degrees={"dp": 2, "tp": 2, "pp": 2},
                       micro_batch=2, global_batch=16, schedule="1f1b", virtual_stages=1,
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


def _numbers(d: dict, prefix: str = "") -> dict:
    """Every number of a figures dict, nested keys joined with '.'."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)):
            out[prefix + k] = float(v)
    return out


@pytest.mark.parametrize("cluster,extra", [
    # local-cpu: the case issue 33 found 1.7e-4 apart, with the capacity less the headroom in one
    (["--cluster", "local-cpu"], ["--global-batch", "8"]),
    # captured at --batch-size 8, planned at micro-batch 2: the plan's model is re-captured
    (["--cluster", "dgx-a100-1x8", "--nodes", "2"], ["--global-batch", "32", "--micro-batch", "2"]),
    (["--cluster", "h100-16x8", "--nodes", "1"], ["--global-batch", "64", "--batch-size", "4"]),
    # the case issue 33 found (plan 9.8277 s, simulate 9.7828 s): gpt3-175b captured on meta,
    # 1024 H100 (about 7 + 5 CPU-seconds for the two commands)
    pytest.param(["--cluster", "h100-128x8"], ["--global-batch", "1536", "--model-arg", "size=gpt3-175b"],
                 marks=pytest.mark.slow),
])
def test_plan_file_needs_no_cluster_and_matches_predicted(capsys, tmp_path, cluster, extra):
    """'autopar simulate plan.json' finds the plan's cluster and gives every figure 'autopar plan'
    wrote in the plan's predicted block, to 1e-9 (simulator/plan_price.py): step, memory,
    capacity (less the plan's headroom, in both), FLOPs and MFU."""
    from autopar.core.plan import load_plan

    out = tmp_path / "plan.json"
    model = [] if "size=gpt3-175b" in extra else MODEL
    assert cli_main(["plan", GPT, *model, *cluster, *extra, "--time-budget", "3", "--no-runtime-check",
                     "-o", str(out), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    predicted = load_plan(out).predicted
    assert planned["plan"]["predicted"] == predicted
    again = _run(capsys, ["simulate", str(out), "--json"])
    assert again["world_size"] == load_plan(out).world_size and again["cluster"].startswith(cluster[1])
    want, got = _numbers(predicted), _numbers(again)
    assert {"step_time_s", "capacity_bytes", "max_memory_bytes", "mfu", "tflops_per_gpu"} <= set(want)
    from autopar.core.cluster import load_cluster
    from autopar.planner.headroom import DEFAULT_MEMORY_HEADROOM

    device = min(g.gpu_memory_bytes for g in load_cluster(cluster[1]).groups)
    assert predicted["capacity_bytes"] == int(device * (1 - DEFAULT_MEMORY_HEADROOM))
    for key in want:
        if key in got:
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-15), key
    assert again["fits"] == predicted["fits"]


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


def test_grad_clip_flag_is_recorded_and_priced(capsys, tmp_path, monkeypatch):
    """'autopar plan --grad-clip' writes "grad_clip": true and prices its plan as a clipped run;
    'autopar simulate' of that file gives the same step, and of the file without the field (an
    older plan, the same run) a shorter one -- the one 'simulate --grad-clip' lengthens again."""
    out = tmp_path / "plan.json"
    fixed = ["--tp", "1", "--pp", "1", "--zero", "0", "--recompute", "none", "--micro-batch", "2", "--no-compile"]
    assert cli_main(["plan", GPT, *MODEL, "--cluster", "local-cpu", "--global-batch", "8", *fixed,
                     "--time-budget", "3", "--no-runtime-check", "--grad-clip", "-o", str(out), "--json"]) == 0
    capsys.readouterr()
    d = json.loads(out.read_text())
    assert d["grad_clip"] is True
    clipped = _run(capsys, ["simulate", str(out), "--json"])
    assert clipped["step_time_s"] == pytest.approx(d["predicted"]["step_time_s"], rel=1e-9)
    del d["grad_clip"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(d))
    plain = _run(capsys, ["simulate", str(old), "--json"])
    assert plain["step_time_s"] < clipped["step_time_s"]
    again = _run(capsys, ["simulate", str(old), "--grad-clip", "--json"])
    assert again["step_time_s"] == pytest.approx(clipped["step_time_s"], rel=1e-12)
    # 'autopar replan' plans again with the flag the old plan was priced with
    from autopar.planner import plan_api, plan_report

    seen = []

    def planned(*args, **kw):      # the planner's part: the flag it is given, and a plan file
        seen.append(kw["grad_clip"])
        Path(kw["output"]).write_text(out.read_text())
        return None

    monkeypatch.setattr(plan_api, "plan", planned)
    monkeypatch.setattr(plan_report, "print_outcome", lambda console, outcome: None)
    for path, want in ((out, True), (old, False)):
        assert cli_main(["replan", str(path), "--nodes", "1", "-o", str(tmp_path / "re.json")]) == 0
        assert seen.pop() is want
