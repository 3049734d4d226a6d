"""Why a plan does or does not use context parallelism (cp) and expert parallelism (ep): one
line each for the plan summary's ``left out`` (``autopar plan``), from the model's eligibility
(core/cp_support.cp_refusal, simulator/ep_cost.ep_refusal), the options, and the fastest plan the search priced with the degree
above 1 (``SearchResult.axis_alternatives``).
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.graph import OpGraph
from autopar.core.units import fmt_seconds

NAMES = {"cp": "context parallel", "ep": "expert parallel"}


@dataclass(frozen=True)
class AxisNote:
    kind: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "reason": self.reason}


def axis_notes(graph: OpGraph, result, options) -> list[AxisNote]:
    """A note per axis (cp, ep) saying why the best plan uses it or not."""
    from autopar.core.cp_support import cp_refusal
    from autopar.simulator.api import ep_refusal

    best = result.best
    out = []
    for axis in ("cp", "ep"):
        degree = getattr(best.plan.mesh, axis)
        admitted, alt = result.axis_alternatives.get(axis, (0, None))
        fixed = options.ep if axis == "ep" else options.degrees.get(axis)
        kind = NAMES[axis]
        if degree > 1:
            why = (f"{axis} {degree} fixed by --{axis}" if fixed else
                   f"{axis} {degree} chosen: the fastest plan that fits")
            out.append(AxisNote(f"{kind} (used)", why))
            continue
        refusal = cp_refusal(graph, 2) if axis == "cp" else ep_refusal(graph, 2)
        if refusal:
            out.append(AxisNote(kind, f"the model cannot take it: {refusal}"))
        elif fixed == 1:
            out.append(AxisNote(kind, f"--{axis} 1 fixed it off"))
        elif not admitted:
            if axis == "ep":
                extra = "; ep must divide dp x cp and the experts count"
            else:
                extra = "; cp must divide the devices left by the other axes"
            out.append(AxisNote(kind, f"no mesh with {axis} > 1 fits the cluster, the batch and the fixed knobs{extra}"))
        elif alt is None:
            out.append(AxisNote(kind, f"no plan with {axis} > 1 of the {admitted} meshes searched fitted memory"))
        else:
            m = alt.plan.mesh
            slower = alt.step_time_s / best.step_time_s - 1.0
            out.append(AxisNote(kind, f"not chosen: the fastest plan with {axis} > 1 found ({m.describe()}"
                                      f"{f', ep {m.ep}' if m.ep > 1 else ''}) predicts {fmt_seconds(alt.step_time_s)} a step, "
                                      f"{100 * slower:.1f}% slower than the plan's {fmt_seconds(best.step_time_s)}"))
    return out
