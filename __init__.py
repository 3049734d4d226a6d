"""autopar: plan a model's parallel layout, simulate it, run it (docs/runtime.md, README).

The package's Python functions are loaded on first use, so ``import autopar`` stays cheap
(no torch import):

* ``autopar.plan(model_file, cluster, global_batch, ...)`` -- search for the fastest plan that
  fits the cluster (``autopar.planner.plan_api.plan``; returns a ``PlanOutcome``);
* ``autopar.simulate(model_file_or_plan_json, ...)`` -- predict step time and memory
  (``autopar.simulator.simulate_api.simulate``; returns a ``Simulation``);
* ``autopar.report(plan_json, measured_json, ...)`` -- a plan's prediction against a measured run
  (``autopar.report.report_api.report``; returns a ``Report``);
* ``autopar.prepare(plan, ...)`` -- a plan applied to a model inside your own training loop,
  under torchrun (``autopar.runtime.api.prepare``; docs/runtime.md, "Your own loop").

docs/api.md shows them together; each ``autopar`` verb parses its flags and calls one of them.
"""
from __future__ import annotations

_LAZY = {"prepare": ("autopar.runtime.api", "prepare"), "PreparedJob": ("autopar.runtime.api", "PreparedJob"),
         "plan": ("autopar.planner.plan_api", "plan"), "simulate": ("autopar.simulator.simulate_api", "simulate"),
         # the report package itself, which calls autopar.report.report_api.report (report/__init__.py)
         "report": ("autopar.report", None)}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = importlib.import_module(module) if attr is None else getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
