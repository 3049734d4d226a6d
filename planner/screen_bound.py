"""A lower bound on a setting's screen score, from one strategy per distinct layer.

The structured phase (search.Planner.structured) ranks every setting by its screen score --
the step latency of the stage DP over the setting's per-layer tables (layer_tables.py,
structured.range_costs) -- and assembles only the best ``num_screened``.  The tables price
every (layer, strategy) pair of the setting; the bound here prices one strategy per distinct
layer, so a setting whose bound already exceeds the ``num_screened``-th best score found is
never tabled (branch and bound, Land & Doig 1960; Alpa prunes its stage DP's enumeration
the same way, Zheng et al. 2022, Sec. 5.2).  Settings screened in ascending order of their
bound meet good incumbents early.  The pruned settings cannot enter the best ``num_screened``,
so the settings assembled are the same as without the bound.

Per layer, the floor of the tables' ``time_mb_s`` over the setting's strategies (each entry is
``max(fwd compute, fwd comm) + max(bwd compute, bwd comm)``, step/compose.folded_layer_time):

* it is at least the compute, ``fwd_s + recompute_s + bwd_s`` and the in-layer collectives
  (``tp_comm_*``, ``cp_comm_*``, ``ep_comm_*``) and the columns of any other registered "compute"
  term (overlap.compute_per_pass), and that compute is least without recompute or with a full one: a
  selective recompute only adds (it reruns the cheap ops and adds the checkpoint wrapper's per-op
  overheads), while a full one that stops early (simulator/axes/recompute.recompute) reruns the
  forward up to its last saved tensor and no longer records the outputs of the forward it
  checkpoints -- on a CPU profile, whose autograd recording costs per byte, that can come to a
  little less than no recompute, so the floor is the lesser of the two;
* the ZeRO stage and offload within one family leave the compute as it is: the autocast mode
  and FSDP's per-unit overhead depend on whether the stage that runs is 2 or more, which one
  family's strategies share (ddp: 0; zero1: 1, run as ZeRO-2 under tp or pp for every layer
  alike -- axes/sharded_dp.effective_zero; fsdp: 2 and 3), and offload moves state, not compute;
* the sharded-DP terms the tables add (layer_tables._sharded_terms: copy-out, the overlap
  slowdown, the fp32 reduce-scatter) only add;
* under FSDP without a pipeline it is also at least the traffic before forward plus the traffic
  after backward of ZeRO-2 without offload (overlap.fsdp_traffic: built in, the all-gather plus
  the reduce-scatter), which ZeRO-3's second gather and offload's copies only add to.

The strategies' once-per-step part (``step_s``: exposed synchronisation, the optimizer) is
never negative and is left out.  tests/planner/test_planner_bound.py checks the floor against every
entry of the tables and the bound against the screen score.
"""
from __future__ import annotations

import math

import numpy as np

from autopar.core.plan import LayerPlan, Mesh, equal_bounds
from autopar.core.rules import ZERO_FAMILIES
from autopar.simulator.api import effective_zero, layer_floor
from autopar.core.rules import MULTI_CHUNK_SCHEDULES, stage_rank
from autopar.simulator.api import interleaved_time, screen_bubble_share, with_term_columns

#: the ZeRO stage whose compute every strategy of the family shares (module docstring)
_FAMILY_ZERO = {family: stages[0] for family, stages in ZERO_FAMILIES.items()}


def layer_time_floor(evaluator, *, styles: list[dict[str, str]], signatures: list[str], mesh: Mesh,
                     micro_batch: int, zero_family: str, precision: str, cost_model) -> np.ndarray:
    """(L,) seconds per micro-batch below every strategy of the family in the setting's tables.

    Under sequence parallelism a layer that can be split runs split (Planner.tables' mask), so
    only that split is priced; otherwise the lesser of split and replicated.
    """
    zero = _FAMILY_ZERO[zero_family]
    traffic = zero_family == "fsdp" and mesh.pp == 1
    out = np.zeros(len(styles))
    memo: dict[tuple, float] = {}
    for i, st in enumerate(styles):
        can_split = bool(st) and mesh.tp > 1
        splits = (True,) if (can_split and mesh.sequence_parallel) else ((True, False) if can_split else (False,))
        best = math.inf
        for split in splits:
            key = (signatures[i], split)
            if key not in memo:
                floor = math.inf
                for recompute in ("none", "full"):
                    lp = LayerPlan(layer=i, tp=tuple(sorted(st.items())) if split else (), zero=zero,
                                   recompute=recompute, offload="none")
                    lc = evaluator.layer_cost(i, lp, mesh, micro_batch, precision, cost_model)
                    # (under a pipeline the gathers are per step, spread over however many
                    # micro-batches the setting runs: axes/pp_fsdp.py; the floor leaves them out;
                    # without one the traffic of ZeRO-2 without offload, whose parts ZeRO-3 and
                    # offload only add to: step/compose.layer_floor)
                    floor = min(floor, layer_floor(with_term_columns(lc, lp, mesh), zero, traffic))
                memo[key] = floor
            best = min(best, memo[key])
        out[i] = best
    return out


def floor_key(mesh: Mesh, micro_batch: int, zero_family: str) -> tuple:
    """What ``layer_time_floor`` depends on besides the model and the cost model: the settings
    of one key share their floors.  Under a pipeline the floor counts no FSDP traffic and ZeRO-1
    runs as ZeRO-2 (axes/sharded_dp.effective_zero), so the zero1 and fsdp families price the same
    layer costs there."""
    runs = effective_zero(_FAMILY_ZERO[zero_family], mesh)
    traffic = zero_family == "fsdp" and mesh.pp == 1
    return (mesh, micro_batch, runs if runs < 2 else 2, traffic)


def screen_bound(floors: np.ndarray, num_microbatches: int, schedule: str, virtual_stages: int) -> float:
    """Lower bound on ``Planner.screen``'s score from per-layer floors ``floors`` (p, L), row r
    priced on pipeline rank r's devices.

    One rank, or equal chunks of a multi-chunk schedule: the screen's own formula, ``m max_r lat_r
    + share (sum_r lat_r - max_r lat_r) / v`` (Narayanan et al. 2021, Sec. 2.2.2; share:
    pipeline_zero_bubble.screen_bubble_share), which grows with every
    ``lat_r``, over the floors of each rank's chunks.  1F1B over p > 1 ranks: the stage DP
    minimises Alpa's eq. 2, ``sum_s t_s + (m - 1) max_s t_s`` (stage_dp.py); any partition's
    stages sum to at least the floors' sum S (each layer on its cheapest rank) and its slowest
    stage holds at least S / p and at least the costliest layer.
    """
    p, L = floors.shape
    m, v = num_microbatches, virtual_stages
    if p == 1 or schedule in MULTI_CHUNK_SCHEDULES:
        bounds = equal_bounds(L, p * v)
        ranks = np.array([stage_rank(schedule, k, p) for k in range(len(bounds) - 1)])
        chunk = np.add.reduceat(floors, bounds[:-1], axis=1)[ranks, np.arange(len(bounds) - 1)]
        lat = np.bincount(ranks, weights=chunk, minlength=p)
        return float(interleaved_time(lat.sum(), lat.max(), m, v, screen_bubble_share(schedule)))
    cheapest = floors.min(axis=0)
    total = float(cheapest.sum())
    return total + (m - 1) * max(total / p, float(cheapest.max()))
