"""``plan(graph, cluster, cost_model, options) -> Plan``: the planner's two searches.

1. **Structured** (Alpa style, Zheng et al. 2022): for every setting -- mesh (dp x tp x pp,
   sequence parallelism), ZeRO family, micro-batch size and count, schedule -- the per-layer
   costs come from the simulator's ``layer_cost``; the stage DP splits the layers (pp > 1) and
   the ILP picks each device's per-layer strategies under its memory budget
   (structured.py).  Settings are screened by the DP's predicted latency (a screen that costs
   no simulation) in ascending order of a lower bound on it, and one whose bound exceeds the
   ``num_screened``-th best latency found is never tabled (screen_bound.py); the best
   ``num_screened`` are assembled and priced by the simulator.
2. **MCMC** (FlexFlow style, Jia et al. 2019): Metropolis-Hastings over whole plans with the
   simulator as the cost and random local moves (moves.py), started from the best structured
   plans (``algo="auto"``) or from the plain data-parallel corner of the space
   (``algo="mcmc"``), within a time and an iteration budget; a chain stops early once half
   its iteration budget has passed without a better plan (FlexFlow's rule, mcmc.py).

Every plan returned fits memory on every device (the simulator's ``fits``); when none does,
NoFeasiblePlanError says what would make one fit (feasibility.py).
"""
from __future__ import annotations

import bisect
import math
import time
from itertools import groupby
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError, NoFeasiblePlanError, UserError
from autopar.core.graph import OpGraph
from autopar.core.plan import PRECISIONS, SCHEDULES, Mesh, ModelRef, Plan, equal_bounds
from autopar.core.rules import MULTI_CHUNK_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, split_backward_problem, stage_rank
from autopar.core.sharding import megatron_styles
from autopar.planner.candidate import Candidate
from autopar.planner.layer_tables import LayerTables, build_layer_tables
from autopar.planner.mcmc import metropolis_hastings
from autopar.planner.moves import MoveSpace, propose
from autopar.planner.screen_bound import floor_key, layer_time_floor, screen_bound
from autopar.planner.space import (RECOMPUTE_CHOICES, LayerChoice, layer_choices, mesh_candidates,
                                   microbatch_candidates, schedule_candidates, zero_families, zero_family_of)
from autopar.planner.structured import Setting, range_costs, solve_setting
from autopar.planner.stage_dp import partition_stages
from autopar.simulator.api import inflight_microbatches, interleaved_time, screen_bubble_share, stage_groups

ALGOS = ("auto", "ilp", "mcmc")
# How the time budget is split, where it binds.  Both shares are set by hand and no measurement
# fixed them; they matter only when a search runs out of time: the benchmarks' searches
# (planner_vs_grid.py, --time-budget 3000 and the default 40 s) finish the structured phase in
# 1-4 s, far inside either share, so no recorded plan depends on them.  What each trades:
# * STRUCTURED_SHARE: under --algo auto the structured phase (screen, ILP + stage DP) may run
#   until this fraction of the budget, MCMC refinement gets the rest -- more than half to the
#   phase that finds the plans MCMC starts from, enough left for MCMC to refine them.
# * SCREEN_SHARE: within the structured phase, screening settings may use this fraction of its
#   time, so that the ILP + stage DP of the best screened settings, which yield the candidates,
#   always get the remaining 30% instead of none.
STRUCTURED_SHARE = 0.6
SCREEN_SHARE = 0.7
# A plan with uniform layer choices is preferred to the best one when it is at most this much
# slower (0.2%: below what the simulator can tell apart; see Planner.tidy).
TIDY_TOLERANCE = 0.002
# relative rounding between a setting's bound and its screen score, which sum the same per-layer
# floats in different orders (~L machine epsilons; 1e-9 covers any model's layer count)
_ROUNDING = 1e-9

ProgressCallback = Callable[[str, int, int], None]     # (phase, done, total)


@dataclass(frozen=True)
class PlanOptions:
    global_batch: int
    algo: str = "auto"                   # "ilp": structured only; "mcmc": MCMC only; "auto": both
    seed: int = 0
    time_budget_s: float = 30.0          # for the whole search; MCMC gets what the structured phase leaves
    precision: str = "bf16"
    max_tp: int | None = None            # largest tensor-parallel degree (default: GPUs per node)
    tp_inside_node: bool = True
    top_k: int = 3                       # runner-up plans kept
    max_micro_batch: int | None = 16
    max_virtual_stages: int = 4
    sequence_parallel: bool = True
    allow_offload: bool = True
    # where an offloaded layer's state goes: "cpu" (host memory), or "nvme" (AdamW's moments on the
    # cluster's NVMe tier) -- searched only where no plan fits host memory (planner/nvme_choice.py)
    offload_tier: str = "cpu"
    recompute: tuple[str, ...] = RECOMPUTE_CHOICES
    zero_families: tuple[str, ...] = ("ddp", "zero1", "fsdp")
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
    # gpipe: dominated by 1F1B (same bubble, more activations: Narayanan et al. 2021, Sec. 2.2.1);
    # MCMC still proposes it
    num_screened: int = 24               # settings the structured phase assembles and simulates
    mcmc_iterations: int = 4000
    # a chain stops once this many proposals in a row found no better plan; None: half of
    # mcmc_iterations, FlexFlow's rule (Jia et al. 2019, Sec. 5.2: no improvement for half the budget)
    mcmc_patience: int | None = None
    mcmc_beta: float = 200.0             # on costs relative to the start plan: +1% accepted w.p. e^-2
    mcmc_starts: int = 2                 # structured plans refined by MCMC in "auto"
    # knobs the user fixed (None: the search chooses); see planner/constraints.py
    #: the degrees the user fixed, by declared axis name (``{"dp": 2, "tp": 4}``: core/parallel_dims.py);
    #: an axis not named is chosen by the search
    degrees: Mapping[str, int] = field(default_factory=dict)
    ep: int | None = None                # expert parallelism (a degree borrowed from dp x cp, not an axis)
    micro_batch: int | None = None
    # micro-batch sizes the model cannot take (core/micro_batch_probe.py): never searched
    refused_micro_batches: frozenset[int] = frozenset()
    zero: int | None = None              # one ZeRO stage on every layer
    offload: str | None = None           # "none" | "cpu" | "nvme" on every layer
    fixed_schedule: str | None = None
    # fraction of each device's memory kept free for the allocator's fragmentation and
    # workspaces (see planner/headroom.py); plans must fit in the rest
    memory_headroom: float = 0.0
    executable: Any = None               # runtime_check.Executable: the kinds the runtime runs
    # the mesh class whose declared axes the search enumerates (core/parallel_dims.py; a subclass
    # declares more, each with its degree rule registered in planner/axis_rules.py)
    mesh_class: type = Mesh

    def check(self) -> None:
        if self.global_batch < 1:
            raise UserError(f"--global-batch is {self.global_batch}; it must be a positive number of samples.")
        if self.algo not in ALGOS:
            raise UserError(f"--algo is {self.algo!r}; it must be one of {', '.join(ALGOS)}.")
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision is {self.precision!r}; it must be one of {', '.join(PRECISIONS)}.")
        if self.time_budget_s <= 0:
            raise UserError(f"--time-budget is {self.time_budget_s}; it must be a positive number of seconds.")
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad:
            raise UserError(f"schedule {bad[0]!r} is not one of {', '.join(SCHEDULES)}.")
        if not 0.0 <= self.memory_headroom < 0.9:
            raise UserError(f"--memory-headroom is {self.memory_headroom}; it must be a fraction in [0, 0.9).")


@dataclass
class Evaluated:
    candidate: Candidate
    plan: Plan
    result: Any                          # SimResult

    @property
    def step_time_s(self) -> float:
        return float(self.result.step_time_s)


@dataclass
class SearchResult:
    best: Evaluated
    runner_ups: list[Evaluated]
    num_evaluated: int
    num_infeasible: int
    num_settings: int
    phase_s: dict[str, float] = field(default_factory=dict)
    method: str = ""
    num_pruned: int = 0                  # settings never tabled: their bound ruled them out
    # the search's view of context and expert parallelism, for the plan summary (planner/parallel_notes.py):
    # per "cp" / "ep", the fastest fitting plan priced with that degree > 1 (None: none fitted), and
    # how many meshes with it > 1 the search admitted
    axis_alternatives: dict = field(default_factory=dict)
    # why the plan offloads to the NVMe tier (planner/nvme_choice.py); "" where it does not
    tier_note: str = ""

    @property
    def plan(self) -> Plan:
        return self.best.plan


class Planner:
    """One search: the graph, the cluster and the simulator's evaluator, with caches."""

    def __init__(self, graph: OpGraph, cluster: Cluster, cost_model, options: PlanOptions,
                 evaluator=None, progress: ProgressCallback | None = None):
        from autopar.simulator.api import PlanEvaluator

        from autopar.planner.constraints import candidate_meshes
        from autopar.planner.headroom import with_headroom

        options.check()
        cluster = with_headroom(cluster, options.memory_headroom)
        self.graph, self.cluster, self.cost_model, self.options = graph, cluster, cost_model, options
        self.evaluator = evaluator or PlanEvaluator(graph, cluster, cost_model)
        self.progress = progress or (lambda phase, done, total: None)
        self.num_layers = len(graph.layers)
        ex = options.executable
        self.styles = [megatron_styles(graph, i) if ex is None else ex.styles(graph, i)
                       for i in range(self.num_layers)]
        # identical layers: same structure and the same split relative to the layer's own path
        self.signatures = [f"{layer.signature}|{_relative_styles(layer.name, self.styles[i])}"
                           for i, layer in enumerate(graph.layers)]
        self.model = ModelRef(file=graph.model_file, args=dict(graph.model_args), name=graph.model_name,
                              fingerprint=graph.fingerprint)
        self.cluster_label = f"{cluster.name} ({cluster.source})" if cluster.source else cluster.name
        self.meshes = candidate_meshes(options, cluster, self.num_layers, graph)
        if not any(self.styles):
            # a tp > 1 mesh with no layer split runs the whole model on every tp rank
            from autopar.planner.constraints import nothing_to_split
            if options.degrees.get("tp", 1) > 1:
                raise nothing_to_split(graph, options.degrees["tp"], ex)
            self.meshes = [m for m in self.meshes if m.tp == 1]
        self.moves = MoveSpace(meshes=tuple(self.meshes), can_split=tuple(bool(s) for s in self.styles),
                               num_layers=self.num_layers, global_batch=options.global_batch,
                               max_micro_batch=options.max_micro_batch,
                               refused_micro_batches=options.refused_micro_batches,
                               max_virtual_stages=options.max_virtual_stages,
                               allow_offload=options.allow_offload, offload_tier=options.offload_tier,
                               recompute_choices=tuple(options.recompute),
                               zero_families=tuple(options.zero_families))
        self.seen: dict[Candidate, Evaluated | None] = {}
        self.num_unscreened = 0
        self.num_pruned = 0                          # settings skipped by their bound (screen_bound.py)
        #: layer_time_floor by (mesh, micro-batch, ZeRO family, cost model): settings that differ in
        #: schedule or micro-batch count share their floors
        self._floors: dict[tuple, np.ndarray] = {}
        self.num_infeasible = 0
        self.ilp_cache: dict = {}
        self.ilp_cache_split: dict = {}              # ILP solutions with every splittable layer split
        self.table_cache: dict = {}
        self.plan_parts: dict = {}       # Candidate.to_plan's memo: shared pipelines and layer plans
        self._choices_admitted: dict[int, tuple] = {}   # id(choices) -> (choices, admitted)

    # ------------------------------------------------------------------ pricing
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
                for ch in {id(ch): ch for ch in c.choices}.values()):
            return False
        hit = self._choices_admitted.get(id(c.choices))   # moves that keep the choices keep their tuple
        if hit is None or hit[0] is not c.choices:
            hit = (c.choices, self._admits_choices(c.choices))   # holding the tuple keeps its id
            self._choices_admitted[id(c.choices)] = hit
        if not hit[1]:
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
        for ch in {id(ch): ch for ch in choices}.values():      # each distinct choice object once
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

    # ------------------------------------------------------------------ settings
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
                    cost_model=cm)
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

    # ------------------------------------------------------------------ MCMC
    def _axis_alternatives(self, fitting: list[Evaluated]) -> dict:
        """Per "cp" / "ep": (meshes admitted with it > 1, the fastest fitting plan with it > 1 or None)."""
        out = {}
        for axis in ("cp", "ep"):
            admitted = sum(1 for m in self.meshes if getattr(m, axis) > 1)
            with_axis = [ev for ev in fitting if getattr(ev.candidate.mesh, axis) > 1]
            out[axis] = (admitted, min(with_axis, key=lambda ev: ev.step_time_s) if with_axis else None)
        return out

    def start_candidates(self) -> list[Candidate]:
        """Plain starts for MCMC alone: every mesh, fewest micro-batches, its smallest-memory corner too."""
        o = self.options
        out = []
        for mesh in self.meshes:
            mbs = microbatch_candidates(o.global_batch, mesh.batch_degree, max_micro_batch=o.max_micro_batch,
                                        refused=o.refused_micro_batches)
            if o.micro_batch is not None:
                mbs = [x for x in microbatch_candidates(o.global_batch, mesh.batch_degree,
                                                        refused=o.refused_micro_batches) if x[0] == o.micro_batch]
            if not mbs:
                continue
            corners = [("ddp", "none", "none"), ("zero1", "none", "none"),
                       ("fsdp", "full", o.offload_tier if o.allow_offload else "none")]
            for family, rc, off in corners:
                if family not in o.zero_families or (family == "zero1" and "ddp" in o.zero_families):
                    continue
                if o.offload is not None:
                    off = o.offload
                mb, m = mbs[-1] if family != "fsdp" else mbs[0]
                zero = o.zero if o.zero is not None else {"ddp": 0, "zero1": 1, "fsdp": 3}[family]
                choices = tuple(LayerChoice(tp=mesh.tp > 1 and bool(self.styles[i]), zero=zero,
                                            recompute=rc if rc in o.recompute else o.recompute[-1],
                                            offload=off) for i in range(self.num_layers))
                schedule = o.fixed_schedule if mesh.pp > 1 and o.fixed_schedule in ("1f1b", "gpipe") else "1f1b"
                out.append(Candidate(mesh=mesh, micro_batch=mb, num_microbatches=m, schedule=schedule,
                                     bounds=self._cuttable_bounds(mesh.pp), choices=choices))
        return out

    def _cuttable_bounds(self, num_stages: int) -> tuple[int, ...]:
        """Equal stages, each boundary moved to the nearest layer where a stage may start."""
        bounds = list(equal_bounds(self.num_layers, num_stages))
        ex = self.options.executable
        if ex is None or num_stages == 1 or not ex.cuttable:
            return tuple(bounds)
        cuts = sorted(ex.cuttable)
        for k in range(1, num_stages):
            bounds[k] = min((c for c in cuts if bounds[k - 1] < c < self.num_layers),
                            key=lambda c: abs(c - bounds[k]), default=bounds[k])
        return tuple(bounds)

    def refine(self, starts: list[Evaluated], deadline: float) -> list[Evaluated]:
        o = self.options
        found: list[Evaluated] = []
        for n, start in enumerate(starts):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            budget_s = remaining / (len(starts) - n)
            ref = start.step_time_s

            def cost(c: Candidate) -> float:
                ev = self.price(c)
                return ev.step_time_s / ref if ev is not None else math.inf

            def step(c: Candidate, rng) -> Candidate:
                return propose(c, rng, self.moves)

            done = [0]

            def tick(c: Candidate, rng) -> Candidate:
                done[0] += 1
                if done[0] % 50 == 0:
                    self.progress(f"MCMC refine {n + 1}/{len(starts)}", done[0], o.mcmc_iterations)
                return step(c, rng)

            patience = o.mcmc_patience if o.mcmc_patience is not None else max(1, o.mcmc_iterations // 2)
            res = metropolis_hastings(start.candidate, tick, cost, beta=o.mcmc_beta, seed=o.seed + n,
                                      max_iterations=o.mcmc_iterations, time_budget_s=budget_s, patience=patience,
                                      keep_trace=False)
            best = self.seen.get(res.best_state)
            if best is not None:
                found.append(best)
        return found

    # ------------------------------------------------------------------ driver
    def run(self) -> SearchResult:
        o = self.options
        t0 = time.perf_counter()
        deadline = t0 + o.time_budget_s
        phase: dict[str, float] = {}
        self.num_settings = 0
        pool: list[Evaluated] = []
        twins: list[Evaluated] = []
        if o.algo in ("ilp", "auto"):
            # the structured phase may use most of the budget, MCMC the rest
            share = 1.0 if o.algo == "ilp" else STRUCTURED_SHARE
            structured = self.structured(t0 + share * o.time_budget_s)
            # the twins join the pool after MCMC's starts are drawn from it (_distinct_best below)
            twins = self.split_backward_twins(structured)
            pool += structured
            phase["structured_s"] = time.perf_counter() - t0
        if o.algo in ("mcmc", "auto"):
            t1 = time.perf_counter()
            starts = _distinct_best(pool, o.mcmc_starts)
            if not starts:       # MCMC alone, or nothing structured fitted: start from plain corners
                starts = [ev for c in self.start_candidates() if (ev := self.price(c)) is not None]
                starts = _distinct_best(starts, max(1, o.mcmc_starts))
            refined = self.refine(starts, deadline)
            pool += refined + self.split_backward_twins(refined)
            phase["mcmc_s"] = time.perf_counter() - t1
        pool += twins
        fitting = [ev for ev in self.seen.values() if ev is not None]
        if not fitting:
            from autopar.planner.feasibility import explain_infeasible

            raise explain_infeasible(self.graph, self.cluster, self.cost_model, o, searched=len(self.seen))
        ranked = _distinct_best(fitting, o.top_k + 1)
        ranked += _whole_backward_runner_up(ranked, fitting)
        ranked[0] = self.tidy(ranked[0])
        method = {"auto": "ilp+dp then mcmc refine", "ilp": "ilp+dp", "mcmc": "mcmc"}[o.algo]
        result = SearchResult(best=ranked[0], runner_ups=ranked[1:], num_evaluated=len(self.seen),
                              num_infeasible=self.num_infeasible, num_settings=self.num_settings,
                              phase_s=phase, method=method, num_pruned=self.num_pruned,
                              axis_alternatives=self._axis_alternatives(fitting))
        elapsed = time.perf_counter() - t0
        result.best = self._finish(result.best, result, elapsed)
        result.runner_ups = [self._finish(ev, result, elapsed) for ev in result.runner_ups]
        return result

    def tidy(self, best: Evaluated) -> Evaluated:
        """Prefer uniform per-layer choices among plans within ``TIDY_TOLERANCE`` of the best.

        The searches leave incidental variety behind (ZeRO-2 on one block, ZeRO-3 on its
        neighbours) that costs nothing measurable but makes a plan harder to read and to run.
        For each field of the layer choice, try giving every layer the value most layers
        have; keep the change when the simulator prices the result within the tolerance.
        """
        limit = best.step_time_s * (1.0 + TIDY_TOLERANCE)
        current = best
        for field_name in ("zero", "recompute", "offload", "tp"):
            values = [getattr(ch, field_name) for ch in current.candidate.choices]
            for value in sorted(set(values), key=values.count, reverse=True):
                if all(v == value for v in values):
                    break
                choices = tuple(replace(ch, **{field_name: value}) for ch in current.candidate.choices)
                ev = self.price(replace(current.candidate, choices=choices))
                if ev is not None and ev.step_time_s <= limit:
                    current = ev
                    break
        return current

    def _finish(self, ev: Evaluated, result: SearchResult, elapsed_s: float) -> Evaluated:
        cm = self.cost_model
        profile = getattr(cm, "name", None) or ",".join(sorted(getattr(cm, "keys", lambda: [])()))
        plan = ev.plan.with_predicted(
            ev.result.predicted_dict(),
            graph_fingerprint=self.graph.fingerprint,
            cluster=self.cluster.name, cluster_file=self.cluster.source, profile=profile,
            method=result.method, seed=self.options.seed, search_s=round(elapsed_s, 3),
            num_evaluated=result.num_evaluated, num_infeasible=result.num_infeasible,
            num_settings=result.num_settings, virtual_stages=ev.candidate.virtual_stages)
        return Evaluated(ev.candidate, plan, ev.result)


def _relative_styles(layer_name: str, styles: dict[str, str]) -> list[tuple[str, str]]:
    prefix = layer_name + "."
    return sorted((k[len(prefix):] if k.startswith(prefix) else k, v) for k, v in styles.items())


def _setting_key(c: Candidate) -> tuple:
    return (c.mesh, c.micro_batch, c.schedule, c.virtual_stages, zero_family_of(c.choices[0].zero))


def _step_time(ev: Evaluated) -> float:
    return ev.step_time_s


def _distinct_best(evs: list[Evaluated], k: int) -> list[Evaluated]:
    """The k fastest plans, at most one per setting (mesh, micro-batch, schedule, ZeRO family)."""
    out, keys = [], set()
    # ordered by (step time, repr of the candidate); the repr, long for ~100 layers, only where
    # step times tie
    ordered = []
    for _, tie in groupby(sorted(evs, key=_step_time), key=_step_time):
        tie = list(tie)
        ordered += sorted(tie, key=lambda e: repr(e.candidate)) if len(tie) > 1 else tie
    for ev in ordered:
        key = _setting_key(ev.candidate)
        if key in keys:
            continue
        keys.add(key)
        out.append(ev)
        if len(out) == k:
            break
    return out


def _whole_backward_runner_up(ranked: list[Evaluated], fitting: list[Evaluated]) -> list[Evaluated]:
    """The fastest plan whose schedule runs whole backward passes, where every ranked plan splits
    it: the search ranks plans eager, and only the others can be compiled afterwards
    (compile_choice.py), which may make them the faster -- so one of them stays in the running."""
    def split(ev: Evaluated) -> bool:
        return ev.plan.mesh.pp > 1 and ev.plan.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES

    if not ranked or not all(split(ev) for ev in ranked):
        return []
    whole = [ev for ev in fitting if not split(ev)]
    return [min(whole, key=lambda ev: ev.result.step_time_s)] if whole else []


def _runs_split(ch: LayerChoice) -> LayerChoice:
    """The nearest choice a split-backward schedule runs (core/rules.split_backward_problem)."""
    if ch.recompute != "selective" and ch.zero < 3 and ch.offload == "none":
        return ch
    return replace(ch, recompute="full" if ch.recompute == "selective" else ch.recompute, zero=min(ch.zero, 2),
                   offload="none")


def search(graph: OpGraph, cluster: Cluster, cost_model, options: PlanOptions, *,
           progress: ProgressCallback | None = None, evaluator=None) -> SearchResult:
    """The best plan, its runner-ups and the search's statistics.  Where no plan fits host memory
    and the cluster has an NVMe tier, the search again with the tier (planner/nvme_choice.py)."""
    try:
        return Planner(graph, cluster, cost_model, options, evaluator=evaluator, progress=progress).run()
    except NoFeasiblePlanError as first:
        from autopar.planner.nvme_choice import nvme_retry

        retry = nvme_retry(graph, cluster, cost_model, options)
        if retry is None:
            raise
        try:
            result = Planner(graph, cluster, cost_model, retry[0], evaluator=evaluator, progress=progress).run()
        except NoFeasiblePlanError:
            raise first from None
        return replace(result, tier_note=retry[1])


def plan(graph: OpGraph, cluster: Cluster, cost_model, options: PlanOptions) -> Plan:
    """The fastest plan found that fits memory on every device (NoFeasiblePlanError if none)."""
    return search(graph, cluster, cost_model, options).best.plan


def keep_best_unless_beaten(result: "SearchResult", choices: list) -> tuple["SearchResult", object]:
    """``result`` with the plans of ``choices`` ((Evaluated, why) per plan, best first, as a
    knob applied after the search -- compile, float8 -- left them) and the knob's ``why`` of the
    plan kept.  The search's order stands (its tidy step prefers a simpler plan within
    ``TIDY_TOLERANCE``) unless the knob makes a runner-up faster than the best by more than that."""
    fastest = min(range(len(choices)), key=lambda i: choices[i][0].step_time_s)
    if choices[fastest][0].step_time_s >= choices[0][0].step_time_s * (1.0 - TIDY_TOLERANCE):
        fastest = 0
    order = [fastest] + [i for i in range(len(choices)) if i != fastest]
    # a new result: the caller's is left as the search returned it
    return (replace(result, best=choices[fastest][0], runner_ups=[choices[i][0] for i in order[1:]]),
            choices[fastest][1])
