"""A search's candidates priced: admitted or not (the fixed knobs, what the runtime runs), turned
into plans and simulated, each once (``CandidatePricing.price``); ``Evaluated`` is a candidate
with its plan and the simulator's result.

``CandidatePricing`` is the part of ``search.Planner`` that both searches call; it reads the
planner's ``options``, ``meshes``, ``styles``, ``model``, ``cluster``, ``cluster_label``,
``evaluator`` and ``num_layers``, and keeps the ``seen`` prices, ``num_infeasible``,
``plan_parts`` and ``_choices_admitted`` that ``Planner.__init__`` sets up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.core.errors import InfeasibleError, UserError
from autopar.core.plan import Mesh, Plan
from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES, split_backward_problem
from autopar.planner.candidate import Candidate
from autopar.planner.space import LayerChoice, zero_family_of
from autopar.simulator.api import stage_groups


@dataclass
class Evaluated:
    candidate: Candidate
    plan: Plan
    result: Any                          # SimResult

    @property
    def step_time_s(self) -> float:
        return float(self.result.step_time_s)


class CandidatePricing:
    """Admit, build and price candidates (cached by candidate)."""

    def to_plan(self, c: Candidate) -> Plan:
        return c.to_plan(model=self.model, styles=self.styles, precision=self.options.precision,
                         cluster=self.cluster_label, memo=self.plan_parts)

    @property
    def cuttable(self) -> frozenset[int] | None:
        """Layer boundaries where stages may start, when the runtime cannot cut at all of them."""
        ex = self.options.executable
        if ex is None or not ex.pipeline or ex.cuttable == frozenset(range(1, self.num_layers)):
            return None
        return ex.cuttable

    def admits(self, c: Candidate) -> bool:
        """The candidate keeps the fixed knobs and uses only what the runtime runs."""
        o, ex = self.options, self.options.executable
        if c.mesh not in self.meshes:
            return False
        if (o.micro_batch is not None and c.micro_batch != o.micro_batch) or c.micro_batch in o.refused_micro_batches:
            return False
        if c.mesh.pp > 1 and c.schedule not in o.schedules:
            return False
        if c.mesh.pp > 1 and c.schedule in SPLIT_BACKWARD_SCHEDULES and any(
                split_backward_problem(c.schedule, ch.recompute, ch.zero, ch.offload, False)
                for ch in set(c.choices)):
            return False
        admitted = self._choices_admitted.get(c.choices)   # moves that keep the choices keep their hash
        if admitted is None:
            admitted = self._choices_admitted[c.choices] = self._admits_choices(c.choices)
        if not admitted:
            return False
        if self.cuttable is not None and not set(c.bounds[1:-1]) <= self.cuttable:
            return False
        return self.splits_something(c)

    def splits_something(self, c: Candidate) -> bool:
        """A tp > 1 mesh splits at least one layer: without one, every tp rank computes the
        whole model (tp - 1 ranks of each group wasted), which is never the plan meant."""
        return c.mesh.tp == 1 or any(ch.tp and self.styles[i] for i, ch in enumerate(c.choices))

    def _admits_choices(self, choices: tuple[LayerChoice, ...]) -> bool:
        o = self.options
        for ch in set(choices):                                 # each distinct choice once
            if o.zero is not None and ch.zero != o.zero or zero_family_of(ch.zero) not in o.zero_families:
                return False
            if ch.recompute not in o.recompute or (ch.offload != "none" and not o.allow_offload):
                return False
            if o.offload is not None and ch.offload != o.offload:
                return False
        return True

    def price(self, c: Candidate) -> Evaluated | None:
        """Simulate a candidate (cached); None when it does not fit or cannot run."""
        if c in self.seen:
            return self.seen[c]
        out = None
        if not self.admits(c):
            self.num_infeasible += 1
            self.seen[c] = None
            return None
        try:
            plan = self.to_plan(c)
            plan.validate(self.num_layers)
            res = self.evaluator.evaluate(plan)
            if res.fits and math.isfinite(res.step_time_s):
                out = Evaluated(c, plan, res)
        except (InfeasibleError, UserError):
            out = None
        if out is None:
            self.num_infeasible += 1
        self.seen[c] = out
        return out

    def capacity(self, mesh: Mesh) -> list[float]:
        """Usable bytes per device for each pipeline rank (the smallest GPU among its ranks)."""
        out = []
        for r in range(mesh.pp):
            groups = stage_groups(self.cluster, mesh, r)
            out.append(float(min(self.cluster.groups[g].gpu_memory_bytes for g in groups)))
        return out
