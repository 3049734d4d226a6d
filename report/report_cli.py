"""``autopar report``: a plan's prediction against a measured run; optionally recalibrate.

    autopar report plan.json measured.json [--html report.html | --png report.png] [--json]
    autopar report plan.json measured.json --calibrate -o profiles/my-machine.json

The simulated side is the plan's ``predicted`` block, completed by re-simulating the plan
(with the plan's profile, or ``--profile``) for the forward / backward / communication /
optimizer breakdown, the memory per rank and the timeline.  With ``--html`` or ``--png`` the
report also draws the run's training curves (report/curves.py): loss per step (and the
validation loss where measured.json has it) and step time per step beside the simulated step
time -- a second image in the HTML page, or a second PNG beside ``--png FILE``,
``FILE``'s stem + ``.curves.png`` (``report_api.curves_png_path``), named in the output.

The work is ``autopar.report(...)`` (report/report_api.py); this module parses the arguments,
calls it, and prints what it returns.
"""
from __future__ import annotations

import argparse
import json
import math

from autopar.core.errors import UserError
from autopar.report.html_page import fmt_error as _fmt_err, fmt_value as _fmt


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
    from autopar.report.report_api import report

    if args.output and not args.calibrate:
        raise UserError("-o is where --calibrate writes the new profile; add --calibrate, or drop -o.")
    if args.with_runs and not args.calibrate:
        raise UserError("--with adds runs to the --calibrate fit; add --calibrate -o PROFILE_JSON, or drop --with.")
    if args.calibrate and not args.output:
        raise UserError("--calibrate needs -o PROFILE_JSON: the file to write the calibrated profile to.")
    rep = report(args.plan, args.measured, cluster=args.cluster, profile=args.profile,
                 calibrate=args.output if args.calibrate else None, with_runs=args.with_runs or (), html=args.html,
                 png=args.png)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, default=_json_safe))
    else:
        _print_table(rep.figures, rep.summary, rep.notes, args.plan, args.measured, rep.profile_name)
        if rep.calibration is not None:
            _print_calibration(rep.calibration, args.output)
        if args.png and rep.curves_png is not None:
            print(f"wrote {args.png} (timelines, memory per rank) and {rep.curves_png} (loss and step time "
                  f"per step)")
    return 0


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


def _json_safe(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return str(o)
