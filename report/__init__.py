"""The loop's last step: a plan's prediction against what a run measured (``autopar report``).

    autopar report plan.json measured.json [--html r.html | --png r.png] [--json]
    autopar report plan.json measured.json --calibrate -o profiles/my-machine.json

Modules, in the order the verb uses them:

* ``report_cli``      -- the verb: parse the arguments, call ``report_api.report``, print;
* ``report_api``      -- ``autopar.report(...)``: read the plan and measured.json
  (``autopar.core.measured``), compare, draw, optionally calibrate;
* ``html_page``       -- the figures as text and the HTML page;
* ``resimulate``      -- find the plan's model, cluster and profile and simulate it again, for
  the breakdown, the memory per rank and the timeline;
* ``compare``         -- simulated against measured, figure by figure, and the errors;
* ``timelines``       -- the simulator's events and the runtime's torch.profiler trace as lanes,
  and the simulated per-phase figures built as the runtime measures them;
* ``curves``          -- the training curves' arrays (loss, validation loss, step time per step);
* ``figures``         -- the pictures (matplotlib);
* ``calibrate``       -- refit a profile's efficiency factors to measured runs, with
  ``calibration_fit`` (the least-squares fit over arrays).

It reads the plan, measured.json and profiles, and re-prices plans with the simulator; it
never imports the runtime or the planner.
"""
from __future__ import annotations

import sys
import types


class _ReportPackage(types.ModuleType):
    """This package, callable: ``autopar.report(plan, measured, ...)`` is
    ``autopar.report.report_api.report`` -- the package and the function share the name the
    ``autopar report`` verb gives both, so calling the package runs the function."""

    def __call__(self, *args, **kwargs):
        from autopar.report.report_api import report

        return report(*args, **kwargs)


sys.modules[__name__].__class__ = _ReportPackage
