"""The order in which torch 2.13's split-backward schedule classes run each rank's actions.

``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` build
their per-rank action lists in ``_calculate_single_rank_operations`` (and the first adds the
bubbles its dependencies need, ``_add_bubbles_to_actions``) from a handful of attributes their
``__init__`` reads off the stages; this calls those methods on an object holding just those
attributes, so the trace (step_trace.py) draws the order the runtime runs without building
stages or a process group.
"""
from __future__ import annotations

import functools
import types

#: (kind, micro-batch, stage): kind "F" forward, "I" input gradient, "W" weight gradient, "B" the
#: whole backward (DualPipeV's pairs are given as their forward and backward, in that order)
Task = tuple[str, int, int]


@functools.lru_cache(maxsize=64)
def torch_action_order(schedule: str, p: int, m: int, v: int = 2) -> tuple[tuple[Task, ...], ...]:
    """Per pp rank, torch's actions for ``schedule`` over p ranks, v stages per rank (2 for the V
    schedules) and m micro-batches."""
    from torch.distributed.pipelining import schedules as S
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    cls = {"zbv": S.ScheduleZBVZeroBubble, "interleaved-zb": S.ScheduleInterleavedZeroBubble,
           "dualpipev": S.ScheduleDualPipeV}[schedule]
    rounds = max(1, m // p)
    holder = types.SimpleNamespace(
        pp_group_size=p, _n_microbatches=m, num_stages=v * p, _num_stages=v * p, n_local_stages=v,
        number_of_rounds=rounds, microbatches_per_round=m // rounds,
        stage_index_to_group_rank=generate_stage_to_rank_mapping(p, v * p, "loop" if schedule == "interleaved-zb"
                                                                else "v"))
    for name in ("_calculate_single_rank_operations", "_add_bubbles_to_actions"):
        if hasattr(cls, name):
            setattr(holder, name, types.MethodType(getattr(cls, name), holder))
    order = {r: holder._calculate_single_rank_operations(r) for r in range(p)}
    if schedule == "interleaved-zb":
        holder.pipeline_order = order
        order = holder._add_bubbles_to_actions(v * p)
    kinds = {S.FORWARD: "F", S.BACKWARD_INPUT: "I", S.BACKWARD_WEIGHT: "W", S.FULL_BACKWARD: "B"}
    out = []
    for r in range(p):
        tasks: list[Task] = []
        for a in order[r]:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):
                tasks.append((kinds[sub.computation_type], sub.microbatch_index, sub.stage_index))
        out.append(tuple(tasks))
    return tuple(out)
