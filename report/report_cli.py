"""``autopar report``: a plan's prediction against a measured run; optionally recalibrate.

    autopar report plan.json measured.json [--html report.html | --png report.png] [--json]
    autopar report plan.json measured.json --calibrate -o profiles/my-machine.json

The simulated side is the plan's ``predicted`` block, completed by re-simulating the plan
(with the plan's profile, or ``--profile``) for the forward / backward / communication /
optimizer breakdown, the memory per rank and the timeline.  With ``--html`` or ``--png`` the
report also draws the run's training curves (report/curves.py): loss per step (and the
validation loss where measured.json has it) and step time per step beside the simulated step
time -- a second image in the HTML page, or a second PNG beside ``--png FILE``,
``FILE``'s stem + ``.curves.png`` (``curves_png_path``), named in the output.
"""
from __future__ import annotations

import argparse
import html
import json
import math
from pathlib import Path

from autopar.core.errors import UserError
from autopar.core.measured import CPU_RSS_GROWTH, Measured, MeasuredFileError, read_measured
from autopar.core.units import fmt_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan.json written by 'autopar plan'")
    p.add_argument("measured", help="measured.json written by a run of that plan")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--html", metavar="FILE", help="write a self-contained HTML report (table + timelines + memory + training curves)")
    out.add_argument("--png", metavar="FILE", help="write the timelines and memory figure as PNG, and the training curves (loss and step "
                                                         "time per step) beside it as FILE's stem + .curves.png")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON instead of a table")
    p.add_argument("--calibrate", action="store_true",
                   help="refit the profile's efficiency factors to this measurement (needs -o)")
    p.add_argument("-o", "--output", metavar="PROFILE_JSON", help="where --calibrate writes the new profile")
    p.add_argument("--with", dest="with_runs", nargs=2, action="append", metavar=("PLAN", "MEASURED"),
                   help="with --calibrate: fit to this run too (repeatable); one fit over every run, each "
                        "re-simulated with the same profile")
    p.add_argument("--profile", default=None, help="profile to simulate with (default: the plan's)")
    p.add_argument("--cluster", default=None, help="cluster file (default: the one recorded in the plan)")


def main(args: argparse.Namespace) -> int:
    from autopar.core.output_file import check_writable, write_bytes_atomic, write_text_atomic
    from autopar.core.plan import load_plan
    from autopar.report import compare, resimulate

    if args.output and not args.calibrate:
        raise UserError("-o is where --calibrate writes the new profile; add --calibrate, or drop -o.")
    if args.with_runs and not args.calibrate:
        raise UserError("--with adds runs to the --calibrate fit; add --calibrate -o PROFILE_JSON, or drop --with.")
    if args.calibrate and not args.output:
        raise UserError("--calibrate needs -o PROFILE_JSON: the file to write the calibrated profile to.")
    for flag, path in (("-o", args.output), ("--html", args.html), ("--png", args.png)):
        if path:
            check_writable(path, flag)
    curves_path = curves_png_path(args.png) if args.png else None
    if curves_path is not None:
        check_writable(curves_path, "--png (its curves figure)")
    plan = load_plan(args.plan)
    measured = load_measured(args.measured)
    compare.check_same_run(plan.model.fingerprint, plan.world_size, measured, args.plan, args.measured,
                           plan_identity=plan.identity)
    ctx = resimulate.load_context(plan, args.plan, cluster_path=args.cluster, profile=args.profile)
    resim, events = resimulate.simulate_figures(ctx, plan)
    simulated = {**resim, **{k: v for k, v in plan.predicted.items() if compare.is_number(v)}}
    figures = compare.join(simulated, measured)
    if not figures:
        raise UserError(f"{args.plan} and {args.measured} share no figure to compare (step_time_s, ...); "
                        f"measured.json is written by 'autopar run'.")
    summary = compare.error_summary(figures)
    notes = _notes(plan, resim, measured, ctx.profile_name)
    missing = compare.unobserved(simulated, measured)
    if missing:
        notes.append(f"left out: {', '.join(missing)} measured as 0 -- the run's profiler saw no region with that "
                     f"label (e.g. pipeline stages the schedule does not label), which is not a measurement.")

    from autopar.report.curves import curve_data

    curves = curve_data(measured, simulated.get("step_time_s"))
    if curves.empty:
        curves_path = None
        if args.html or args.png:
            notes.append("no training curves: measured.json has no losses or step times per step.")
    calibration = None
    if args.calibrate:
        from autopar.profiles import load_profile

        calibration = _calibrate(ctx, plan, measured, Path(args.output), Path(args.plan).stem, args.measured,
                                 more=args.with_runs or ())
        load_profile(calibration.profile)          # the schema's checks before anything is written
        write_text_atomic(args.output, json.dumps(calibration.profile, indent=1) + "\n")

    if args.json:
        out = {"plan": args.plan, "measured": args.measured, "profile": ctx.profile_name,
               "figures": [f.to_dict() for f in figures], "summary": summary, "notes": notes}
        if calibration is not None:
            out["calibration"] = _calibration_dict(calibration, args.output)
        if curves_path is not None:
            out["curves_png"] = str(curves_path)
        print(json.dumps(out, indent=2, default=_json_safe))
    else:
        _print_table(figures, summary, notes, args.plan, args.measured, ctx.profile_name)
        if calibration is not None:
            _print_calibration(calibration, args.output)

    if args.html or args.png:
        from autopar.report import figures as figs
        from autopar.report.timelines import measured_lanes, simulated_lanes

        trace = measured.trace_file
        meas_lanes = measured_lanes(_resolve(trace, args.measured)) if trace else None
        meas_memory = None if measured.memory_per_rank_bytes is None else list(measured.memory_per_rank_bytes)
        fig = figs.report_figure(simulated_lanes(events), meas_lanes, list(resim.get("memory_per_rank_bytes", [])),
                                 meas_memory,
                                 f"{plan.model.name}: simulated ({ctx.profile_name}) vs measured — {args.plan}")
        png = figs.figure_png_bytes(fig)
        curves_png = None if curves.empty else figs.figure_png_bytes(figs.curves_figure(
            curves, f"{plan.model.name}: training curves ({args.measured}), simulated step time ({ctx.profile_name})"))
        if args.png:
            write_bytes_atomic(args.png, png)
            if curves_path is not None:
                write_bytes_atomic(curves_path, curves_png)
                if not args.json:
                    print(f"wrote {args.png} (timelines, memory per rank) and {curves_path} (loss and step time "
                          f"per step)")
        else:
            write_text_atomic(args.html, render_html(figures, summary, notes, png, args.plan, args.measured,
                                                     ctx.profile_name, calibration, curves_png=curves_png))
    return 0


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


def _fmt(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return str(value)
    if unit == "s":
        return f"{value * 1e3:.3f} ms"
    if unit == "B":
        return fmt_bytes(value)
    if unit == "":
        return f"{value:.4f}"
    return f"{value:.4g} {unit}"


def _fmt_err(e: float) -> str:
    return f"{e:+.1%}" if math.isfinite(e) else "n/a"


def _print_table(figures, summary, notes, plan_path, measured_path, profile_name) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"simulated ({profile_name}) vs measured: {plan_path} / {measured_path}")
    for col, just in (("figure", "left"), ("simulated", "right"), ("measured", "right"), ("error", "right")):
        t.add_column(col, justify=just)
    for f in figures:
        colour = "green" if abs(f.error) <= 0.10 else "yellow" if abs(f.error) <= 0.25 else "red"
        t.add_row(f.label, _fmt(f.simulated, f.unit), _fmt(f.measured, f.unit), f"[{colour}]{_fmt_err(f.error)}[/]")
    if summary:
        t.caption = (f"median |error| {summary['median_abs_error']:.1%}, worst {summary['worst_abs_error']:.1%}; "
                     f"error = (simulated - measured) / measured")
    c = Console()
    c.print(t)
    for n in notes:
        c.print(f"note: {n}")


def _calibration_dict(res, output) -> dict:
    return {"output": str(output), "scales": res.scales, "uninformed": res.uninformed,
            "changes": [{"factor": c.factor, "old_efficiency": c.old_efficiency, "new_efficiency": c.new_efficiency,
                         "time_scale": c.time_scale, "why": c.why} for c in res.changes],
            "errors_before": res.errors_before, "errors_after": res.errors_after}


def _print_calibration(res, output) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    if not res.changes:
        c.print(f"calibration: nothing changed (the measurement informs {', '.join(sorted(set(res.scales) - set(res.uninformed))) or 'no factor'}); wrote {output}")
        return
    t = Table(title=f"calibration -> {output}")
    for col in ("factor", "efficiency old -> new", "time x", "why"):
        t.add_column(col)
    for ch in res.changes:
        t.add_row(ch.factor, f"{ch.old_efficiency:.4g} -> {ch.new_efficiency:.4g}", f"{ch.time_scale:.3f}", ch.why)
    c.print(t)
    c.print(f"unchanged (not informed by this measurement): {', '.join(res.uninformed) or 'none'}")
    for name, errs in res.errors_before.items():
        after = res.errors_after[name]
        c.print("errors before -> after: " + ", ".join(f"{k} {_fmt_err(v)} -> {_fmt_err(after[k])}" for k, v in errs.items()))


def render_html(figures, summary, notes, png: bytes, plan_path, measured_path, profile_name, calibration=None,
                curves_png: bytes | None = None) -> str:
    from autopar.report.figures import png_data_uri

    esc = html.escape
    rows = "\n".join(
        f"<tr><td>{esc(f.label)}</td><td>{esc(_fmt(f.simulated, f.unit))}</td><td>{esc(_fmt(f.measured, f.unit))}</td>"
        f"<td class='{'ok' if abs(f.error) <= 0.10 else 'bad'}'>{esc(_fmt_err(f.error))}</td></tr>" for f in figures)
    summ = (f"<p>median |error| {summary['median_abs_error']:.1%}, worst {summary['worst_abs_error']:.1%} "
            f"(error = (simulated &minus; measured) / measured)</p>") if summary else ""
    note_html = "".join(f"<p class='note'>{esc(n)}</p>" for n in notes)
    cal = ""
    if calibration is not None and calibration.changes:
        cal = "<h2>calibration</h2><table><tr><th>factor</th><th>efficiency</th><th>time &times;</th><th>why</th></tr>" + "".join(
            f"<tr><td>{esc(c.factor)}</td><td>{c.old_efficiency:.4g} &rarr; {c.new_efficiency:.4g}</td>"
            f"<td>{c.time_scale:.3f}</td><td>{esc(c.why)}</td></tr>" for c in calibration.changes) + "</table>"
    curves = "" if curves_png is None else (
        f'\n<h2>training curves</h2>\n<img alt="loss and step time per step" src="{png_data_uri(curves_png)}">')
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>autopar report: {esc(str(plan_path))}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}} td:first-child{{text-align:left}}
.ok{{color:#1a7f37}} .bad{{color:#c0392b}} .note{{color:#555;font-size:90%}} img{{max-width:100%}}</style></head>
<body><h1>simulated vs measured</h1>
<p>plan {esc(str(plan_path))}, measurement {esc(str(measured_path))}, profile {esc(profile_name)}</p>
<table><tr><th>figure</th><th>simulated</th><th>measured</th><th>error</th></tr>
{rows}
</table>{summ}{note_html}{cal}
<h2>timelines and memory per rank</h2>
<img alt="simulated and measured timelines, memory per rank" src="{png_data_uri(png)}">{curves}
</body></html>
"""


def _resolve(path: str, measured_path: str) -> Path:
    p = Path(path)
    return p if p.is_file() else Path(measured_path).parent / p.name


def _json_safe(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return str(o)
