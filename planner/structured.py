"""The structured search for one setting: stage DP over layer ranges, then an ILP per stage.

Alpa (Zheng et al. 2022, Sec. 5.2) prices every layer range on every submesh with the
intra-op ILP and partitions by DP.  Here the stage DP (stage_dp.py) prices a range ``i..j`` on
pipeline position ``s`` with the best strategy applied uniformly to the range among those that
fit the position's memory (vectorised over all ranges at once; an upper bound of what the ILP
achieves on it), and once the boundaries are fixed the ILP (ilp.py) picks each stage's
per-layer strategies under the per-device budget, mixing strategies inside runs of identical
layers where memory binds.  Identical stages (same layers, same micro-batches in flight, same
budget) are solved once.

Memory per device of a stage (simulator/memory.py): the state of its layers, activations of
one micro-batch times the micro-batches in flight at its position, and terms that are a
maximum over layers (the recompute transient, FSDP's unsharded buffers), the DDP buckets and
the pipeline send/receive buffers, which are reserved before the ILP and re-checked after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.core.errors import InfeasibleError
from autopar.core.plan import Mesh, equal_bounds
from autopar.core.rules import MULTI_CHUNK_SCHEDULES, stage_rank
from autopar.planner.candidate import Candidate
from autopar.planner.ilp import ChoiceNode, group_consecutive, solve_intra_op
from autopar.planner.layer_tables import LayerTables
from autopar.planner.stage_dp import partition_stages
from autopar.simulator.api import (ddp_bucket_bytes, inflight_microbatches, p2p_buffer_bytes, tied_held_share,
                                   tied_range_held_bytes, tied_uses)


@dataclass(frozen=True)
class Setting:
    mesh: Mesh
    micro_batch: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    zero_family: str


def _fixed_bytes(tables: LayerTables, layers: range, family: str) -> float:
    """Buffers that do not depend on the strategy mix: DDP buckets and pipeline send/receive."""
    out = 0.0
    if family in ("ddp", "zero1"):
        grads = float(tables.static_bytes[layers.start:layers.stop].max(axis=1).sum())
        out += float(ddp_bucket_bytes(grads))
    if len(layers):
        out += p2p_buffer_bytes(float(tables.output_bytes[layers.stop - 1]))
    return out


def _inflight(setting: Setting, pp_rank: int) -> int:
    return inflight_microbatches(setting.schedule, setting.mesh.pp, pp_rank, setting.num_microbatches,
                                 setting.virtual_stages)


def max_stage_layers(num_layers: int, num_stages: int) -> int:
    """Longest stage the DP considers: twice the mean plus two layers.

    A stage that long holds over twice the work of an average one, so the pipeline it bounds
    (eq. 2, (m - 1) * max stage) loses to a more even split whenever layers are of similar
    cost; the band keeps the DP's range table at O(L * L / p) instead of O(L^2).
    """
    if num_stages <= 1:
        return num_layers
    return min(num_layers, 2 * -(-num_layers // num_stages) + 2)


def range_costs(tables_by_rank: list[LayerTables], setting: Setting, capacity_bytes: list[float],
                allowed: np.ndarray | None = None, inflight_by_rank: list[float] | None = None,
                cuttable: frozenset[int] | None = None,
                ranges: list[tuple[int, int]] | None = None) -> np.ndarray:
    """cost[s, i, j]: per-micro-batch latency of layers i..j-1 on pipeline rank s, with the best
    strategy applied uniformly to the range among those that fit the rank's memory.

    ``tables_by_rank[s]`` prices rank s's devices (ranks on different GPU types of a
    heterogeneous cluster have different tables); ``allowed`` (L, C) masks strategies out.
    Ranges longer than ``max_stage_layers`` are left at ``inf``, and so are ranges that start
    or end at a layer boundary outside ``cuttable`` (where the runtime cannot cut stages).
    ``ranges`` [(i, j), ...]: price only these (the others are left at ``inf``), for a caller
    whose stages are fixed (equal chunks).
    """
    S = setting.mesh.pp
    L = tables_by_rank[0].num_layers
    m = setting.num_microbatches
    if inflight_by_rank is None:
        inflight_by_rank = [_inflight(setting, s) for s in range(S)]
    if ranges is None:
        width = max_stage_layers(L, S * setting.virtual_stages)
        starts = np.repeat(np.arange(L), width)
        ends = starts + np.tile(np.arange(1, width + 1), L)
        keep = ends <= L
        starts, ends = starts[keep], ends[keep]
    else:
        starts = np.array([i for i, _ in ranges], dtype=np.int64)
        ends = np.array([j for _, j in ranges], dtype=np.int64)
    out = np.full((S, L, L + 1), np.inf)
    memo: dict[tuple, np.ndarray] = {}
    prepared: dict[tuple, tuple] = {}
    for s in range(S):
        tables = tables_by_rank[s]
        key = (tables.key, inflight_by_rank[s], capacity_bytes[s])
        if key not in memo:
            if tables.key not in prepared:
                prepared[tables.key] = _range_sums(tables, setting, m, allowed, starts, ends)
            T, base, AC = prepared[tables.key]
            mem = base + inflight_by_rank[s] * AC
            memo[key] = np.where(mem <= capacity_bytes[s], T, np.inf).min(axis=1)
        out[s, starts, ends] = memo[key]
    if cuttable is not None:
        uncut = [b for b in range(1, L) if b not in cuttable]
        out[:, uncut, :] = np.inf
        out[:, :, uncut] = np.inf
    return out


def _range_sums(tables: LayerTables, setting: Setting, m: int, allowed: np.ndarray | None,
                starts: np.ndarray, ends: np.ndarray):
    """Per range k = (starts[k], ends[k]) and strategy: latency, memory without activations,
    activations per micro-batch -- each (K, C)."""
    L, C = tables.time_mb_s.shape
    ok = tables.valid if allowed is None else (tables.valid & allowed)
    t = tables.time_mb_s + tables.step_s / m                      # (L, C)

    def prefix(x):
        return np.vstack([np.zeros(C), np.cumsum(x, axis=0)])    # (L+1, C)

    pt, ps, pa, pbad = prefix(t), prefix(tables.static_bytes), prefix(tables.activation_bytes), prefix(~ok)
    T = pt[ends] - pt[starts]
    ST = ps[ends] - ps[starts]
    AC = pa[ends] - pa[starts]
    bad = (pbad[ends] - pbad[starts]) > 0
    width = int((ends - starts).max())
    # maximum of the reserve over the range's layers: a running maximum along the layers that
    # follow each start, read at the range's length
    padded = np.vstack([tables.reserve_bytes, np.full((width, C), -np.inf)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=0)[:L]    # (L, C, width)
    running = np.maximum.accumulate(windows, axis=2)
    reserve = running[starts, :, ends - starts - 1]                                 # (K, C)
    p2p = p2p_buffer_bytes(tables.output_bytes[ends - 1][:, None])
    ddp = 0.0
    if setting.zero_family in ("ddp", "zero1"):
        ddp = ddp_bucket_bytes(ST)
    if tables.tied_uses:
        ST = ST + tied_range_held_bytes(list(tables.tied_uses), tables.tied_bytes, starts, ends)
    base = np.where(bad, np.inf, ST + reserve + p2p + ddp)
    return T, base, AC


def stage_ilp(tables: LayerTables, signatures: list[str], chunks: list[range], inflight: float,
              capacity_bytes: float, num_microbatches: int, family: str, seed: int,
              allowed: np.ndarray | None = None, time_limit_s: float = 2.0) -> tuple[list[int], float]:
    """Per-layer strategy indices for the layers one device holds (one stage, or the chunks of
    an interleaved rank) under the budget (ilp.py), and its cost.

    ``allowed`` (L, C) masks strategies out (e.g. replication under sequence parallelism).
    The reserve (a max over layers) is first taken at the largest among the strategies, then
    tightened to the chosen ones' until the stage fits.
    """
    step = tables.step_time(num_microbatches)
    mem = tables.static_bytes + inflight * tables.activation_bytes
    run_keys = list(signatures)
    if tables.tied_uses:                   # the copies of tied weights these chunks hold
        share = tied_held_share(list(tables.tied_uses), [c.start for c in chunks], tables.num_layers)
        mem = mem + share[:, None] * tables.tied_bytes
        # a layer holding a copy is not one of a run of identical layers that hold none
        run_keys = [f"{sig}+copy{share[i]:g}" if share[i] else sig for i, sig in enumerate(signatures)]
    fixed = max(_fixed_bytes(tables, ch, family) for ch in chunks)
    ok = tables.valid if allowed is None else (tables.valid & allowed)
    runs = [(ch.start + a, ch.start + b) for ch in chunks
            for a, b in group_consecutive(run_keys[ch.start:ch.stop])]
    layer_ids = [i for ch in chunks for i in ch]
    idx = [np.flatnonzero(ok[a]) for a, _ in runs]
    nodes = [ChoiceNode(cost_s=step[a, ix], memory_bytes=mem[a, ix], count=b - a, name=signatures[a])
             for (a, b), ix in zip(runs, idx)]
    reserve = max(float(tables.reserve_bytes[a, ix].max()) for (a, _), ix in zip(runs, idx))
    budget = capacity_bytes - fixed - reserve
    for _ in range(6):
        sol = solve_intra_op(nodes, [], budget, time_limit_s=time_limit_s, seed=seed)
        chosen = []
        for v, ((a, b), ix) in enumerate(zip(runs, idx)):
            chosen += [int(ix[k]) for k in sol.layer_strategies(v)]
        actual_reserve = max(float(tables.reserve_bytes[i, c]) for i, c in zip(layer_ids, chosen))
        total = sol.memory_bytes + fixed + actual_reserve
        if total <= capacity_bytes:
            return chosen, sol.cost_s
        budget -= total - capacity_bytes
    raise InfeasibleError(f"layers {[(c.start, c.stop - 1) for c in chunks]} do not fit in "
                          f"{capacity_bytes:.4g} bytes")


def solve_setting(tables_by_rank: list[LayerTables], signatures: list[str], setting: Setting,
                  capacity_bytes: list[float], seed: int = 0, allowed: np.ndarray | None = None,
                  ilp_cache: dict | None = None, cuttable: frozenset[int] | None = None) -> Candidate:
    """Stage boundaries (DP) and per-layer strategies (ILP) for one setting (stages start only
    at ``cuttable`` boundaries when given)."""
    mesh = setting.mesh
    L = tables_by_rank[0].num_layers
    num_stages = mesh.pp * setting.virtual_stages
    if setting.schedule in MULTI_CHUNK_SCHEDULES or mesh.pp == 1:
        bounds = equal_bounds(L, num_stages)
    else:
        cost = range_costs(tables_by_rank, setting, capacity_bytes, allowed, cuttable=cuttable)
        bounds = partition_stages(cost, mesh.pp, setting.num_microbatches).bounds
    chosen: list[int] = [0] * L
    cache = ilp_cache if ilp_cache is not None else {}
    for r in range(mesh.pp):
        # the layers pipeline rank r holds (several chunks when interleaved), solved together
        tables = tables_by_rank[r]
        chunks = [range(bounds[s], bounds[s + 1]) for s in range(num_stages)
                  if stage_rank(setting.schedule, s, mesh.pp) == r]
        inflight = _inflight(setting, r) / max(1, setting.virtual_stages)
        key = (tuple(tuple(signatures[c.start:c.stop]) for c in chunks), chunks[0].start == 0,
               chunks[-1].stop == L, inflight, capacity_bytes[r], setting, tables.key)
        if key not in cache:
            cache[key] = stage_ilp(tables, signatures, chunks, inflight, capacity_bytes[r],
                                   setting.num_microbatches, setting.zero_family, seed, allowed)[0]
        for i, c in zip([i for ch in chunks for i in ch], cache[key]):
            chosen[i] = c
    choices = tuple(tables_by_rank[0].choices[c] for c in chosen)
    return Candidate(mesh=mesh, micro_batch=setting.micro_batch, num_microbatches=setting.num_microbatches,
                     schedule=setting.schedule, bounds=tuple(bounds), choices=choices)
