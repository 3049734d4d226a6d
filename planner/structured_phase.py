"""The structured search (Alpa style, Zheng et al. 2022): every setting -- mesh, ZeRO family,
micro-batch size and count, schedule -- screened by the stage DP's predicted latency in
ascending order of a lower bound on it (screen_bound.py), the best ``num_screened`` assembled
by the stage DP and the per-stage ILP (structured.py) and priced by the simulator; then the
split-backward twins of the pipelined plans.

``StructuredPhase`` is that part of ``search.Planner``; it reads the planner's ``options``,
``meshes``, ``styles``, ``signatures``, ``evaluator``, ``num_layers`` and ``progress``, prices
through ``CandidatePricing`` (``price``, ``capacity``, ``cuttable``, ``splits_something``), and
keeps ``table_cache``, ``ilp_cache``, ``ilp_cache_split``, ``_floors``, ``num_settings``,
``num_pruned`` and ``num_unscreened``.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import replace

import numpy as np

from autopar.core.errors import InfeasibleError
from autopar.core.plan import equal_bounds
from autopar.core.rules import MULTI_CHUNK_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, split_backward_problem, stage_rank
from autopar.planner.candidate import Candidate
from autopar.planner.candidate_pricing import Evaluated
from autopar.planner.layer_tables import LayerTables, build_layer_tables
from autopar.planner.screen_bound import floor_key, layer_time_floor, screen_bound
from autopar.planner.space import LayerChoice, layer_choices, microbatch_candidates, schedule_candidates, zero_families
from autopar.planner.stage_dp import partition_stages
from autopar.planner.structured import Setting, range_costs, solve_setting
from autopar.simulator.api import inflight_microbatches, interleaved_time, screen_bubble_share

# Within the structured phase, screening settings may use this fraction of its time, so that the
# ILP + stage DP of the best screened settings, which yield the candidates, always get the
# remaining 30% instead of none.  Set by hand, no measurement fixed it; no recorded plan depends
# on it (search.py, STRUCTURED_SHARE).
SCREEN_SHARE = 0.7
# relative rounding between a setting's bound and its screen score, which sum the same per-layer
# floats in different orders (~L machine epsilons; 1e-9 covers any model's layer count)
_ROUNDING = 1e-9


class StructuredPhase:
    """Screen the settings, solve the best, price them; the split-backward twins."""

    def settings(self) -> list[Setting]:
        """The settings the structured phase screens, ordered round-robin over meshes.

        Two cuts keep the count down (MCMC still reaches what they leave out): micro-batch
        sizes are powers of two (per-sample costs change slowly between them), and with
        tp > 1 only sequence-parallel meshes are screened -- sequence parallelism moves the same
        bytes as the all-reduces it replaces and divides activations and element-wise work by
        tp (Korthikanti et al. 2022, Sec. 4.2.2), so it does not lose under this cost model.
        The split-backward schedules are screened only where no other pipeline schedule is
        searched (``--schedule`` fixed one): the screen knows whole backward passes only, so it
        cannot tell their bubble, and they are priced instead as twins of the structured plans
        (``split_backward_twins``) and reached by MCMC's schedule moves.
        """
        o = self.options
        per_mesh = []
        whole = [s for s in o.schedules if s not in SPLIT_BACKWARD_SCHEDULES]
        for mesh in self.meshes:
            if mesh.tp > 1 and o.sequence_parallel and not mesh.sequence_parallel:
                continue
            rows = []
            mbs = microbatch_candidates(o.global_batch, mesh.batch_degree, max_micro_batch=o.max_micro_batch,
                                        refused=o.refused_micro_batches)
            if o.micro_batch is not None:
                mbs = [x for x in microbatch_candidates(o.global_batch, mesh.batch_degree,
                                                        refused=o.refused_micro_batches) if x[0] == o.micro_batch]
            pow2 = [x for x in mbs if x[0] & (x[0] - 1) == 0]
            for family in zero_families(mesh.dp):
                if family not in o.zero_families:
                    continue
                for mb, m in pow2 or mbs:
                    for schedule, v in schedule_candidates(mesh.pp, self.num_layers, m,
                                                           max_virtual_stages=o.max_virtual_stages):
                        if mesh.pp > 1 and (schedule not in o.schedules or
                                            (whole and schedule in SPLIT_BACKWARD_SCHEDULES)):
                            continue
                        rows.append(Setting(mesh, mb, m, schedule, v, family))
            per_mesh.append(rows)
        out = []
        for k in range(max((len(r) for r in per_mesh), default=0)):
            out += [r[k] for r in per_mesh if k < len(r)]
        return out

    def tables(self, s: Setting) -> tuple[list[LayerTables], np.ndarray | None]:
        """Per pipeline rank, the layer tables of the setting (shared between ranks of one GPU type)."""
        o = self.options
        # a split-backward schedule runs a subset of the choices (core/rules.split_backward_problem)
        split = s.mesh.pp > 1 and s.schedule in SPLIT_BACKWARD_SCHEDULES
        key = (s.mesh, s.micro_batch, s.zero_family, split)
        hit = self.table_cache.get(key)
        if hit is not None:
            return hit
        choices = layer_choices(tp=s.mesh.tp, dp=s.mesh.dp, zero_family=s.zero_family, can_split=True,
                                allow_offload=o.allow_offload, offload_tier=o.offload_tier)
        choices = [c for c in choices if c.recompute in o.recompute
                   and (o.zero is None or c.zero == o.zero) and (o.offload is None or c.offload == o.offload)
                   and not (split and split_backward_problem(s.schedule, c.recompute, c.zero, c.offload, False))]
        if not choices:
            raise InfeasibleError(f"no layer choice runs under the {s.schedule} schedule with the fixed knobs")
        by_cm: dict[str, LayerTables] = {}
        per_rank = []
        for cm in self.evaluator.rank_cost_models(s.mesh):
            if cm.name not in by_cm:
                by_cm[cm.name] = build_layer_tables(
                    self.evaluator, styles=self.styles, signatures=self.signatures, choices=choices, mesh=s.mesh,
                    micro_batch=s.micro_batch, num_microbatches=s.num_microbatches, precision=o.precision,
                    cost_model=cm, key=(key, cm.name))
            per_rank.append(by_cm[cm.name])
        allowed = None
        if s.mesh.sequence_parallel:
            # under sequence parallelism the layer boundary is split on the sequence: a layer
            # that can be split runs split (a replicated one would need the whole sequence)
            split = np.array([bool(st) for st in self.styles])
            allowed = np.array([[ch.tp or not split[i] for ch in choices] for i in range(self.num_layers)])
        self.table_cache[key] = (per_rank, allowed)
        return per_rank, allowed

    def solve(self, s: Setting, tables: list[LayerTables], allowed) -> Candidate:
        """The structured phase's candidate for a setting (stage DP and per-stage ILP); where the
        ILP left every layer whole on a tp mesh, solved again with every layer that can be split
        split (the plan the tp degree was chosen for).  Raises ``InfeasibleError``."""
        c = solve_setting(tables, self.signatures, s, self.capacity(s.mesh), seed=self.options.seed,
                          cuttable=self.cuttable, allowed=allowed, ilp_cache=self.ilp_cache)
        if not self.splits_something(c):
            c = solve_setting(tables, self.signatures, s, self.capacity(s.mesh), seed=self.options.seed,
                              cuttable=self.cuttable, allowed=self._split_all(tables[0].choices, allowed),
                              ilp_cache=self.ilp_cache_split)     # its key does not hold allowed
        return c

    def _split_all(self, choices, allowed: np.ndarray | None) -> np.ndarray:
        """``allowed`` with the unsplit choices of every splittable layer ruled out."""
        forced = np.array([[ch.tp or not self.styles[i] for ch in choices] for i in range(self.num_layers)])
        return forced if allowed is None else forced & allowed

    def screen(self, s: Setting, tables: list[LayerTables], allowed, cap: float = math.inf) -> float:
        """Predicted step latency of the setting's DP partition, before any simulation; ``inf``
        where it is not below ``cap`` and the stage DP could tell without finishing."""
        capacity = self.capacity(s.mesh)
        m, p, v = s.num_microbatches, s.mesh.pp, s.virtual_stages
        if p == 1 or s.schedule in MULTI_CHUNK_SCHEDULES:
            # equal chunks; each of a rank's v chunks gets 1/v of its memory and in-flight count,
            # bubble divided by v (Narayanan et al. 2021, Sec. 2.2.2), of which a split-backward
            # schedule keeps its share (pipeline_zero_bubble.screen_bubble_share)
            bounds = equal_bounds(self.num_layers, p * v)
            inflight = [inflight_microbatches(s.schedule, p, r, m, v) / v for r in range(p)]
            cost = range_costs(tables, s, [c / v for c in capacity], allowed, inflight, cuttable=self.cuttable,
                               ranges=list(zip(bounds[:-1], bounds[1:])))
            lat = [sum(cost[r, bounds[k], bounds[k + 1]] for k in range(len(bounds) - 1)
                       if stage_rank(s.schedule, k, p) == r) for r in range(p)]
            if not all(map(math.isfinite, lat)):
                return math.inf
            return float(interleaved_time(sum(lat), max(lat), m, v, screen_bubble_share(s.schedule)))
        try:
            part = partition_stages(range_costs(tables, s, capacity, allowed, cuttable=self.cuttable), p, m,
                                    upper_bound=cap)
        except InfeasibleError:
            return math.inf
        return math.inf if part is None else part.step_latency_s

    def bound(self, s: Setting) -> float:
        """A lower bound on ``screen(s)`` that prices one strategy per distinct layer (screen_bound.py)."""
        rows = []
        for cm in self.evaluator.rank_cost_models(s.mesh):
            key = floor_key(s.mesh, s.micro_batch, s.zero_family) + (cm.name,)
            if key not in self._floors:
                self._floors[key] = layer_time_floor(self.evaluator, styles=self.styles, signatures=self.signatures,
                                                     mesh=s.mesh, micro_batch=s.micro_batch,
                                                     zero_family=s.zero_family, precision=self.options.precision,
                                                     cost_model=cm)
            rows.append(self._floors[key])
        return screen_bound(np.array(rows), s.num_microbatches, s.schedule, s.virtual_stages)

    def structured(self, deadline: float) -> list[Evaluated]:
        """Screen the settings, best bound first, skipping those whose bound exceeds the
        ``num_screened``-th best score found (they cannot be among the best ``num_screened``,
        screen_bound.py); assemble and price the best ``num_screened``."""
        settings = self.settings()
        t0 = time.perf_counter()
        screen_deadline = t0 + SCREEN_SHARE * (deadline - t0)
        self.num_settings = len(settings)
        keep = self.options.num_screened
        bounds = [self.bound(s) for s in settings]
        order = sorted(range(len(settings)), key=lambda k: (bounds[k], k))
        scored: list[tuple[float, int, Setting]] = []
        best_scores: list[float] = []                  # ascending, the finite scores so far
        for n, k in enumerate(order):
            s = settings[k]
            self.progress("screening settings", n, len(settings))
            # the bound and the score add the same floats in other orders (prefix sums): a
            # setting is skipped only when its bound exceeds the incumbent beyond rounding
            cap = best_scores[keep - 1] * (1.0 + _ROUNDING) if 0 < keep <= len(best_scores) else math.inf
            if bounds[k] > cap:
                self.num_pruned = len(settings) - n    # the rest: bounds ascend
                break
            if time.perf_counter() > screen_deadline:
                self.num_unscreened = len(settings) - n
                break
            try:
                t, allowed = self.tables(s)
                score = self.screen(s, t, allowed, cap)    # inf: not below the incumbent, left out
            except InfeasibleError:
                score = math.inf
            if math.isfinite(score):
                scored.append((score, k, s))
                bisect.insort(best_scores, score)
        self.progress("screening settings", len(settings), len(settings))
        scored.sort(key=lambda x: (x[0], x[1]))
        out: list[Evaluated] = []
        top = scored[: self.options.num_screened]
        for n, (_, _, s) in enumerate(top):
            self.progress("ILP + stage DP", n, len(top))
            if time.perf_counter() > deadline and out:
                break
            t, allowed = self.tables(s)
            try:
                c = self.solve(s, t, allowed)
            except InfeasibleError:
                self.num_infeasible += 1
                continue
            ev = self.price(c)
            if ev is not None:
                out.append(ev)
        self.progress("ILP + stage DP", len(top), len(top))
        return out

    def split_backward_twins(self, pool: list[Evaluated]) -> list[Evaluated]:
        """Each pipelined plan of ``pool`` under the split-backward schedules it admits (equal
        chunks, space.schedule_candidates), its layers' choices kept where the split backward runs
        them, else the nearest that runs (selective recompute -> full, ZeRO-3 -> 2, no offload:
        core/rules.split_backward_problem), priced by the simulator.  Only where whole-backward
        schedules are searched too (otherwise ``settings`` screened them)."""
        o = self.options
        split = [s for s in o.schedules if s in SPLIT_BACKWARD_SCHEDULES]
        if not split or all(s in SPLIT_BACKWARD_SCHEDULES for s in o.schedules):
            return []
        out = []
        for ev in pool:
            c = ev.candidate
            if c.mesh.pp == 1:
                continue
            choices = tuple(_runs_split(ch) for ch in c.choices)
            for schedule, v in schedule_candidates(c.mesh.pp, self.num_layers, c.num_microbatches,
                                                   max_virtual_stages=o.max_virtual_stages):
                if schedule in split and (schedule, v) != (c.schedule, c.virtual_stages):
                    twin = replace(c, schedule=schedule, bounds=equal_bounds(self.num_layers, c.mesh.pp * v),
                                   choices=choices)
                    priced = self.price(twin)
                    if priced is not None:
                        out.append(priced)
        return out


def _runs_split(ch: LayerChoice) -> LayerChoice:
    """The nearest choice a split-backward schedule runs (core/rules.split_backward_problem)."""
    if ch.recompute != "selective" and ch.zero < 3 and ch.offload == "none":
        return ch
    return replace(ch, recompute="full" if ch.recompute == "selective" else ch.recompute, zero=min(ch.zero, 2),
                   offload="none")
