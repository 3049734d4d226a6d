"""Plan, then run, with context and expert parallelism on 4 ranks: ``autopar plan moe.py --ep 2
--pp 2`` on the 4-process local-cpu cluster and ``autopar plan hf_llama.py --cp 2 --pp 2`` on a
4-device gloo cluster write a plan with those degrees, and the plan, checked as ``autopar run``
checks a plan before launch (``runtime.plan_check.check_plan``), trains 2 steps: the ep x pp plan
like the plain loop, the cp x pp plan with finite losses, the measured file written for that plan
and the run saying it ran those degrees.

The plans are made in the test process (tests/cli_inprocess.run_cli, with the planner's runtime
check on fake ranks; a 1 s search, the flags fix the whole mesh); ONE 4-rank torchrun launch then
trains both in turn (tests/zoo_worker.py: ``runtime.train.run`` per plan, one process group). The
2-rank ``--cp 2`` / ``--ep 2`` plans of the zoo's Llama, GPT-2, Mixtral, MoE and DeepSeek-V3 style
MoE train in tests/integration/test_zoo_plan_run.py's launch
(``test_plan_with_cp_or_ep_then_run_trains``). ``autopar run``'s own launch function
(``runtime.run_launch.run_plan``) is tested by tests/integration/test_runtime_ep.py's edited-plan
case and test_runtime_launch.py.
"""
from __future__ import annotations

import json
import math

import pytest

from runtime_support import ROOT
from test_zoo_plan_run import CLUSTER, _trained

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ZOO = ROOT / "tests" / "zoo"
STEPS = 2
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
                    "--time-budget", "1", "-o", plan_path, "--json")
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
