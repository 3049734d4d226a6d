"""Calibration: refit a profile's efficiency factors so it predicts measured runs better.

A *factor* is one knob of the cost model the profile holds:

* ``linear``, ``matmul``, ``attention``, ``conv``: ``efficiency[kind]`` (roofline) and the
  ``op_table`` rows of that kind;
* ``memory_bound``: ``efficiency.memory_bound`` and the op-table rows of every other kind
  (norms, softmax, element-wise, embedding, the optimizer step, ...);
* ``collective.intra`` / ``collective.inter``: ``collective_efficiency[level]`` and the
  ``collective_table`` rows of that link level;
* ``overhead.tp``, ``overhead.fsdp``, ``overhead.optimizer``: the profile's measured framework
  overheads of a tensor-parallel module, an FSDP unit and an optimizer parameter tensor
  (``framework_overheads``, profiling/overheads.py).  What a tensor-parallel or FSDP run
  spends beyond its arithmetic and collectives is framework work that no efficiency of an
  op describes; without these factors the fit could only stretch ops and collectives that
  the data-parallel runs show to be right.  A profile without measured overheads leaves them
  uninformed (a scale of zero seconds moves nothing).

Refitting a factor by a time scale ``s`` divides its efficiency by ``s`` and multiplies its
measured table rows by ``s`` (their ``measured_seconds`` stay as measured), so the cost model
prices that factor ``s`` times slower whichever path -- table or roofline -- it takes
(an efficiency is a fraction of the peak, so it stops at 1.0; the table rows do not).

The fit (``calibration_fit.fit_scales``) is a least-squares fit of log errors over the
measured figures of every observation (step time and, when the run was profiled, forward,
backward, communication and optimizer), each prediction a re-simulation.  Before fitting,
the sensitivity of each predicted figure to each factor is taken by re-predicting with that
factor 10% slower: a factor that moves no measured figure by 1% or more is *not informed*
by the measurement and is left exactly as it was.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from autopar.profiles import EFFICIENCY_KINDS
from autopar.report.calibration_fit import DEFAULT_RIDGE, fit_scales, relative_errors

#: the profile's ``efficiency`` kinds (the profile schema, autopar.profiles)
OP_FACTORS = EFFICIENCY_KINDS
#: op-table row kinds priced by another kind's efficiency: the attention computed from its
#: matmuls and softmax (profiling/op_sweeps.py) is attention work
_ROW_FACTOR = {"attention_math": "attention"}
COLLECTIVE_FACTORS = ("collective.intra", "collective.inter")
#: overhead factor -> the ``framework_overheads`` keys it scales
OVERHEAD_FACTORS = {"overhead.tp": ("tp_module_fwd_s", "tp_module_bwd_s", "dtensor_module_fwd_s",
                                    "dtensor_module_bwd_s"),
                    "overhead.fsdp": ("fsdp_unit_fwd_s", "fsdp_unit_bwd_s", "fsdp_unit_fwd_per_byte_s",
                                      "fsdp_unit_bwd_per_byte_s"),
                    "overhead.optimizer": ("optimizer_tensor_s", "optimizer_dtensor_tensor_s")}
FACTORS = OP_FACTORS + COLLECTIVE_FACTORS + tuple(OVERHEAD_FACTORS)
#: the measured figures calibration fits, when measured
FITTED_FIGURES = ("step_time_s", "fwd_s", "bwd_s", "comm_s", "optimizer_s")
#: weight of each figure's log error; the step time, the figure a plan is chosen by, weighs as
#: much as the four breakdown figures together (2^2 = 4 x 1^2)
FIGURE_WEIGHTS = {"step_time_s": 2.0, "fwd_s": 1.0, "bwd_s": 1.0, "comm_s": 1.0, "optimizer_s": 1.0}
INFORMED_SHARE = 0.01          # a factor must move some figure by >= 1% of it to be refitted
#: ridge weights tried by leave-one-out cross-validation (``choose_ridge``), from the default
#: (undetermined directions held at 1, the determined ones free) to one that keeps a factor
#: within a few % of 1 unless the runs insist
RIDGE_CANDIDATES = (DEFAULT_RIDGE, 1e-2, 1e-1, 1.0)
MIN_CV_OBSERVATIONS = 4        # fewer runs: leaving one out leaves too little to fit
PROBE = 0.10                   # sensitivity probe: the factor 10% slower

Predict = Callable[[Mapping], Mapping[str, float]]


@dataclass
class Observation:
    """One measured run: ``predict(profile) -> figures`` re-simulates it with a profile."""
    name: str
    predict: Predict
    measured: Mapping[str, float]

    def figure_keys(self) -> list[str]:
        # a figure measured as 0 was not observed (no profiler region with its label): not an equation
        return [k for k in FITTED_FIGURES if isinstance(self.measured.get(k), (int, float)) and self.measured[k] > 0]


@dataclass(frozen=True)
class Change:
    factor: str
    old_efficiency: float
    new_efficiency: float
    time_scale: float
    why: str


@dataclass
class CalibrationResult:
    profile: dict
    scales: dict[str, float]
    changes: list[Change]
    uninformed: list[str]
    errors_before: dict[str, dict[str, float]] = field(default_factory=dict)   # observation -> figure -> error
    errors_after: dict[str, dict[str, float]] = field(default_factory=dict)
    ridge: float = DEFAULT_RIDGE                 # the ridge weight of the fit
    cv_errors: dict[float, float] = field(default_factory=dict)   # ridge -> leave-one-out error (choose_ridge)


def scale_profile(profile: Mapping, scales: Mapping[str, float]) -> dict:
    """A copy of ``profile`` whose factors are ``scales[f]`` times slower (1.0: unchanged)."""
    prof = copy.deepcopy(dict(profile))
    eff = dict(prof.get("efficiency", {}))
    ceff = dict(prof.get("collective_efficiency", {}))
    # efficiencies are fractions of the profile's peak / the cluster's link (<= 1 by the schema):
    # a factor cannot be made faster than that on the roofline path; its measured rows still scale
    over = dict(prof.get("framework_overheads", {}) or {})
    for f, s in scales.items():
        if s == 1.0:
            continue
        if f in OVERHEAD_FACTORS:
            for key in OVERHEAD_FACTORS[f]:
                if key in over:
                    over[key] = float(over[key]) * s
        elif f in OP_FACTORS:
            eff[f] = min(1.0, eff.get(f, 1.0) / s)
        else:
            level = f.split(".", 1)[1]
            ceff[level] = min(1.0, ceff.get(level, 1.0) / s)
    prof["efficiency"], prof["collective_efficiency"] = eff, ceff
    if over:
        prof["framework_overheads"] = over
    rows = []
    for r in prof.get("op_table", []) or []:
        f = _row_factor(r["kind"])
        s = scales.get(f, 1.0)
        rows.append(r if s == 1.0 else {**r, "seconds": r["seconds"] * s})
    prof["op_table"] = rows
    crows = []
    for r in prof.get("collective_table", []) or []:
        s = scales.get(f"collective.{r['level']}", 1.0)
        crows.append(r if s == 1.0 else {**r, "seconds": r["seconds"] * s})
    prof["collective_table"] = crows
    return prof


def _row_factor(kind: str) -> str:
    """The factor an op-table row of ``kind`` belongs to: its compute kind, else memory_bound."""
    f = _ROW_FACTOR.get(kind, kind)
    return f if f in OP_FACTORS else "memory_bound"


def calibrate(profile: Mapping, observations: Sequence[Observation], factors: Sequence[str] = FACTORS,
              max_evaluations: int = 200, ridge: float | None = None) -> CalibrationResult:
    """Refit ``factors`` of ``profile`` to the observations; only informed factors change.

    ``ridge``: the weight that holds the scales at 1 (calibration_fit.fit_scales).  None: with
    ``MIN_CV_OBSERVATIONS`` observations or more it is chosen by leave-one-out cross-validation
    (``choose_ridge``), with fewer it is ``DEFAULT_RIDGE``."""
    if not observations:
        raise ValueError("calibration needs at least one observation")
    if len({o.name for o in observations}) != len(observations):
        raise ValueError("observation names must be unique: " + ", ".join(o.name for o in observations))
    cv: dict[float, float] = {}
    if ridge is None:
        if len(observations) >= MIN_CV_OBSERVATIONS:
            ridge, cv = choose_ridge(profile, observations, factors, max_evaluations)
        else:
            ridge = DEFAULT_RIDGE
    fit = _fit(profile, observations, factors, max_evaluations, ridge)
    eqs, y, p0, sens0, scales, informed = fit.eqs, fit.y, fit.p0, fit.sens0, fit.scales, fit.informed
    p_final = fit.predict_all(scales)
    result_profile = scale_profile(profile, scales)
    changes = [_describe(f, profile, result_profile, scales[f], eqs, y, p0, sens0[:, factors.index(f)])
               for f in informed if abs(scales[f] - 1.0) > 1e-9]
    _record_sources(result_profile, changes, [o.name for o in observations])
    if cv and changes:
        result_profile["sources"]["calibration"] += (
            f" (ridge {ridge:g}, chosen by leave-one-out over " +
            ", ".join(f"{r:g}: {e:.1%}" for r, e in cv.items()) + ")")
    res = CalibrationResult(profile=result_profile, scales=scales, changes=changes,
                            uninformed=[f for f in factors if f not in informed], ridge=ridge, cv_errors=cv)
    for (o, k), e0, e1 in zip(eqs, relative_errors(p0, y), relative_errors(p_final, y)):
        res.errors_before.setdefault(o.name, {})[k] = float(e0)
        res.errors_after.setdefault(o.name, {})[k] = float(e1)
    return res


@dataclass
class _Fit:
    eqs: list
    y: np.ndarray
    p0: np.ndarray
    sens0: np.ndarray
    scales: dict[str, float]
    informed: list[str]
    predict_all: Callable[[Mapping[str, float]], np.ndarray]


def _fit(profile: Mapping, observations: Sequence[Observation], factors: Sequence[str], max_evaluations: int,
         ridge: float) -> _Fit:
    eqs = [(o, k) for o in observations for k in o.figure_keys()]
    if not eqs:
        raise ValueError("no observation holds a positive measured figure among " + ", ".join(FITTED_FIGURES))
    y = np.array([o.measured[k] for o, k in eqs], dtype=float)

    def predict_all(scales: Mapping[str, float]) -> np.ndarray:
        prof = scale_profile(profile, scales)
        out = {o.name: o.predict(prof) for o in observations}
        return np.array([float(out[o.name].get(k, 0.0)) for o, k in eqs])

    scales = {f: 1.0 for f in factors}
    p0 = predict_all(scales)
    sens0 = _sensitivity(predict_all, scales, factors, p0)
    informed = [f for j, f in enumerate(factors) if np.max(np.abs(sens0[:, j]) / y) >= INFORMED_SHARE]

    def predict_informed(values: np.ndarray) -> np.ndarray:
        return predict_all({**scales, **dict(zip(informed, values.tolist()))})

    weights = np.array([FIGURE_WEIGHTS[k] for _, k in eqs])
    fitted = fit_scales(predict_informed, y, len(informed), ridge=ridge, max_evaluations=max_evaluations,
                        weights=weights)
    for f, v in zip(informed, fitted):
        scales[f] = float(v)
    return _Fit(eqs, y, p0, sens0, scales, informed, predict_all)


def choose_ridge(profile: Mapping, observations: Sequence[Observation], factors: Sequence[str] = FACTORS,
                 max_evaluations: int = 200) -> tuple[float, dict[float, float]]:
    """The ridge of ``RIDGE_CANDIDATES`` whose fits predict left-out runs best, and each
    candidate's leave-one-out error.

    With a handful of runs and as many factors the fit can explain every run it sees and
    none it does not (on this machine: the fitted half of the accuracy benchmark from 21% to 3%,
    the held-back half from 13% to 29%).  So each candidate is fitted on all runs but one and
    scored by how well it then predicts that run's step time (mean absolute log error over
    the runs left out); the best score wins, a tie the stronger ridge (leave-one-out
    cross-validation: Stone 1974; for the ridge weight, Golub, Heath & Wahba 1979)."""
    scores: dict[float, float] = {}
    for ridge in RIDGE_CANDIDATES:
        errs = []
        for i, left in enumerate(observations):
            if "step_time_s" not in left.figure_keys():
                continue
            rest = [o for j, o in enumerate(observations) if j != i]
            fit = _fit(profile, rest, factors, max_evaluations, ridge)
            predicted = float(left.predict(scale_profile(profile, fit.scales)).get("step_time_s", 0.0))
            errs.append(abs(float(np.log(max(predicted, 1e-30) / left.measured["step_time_s"]))))
        scores[ridge] = float(np.mean(errs)) if errs else 0.0
    best = min(scores.values())
    return max(r for r, e in scores.items() if e <= best * (1 + 1e-9)), scores


def _sensitivity(predict_all, scales: dict, factors: Sequence[str], p: np.ndarray) -> np.ndarray:
    """d prediction / d scale, by re-predicting with each factor PROBE slower."""
    cols = []
    for f in factors:
        probe = dict(scales)
        probe[f] = scales[f] * (1.0 + PROBE)
        cols.append((predict_all(probe) - p) / (scales[f] * PROBE))
    return np.stack(cols, axis=1) if cols else np.zeros((p.size, 0))


def _efficiency_of(profile: Mapping, factor: str) -> float:
    """A factor's efficiency; for an overhead factor, its first overhead in seconds."""
    if factor in OVERHEAD_FACTORS:
        return float((profile.get("framework_overheads", {}) or {}).get(OVERHEAD_FACTORS[factor][0], 0.0))
    if factor in OP_FACTORS:
        return float(profile.get("efficiency", {}).get(factor, 1.0))
    return float(profile.get("collective_efficiency", {}).get(factor.split(".", 1)[1], 1.0))


def _describe(factor, old_prof, new_prof, scale, eqs, y, p0, sens_col) -> Change:
    # the figure this factor weighs most in, relative to the figure
    share = np.abs(sens_col) / np.maximum(p0, 1e-30)
    i = int(np.argmax(share))
    obs, key = eqs[i]
    why = (f"{obs.name}: {key} measured {y[i]:.4g} s, simulated {p0[i]:.4g} s "
           f"({(p0[i] - y[i]) / y[i]:+.1%}); {factor} is {min(share[i], 1.0):.0%} of the simulated {key}")
    return Change(factor, _efficiency_of(old_prof, factor), _efficiency_of(new_prof, factor), scale, why)


def _record_sources(prof: dict, changes: list[Change], names: list[str]) -> None:
    src = dict(prof.get("sources", {}))
    for c in changes:
        if c.factor in OVERHEAD_FACTORS:
            for key in OVERHEAD_FACTORS[c.factor]:
                src[f"framework_overheads.{key}"] = f"calibrated on {', '.join(names)}: time x{c.time_scale:.3f}; {c.why}"
            continue
        key = f"efficiency.{c.factor}" if c.factor in OP_FACTORS else f"collective_efficiency.{c.factor.split('.', 1)[1]}"
        src[key] = (f"calibrated on {', '.join(names)}: time x{c.time_scale:.3f} "
                    f"(efficiency {c.old_efficiency:.4g} -> {c.new_efficiency:.4g}); {c.why}")
    if changes:
        note = "; ".join(f"{c.factor} x{c.time_scale:.3f}" for c in changes)
        src["calibration"] = (src["calibration"] + " | " if "calibration" in src else "") + \
            f"time scales fitted on {', '.join(names)}: {note}"
    prof["sources"] = src
