"""Per-layer cost tables for one setting (mesh, micro-batching, ZeRO family): the ILP's inputs.

For every layer and every strategy of the setting, the simulator's ``LayerCost`` (priced once
per distinct layer signature -- identical blocks cost the same) is folded into three numbers
the solvers read:

* ``time_mb_s``   seconds the layer keeps its device busy per micro-batch: forward, backward,
  recompute and the tensor-parallel collectives, which sit on the critical path (Shoeybi et
  al. 2019, Sec. 3: the f/g all-reduces are synchronous);
* ``step_s``      seconds per step that do not repeat with micro-batches and are not hidden
  (data-parallel synchronisation beyond the backward it overlaps -- DDP overlaps its bucketed
  all-reduce with the backward of the last micro-batch (Li et al. 2020, "PyTorch Distributed",
  Sec. 3.2.3); FSDP prefetches the next all-gather behind the current layer's compute (Zhao et
  al. 2023, Sec. 3.3), so only what exceeds that compute shows -- plus the optimizer step);
* ``static_bytes`` parameters, gradients and optimizer state on the device, and
  ``activation_bytes`` kept for backward per micro-batch (times the micro-batches in flight);
  ``tied_bytes`` a copy of a tied weight, counted by stage (simulator/tied_copies.py).

These are the ILP's node costs and memory (ilp.py eq. 1, 1b); the simulator prices the
assembled plan exactly afterwards, so the folding only has to rank strategies well.  The fold of
the first two is the simulator's (step/compose.folded_layer_time, through simulator/api.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from autopar.core.plan import LayerPlan, Mesh
from autopar.planner.space import LayerChoice
from autopar.simulator.api import (effective_zero, folded_layer_time, fsdp_buffer_bytes, layer_row, tied_uses,
                                   with_term_columns)


@dataclass(frozen=True)
class LayerTables:
    choices: tuple[LayerChoice, ...]     # the setting's strategies (shared index space)
    time_mb_s: np.ndarray                # (L, C) per micro-batch
    step_s: np.ndarray                   # (L, C) once per step
    static_bytes: np.ndarray             # (L, C)
    activation_bytes: np.ndarray         # (L, C) per micro-batch in flight
    reserve_bytes: np.ndarray            # (L, C) transient peak terms (max, not sum, over layers)
    output_bytes: np.ndarray             # (L,) boundary activation per micro-batch (pipeline sends)
    valid: np.ndarray                    # (L, C) bool: the choice is a real option for the layer
    #: (L, C) state of a copy of the tied weights the layer uses, held where its stage does not
    #: hold an earlier user (simulator/tied_copies.py; ``tied_uses`` says which)
    tied_bytes: np.ndarray | None = None
    tied_uses: tuple = ()
    #: what the tables were built for, as values (``build_layer_tables``): the solvers' memos
    #: (structured.py) key the tables by it
    key: tuple = ()

    @property
    def num_layers(self) -> int:
        return self.time_mb_s.shape[0]

    def step_time(self, num_microbatches: int) -> np.ndarray:
        """(L, C) seconds per step of each layer's strategies when it runs alone."""
        return num_microbatches * self.time_mb_s + self.step_s


def build_layer_tables(evaluator, *, styles: list[dict[str, str]], signatures: list[str],
                       choices: list[LayerChoice], mesh: Mesh, micro_batch: int, num_microbatches: int,
                       precision: str, cost_model=None, key: tuple | None = None) -> LayerTables:
    """Price every (layer, choice) of a setting through ``evaluator.layer_cost``.  ``key``: the
    tables' ``key`` (default: the mesh, micro-batch, micro-batches, precision, cost model and
    choices they are built for; the planner's structured phase gives its own table cache's key)."""
    L, C = len(styles), len(choices)
    # identical layers (one signature, a split or none) have identical rows: priced once, on the
    # first of them, and spread to the others by index
    keys = [(sig, bool(st)) for sig, st in zip(signatures, styles)]
    first: dict[tuple, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    group = {key: g for g, key in enumerate(first)}
    which = np.array([group[key] for key in keys], dtype=np.intp)
    cols = np.zeros((7, len(first), C))      # time_mb, step, static, activation, reserve, output, tied
    valid_rows = np.ones((len(first), C), dtype=bool)
    memo: dict[LayerChoice, tuple] = {}
    pipeline_m = num_microbatches if mesh.pp > 1 else None
    sharded = _sharded_terms(evaluator, mesh, precision, cost_model, pipeline_m)
    for g, i in enumerate(first.values()):
        can_split = bool(styles[i]) and mesh.tp > 1
        for c, ch in enumerate(choices):
            eff = ch if (can_split or not ch.tp) else replace(ch, tp=False)
            valid_rows[g, c] = eff == ch
            if eff not in memo:
                lp = LayerPlan(layer=i, tp=tuple(sorted(styles[i].items())) if eff.tp else (),
                               zero=eff.zero, recompute=eff.recompute, offload=eff.offload)
                lc = evaluator.layer_cost(i, lp, mesh, micro_batch, precision, cost_model)
                runs = effective_zero(eff.zero, mesh)
                if sharded is not None and runs >= 2:
                    lc = sharded(lc, lp)
                # (the layer's own traffic beside its compute, the exposed sync per step:
                # step/compose.folded_layer_time, with the registered terms' columns)
                t_mb, t_step = folded_layer_time(with_term_columns(lc, lp, mesh), runs, eff.offload != "none",
                                                 pipeline_m)
                memo[eff] = (t_mb, t_step, lc.param_bytes + lc.grad_bytes + lc.optimizer_bytes,
                             lc.activation_bytes,
                             lc.transient_bytes + fsdp_buffer_bytes(lc.fsdp_param_buffer_bytes,
                                                                    lc.fsdp_grad_buffer_bytes),
                             lc.output_bytes,
                             lc.tied_param_bytes + lc.tied_grad_bytes + lc.tied_optimizer_bytes)
            cols[:, g, c] = memo[eff]
        memo.clear()
    time_mb, step, static, act, reserve = (cols[k][which] for k in range(5))
    out = cols[5][which, -1] if C else np.zeros(L)
    uses = tuple(tied_uses(evaluator.graph))
    tied = cols[6][which] if uses else None
    if key is None:
        key = (mesh, micro_batch, num_microbatches, precision, cost_model.name if cost_model else None,
               tuple(choices))
    return LayerTables(tuple(choices), time_mb, step, static, act, reserve, out, valid_rows[which], tied, uses,
                       key)


def _sharded_terms(evaluator, mesh: Mesh, precision: str, cost_model, pipeline_m: int | None = None):
    """A function adding to a sharded layer's LayerCost what the simulator adds to whole plans'
    rows (simulator/sharded_dp.py: FSDP2's copy-out and copy-in, the NCCL overlap slowdown, the
    fp32 reduce-scatter, a ring over nodes at its own efficiency), so the tables rank FSDP
    choices as the full price will; None where those terms do not apply (a CPU profile's ranks
    take turns: sharded_dp_table.plan_table_costs)."""
    from autopar.simulator.api import (COLUMN_INDEX, LAYER_COST_FIELDS, RECOMPUTE_CODE, LayerCost, collective_terms,
                                       layer_among_equals, reduce_scale, serial_communication)

    cm = cost_model or evaluator.rank_cost_models(mesh)[0]
    if cm.host_dispatch_bound or serial_communication(evaluator.cluster, mesh):
        return None
    n = len(LAYER_COST_FIELDS)
    factor = reduce_scale(precision, cm.code.reduce_bytes)
    dp = evaluator.links(mesh).dp
    terms = collective_terms(cm.code.sharded, dp.level, dp.size, dp.link.bandwidth_GBps, dp.link.latency_s,
                             evaluator.cluster.inter_node.bandwidth_GBps,
                             cm.collective_efficiency.get("inter", 1.0), cm.calibration)

    def add(lc, lp: LayerPlan):
        row = np.array(layer_row(lc, float(effective_zero(lp.zero, mesh)), 1.0 if lp.offload != "none" else 0.0,
                                 float(RECOMPUTE_CODE[lp.recompute]), lp, mesh))
        out = layer_among_equals(row, COLUMN_INDEX, COLUMN_INDEX["zero"], cm.memory_bandwidth_Bps,
                                 cm.efficiency.get("memory_bound", 1.0), factor, pipeline_m, **terms)
        return LayerCost(**{f: type(getattr(lc, f))(v) for f, v in zip(LAYER_COST_FIELDS, out[:n])})

    return add
