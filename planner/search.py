"""``best_plan(graph, cluster, cost_model, options) -> Plan``: the planner's two searches.

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

import time
from itertools import groupby
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.errors import NoFeasiblePlanError, UserError
from autopar.core.graph import OpGraph
from autopar.core.plan import PRECISIONS, SCHEDULES, Mesh, ModelRef, Plan
from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES
from autopar.core.sharding import megatron_styles
from autopar.planner.candidate import Candidate
from autopar.planner.candidate_pricing import CandidatePricing, Evaluated
from autopar.planner.mcmc_refine import McmcRefine
from autopar.planner.moves import MoveSpace
from autopar.planner.space import RECOMPUTE_CHOICES, zero_family_of
from autopar.planner.structured_phase import StructuredPhase

ALGOS = ("auto", "ilp", "mcmc")
# How the time budget is split, where it binds: under --algo auto the structured phase (screen,
# ILP + stage DP) may run until this fraction of the budget, MCMC refinement gets the rest --
# more than half to the phase that finds the plans MCMC starts from, enough left for MCMC to
# refine them.  Set by hand and no measurement fixed it (nor structured_phase.SCREEN_SHARE); it
# matters only when a search runs out of time: the benchmarks' searches (planner_vs_grid.py,
# --time-budget 3000 and the default 40 s) finish the structured phase in 1-4 s, far inside it,
# so no recorded plan depends on it.
STRUCTURED_SHARE = 0.6
# A plan with uniform layer choices is preferred to the best one when it is at most this much
# slower (0.2%: below what the simulator can tell apart; see Planner.tidy).
TIDY_TOLERANCE = 0.002

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


class Planner(CandidatePricing, StructuredPhase, McmcRefine):
    """One search: the graph, the cluster and the simulator's evaluator, with caches.

    Its jobs live in one module each: pricing candidates (candidate_pricing.py), the structured
    phase (structured_phase.py) and MCMC refinement (mcmc_refine.py); this class sets up the
    state they share (``__init__``), drives them (``run``) and ranks and finishes what they found
    (``tidy``, ``_finish``)."""

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
        self._choices_admitted: dict[tuple, bool] = {}  # CandidatePricing.admits: choices -> admitted

    def _axis_alternatives(self, fitting: list[Evaluated]) -> dict:
        """Per "cp" / "ep": (meshes admitted with it > 1, the fastest fitting plan with it > 1 or None)."""
        out = {}
        for axis in ("cp", "ep"):
            admitted = sum(1 for m in self.meshes if getattr(m, axis) > 1)
            with_axis = [ev for ev in fitting if getattr(ev.candidate.mesh, axis) > 1]
            out[axis] = (admitted, min(with_axis, key=lambda ev: ev.step_time_s) if with_axis else None)
        return out

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


def best_plan(graph: OpGraph, cluster: Cluster, cost_model, options: PlanOptions) -> Plan:
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
