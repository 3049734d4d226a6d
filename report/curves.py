"""The report's training curves: loss (and validation loss) and step time per step, from measured.json.

``curve_data`` prepares the arrays the figure plots (``report/figures.py``, ``curves_figure``);
it holds no drawing, so a test compares them with measured.json directly.

Step numbers count optimizer steps from 1, over the whole run.  ``step_times_s`` holds the steps
this run timed, ``first_step + 1`` onward (a resumed run times only its own steps);
``losses`` may reach further back (a resumed run keeps the losses of the steps before the
checkpoint), so they are numbered to end at the same last step.  ``val_losses`` carry their own
step numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.measured import Measured


@dataclass(frozen=True)
class CurveData:
    loss_steps: list[int]
    losses: list[float]
    val_steps: list[int]
    val_losses: list[float]
    time_steps: list[int]
    step_times_s: list[float]
    measured_step_time_s: float           # measured.json's step_time_s (the median after warm-up)
    simulated_step_time_s: float | None   # the plan's predicted step time

    @property
    def empty(self) -> bool:
        return not (self.losses or self.step_times_s or self.val_losses)


def curve_data(measured: Measured, simulated_step_time_s: float | None) -> CurveData:
    """The curves' arrays from a run's measured.json (module docstring)."""
    first = measured.first_step or 0
    times = list(measured.step_times_s or ())
    losses = list(measured.losses or ())
    last = first + len(times) if times else len(losses)
    loss_steps = list(range(last - len(losses) + 1, last + 1))
    val = list(measured.val_losses or ())
    return CurveData(loss_steps=loss_steps, losses=losses, val_steps=[s for s, _ in val],
                     val_losses=[v for _, v in val], time_steps=list(range(first + 1, first + len(times) + 1)),
                     step_times_s=times, measured_step_time_s=measured.step_time_s,
                     simulated_step_time_s=simulated_step_time_s)
