"""Simulated against measured, figure by figure: the join and the errors.

The join is on names: a figure is compared when the simulated side (the plan's ``predicted``
block, completed by re-simulating the plan for the breakdown) and the run's ``Measured``
(autopar.core.measured, whose figure names are the ``predicted`` block's) both hold it.
The error of a figure is relative to the measurement, signed: ``(simulated - measured) /
measured`` -- positive when the simulator over-predicts.  Nothing here simulates or reads
files; ``autopar.report.resimulate`` and ``report_api`` do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from autopar.core.errors import UserError
from autopar.core.measured import Measured
from autopar.core.schema import is_number

#: (key, label, unit) of the scalar figures, in the order the report shows them: the figures
#: a run measures (``Measured.figures``)
SCALAR_FIGURES = (
    ("step_time_s", "step time", "s"),
    ("fwd_s", "forward", "s"),
    ("bwd_s", "backward", "s"),
    ("comm_s", "communication", "s"),
    ("optimizer_s", "optimizer", "s"),
    ("max_memory_bytes", "peak memory (max over ranks)", "B"),
    ("samples_per_s", "throughput", "samples/s"),
    ("tokens_per_s", "throughput", "tokens/s"),
)
MEMORY_PER_RANK_KEY = "memory_per_rank_bytes"      # the simulated side's (resimulate.simulate_figures)


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    unit: str
    simulated: float
    measured: float

    @property
    def error(self) -> float:
        """(simulated - measured) / measured; inf when the measurement is 0 and the simulation is not."""
        if self.measured == 0:
            return 0.0 if self.simulated == 0 else math.inf
        return (self.simulated - self.measured) / self.measured

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "unit": self.unit, "simulated": self.simulated,
                "measured": self.measured, "error": self.error}


def check_same_run(plan_fingerprint: str, plan_world_size: int, measured: Measured,
                   plan_source: str, measured_source: str, plan_identity: str | None = None) -> None:
    """A measurement of another model, another plan (``plan_identity``, where measured.json
    records one) or another launch cannot be compared: UserError."""
    fp = measured.fingerprint
    if fp is None:
        raise UserError(f"{measured_source} has no 'fingerprint' field, so it cannot be matched with {plan_source}; "
                        f"measured.json is written by 'autopar run' (or python -m autopar.runtime) beside the plan.")
    if str(fp) != str(plan_fingerprint):
        raise UserError(f"{measured_source} was measured for the model with fingerprint {fp}, but {plan_source} is "
                        f"for fingerprint {plan_fingerprint}: they are different models (or model arguments). "
                        f"Run this plan ('autopar run {plan_source}') and report on the measured.json it writes.")
    got = measured.plan_identity
    if plan_identity is not None and got is not None and str(got) != str(plan_identity):
        ran = f" (plan file {measured.plan})" if measured.plan else ""
        raise UserError(f"{measured_source} was measured running another plan{ran}, with identity {got}, than "
                        f"{plan_source}, whose identity is {plan_identity}: the same model, but other parallel "
                        f"decisions, so the comparison would be meaningless. Report {measured_source} against the "
                        f"plan that ran, or run {plan_source} ('autopar run {plan_source} --measured PATH') and "
                        f"report on what it writes.")
    ws = measured.world_size
    if ws is not None and int(ws) != int(plan_world_size):
        raise UserError(f"{measured_source} was measured on {ws} ranks but {plan_source} needs {plan_world_size}; "
                        f"report on the measured.json written by a run of this plan.")


def join(simulated: Mapping[str, Any], measured: Measured) -> list[Figure]:
    """The scalar figures both sides hold, in SCALAR_FIGURES order, then per-rank memory.

    A figure measured as exactly 0 where the simulation has time is left out (see
    ``unobserved``): the run's profiler saw no region with that label, which is not a measurement.
    """
    out = []
    meas = measured.figures()
    for key, label, unit in SCALAR_FIGURES:
        s, m = simulated.get(key), meas.get(key)
        if is_number(s) and is_number(m) and not (m == 0 and s != 0):
            out.append(Figure(key, label, unit, float(s), float(m)))
    sim_ranks = simulated.get(MEMORY_PER_RANK_KEY)
    meas_ranks = measured.memory_per_rank_bytes
    if isinstance(sim_ranks, (list, tuple)) and isinstance(meas_ranks, (list, tuple)):
        for r, (s, m) in enumerate(zip(sim_ranks, meas_ranks)):
            if is_number(s) and is_number(m):
                out.append(Figure(f"memory_rank{r}_bytes", f"peak memory rank {r}", "B", float(s), float(m)))
    return out


def unobserved(simulated: Mapping[str, Any], measured: Measured) -> list[str]:
    """Keys measured as 0 while simulated non-zero (left out of the join)."""
    meas = measured.figures()
    return [key for key, _, _ in SCALAR_FIGURES
            if is_number(simulated.get(key)) and is_number(meas.get(key))
            and meas[key] == 0 and simulated[key] != 0]


def error_summary(figures: list[Figure]) -> dict[str, float]:
    """Median and worst absolute error over the figures (the report's last line)."""
    errs = sorted(abs(f.error) for f in figures if math.isfinite(f.error))
    if not errs:
        return {}
    mid = len(errs) // 2
    median = errs[mid] if len(errs) % 2 else 0.5 * (errs[mid - 1] + errs[mid])
    return {"median_abs_error": median, "worst_abs_error": errs[-1]}


