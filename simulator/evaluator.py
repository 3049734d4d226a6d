"""The fast path for search: price a plan from cached per-layer costs.

``PlanEvaluator.evaluate(plan)`` prices a plan without an event timeline:

1. the plan's context (step/context.py), built once per value of what it is built from;
2. per layer, a ``LayerCost`` cached by (layer signature, the layer's tp styles relative to
   the layer, ZeRO, recompute, offload) within a context (mesh, micro-batch, precision), so a
   plan that differs from the last one in a few layers recomputes only those rows
   (a LayerTable: step/layer_table.py, built by step/layer_rows.py);
3. the registered "table" cost terms rewrite the rows (step/term_registry.py, step/builtin_terms.py): DDP's
   buckets where the runtime runs plain DDP, sharded data parallelism's copies, on CPU nodes the
   waits of ranks that meet (``_derive``);
4. the step in closed form by the context's step form (step_model.OVERLAPPED, or
   cpu_node.SERIAL where communication takes turns with compute, chosen when the context is
   built), and memory per pipeline rank (step/memory.py) from per-rank sums (step/assemble.py).

Where every term acting on the plan's context is local (term_registry.memo_safe) and the step
form allows (a GPU plan: no DDP buckets, no CPU waits) ``evaluate`` keeps, per context, the last plan's
derived table and a memo of each layer's derived row by its neighbourhood (step/layer_memo.py), so
a plan that changes a few layers looks up a few rows and redoes only the reductions over
layers; the numbers are the same bits as ``prepare`` + ``closed_form_step`` + ``assemble``.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh, Plan
from autopar.simulator.axes.dp_buckets import DDP_FIRST_BUCKET_BYTES, ddp_bucketed_all_reduces  # noqa: F401
from autopar.simulator.axes.sharded_dp_zero3_spans import layer_units
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.topology import MeshLinks, mesh_links, stage_groups
from autopar.simulator.result import SimResult
from autopar.simulator.step import layer_table, term_registry
from autopar.simulator.step.assemble import ModelFacts, assemble
from autopar.simulator.step.context import Context, ContextNames, build_context
from autopar.simulator.step.layer_cost import LayerCost
from autopar.simulator.step.layer_memo import (ACT, BWD, FWD, MAXIMA, NUM_DERIVED, OUT_END, LayerMemo,  # noqa: F401
                                              derived_table)
from autopar.simulator.step.layer_rows import LayerRows
from autopar.simulator.step.layer_table import LayerTable
from autopar.simulator.step.compose import step_from_chunk_times


class PlanEvaluator:
    """Prices plans for the search; ``layer_cost`` is the table the planner's ILP reads."""

    def __init__(self, graph: OpGraph, cluster: Cluster, cost_model: CostModel | Mapping[str, CostModel]):
        self.graph = graph
        self.cluster = cluster
        if isinstance(cost_model, CostModel):
            self._cms = {g.gpu: cost_model for g in cluster.groups}
        else:
            missing = [g.gpu for g in cluster.groups if g.gpu not in cost_model]
            if missing:
                raise ValueError(f"no cost model for GPU types {missing}")
            self._cms = dict(cost_model)
        self.num_layers = len(graph.layers)
        # the layer table's columns as the registered terms make them (term_registry.py)
        self._table_width = NUM_DERIVED + len(layer_table.COLUMNS)
        # what assemble reads of the model (every group runs the same code)
        self._model = ModelFacts.of(graph, next(iter(self._cms.values())).code.selective_mm_policy)
        self.rows = LayerRows(graph, cluster, self.links, self.rank_cost_models)
        self._names = ContextNames()
        # contexts by the values they are built from (_context)
        self._ctx_cache: dict[tuple, Context] = {}
        self._links_cache: dict[Mesh, MeshLinks] = {}
        self._units: list | None = None                 # _fetch_units
        self._per_graph: dict = {}                      # per_graph: fn -> fn(graph)

    @property
    def num_layer_costs_computed(self) -> int:
        """Layer costs priced so far (each once per cache key: LayerRows.layer_cost)."""
        return self.rows.num_layer_costs_computed

    def layer_cost(self, layer_index: int, layer_plan: LayerPlan, mesh: Mesh, micro_batch: int,
                   precision: str, cost_model: CostModel | None = None, compiled: bool = False,
                   fp8_recipe: str = "tensorwise") -> LayerCost:
        """Cost of one layer under one choice, per device and micro-batch (cached: LayerRows.layer_cost)."""
        return self.rows.layer_cost(layer_index, layer_plan, mesh, micro_batch, precision, cost_model, compiled,
                                    fp8_recipe)

    # ------------------------------------------------------------------ layer table
    def _fetch_units(self) -> list:
        """Each layer's gathered sub-modules (axes/sharded_dp_zero3_spans.layer_units), worked out once."""
        if self._units is None:
            self._units = [layer_units(self.graph.layer_ops(i)) for i in range(self.num_layers)]
        return self._units

    def per_graph(self, fn):
        """``fn(graph)``, worked out once (the evaluator's graph does not change): a fact of the
        model a cost term reads, e.g. axes/grad_compression.graph_matrices; kept by ``fn``."""
        kept = self._per_graph.get(fn)
        if kept is None:
            kept = self._per_graph[fn] = fn(self.graph)
        return kept

    def links(self, mesh: Mesh) -> MeshLinks:
        links = self._links_cache.get(mesh)
        if links is None:
            links = mesh_links(self.cluster, mesh)
            self._links_cache[mesh] = links
        return links

    def rank_cost_models(self, mesh: Mesh) -> list[CostModel]:
        """The cost model that prices each pipeline rank (its slowest device type)."""
        out = []
        for r in range(mesh.pp):
            cms = [self._cms[self.cluster.groups[g].gpu] for g in stage_groups(self.cluster, mesh, r)]
            # the slowest device of the stage sets its pace: lowest matmul throughput
            out.append(min(cms, key=lambda cm: cm.peak("bf16") * cm.efficiency.get("matmul", 1.0)))
        return out


    # -------------------------------------------------------------------- context
    def _context(self, plan: Plan) -> Context:
        """The plan's context (step/context.py), kept by the values it is built from."""
        pl = plan.pipeline
        key = (plan.mesh, plan.micro_batch, plan.precision, pl.stages, pl.schedule, pl.num_microbatches, plan.compile,
               plan.fp8_recipe)
        ctx = self._ctx_cache.get(key)
        if ctx is None:
            mesh = plan.mesh
            ctx = build_context(plan, key, self.graph, self.cluster, self.links(mesh), self.rank_cost_models(mesh),
                                self._names)
            self._ctx_cache[key] = ctx
        return ctx

    # ------------------------------------------------------------------ evaluation
    def prepare(self, plan: Plan) -> tuple[Context, LayerTable]:
        """The plan's context and its per-layer table, as the step model reads them."""
        ctx = self._context(plan)
        return ctx, self._derive(LayerTable(self.rows.rows_and_ids(plan, ctx)[0]), ctx)

    def _derive(self, rows: LayerTable, ctx: Context) -> LayerTable:
        """The plan's rows rewritten by the registered "table" terms, in order (step/builtin_terms.py:
        DDP buckets, sharded data parallelism's copies and overlap, the waits of CPU ranks that
        meet): the terms that depend on other layers."""
        for term in term_registry.table_terms():
            rows = term.derive(rows, ctx, self)
        return rows

    def evaluate(self, plan: Plan) -> SimResult:
        ctx = self._context(plan)
        if not ctx.memo_ok:
            rows = self._derive(LayerTable(self.rows.rows_and_ids(plan, ctx)[0]), ctx)
            step_r, bubble = ctx.step_form.step(ctx, rows)
            return self.assemble(plan, ctx, rows, step_r, bubble)
        table, (n_sharded, _, n_zero1) = derived_table(plan, ctx, self.rows, self._derive, self._table_width)
        rows = LayerTable(table[:, NUM_DERIVED:])
        # per model chunk, in one call each: the sums of (forward, backward, activation) and the
        # maxima of the MAX_COLUMNS (the same numbers as one column at a time)
        sums = np.add.reduceat(table[:, FWD:ACT + 1], ctx.starts, axis=0)
        maxima = np.maximum.reduceat(table[:, MAXIMA:OUT_END + 1], ctx.starts, axis=0)
        any_ddp = n_sharded < self.num_layers             # (ZeRO stages are 0 .. 3)
        # (under a pipeline the reduce-scatters of each rank's first chunk end its step:
        # dp_sync.fsdp_tails sums them from the rows)
        step_r, bubble = step_from_chunk_times(ctx, rows, table[:, BWD], sums[:, 0], sums[:, 1],
                                               maxima[:ctx.p, 3] if ctx.pipeline_m is None else None,
                                               any_ddp, n_zero1 > 0)
        return self.assemble(plan, ctx, rows, step_r, bubble, chunk_terms=(sums[:, 2], maxima[:, :3].T, maxima[:, 4]),
                             any_ddp=any_ddp)


    def assemble(self, plan: Plan, ctx: Context, rows: LayerTable, step_r: np.ndarray, bubble: float,
                 timeline: list | None = None, chunk_terms: tuple | None = None,
                 any_ddp: bool | None = None) -> SimResult:
        """The SimResult of a plan whose step is ``step_r``, ``bubble`` (step/assemble.py)."""
        return assemble(plan, ctx, rows, step_r, bubble, self._model, timeline, chunk_terms, any_ddp, self.cluster)


def closed_form_step(ctx: Context, rows: LayerTable) -> tuple[np.ndarray, float]:
    """(time at which each pipeline rank finishes the step, bubble fraction): the step model in
    the context's form (step_model.OVERLAPPED, or cpu_node.SERIAL on CPU nodes whose
    communication takes turns with compute), chosen when the context was built."""
    return ctx.step_form.step(ctx, rows)
