"""``autopar plan --trial-steps N``: measure the shortlist, keep the fastest, calibrate.

The simulator's error on plans of one family is as large as the gap between the winner and
the runner-ups inside its validation band (planner/confidence.py), so those plans are too
close to call on paper.  With ``--trial-steps N`` the planner settles it by running them:

1. the shortlist (``shortlist``): the winner and every runner-up predicted within the band,
   filled up to ``--trial-plans`` plans (default 3) with the next fastest runner-ups, so the
   calibration below sees more than one layout;
2. each is written to ``<plan>.trials/<k>/plan.json`` and started with ``autopar run``'s own
   launch path (``autopar.runtime.run_launch.run_plan``, the one function of the runtime the planner
   calls: the planner starts plans as a user would, and the runtime never imports the planner).
   On one node torchrun runs it here for N steps and the runtime writes measured.json beside
   it; a plan for several nodes gets its per-node commands printed and is not measured;
3. the plan with the lowest measured step time is kept (the predicted order when nothing was
   measured) and written to ``-o`` with the simulator's ``predicted`` block and the trials'
   measured figures under ``provenance.trial_steps``;
4. the profile is refitted to every measured trial at once (the fit of ``autopar report
   --calibrate``, report/calibrate.py, one observation per trial) into
   ``<plan>.calibrated-profile.json``.

A trial that fails (a plan the runtime refuses, a rank that dies) is reported with its log and
left out; it never stops the others.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

#: the accuracy benchmark's committed results: the band for a CPU profile (no published runs)
ACCURACY_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "accuracy_local_cpu.json"
DEFAULT_TRIAL_PLANS = 3
#: steps left out of the measured median (the runtime's default, runtime/options.py)
WARMUP_STEPS = 2


@dataclass
class Trial:
    index: int                     # 1-based, in predicted order
    evaluated: object              # planner.search.Evaluated
    plan_path: Path
    predicted_s: float
    in_band: bool
    measured_s: float | None = None
    measured_path: Path | None = None
    log_path: Path | None = None
    error: str | None = None       # why it did not measure
    wall_s: float = 0.0
    commands: str | None = None    # several nodes: what to run on each

    def to_dict(self) -> dict:
        return {"index": self.index, "plan": str(self.plan_path), "predicted_step_time_s": self.predicted_s,
                "measured_step_time_s": self.measured_s,
                "measured": None if self.measured_path is None else str(self.measured_path),
                "in_validation_band": self.in_band, "error": self.error, "wall_s": round(self.wall_s, 2)}


@dataclass
class TrialOutcome:
    trials: list[Trial]
    kept: Trial
    band: float
    band_source: str
    multi_node: bool
    breakdown: bool = False        # the trials ran with the runtime's --profile
    calibrated_profile: Path | None = None
    calibration_note: str = ""
    calibration: object = None     # report.calibrate.CalibrationResult

    @property
    def measured(self) -> list[Trial]:
        return [t for t in self.trials if t.measured_s is not None]


def cpu_band(path: Path = ACCURACY_RESULTS) -> tuple[float, str] | None:
    """The median |step-time error| of the committed accuracy benchmark on this machine, or None."""
    try:
        data = json.loads(path.read_text())
        value = float(data["summary"]["median_abs_step_error"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value, (f"local-cpu plans: median |error| {100 * value:.1f}% over "
                   f"{data['summary'].get('num_plans', '?')} plans (benchmarks/accuracy_local_cpu.py)")


def band_for(errors: list, cluster) -> tuple[float, str]:
    """The validation band of the winner: its family's median |error| on published runs
    (planner/confidence.py), else, on a CPU cluster, the accuracy benchmark's median; else 0."""
    if errors and errors[0] is not None:
        return errors[0].median_abs, errors[0].describe()
    if cluster.backend == "gloo":
        cpu = cpu_band()
        if cpu is not None:
            return cpu
    return 0.0, "no validation figures for this plan family and device"


def shortlist(steps: list[float], band: float, min_plans: int) -> list[tuple[int, bool]]:
    """(index into ``steps``, inside the band) of the plans to try: ``steps[0]`` (the winner), every
    plan within ``band`` of it, then the next fastest until ``min_plans`` are chosen."""
    inside = [i for i, s in enumerate(steps) if i == 0 or s <= steps[0] * (1.0 + band)]
    rest = [i for i in range(len(steps)) if i not in inside]
    chosen = inside + rest[:max(0, min_plans - len(inside))]
    return [(i, i in inside) for i in sorted(chosen)]


def trial_paths(output: str | Path) -> tuple[Path, Path]:
    """(folder of the trials, calibrated profile) for the plan written to ``output``."""
    out = Path(output)
    return out.with_name(out.stem + ".trials"), out.with_name(out.stem + ".calibrated-profile.json")


Launch = Callable[..., int]


def run_trials(evaluated: list, in_band: list[bool], *, steps: int, output: str | Path, multi_node: bool,
               provenance: dict, say: Callable[..., None], launch: Launch | None = None,
               breakdown: bool = False) -> list[Trial]:
    """Write each plan of ``evaluated`` (Evaluated, predicted order) under the trials folder and
    start it with ``launch`` (default: autopar run's ``run_plan``; ``breakdown``: with the
    runtime's ``--profile``); one line per trial."""
    from autopar.core.measured import MeasuredFileError, read_measured
    from autopar.core.plan import save_plan
    from autopar.core.errors import UserError

    if launch is None:
        from autopar.runtime.run_launch import run_plan as launch
    folder, _ = trial_paths(output)
    trials = []
    warmup = min(WARMUP_STEPS, steps - 1)
    for k, (ev, band_mark) in enumerate(zip(evaluated, in_band), 1):
        d = folder / str(k)
        d.mkdir(parents=True, exist_ok=True)
        plan_path = d / "plan.json"
        measured_path = d / "measured.json"
        measured_path.unlink(missing_ok=True)       # a stale file from an earlier trial must not count
        plan = ev.plan.with_predicted(ev.plan.predicted, **provenance)
        save_plan(plan, plan_path)
        t = Trial(index=k, evaluated=ev, plan_path=plan_path, predicted_s=ev.step_time_s, in_band=band_mark,
                  log_path=d / "run.log")
        trials.append(t)
        head = f"trial {k}/{len(evaluated)}  {_describe(plan):<34} predicted {1e3 * t.predicted_s:8.1f} ms"
        t0 = time.perf_counter()
        if multi_node:
            t.error = "several nodes: not run here"
            say(head + "  -> run on every node:")
            code = launch(plan_path, steps=steps, timing_warmup_steps=warmup, profile=breakdown)
            t.wall_s = time.perf_counter() - t0
            if code != 0:
                t.error = f"autopar run exited {code}"
            continue
        say(head, end="")                       # the rest of the line when the run ends
        try:
            with open(t.log_path, "w") as log:
                code = launch(plan_path, steps=steps, timing_warmup_steps=warmup, profile=breakdown, log=log)
        except UserError as e:
            code, t.error = 2, str(e)
        t.wall_s = time.perf_counter() - t0
        if code == 0:
            try:
                t.measured_s = read_measured(measured_path).step_time_s
                t.measured_path = measured_path
                if not t.measured_s > 0:
                    t.measured_s, t.error = None, "measured no step"
            except (MeasuredFileError, OSError) as e:
                t.error = f"no measurement: {e}"
        elif t.error is None:
            t.error = f"exit {code}: {_last_line(t.log_path)}"
        if t.measured_s is not None:
            err = (t.predicted_s - t.measured_s) / t.measured_s
            say(f"  measured {1e3 * t.measured_s:8.1f} ms  ({err:+.1%})  [{t.wall_s:.0f} s]")
        else:
            say(f"  FAILED ({t.error}; log {t.log_path})  [{t.wall_s:.0f} s]")
    return trials


def keep_fastest(trials: list[Trial]) -> Trial:
    """The trial with the lowest measured step time; the predicted winner when none measured."""
    measured = [t for t in trials if t.measured_s is not None]
    return min(measured, key=lambda t: (t.measured_s, t.index)) if measured else trials[0]


def calibrate_trials(trials: list[Trial], profile: str | None, output: Path):
    """The profile refitted to every measured trial (report_api.calibrate_runs), written to
    ``output``; returns the CalibrationResult."""
    from autopar.core.output_file import write_text_atomic
    from autopar.core.plan import load_plan
    from autopar.profiles import load_profile
    from autopar.report import resimulate
    from autopar.report.report_api import calibrate_runs, load_measured

    runs = []
    for t in trials:
        if t.measured_s is None:
            continue
        plan = load_plan(t.plan_path)
        ctx = resimulate.load_context(plan, t.plan_path, profile=profile)
        runs.append((f"trial {t.index}", ctx, plan, load_measured(str(t.measured_path))))
    res = calibrate_runs(runs[0][1].profile, runs, output, ", ".join(str(t.measured_path) for t in trials
                                                                       if t.measured_path))
    load_profile(res.profile)                  # the schema's checks before anything is written
    write_text_atomic(output, json.dumps(res.profile, indent=1) + "\n")
    return res


def trial_provenance(outcome: TrialOutcome, steps: int) -> dict:
    """What plan.json records of the trials (``provenance.trial_steps``)."""
    kept = outcome.kept
    return {"steps": steps, "warmup_steps": min(WARMUP_STEPS, steps - 1), "breakdown": outcome.breakdown,
            "band": outcome.band, "band_source": outcome.band_source,
            "kept": kept.index, "kept_because": ("lowest measured step time" if kept.measured_s is not None
                                                 else "nothing was measured: the predicted winner"),
            "predicted_step_time_s": kept.predicted_s, "measured_step_time_s": kept.measured_s,
            "measured": None if kept.measured_path is None else str(kept.measured_path),
            "calibrated_profile": None if outcome.calibrated_profile is None else str(outcome.calibrated_profile),
            "trials": [t.to_dict() for t in outcome.trials]}


def trial_shortlist(result, errors: list, cluster, *, steps: int, output: str | Path, min_plans: int,
                    provenance: dict, profile: str | None, say: Callable[..., None],
                    launch: Launch | None = None, breakdown: bool = False) -> TrialOutcome:
    """Steps 1-4 of the module docstring for a search result (best first, then the runner-ups,
    with ``errors`` their FamilyErrors from planner/confidence.py)."""
    from autopar.core.errors import UserError

    plans = [result.best] + list(result.runner_ups)
    band, band_source = band_for(errors, cluster)
    picks = shortlist([ev.step_time_s for ev in plans], band, min_plans)
    counts = cluster.ranks_per_node(plans[0].plan.world_size) or [plans[0].plan.world_size]
    multi_node = len(counts) > 1
    folder, profile_out = trial_paths(output)
    inside = sum(1 for _, b in picks if b)
    say(f"trial steps: {len(picks)} plans, {steps} steps each ({inside} within the validation band of "
        f"{100 * band:.1f}%: {band_source}); runs in {folder}")
    trials = run_trials([plans[i] for i, _ in picks], [b for _, b in picks], steps=steps, output=output,
                        multi_node=multi_node, provenance=provenance, say=say, launch=launch,
                        breakdown=breakdown)
    outcome = TrialOutcome(trials=trials, kept=keep_fastest(trials), band=band, band_source=band_source,
                           multi_node=multi_node, breakdown=breakdown)
    if outcome.measured:
        say(f"refitting the profile to the {len(outcome.measured)} measured trials (report --calibrate's fit) ...")
        try:
            res = calibrate_trials(trials, profile, profile_out)
            outcome.calibrated_profile, outcome.calibration = profile_out, res
            changed = "; ".join(f"{c.factor} x{c.time_scale:.3f}" for c in res.changes) or "nothing changed"
            after = [abs(e["step_time_s"]) for e in res.errors_after.values() if "step_time_s" in e]
            outcome.calibration_note = (f"fitted on {len(outcome.measured)} trials: {changed}"
                                        + (f"; median |step error| on them now {statistics.median(after):.1%}"
                                           if after else ""))
        except (UserError, ValueError) as e:
            outcome.calibration_note = f"not written ({e})"
    return outcome


def summary_lines(outcome: TrialOutcome) -> list[str]:
    """The closing lines of the trial display."""
    lines = []
    m = outcome.measured
    if outcome.multi_node:
        lines.append("trial steps: the plans span several nodes; run the commands above on each node, then "
                     "'autopar report PLAN MEASURED --calibrate' on the measured.json files. Kept the predicted winner.")
        return lines
    if not m:
        lines.append("trial steps: no trial measured a step; kept the predicted winner (see the logs above).")
        return lines
    k = outcome.kept
    lines.append(f"kept trial {k.index}: measured {1e3 * k.measured_s:.1f} ms, the fastest of {len(m)} measured "
                 f"(predicted {1e3 * k.predicted_s:.1f} ms)")
    if k.index != 1:
        first = outcome.trials[0]
        if first.measured_s is not None:
            lines.append(f"  the predicted winner measured {1e3 * first.measured_s:.1f} ms "
                         f"({first.measured_s / k.measured_s - 1:+.1%} slower than the kept plan)")
    errs = [abs(t.predicted_s - t.measured_s) / t.measured_s for t in m]
    lines.append(f"  prediction error over the trials: median |error| {statistics.median(errs):.1%}")
    if outcome.calibrated_profile is not None:
        lines.append(f"calibrated profile: {outcome.calibrated_profile}  ({outcome.calibration_note})")
    elif outcome.calibration_note:
        lines.append(f"calibration: {outcome.calibration_note}")
    return lines


def _describe(plan) -> str:
    kinds = sorted({("z%d" % lp.zero if lp.zero else "") + (f"+rc-{lp.recompute}" if lp.recompute != "none" else "")
                    + ("+tp" if lp.tp else "") for lp in plan.layers})
    kinds = [k.lstrip("+") for k in kinds if k]
    return (f"{plan.mesh.describe('{name}{size}', sep=' ')} mb{plan.micro_batch}x{plan.pipeline.num_microbatches}"
            + (" " + "/".join(kinds) if kinds else ""))


def _last_line(path: Path | None) -> str:
    try:
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except (OSError, TypeError):
        return "no log"
    return lines[-1][-200:] if lines else "no output"


def say_to(stream=None) -> Callable[..., None]:
    """A progress printer: ``say(text)`` a line, ``say(text, end="")`` the start of one."""
    def say(text: str, end: str = "\n") -> None:
        print(text, file=stream or sys.stdout, flush=True, end=end)
    return say
