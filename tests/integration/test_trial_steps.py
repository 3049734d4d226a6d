"""``autopar plan --trial-steps N`` (planner/trial_steps.py): the shortlist is measured with
autopar run's launch path, the fastest measured plan is kept, plan.json holds both figures,
and the profile is refitted to every trial.

The mechanics are checked against the runs themselves (each trial's measured.json written by
the runtime), never against a timing window: which plan measured fastest is whatever the runs
say on this machine at the time.  ``autopar report`` and the ``autopar plan`` calls that launch
nothing run in the test process (tests/cli_inprocess.py).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.core.measured import Measured
from autopar.core.plan import ModelRef, load_plan, uniform_plan
from autopar.planner import trial_steps as ts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_inprocess import run_cli  # noqa: E402
from runtime_support import ROOT, worker_env  # noqa: E402

GPT = ["examples/gpt.py", "--model-arg", "layers=2", "--model-arg", "hidden=64", "--model-arg", "heads=2",
       "--model-arg", "seq=32", "--model-arg", "vocab=256", "--batch-size", "2"]


def test_shortlist_is_the_band_filled_up_to_k():
    # winner 1.0; band 5%: 1.03 inside, 1.08 and 1.2 outside
    assert ts.shortlist([1.0, 1.03, 1.08, 1.2], 0.05, 3) == [(0, True), (1, True), (2, False)]
    # a wide band keeps every plan inside it, more than k
    assert ts.shortlist([1.0, 1.03, 1.08, 1.2], 0.25, 2) == [(0, True), (1, True), (2, True), (3, True)]
    # no band: the k fastest
    assert ts.shortlist([1.0, 1.01, 1.5], 0.0, 2) == [(0, True), (1, False)]


class _Ev:
    def __init__(self, plan, step):
        self.plan, self._step = plan, step

    @property
    def step_time_s(self):
        return self._step


def _plans():
    model = ModelRef(file="m.py", args={}, name="m", fingerprint="f")
    return [_Ev(uniform_plan(model=model, num_layers=2, dp=2, micro_batch=mb, num_microbatches=2 // mb).with_predicted(
        {"step_time_s": s}), s) for mb, s in ((2, 0.10), (1, 0.11), (2, 0.12))]


def test_a_failed_trial_is_reported_and_the_fastest_measured_is_kept(tmp_path):
    """A launcher standing in for autopar run: trial 2 fails, trials 1 and 3 write measured.json
    with step times where the third is fastest; the loop goes on past the failure and keeps 3."""
    steps_by_trial = {"1": 0.30, "3": 0.20}

    def launch(plan_path, *, steps, timing_warmup_steps, profile=False, log=None):
        k = Path(plan_path).parent.name
        assert steps == 4 and timing_warmup_steps == 2 and log is not None
        if k not in steps_by_trial:
            print("rank 1: boom", file=log)
            return 1
        m = Measured(step_time_s=steps_by_trial[k], step_times_s=[steps_by_trial[k]] * steps, world_size=2)
        (Path(plan_path).parent / "measured.json").write_text(json.dumps(m.to_json()))
        return 0

    lines = []
    trials = ts.run_trials(_plans(), [True, True, False], steps=4, output=tmp_path / "plan.json", multi_node=False,
                           provenance={"cluster_ref": "local-cpu"}, say=lambda text, end="\n": lines.append(text),
                           launch=launch)
    assert [t.measured_s for t in trials] == [0.30, None, 0.20]
    assert "boom" in trials[1].error and "FAILED" in "".join(lines)
    assert ts.keep_fastest(trials).index == 3
    written = load_plan(tmp_path / "plan.trials" / "2" / "plan.json")
    assert written.provenance["cluster_ref"] == "local-cpu" and written.micro_batch == 1
    # nothing measured: the predicted winner stays
    for t in trials:
        t.measured_s = None
    assert ts.keep_fastest(trials).index == 1


def _plan_cli(tmp_path, *extra):
    return run_cli("plan", *GPT, "--time-budget", "5", "-o", tmp_path / "plan.json", "--json", *extra, cwd=ROOT)


@pytest.mark.multiproc
def test_trial_steps_on_local_cpu_measures_three_plans_and_keeps_the_fastest(tmp_path):
    """The whole loop on the 4-process local-cpu cluster (one torchrun per trial), from an
    ``autopar plan`` process (run in this process it measured fewer than three plans: left as is)."""
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "plan", *GPT, "--time-budget", "5",
                          "-o", str(tmp_path / "plan.json"), "--json", "--cluster", "local-cpu", "--global-batch", "8",
                          "--trial-steps", "3"], cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout)                   # the progress went to stderr
    assert out.stderr.count("trial ") >= 3 and "measured" in out.stderr
    trials = summary["trial_steps"]["trials"]
    assert len(trials) == 3
    runs = []
    for t in trials:
        assert t["error"] is None, t
        m = json.loads(Path(t["measured"]).read_text())     # what the runtime wrote
        assert m["step_time_s"] == pytest.approx(t["measured_step_time_s"])
        runs.append((m["step_time_s"], t))
    fastest = min(runs, key=lambda r: r[0])[1]
    plan = load_plan(tmp_path / "plan.json")
    rec = plan.provenance["trial_steps"]
    assert rec["kept"] == fastest["index"]
    kept_plan = load_plan(fastest["plan"])
    assert (plan.mesh, plan.micro_batch, plan.layers) == (kept_plan.mesh, kept_plan.micro_batch, kept_plan.layers)
    # both figures: the simulator's prediction of the kept plan and its measured step
    assert plan.predicted["step_time_s"] == pytest.approx(kept_plan.predicted["step_time_s"])
    assert rec["predicted_step_time_s"] == pytest.approx(plan.predicted["step_time_s"])
    assert rec["measured_step_time_s"] == pytest.approx(min(r[0] for r in runs))
    # the profile refitted to all three trials exists, loads, and says what it was fitted on
    from autopar.profiles import load_profile

    prof = load_profile(rec["calibrated_profile"])
    assert Path(rec["calibrated_profile"]) == tmp_path / "plan.calibrated-profile.json"
    assert prof["name"] == "plan.calibrated-profile"
    src = json.dumps(prof.get("sources", {}))
    assert all(f"trial {k}" in src for k in (1, 2, 3)) or "calibration" not in src

    # report --calibrate --with: the same multi-run fit from the command line
    t1, t2 = trials[0], trials[1]
    rep = run_cli("report", t1["plan"], t1["measured"], "--calibrate", "-o", tmp_path / "two.json",
                  "--with", t2["plan"], t2["measured"], "--json", cwd=ROOT)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    cal = json.loads(rep.stdout)["calibration"]
    assert set(cal["errors_before"]) == {"plan", "2/plan"}


@pytest.mark.slow          # an `autopar plan` search, about 5 s
def test_trial_steps_on_several_nodes_prints_the_commands(tmp_path):
    out = _plan_cli(tmp_path, "--cluster", "dgx-a100-4x8", "--global-batch", "64", "--trial-steps", "2",
                    "--no-runtime-check")
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout)
    rec = summary["trial_steps"]
    assert len(rec["trials"]) >= 1 and all(t["measured_step_time_s"] is None for t in rec["trials"])
    assert "--nnodes" in out.stderr and rec["kept"] == 1 and rec["calibrated_profile"] is None
    assert not (tmp_path / "plan.calibrated-profile.json").exists()


def test_report_with_needs_calibrate_and_plan_trial_flags_need_trial_steps(tmp_path):
    """Flags that only make sense with another are refused with exit 2 before any work."""
    rep = run_cli("report", "a.json", "b.json", "--with", "c.json", "d.json", cwd=ROOT)
    flat = lambda text: " ".join(text.split())  # noqa: E731  (messages are wrapped as paragraphs)
    assert rep.returncode == 2 and "--with adds runs to the --calibrate fit" in flat(rep.stderr)
    out = _plan_cli(tmp_path, "--cluster", "local-cpu", "--global-batch", "8", "--trial-plans", "2")
    assert out.returncode == 2 and "add --trial-steps N" in flat(out.stderr)
    out = _plan_cli(tmp_path, "--cluster", "local-cpu", "--global-batch", "8", "--trial-steps", "2",
                    "--trial-plans", "5")
    assert out.returncode == 2 and "raise --top-k to 4" in flat(out.stderr)
    assert not (tmp_path / "plan.json").exists() and not (tmp_path / "plan.trials").exists()
