"""Plan, then run, with context and expert parallelism: ``autopar plan --cp 2`` (the zoo's Llama
and GPT-2, both attending through SDPA; the zoo's nanoGPT writes its attention as matmul and
softmax, which cp refuses) and ``autopar plan --ep 2`` (the zoo's Mixtral, MoE and DeepSeek-V3
style MoE) on a 2-device gloo cluster writes a plan with that degree, and the plan it printed,
checked as ``autopar run`` checks a plan before launch (``runtime.plan_check.check_plan``),
trains 2 steps on 2 ranks: finite losses, the measured file written for that plan, and the run
saying it ran cp = 2 / ep = 2.

The plans are made in the test process (tests/cli_inprocess.run_cli, with the planner's runtime
check on fake ranks); ONE torchrun launch then trains the five in turn (tests/zoo_worker.py:
``runtime.train.run`` per plan, one process group, as tests/integration/test_zoo_plan_run.py
does), instead of five launches each importing transformers.  ``autopar run``'s own launch
function (``runtime.run_launch.run_plan``) is tested by tests/integration/test_runtime_ep.py's
edited-plan case and test_runtime_launch.py; the two 4-rank cases below (ep x pp, cp x pp)
share a second launch the same way.  A global batch of 2: the cp plans
hold it on one dp rank, the ep plans one sample per rank.
"""
from __future__ import annotations

import json
import math
import os

import pytest

from runtime_support import ROOT
from test_zoo_plan_run import CLUSTER

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ZOO = ROOT / "tests" / "zoo"
STEPS = 2
CASES = {
    "hf_llama_cp2": ("hf_llama.py", "cp"),
    "hf_gpt2_cp2": ("hf_gpt2.py", "cp"),
    "hf_mixtral_ep2": ("hf_mixtral.py", "ep"),
    "moe_ep2": ("moe.py", "ep"),
    "deepseek_moe_ep2": ("deepseek_moe.py", "ep"),
}


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "two-cpu.yaml"
    path.write_text(CLUSTER)
    return path


WORKER = ROOT / "tests" / "zoo_worker.py"


def _plan_and_train(folder, plans: dict, nproc: int) -> dict[str, dict]:
    """name -> its case, after one torchrun launch trained every plan that planned.  ``plans``:
    name -> (model file in the zoo, cluster file, global batch, the flags fixing the degrees).
    Each plan is made in this process and checked as ``autopar run`` checks a plan before
    torchrun; a plan that fails is kept as its error, for that name's test to show."""
    from cli_inprocess import run_cli
    from runtime_support import failure_summary, torchrun, worker_env

    from autopar.runtime.plan_check import check_plan

    cases = {}
    for name, (model, cluster, batch, flags) in plans.items():
        plan_path = folder / f"{name}.plan.json"
        r = run_cli("plan", ZOO / model, "--cluster", cluster, "--global-batch", batch, *flags,
                    "--time-budget", "2", "-o", plan_path, "--json")
        if r.returncode != 0:
            cases[name] = {"error": f"autopar plan exited {r.returncode}: {r.stderr[-3000:]}"}
            continue
        check_plan(plan_path, None)
        cases[name] = {"plan": str(plan_path), "steps": STEPS, "measured": str(folder / f"{name}.measured.json"),
                       "result": str(folder / f"{name}.result.json")}
    runnable = [c for c in cases.values() if "plan" in c]
    spec = folder / "cases.json"
    spec.write_text(json.dumps(runnable))
    out = torchrun(nproc, str(WORKER), str(spec), timeout_s=600, env=worker_env())
    log = out.stdout + out.stderr
    for c in runnable:
        c["log"] = log
        c["launch"] = "" if out.returncode == 0 else failure_summary(log)
    return cases


def _trained(case: dict, needles: tuple[str, ...], world: int) -> tuple[dict, dict]:
    """(the plan, its measured file) of a case the shared launch trained: it finished, the run's
    own line for the plan names ``needles`` (what it ran), and the measured file is this plan's,
    on ``world`` ranks, with the losses the worker recorded."""
    assert "error" not in case, case.get("error")
    plan = json.loads(open(case["plan"]).read())
    assert os.path.exists(case["result"]), f"{plan['mesh']} did not finish in the shared launch:\n{case['launch']}"
    out = json.loads(open(case["result"]).read())
    assert "losses" in out, f"{plan['mesh']}: {out}"
    line = next((l for l in case["log"].splitlines() if f"plan {case['plan']}: mesh" in l), "")
    assert all(n in line for n in needles), case["log"][-3000:]
    m = json.loads(open(case["measured"]).read())
    assert m["plan"] == case["plan"] and m["world_size"] == world and m["losses"] == out["losses"]
    return plan, m


@pytest.fixture(scope="module")
def trained(cluster_file, tmp_path_factory) -> dict[str, dict]:
    """The five 2-rank cases, trained in one launch."""
    pytest.importorskip("transformers")
    plans = {name: (model, cluster_file, "2", (f"--{axis}", "2")) for name, (model, axis) in CASES.items()}
    return _plan_and_train(tmp_path_factory.mktemp("cp_ep_plans"), plans, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_plan_with_cp_or_ep_then_run_trains(name, trained):
    _model, axis = CASES[name]
    plan, m = _trained(trained[name], (f" {axis}=2",), 2)
    assert plan["mesh"][axis] == 2 and plan["mesh"]["world_size"] == 2, plan["mesh"]
    left = {x["kind"]: x["reason"] for x in plan["provenance"]["left_out"]}
    assert left[{"cp": "context parallel (used)", "ep": "expert parallel (used)"}[axis]] == f"{axis} 2 fixed by --{axis}"
    assert m["global_batch"] == 2
    assert len(m["losses"]) == STEPS and all(math.isfinite(x) for x in m["losses"]), m["losses"]


@pytest.fixture(scope="module")
def trained_4(tmp_path_factory) -> dict[str, dict]:
    """The two 4-rank cases -- ``autopar plan moe.py --ep 2 --pp 2`` on the 4-process local-cpu
    cluster and ``autopar plan hf_llama.py --cp 2 --pp 2`` on a 4-device gloo cluster -- trained
    in one 4-rank launch."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("pp_plans")
    four = folder / "four-cpu.yaml"
    four.write_text(CLUSTER.replace("name: two-cpu", "name: four-cpu")
                    .replace("gpus_per_node: 2", "gpus_per_node: 4").replace("compute_slots: 2", "compute_slots: 4"))
    plans = {"moe_ep2_pp2": ("moe.py", ROOT / "examples" / "clusters" / "local-cpu.yaml", "4", ("--ep", "2", "--pp", "2")),
             "hf_llama_cp2_pp2": ("hf_llama.py", four, "2", ("--cp", "2", "--pp", "2"))}
    return _plan_and_train(folder, plans, 4)


def test_plan_with_ep_and_pp_then_run_matches_the_plain_loop(trained_4):
    """The ep 2 x pp 2 plan (dp 2: ep borrows the dp ranks of each stage) trains like the plain
    PyTorch loop (tests/plain_loop.py) within 1e-5 on the losses."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import plain_loop

    plan, m = _trained(trained_4["moe_ep2_pp2"], (" ep=2", " pp=2"), 4)
    assert (plan["mesh"]["ep"], plan["mesh"]["pp"], plan["mesh"]["dp"], plan["precision"]) == (2, 2, 2, "fp32"), \
        plan["mesh"]
    losses, want = m["losses"], plain_loop.train_plain(ZOO / "moe.py", {}, 4, STEPS).losses
    assert len(losses) == STEPS and max(abs(a - b) for a, b in zip(losses, want)) <= 1e-5, (losses, want)


def test_plan_cp_x_pp_then_run_trains(trained_4):
    """The cp 2 x pp 2 plan for the zoo's Llama (the runtime check on fake ranks accepts it) trains."""
    plan, m = _trained(trained_4["hf_llama_cp2_pp2"], (" cp=2", " pp=2"), 4)
    assert (plan["mesh"]["cp"], plan["mesh"]["pp"], plan["mesh"]["world_size"]) == (2, 2, 4), plan["mesh"]
    assert len(m["losses"]) == STEPS and all(math.isfinite(x) for x in m["losses"])
