"""``autopar plan`` with fixed knobs (--dp/--tp/--pp/--zero/--recompute/--offload/--micro-batch/
--schedule): the printed plan keeps them and the search fills in the rest; a knob the model,
the cluster or the runtime cannot take exits 2 and says why.  And the memory headroom: plans
leave the allocator's share of every device free."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPT = ["examples/gpt.py", "--model-arg", "layers=4", "--model-arg", "hidden=64", "--model-arg", "heads=4",
       "--model-arg", "seq=16", "--model-arg", "vocab=128"]


def _plan(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``autopar plan ...`` in this process (tests/cli_inprocess.run_cli: its stdout, stderr and
    exit code as a subprocess returns them, without ~3 s of imports per case)."""
    from cli_inprocess import run_cli

    return run_cli("plan", *args, "--cluster", "local-cpu", "--time-budget", "4", "-o", tmp_path / "plan.json",
                   "--json", cwd=ROOT)


def test_fixed_knobs_are_honoured(tmp_path):
    r = _plan(tmp_path, *GPT, "--global-batch", "8", "--dp", "2", "--tp", "2", "--zero", "3",
              "--recompute", "full", "--micro-batch", "2")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    assert (plan["mesh"]["dp"], plan["mesh"]["tp"], plan["mesh"]["pp"]) == (2, 2, 1)
    assert plan["micro_batch"] == 2
    assert {layer["zero"] for layer in plan["layers"]} == {3}
    assert {layer["recompute"] for layer in plan["layers"]} == {"full"}
    assert (tmp_path / "plan.json").is_file()


def test_fixed_pipeline_and_schedule_are_honoured(tmp_path):
    r = _plan(tmp_path, *GPT, "--global-batch", "8", "--pp", "2", "--schedule", "gpipe", "--offload", "none")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    assert plan["mesh"]["pp"] == 2 and plan["pipeline"]["schedule"] == "gpipe"
    assert {layer["offload"] for layer in plan["layers"]} == {"none"}


@pytest.mark.parametrize("args, says", [
    (["--tp", "3"], "does not divide"),                                 # 4 devices
    (["--dp", "2", "--tp", "2", "--pp", "2"], "must equal 4"),
    (["--offload", "cpu", "--zero", "1"], "needs --zero 2 or 3"),
    (["--offload", "nvme+params+grads"], "--offload nvme+params+grads: cluster local-cpu gives no nvme entry"),
    (["--micro-batch", "3"], "does not divide --global-batch 8"),
])
def test_impossible_constraint_exits_2(tmp_path, args, says):
    r = _plan(tmp_path, *GPT, "--global-batch", "8", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in " ".join(r.stderr.split())
    assert not (tmp_path / "plan.json").exists()


def test_constraint_the_runtime_cannot_run_exits_2_with_its_reason(tmp_path):
    r = _plan(tmp_path, "tests/plan_models/two_tower.py", "--global-batch", "8", "--pp", "2")
    assert r.returncode == 2
    assert "pipeline" in r.stderr and "one activation" in " ".join(r.stderr.split())
    r = _plan(tmp_path, "tests/plan_models/two_tower.py", "--global-batch", "8", "--tp", "2")
    assert r.returncode == 2 and "does not divide over tp = 2" in " ".join(r.stderr.split())


def test_left_out_kinds_are_in_plan_json(tmp_path):
    r = _plan(tmp_path, "tests/plan_models/two_tower.py", "--global-batch", "8")
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    kinds = {x["kind"] for x in plan["provenance"]["left_out"]}
    assert {"pipeline", "tensor parallel"} <= kinds
    assert plan["mesh"]["tp"] == 1 and plan["mesh"]["pp"] == 1


def test_memory_headroom_is_kept():
    """One fixed layout (dp 8, micro-batch 8, DDP, no recompute) on devices sized so that it
    fills 90% of each: without headroom it is the plan; with the default headroom it no longer
    fits (exit 3), and with full recompute the plan found stays within 88.5% of a device."""
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.core.errors import NoFeasiblePlanError
    from autopar.planner.headroom import DEFAULT_MEMORY_HEADROOM
    from autopar.planner.search import PlanOptions, search
    from autopar.simulator.device.cost_model import CostModel

    graph = capture_model_file(ROOT / "examples" / "gpt.py", {"layers": 4, "hidden": 256, "heads": 4, "seq": 256,
                                                              "vocab": 1024}, 8)
    base = load_cluster("dgx-a100-1x8")
    cms = {g.gpu: CostModel.from_profile(g.gpu) for g in base.groups}
    opts = PlanOptions(global_batch=64, algo="mcmc", time_budget_s=5, mcmc_iterations=300, precision="bf16", allow_offload=False,
                       zero_families=("ddp",), recompute=("none",), degrees={"dp": 8}, micro_batch=8, zero=0)
    need = float(search(graph, base, cms, opts).best.result.max_memory_bytes)
    cap = need / 0.90
    tight = replace(base, groups=tuple(replace(g, gpu_memory_bytes=int(cap)) for g in base.groups))
    assert float(search(graph, tight, cms, opts).best.result.max_memory_bytes) == pytest.approx(need)
    with pytest.raises(NoFeasiblePlanError):
        search(graph, tight, cms, replace(opts, memory_headroom=DEFAULT_MEMORY_HEADROOM))
    kept = search(graph, tight, cms, replace(opts, memory_headroom=DEFAULT_MEMORY_HEADROOM,
                                             recompute=("full",))).best
    assert float(kept.result.max_memory_bytes) <= (1 - DEFAULT_MEMORY_HEADROOM) * cap


GPT6 = [a if a != "layers=4" else "layers=6" for a in GPT]       # 8 layers: 2 equal chunks per rank at pp 2


@pytest.mark.parametrize("schedule", ["dualpipev"])
def test_fixed_split_backward_schedule_is_honoured(tmp_path, schedule):
    """``--schedule`` fixes a split-backward schedule: two stages per pp rank, and only choices
    its backward runs (no selective recompute, ZeRO-3 or offload: core/rules.split_backward_problem)."""
    r = _plan(tmp_path, *GPT6, "--global-batch", "8", "--pp", "2", "--schedule", schedule)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    assert plan["pipeline"]["schedule"] == schedule and len(plan["pipeline"]["stages"]) == 4
    assert all(l["recompute"] != "selective" and l["zero"] < 3 and l["offload"] == "none" for l in plan["layers"])


def test_split_backward_schedule_with_a_knob_it_cannot_run_exits_2(tmp_path):
    r = _plan(tmp_path, *GPT6, "--global-batch", "8", "--pp", "2", "--schedule", "zbv", "--recompute", "selective")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "selective activation checkpoint" in " ".join(r.stderr.split())
    assert not (tmp_path / "plan.json").exists()
