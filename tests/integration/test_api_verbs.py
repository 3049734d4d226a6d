"""``autopar.plan``, ``autopar.simulate`` and ``autopar.report``: the Python functions each verb
calls.  Each is checked against closed facts (the plan's degrees multiply to its world size and
split the global batch; the report's error of a run measured 25% slower is -20%) and against what
the verb prints for the same arguments (the same plan, the same figures), and the plan's
predicted step against ``simulate`` of the plan file it wrote.

The model is tests/zoo/nanogpt.py (2 layers, hidden 32) on the bundled 4-device local-cpu cluster.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_inprocess import run_cli

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "tests" / "zoo" / "nanogpt.py")
PLAN_ARGS = dict(algo="ilp", time_budget=10.0, runtime_check=False)
PLAN_FLAGS = ["--algo", "ilp", "--time-budget", "10", "--no-runtime-check"]


def _without_timings(plan_dict: dict) -> dict:
    out = json.loads(json.dumps(plan_dict, default=float))
    out["provenance"].pop("search_s")
    return out


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The plan of autopar.plan (written to api.json) and of 'autopar plan --json' (cli.json)."""
    import autopar

    d = tmp_path_factory.mktemp("api")
    seen = []
    out = autopar.plan(MODEL, "local-cpu", 8, output=d / "api.json", warn=seen.append,
                       progress=lambda phase, done, total: seen.append(phase), **PLAN_ARGS)
    cli = run_cli("plan", MODEL, "--cluster", "local-cpu", "--global-batch", "8", *PLAN_FLAGS, "-o", d / "cli.json",
                  "--json")
    assert cli.returncode == 0, cli.stderr
    return d, out, json.loads(cli.stdout), seen


def test_plan_returns_the_plan_the_verb_writes(planned):
    d, out, cli, seen = planned
    plan = out.plan
    # closed facts: the degrees make the world, within the cluster's 4 devices; the batch splits
    assert plan.world_size == plan.mesh.dp * plan.mesh.tp * plan.mesh.pp * plan.mesh.cp <= 4
    assert plan.mesh.batch_degree * plan.micro_batch * plan.pipeline.num_microbatches == 8
    assert out.output == str(d / "api.json") and out.command.endswith(str(d / "api.json"))
    assert "screening settings" in seen                    # the search's progress reached the callback
    # the verb's plan: the same, field by field (but the search's wall time)
    assert _without_timings(json.loads((d / "api.json").read_text())) == _without_timings(plan.to_dict())
    assert _without_timings(cli["plan"]) == _without_timings(plan.to_dict())
    ours = out.to_dict()
    for key in ("runner_ups", "compile", "float8", "validation"):
        assert json.loads(json.dumps(ours[key], default=float)) == cli[key], key


def test_the_planned_step_is_what_simulate_gives_its_file(planned):
    import autopar

    d, out, _, _ = planned
    sim = autopar.simulate(d / "api.json")
    assert sim.result.step_time_s == out.plan.predicted["step_time_s"]
    assert sim.plan.world_size == out.plan.world_size and sim.cluster.name == "local-cpu"


def test_simulate_a_configuration_as_the_verb_does(capsys):
    import autopar

    sim = autopar.simulate(MODEL, cluster="local-cpu", degrees={"dp": 2}, micro_batch=2, global_batch=8)
    # closed facts: dp 2 x the other axes at 1; 8 samples = dp 2 x micro-batch 2 x 2 micro-batches
    assert sim.plan.world_size == 2 and sim.plan.pipeline.num_microbatches == 2
    cli = run_cli("simulate", MODEL, "--cluster", "local-cpu", "--dp", "2", "--micro-batch", "2", "--global-batch", "8",
                  "--json")
    assert cli.returncode == 0, cli.stderr
    printed = json.loads(cli.stdout)
    assert printed["step_time_s"] == sim.result.step_time_s
    assert printed["plan"] == json.loads(json.dumps(sim.to_dict()["plan"]))
    # unset, the batch axis takes the devices the others leave: 4 on local-cpu (a Cluster object here)
    from autopar.core.cluster import load_cluster

    assert autopar.simulate(MODEL, cluster=load_cluster("local-cpu"), global_batch=8).plan.mesh.dp == 4


def test_simulate_refuses_an_axis_it_does_not_know():
    import autopar
    from autopar.core.errors import UserError

    with pytest.raises(UserError, match="not a parallel axis"):
        autopar.simulate(MODEL, cluster="local-cpu", degrees={"dpp": 2})


def test_report_of_a_run_measured_slower(planned, tmp_path):
    import autopar

    d, out, _, _ = planned
    predicted = out.plan.predicted["step_time_s"]
    measured = {"step_time_s": 1.25 * predicted, "fingerprint": out.plan.model.fingerprint,
                "world_size": out.plan.world_size}
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    rep = autopar.report(d / "api.json", tmp_path / "measured.json")
    step = next(f for f in rep.figures if f.key == "step_time_s")
    assert step.error == pytest.approx(1 / 1.25 - 1, rel=1e-12)      # (simulated - measured) / measured
    cli = run_cli("report", d / "api.json", tmp_path / "measured.json", "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["figures"] == json.loads(json.dumps(rep.to_dict()["figures"], default=str))


def test_no_output_replaces_an_input(tmp_path):
    import shutil

    import autopar
    from autopar.core.errors import UserError

    model = tmp_path / "model.py"
    shutil.copy(MODEL, model)
    before = model.read_text()
    with pytest.raises(UserError, match="same file as the model file"):
        autopar.plan(model, "local-cpu", 8, output=model, **PLAN_ARGS)
    with pytest.raises(UserError, match="same file as the model file"):
        autopar.simulate(model, cluster="local-cpu", trace=model)
    assert model.read_text() == before


def test_plan_on_a_cluster_object(planned):
    import autopar
    from autopar.core.cluster import load_cluster

    _, out, _, _ = planned
    again = autopar.plan(MODEL, load_cluster("local-cpu"), 8, **PLAN_ARGS).plan.to_dict()
    first = out.plan.to_dict()
    # the same plan; a Cluster object is not a file or name the plan could load again
    assert first["provenance"].pop("cluster_ref") == "local-cpu" and again["provenance"].pop("cluster_ref") is None
    assert _without_timings(again) == _without_timings(first)
