"""A plan's per-layer rows, each layer's cost cached by value.

``LayerRows.layer_cost`` prices one layer under one choice (step/layer_cost.py), cached by
(the layer's choice relative to the layer -- identical blocks share it -- mesh, micro-batch,
precision, cost model, compile, float8 recipe); ``row`` turns it into the layer table's row
(term_registry.layer_row) with an integer naming it (equal integers, equal rows); ``rows_and_ids``
builds a plan's rows, from the last plan's of the same context where only a few layers changed.
"""
from __future__ import annotations

from itertools import compress
from operator import is_not
from typing import Callable

import numpy as np

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError
from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh, Plan
from autopar.core.sharding import propagate
from autopar.simulator.axes.sharded_dp import effective_zero
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.topology import MeshLinks, busy_devices_per_node
from autopar.simulator.step import cpu_node, term_registry
from autopar.simulator.step.context import Context
from autopar.simulator.step.layer_cost import LayerCost, compute_layer_cost
from autopar.simulator.step.layer_table import COLUMN_INDEX, RECOMPUTE_CODE

_OFFLOAD, _ZERO = COLUMN_INDEX["offload"], COLUMN_INDEX["zero"]


class LayerRows:
    """The rows of plans on one graph and cluster; ``links`` and ``rank_cost_models``: the
    mesh's links and each pipeline rank's cost model (PlanEvaluator's)."""

    def __init__(self, graph: OpGraph, cluster: Cluster, links: Callable[[Mesh], MeshLinks],
                 rank_cost_models: Callable[[Mesh], list[CostModel]]):
        self.graph = graph
        self.cluster = cluster
        self.num_layers = len(graph.layers)
        self.links = links
        self.rank_cost_models = rank_cost_models
        self._prefix = [layer.name + "." for layer in graph.layers]
        self._sig = [layer.signature for layer in graph.layers]
        self._cost_cache: dict[tuple, LayerCost] = {}
        #: the ops' compute of a layer by what it reads (step/op_work.op_work_key): shared between
        #: meshes that differ in dp or pp only
        self._work_cache: dict[tuple, object] = {}
        self._row_cache: dict[tuple, tuple[np.ndarray, int]] = {}   # key -> (row, row id)
        #: per row id: (runs sharded, is offloaded, runs ZeRO-1)
        self.row_flags: list[tuple[int, int, int]] = []
        self._relkey_cache: dict[tuple, int] = {}
        self._rel_ids: dict[tuple, int] = {}
        self._layouts: dict[tuple, object] = {}
        # the last rows built per Context.rows_key: rows_key -> (layer plans, rows, row ids)
        self._last_rows: dict[tuple, tuple] = {}
        self.num_layer_costs_computed = 0

    def layer_cost(self, layer_index: int, layer_plan: LayerPlan, mesh: Mesh, micro_batch: int,
                   precision: str, cost_model: CostModel | None = None, compiled: bool = False,
                   fp8_recipe: str = "tensorwise") -> LayerCost:
        """Cost of one layer under one choice, per device and micro-batch (cached); ``compiled``:
        the plan's ``compile`` (simulator/axes/compile_fusion.py), ``fp8_recipe`` its float8 recipe."""
        cm = cost_model or self.rank_cost_models(mesh)[0]
        key = (self.relative_key(layer_index, layer_plan), mesh, micro_batch, precision, cm.name, compiled,
               fp8_recipe if layer_plan.precision == "fp8" else "")
        cost = self._cost_cache.get(key)
        if cost is None:
            # the layout depends on the layer, its styles and the tp axis only: shared between
            # the costs of every ZeRO / recompute / offload choice, micro-batch and dp x pp
            loss_parallel = cm.code.loss_parallel
            layout_key = (layer_index, layer_plan.tp, mesh.tp, mesh.sequence_parallel, loss_parallel)
            layout = self._layouts.get(layout_key)
            if layout is None:
                layout = propagate(self.graph, layer_index, layer_plan.tp_styles, mesh.tp, mesh.sequence_parallel,
                                   loss_parallel)
                self._layouts[layout_key] = layout
            cost = compute_layer_cost(self.graph, layer_index, layout, layer_plan, mesh, micro_batch,
                                      precision, cm, self.links(mesh),
                                      # CPU nodes: oversubscribed compute slots; the waits of ranks
                                      # that meet are added per plan (cpu_node.with_meeting_waits)
                                      cpu_node.compute_stretch(self.cluster, mesh),
                                      busy_devices_per_node(self.cluster, mesh), compiled=compiled,
                                      fp8_recipe=fp8_recipe, work_cache=self._work_cache)
            self._cost_cache[key] = cost
            self.num_layer_costs_computed += 1
        return cost


    def relative_key(self, index: int, lp: LayerPlan) -> int:
        """The layer's choice relative to the layer (its signature, styles by path within the layer,
        ZeRO, recompute, offload, own precision), as an integer: identical blocks under the same
        choice share it."""
        k = (index, lp.tp, lp.zero, lp.recompute, lp.offload, lp.precision)
        rel = self._relkey_cache.get(k)
        if rel is None:
            prefix = self._prefix[index]
            styles = tuple(sorted((m[len(prefix):] if m.startswith(prefix) else m, s) for m, s in lp.tp))
            # a small integer names the relative key in the caches' keys (cheap to hash)
            rel = self._rel_ids.setdefault((self._sig[index], styles, lp.zero, lp.recompute, lp.offload,
                                            lp.precision), len(self._rel_ids))
            self._relkey_cache[k] = rel
        return rel


    def row(self, index: int, lp: LayerPlan, ctx: Context) -> tuple[np.ndarray, int]:
        """(the layer's row, an integer naming that row: equal integers, equal rows)."""
        rel = self.relative_key(index, lp)
        key = (rel, ctx.row_context, ctx.layer_cm_names[index])
        row_id = self._row_cache.get(key)
        if row_id is None:
            cm = ctx.rank_cm[ctx.layer_rank[index]]
            c = self.layer_cost(index, lp, ctx.mesh, ctx.micro_batch, ctx.precision, cm, ctx.compiled, ctx.fp8_recipe)
            row = np.array(term_registry.layer_row(c, float(effective_zero(lp.zero, ctx.mesh)),
                                                   1.0 if lp.offload != "none" else 0.0,
                                                   float(RECOMPUTE_CODE[lp.recompute]), lp, ctx.mesh), dtype=float)
            row_id = self._row_cache[key] = (row, len(self._row_cache))
            # (runs sharded, is offloaded, runs ZeRO-1)
            self.row_flags.append((int(row[_ZERO] >= 2), int(row[_OFFLOAD] != 0), int(row[_ZERO] == 1)))
        return row_id


    def rows_and_ids(self, plan: Plan, ctx: Context) -> tuple[np.ndarray, list[int]]:
        """The plan's (layers, columns) rows and the integer naming each layer's row (``row``)."""
        layers = plan.layers
        if len(layers) != self.num_layers:
            raise InfeasibleError(f"plan has {len(layers)} layer entries, the model {self.num_layers} layers")
        # a layer's row depends on its plan, the mesh, micro-batch and precision and its rank's
        # cost model (``row``): rows built for another context with the same rows_key serve
        last = self._last_rows.pop(ctx.rows_key, None)
        if last is not None:
            old_layers, rows, ids = last
            if layers is not old_layers:   # rows and ids are never written after this: copies only to change them
                # the layers that are other objects (in C: a search keeps the unchanged ones), then
                # those of them that differ
                moved = compress(range(len(layers)), map(is_not, layers, old_layers))
                changed = [i for i in moved if layers[i] != old_layers[i]]
                if changed:
                    rows = rows.copy()
                    ids = ids.copy()
                    for i in changed:
                        rows[i], ids[i] = self.row(i, layers[i], ctx)
        else:
            built = [self.row(i, lp, ctx) for i, lp in enumerate(layers)]
            rows = np.array([r for r, _ in built], dtype=float)
            ids = [i for _, i in built]
        if len(self._last_rows) >= 64:
            self._last_rows.pop(next(iter(self._last_rows)))      # the least recently used
        self._last_rows[ctx.rows_key] = (layers, rows, ids)
        return rows, ids
