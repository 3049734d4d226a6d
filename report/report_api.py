"""``autopar.report(plan, measured, ...)``: a plan's prediction against a measured run, as a
Python function (``autopar report`` prints what it returns).

    import autopar
    rep = autopar.report("plan.json", "measured.json")
    print(rep.summary["median_abs_error"], [f.to_dict() for f in rep.figures])

The simulated side is the plan's ``predicted`` block, completed by re-simulating the plan
(with the plan's profile, or ``profile=``) for the forward / backward / communication /
optimizer breakdown, the memory per rank and the timeline (report/resimulate.py).
``calibrate=PROFILE_JSON`` refits the profile's efficiency factors to this run (and the
``with_runs`` pairs) and writes it there; ``html=`` / ``png=`` write the page or the figures,
the training curves beside ``png`` (``curves_png_path``).  Bad input raises ``UserError``;
nothing is printed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from autopar.core.errors import UserError
from autopar.core.measured import CPU_RSS_GROWTH, Measured, MeasuredFileError, read_measured


@dataclass
class Report:
    """What ``report`` found: the figures compared (``compare.Figure``), their error summary,
    the notes, the profile re-simulated with, and what was written."""
    plan_path: str
    measured_path: str
    profile_name: str
    figures: list
    summary: dict
    notes: list[str]
    calibration: object = None           # report/calibrate.CalibrationResult, with calibrate=
    calibrate_output: str | None = None
    curves_png: Path | None = None       # the training curves written beside png=
    written: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """``autopar report --json``'s object."""
        out = {"plan": self.plan_path, "measured": self.measured_path, "profile": self.profile_name,
               "figures": [f.to_dict() for f in self.figures], "summary": self.summary, "notes": self.notes}
        if self.calibration is not None:
            out["calibration"] = calibration_dict(self.calibration, self.calibrate_output)
        if self.curves_png is not None:
            out["curves_png"] = str(self.curves_png)
        return out


def report(plan: str | Path, measured: str | Path, *, cluster: str | None = None, profile: str | None = None,
           calibrate: str | Path | None = None, with_runs=(), html: str | Path | None = None,
           png: str | Path | None = None) -> Report:
    """Compare the plan file ``plan`` with the run's ``measured`` (measured.json), re-simulated on
    ``cluster`` (default: the plan's) with ``profile`` (default: the plan's).  ``calibrate``: write
    the profile refitted to this run and the ``with_runs`` ((plan, measured) pairs) there.
    ``html`` or ``png``: write the report page or its figures too.  Every output is checked
    writable before any work."""
    from autopar.core.output_file import check_not_read, check_writable, write_text_atomic
    from autopar.core.plan import load_plan
    from autopar.report import compare, resimulate

    plan_path, measured_path = str(plan), str(measured)
    if with_runs and not calibrate:
        raise UserError("--with adds runs to the --calibrate fit; add --calibrate -o PROFILE_JSON, or drop --with.")
    if html and png:
        raise UserError("--html and --png are two forms of the same figures; give one of them.")
    for flag, path in (("-o", calibrate), ("--html", html), ("--png", png)):
        if path:
            check_writable(path, flag)
            check_not_read(path, flag, {"plan file": plan_path, "measured file": measured_path})
    curves_path = curves_png_path(png) if png else None
    if curves_path is not None:
        check_writable(curves_path, "--png (its curves figure)")
    the_plan = load_plan(plan_path)
    the_measured = load_measured(measured_path)
    compare.check_same_run(the_plan.model.fingerprint, the_plan.world_size, the_measured, plan_path, measured_path,
                           plan_identity=the_plan.identity)
    ctx = resimulate.load_context(the_plan, plan_path, cluster_path=cluster, profile=profile)
    resim, events = resimulate.simulate_figures(ctx, the_plan)
    simulated = {**resim, **{k: v for k, v in the_plan.predicted.items() if compare.is_number(v)}}
    figures = compare.join(simulated, the_measured)
    if not figures:
        raise UserError(f"{plan_path} and {measured_path} share no figure to compare (step_time_s, ...); "
                        f"measured.json is written by 'autopar run'.")
    notes = _notes(the_plan, resim, the_measured, ctx.profile_name)
    missing = compare.unobserved(simulated, the_measured)
    if missing:
        notes.append(f"left out: {', '.join(missing)} measured as 0 -- the run's profiler saw no region with that "
                     f"label (e.g. pipeline stages the schedule does not label), which is not a measurement.")

    from autopar.report.curves import curve_data

    curves = curve_data(the_measured, simulated.get("step_time_s"))
    if curves.empty:
        curves_path = None
        if html or png:
            notes.append("no training curves: measured.json has no losses or step times per step.")
    out = Report(plan_path, measured_path, ctx.profile_name, figures, compare.error_summary(figures), notes,
                 calibrate_output=None if calibrate is None else str(calibrate), curves_png=curves_path)
    if calibrate:
        from autopar.profiles import load_profile

        out.calibration = _calibrate(ctx, the_plan, the_measured, Path(calibrate), Path(plan_path).stem,
                                     measured_path, more=with_runs or ())
        load_profile(out.calibration.profile)          # the schema's checks before anything is written
        write_text_atomic(calibrate, json.dumps(out.calibration.profile, indent=1) + "\n")
        out.written.append(str(calibrate))
    if html or png:
        _write_figures(out, the_plan, the_measured, resim, events, curves, html=html, png=png)
    return out


def _write_figures(out: Report, plan, measured: Measured, resim: dict, events, curves, *, html, png) -> None:
    """The timelines, memory per rank and training curves as PNG files (``png``) or one HTML page
    (``html``)."""
    from autopar.core.output_file import write_bytes_atomic, write_text_atomic
    from autopar.report import figures as figs
    from autopar.report.html_page import render_html
    from autopar.report.timelines import measured_lanes, simulated_lanes

    trace = measured.trace_file
    meas_lanes = measured_lanes(_resolve(trace, out.measured_path)) if trace else None
    meas_memory = None if measured.memory_per_rank_bytes is None else list(measured.memory_per_rank_bytes)
    fig = figs.report_figure(simulated_lanes(events), meas_lanes, list(resim.get("memory_per_rank_bytes", [])),
                             meas_memory,
                             f"{plan.model.name}: simulated ({out.profile_name}) vs measured — {out.plan_path}")
    png_bytes = figs.figure_png_bytes(fig)
    curves_png = None if curves.empty else figs.figure_png_bytes(figs.curves_figure(
        curves, f"{plan.model.name}: training curves ({out.measured_path}), simulated step time ({out.profile_name})"))
    if png:
        write_bytes_atomic(png, png_bytes)
        out.written.append(str(png))
        if out.curves_png is not None:
            write_bytes_atomic(out.curves_png, curves_png)
            out.written.append(str(out.curves_png))
    else:
        write_text_atomic(html, render_html(out.figures, out.summary, out.notes, png_bytes, out.plan_path,
                                            out.measured_path, out.profile_name, out.calibration,
                                            curves_png=curves_png))
        out.written.append(str(html))


def curves_png_path(png: str | Path) -> Path | None:
    """Where ``--png FILE`` puts the training curves: beside it, ``FILE``'s stem + ``.curves.png``;
    None for a device or FIFO (``/dev/null``), which takes the one figure only."""
    from autopar.core.output_file import is_special

    p = Path(png)
    return None if is_special(p) else p.with_name(p.stem + ".curves.png")


def load_measured(path: str) -> Measured:
    """measured.json, read by its schema (autopar.core.measured); a report also needs a step:
    step_time_s > 0."""
    m = read_measured(path)
    if m.step_time_s <= 0:
        raise MeasuredFileError(f"measured file {path}, field step_time_s: the value is {m.step_time_s!r}; a step "
                                f"takes a time > 0 (a run that trained no step measures nothing); it should be the "
                                f"measured.json 'autopar run' wrote: measure the plan again.")
    return m


def _calibrate(ctx, plan, measured, output: Path, name: str, measured_path: str, more=()):
    """The profile refitted to this run and the ``more`` runs ((plan path, measured path) pairs,
    ``--with``), each re-simulated on its own cluster with the same profile."""
    runs = [(name, ctx, plan, measured)]
    for plan_path, measured_path_k in more:
        from autopar.core.plan import load_plan
        from autopar.report import compare, resimulate

        plan_k, measured_k = load_plan(plan_path), load_measured(measured_path_k)
        compare.check_same_run(plan_k.model.fingerprint, plan_k.world_size, measured_k, plan_path, measured_path_k)
        ctx_k = resimulate.load_context(plan_k, plan_path, profile=ctx.profile_name)
        runs.append((_run_name(plan_path, [r[0] for r in runs]), ctx_k, plan_k, measured_k))
    return calibrate_runs(ctx.profile, runs, output, ", ".join([measured_path, *(m for _, m in more)]))


def _run_name(plan_path: str, taken: list[str]) -> str:
    """A name for a run in the calibration's report: the plan file's stem, or with its folder
    when that stem is taken (trial-1/plan.json, trial-2/plan.json)."""
    p = Path(plan_path)
    name = p.stem
    if name in taken:
        name = f"{p.parent.name}/{p.stem}"
    k = 2
    while name in taken:
        name, k = f"{p.stem}-{k}", k + 1
    return name


def calibrate_runs(profile: dict, runs, output: Path, measured_paths: str):
    """``profile`` refitted to several measured runs at once (report/calibrate.py): ``runs`` is a
    list of (name, PlanContext, Plan, Measured); each run is one observation, predicted by
    re-simulating its plan on its context's graph and cluster.  Used by ``report --calibrate``
    (one run, or more with ``--with``) and by ``autopar plan --trial-steps`` (every trial)."""
    from autopar.report.calibrate import Observation, calibrate
    from autopar.report.resimulate import simulate_figures

    def predictor(ctx, plan):
        return lambda prof: simulate_figures(ctx, plan, prof, timeline=True)[0]

    obs = [Observation(name=name, measured=measured.figures(), predict=predictor(ctx, plan))
           for name, ctx, plan, measured in runs]
    try:
        res = calibrate(profile, obs)
    except ValueError as e:
        raise UserError(f"calibration cannot fit the profile to {measured_paths}: {e}. Calibration needs a "
                        f"measured.json with positive step, forward/backward or communication times from a run "
                        f"of this plan ('autopar run PLAN --profile'); nothing was written to {output}.") from None
    res.profile["name"] = Path(output).stem
    return res


def _notes(plan, resim: dict, measured: Measured, profile_name: str) -> list[str]:
    notes = []
    pred = plan.predicted.get("step_time_s")
    if isinstance(pred, (int, float)) and resim.get("step_time_s") and abs(resim["step_time_s"] - pred) > 1e-3 * pred:
        notes.append(f"re-simulating with profile {profile_name} gives step time {resim['step_time_s']:.4g} s; the "
                     f"plan recorded {pred:.4g} s (another profile, or the planner's closed-form estimate rather than "
                     f"the event simulation); the table shows the plan's figures, and the breakdown and memory per "
                     f"rank re-simulated.")
    if measured.memory_kind == CPU_RSS_GROWTH:
        notes.append("measured memory on CPU is the growth of the process's peak resident set size (allocator slack, "
                     "the Python heap and the communication library's buffers included).")
    if measured.fwd_s is None:
        notes.append("no forward/backward/communication/optimizer breakdown measured: run with --profile for it.")
    return notes


def calibration_dict(res, output) -> dict:
    return {"output": str(output), "scales": res.scales, "uninformed": res.uninformed,
            "changes": [{"factor": c.factor, "old_efficiency": c.old_efficiency, "new_efficiency": c.new_efficiency,
                         "time_scale": c.time_scale, "why": c.why} for c in res.changes],
            "errors_before": res.errors_before, "errors_after": res.errors_after}


def _resolve(path: str, measured_path: str) -> Path:
    p = Path(path)
    return p if p.is_file() else Path(measured_path).parent / p.name
