"""Event simulation of one training step, one representative device per pipeline rank.

All data- and tensor-parallel replicas of a pipeline rank run the same tasks on a homogeneous
cluster, so one device per pipeline rank stands for all (on a heterogeneous cluster its cost
model is the stage's slowest device's).  Each device has streams (timeline.STREAMS); a task
starts when its stream is free and its inputs have arrived:

* compute: per micro-batch and model chunk, the forward or backward of each layer in order
  (recompute first, inside backward); tensor-parallel collectives follow each layer's
  compute on the critical path (Megatron-LM runs them synchronously);
* dp: FSDP all-gathers prefetched one layer ahead (issued when the previous layer starts),
  reduce-scatters after each layer's backward; DDP all-reduces of a layer's gradients after
  its last micro-batch's backward (gradient accumulation: none before) -- one stream, so
  they queue (Li et al. 2020, "PyTorch Distributed", Sec. 3.2; Zhao et al. 2023, "PyTorch
  FSDP", Sec. 3.3);
* pp: the activation (forward) or its gradient (backward) sent to the neighbouring stage;
  the receiver's task waits for it;
* after the last backward: the optimizer step (host Adam for offloaded layers) and ZeRO-1's
  parameter all-gather.

When communication cannot overlap compute (``ctx.serial_comm``: CPU processes on every core,
cpu_node.serial_communication), every communication task blocks the compute stream until it
ends: prefetches, reduce-scatters, all-reduces and sends take turns with the layers.

Schedules: GPipe (all forwards, then all backwards; Huang et al. 2019), 1F1B (p - r - 1
warm-up forwards on rank r, then one forward one backward; Narayanan et al. 2021 Sec. 2.2.1)
and interleaved 1F1B (v model chunks per rank, 2(p - r - 1) + (v - 1)p warm-up steps,
micro-batches in groups of p per chunk; Sec. 2.2.2).
"""
from __future__ import annotations

import numpy as np

from autopar.simulator.evaluator import _Context
from autopar.simulator.layer_table import LayerTable
from autopar.simulator.timeline import Timeline


def schedule_tasks(schedule: str, p: int, r: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Ordered (pass, micro-batch, chunk) tasks of pipeline rank ``r``."""
    if schedule == "gpipe" or (p == 1 and v == 1):
        if schedule == "gpipe" and p > 1:
            return [("F", i, c) for i in range(m) for c in range(v)] + \
                   [("B", i, c) for i in range(m) for c in reversed(range(v))]
        return [t for i in range(m) for t in ([("F", i, c) for c in range(v)] + [("B", i, c) for c in reversed(range(v))])]
    if v == 1:
        warm = min(p - r - 1, m)
        tasks = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            tasks += [("F", warm + i, 0), ("B", i, 0)]
        tasks += [("B", i, 0) for i in range(m - warm, m)]
        return tasks
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    tasks = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        tasks += [fwd(warm + i), bwd(i)]
    tasks += [bwd(k) for k in range(total - warm, total)]
    return tasks


def simulate_step(ctx: _Context, rows: LayerTable, timeline: Timeline, device_of_rank: list[int]) -> tuple[np.ndarray, float]:
    """Play the step out; returns (finish time per pipeline rank, bubble fraction)."""
    p, v, m = ctx.p, ctx.v, ctx.num_microbatches
    G = p * v
    fwd_s, bwd_s, rec_s = rows.fwd_s, rows.bwd_s, rows.recompute_s
    tpf, tpb = rows.tp_comm_fwd_s, rows.tp_comm_bwd_s
    ag, rs, ar = rows.dp_allgather_s, rows.dp_reducescatter_s, rows.dp_allreduce_s
    h2d, d2h, opt = rows.h2d_s, rows.d2h_s, rows.optimizer_s
    zero, off = rows.zero, rows.offload
    # plain Python lists: scalar indexing into numpy arrays is slow in the inner loop
    fwd_s, bwd_s, rec_s, tpf, tpb = (x.tolist() for x in (fwd_s, bwd_s, rec_s, tpf, tpb))
    ag, rs, ar, h2d, d2h, opt, zero, off = (x.tolist() for x in (ag, rs, ar, h2d, d2h, opt, zero, off))
    starts, ends = ctx.starts.tolist(), ctx.ends.tolist()
    p2p = ctx.p2p_s
    serial = ctx.serial_comm
    tasks = [schedule_tasks(ctx.schedule, p, r, m, v) for r in range(p)]
    ptr = [0] * p
    compute_free = [0.0] * p
    dp_free = [0.0] * p
    pp_free = [0.0] * p
    busy = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    last_mb = m - 1
    tl = timeline
    remaining = sum(len(t) for t in tasks)
    while remaining:
        progressed = False
        for r in range(p):
            dev = device_of_rank[r]
            my = tasks[r]
            while ptr[r] < len(my):
                kind, mb, chunk = my[ptr[r]]
                g = chunk * p + r
                if kind == "F":
                    dep = ("F", mb, g - 1) if g > 0 else None
                else:
                    dep = ("B", mb, g + 1) if g < G - 1 else ("F", mb, g)
                if dep is not None and dep not in done:
                    break
                ready = done[dep] if dep is not None else 0.0
                t = max(compute_free[r], ready)
                a, b = starts[g], ends[g]
                if kind == "F":
                    order = range(a, b)
                    needs = [zero[k] >= 2 or off[k] for k in order]
                    comms = [(ag[k] if zero[k] >= 2 else 0.0) + (h2d[k] if off[k] else 0.0) for k in order]
                else:
                    order = range(b - 1, a - 1, -1)
                    needs = [zero[k] >= 3 for k in order]
                    comms = [ag[k] + (h2d[k] if off[k] else 0.0) for k in order]
                # FSDP: the first layer's all-gather now, each next one prefetched when the
                # previous layer starts (issued before that layer's reduce-scatter)
                gathered = [0.0] * len(order)
                if needs and needs[0]:
                    s0 = max(dp_free[r], t)
                    tl.add(dev, "dp", f"all_gather L{order[0]}", s0, comms[0], micro_batch=mb)
                    dp_free[r] = gathered[0] = s0 + comms[0]
                for j, k in enumerate(order):
                    t = max(t, gathered[j])
                    if j + 1 < len(order) and needs[j + 1]:
                        s0 = max(dp_free[r], t)
                        tl.add(dev, "dp", f"all_gather L{order[j + 1]}", s0, comms[j + 1], micro_batch=mb)
                        dp_free[r] = gathered[j + 1] = s0 + comms[j + 1]
                        if serial:
                            t = dp_free[r]
                    if kind == "F":
                        tl.add(dev, "compute", f"fwd L{k}", t, fwd_s[k], micro_batch=mb)
                        t += fwd_s[k]
                        tl.add(dev, "tp", f"tp fwd L{k}", t, tpf[k], micro_batch=mb)
                        t += tpf[k]
                        busy[r] += fwd_s[k] + tpf[k]
                        continue
                    if rec_s[k]:
                        tl.add(dev, "compute", f"recompute L{k}", t, rec_s[k], micro_batch=mb)
                        t += rec_s[k]
                    tl.add(dev, "compute", f"bwd L{k}", t, bwd_s[k], micro_batch=mb)
                    t += bwd_s[k]
                    tl.add(dev, "tp", f"tp bwd L{k}", t, tpb[k], micro_batch=mb)
                    t += tpb[k]
                    busy[r] += rec_s[k] + bwd_s[k] + tpb[k]
                    if zero[k] >= 2:
                        comm = rs[k] + (d2h[k] if off[k] else 0.0)
                        s0 = max(dp_free[r], t)
                        tl.add(dev, "dp", f"reduce_scatter L{k}", s0, comm, micro_batch=mb)
                        dp_free[r] = s0 + comm
                        if serial:
                            t = dp_free[r]
                    elif mb == last_mb and ar[k] > 0:
                        s0 = max(dp_free[r], t)
                        tl.add(dev, "dp", f"all_reduce L{k}", s0, ar[k])
                        dp_free[r] = s0 + ar[k]
                        if serial:
                            t = dp_free[r]
                compute_free[r] = t
                # send the activation / gradient to the neighbouring stage
                if (kind == "F" and g < G - 1) or (kind == "B" and g > 0):
                    s0 = max(pp_free[r], t)
                    tl.add(dev, "pp", f"send {'act' if kind == 'F' else 'grad'} mb{mb}", s0, p2p)
                    pp_free[r] = s0 + p2p
                    done[(kind, mb, g)] = s0 + p2p
                    if serial:
                        compute_free[r] = pp_free[r]
                else:
                    done[(kind, mb, g)] = t
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked: a task waits for one that never runs")
    pipe_end = max(compute_free)
    finish = np.zeros(p)
    for r in range(p):
        dev = device_of_rank[r]
        layers = [k for g in range(r, G, p) for k in range(starts[g], ends[g])]
        t = max(compute_free[r], dp_free[r])
        dev_opt = sum(opt[k] for k in layers if not off[k])
        host_opt = sum(opt[k] for k in layers if off[k])
        tl.add(dev, "compute", "optimizer", t, dev_opt)
        tl.add(dev, "host", "optimizer (host)", t, host_opt)
        t += dev_opt + host_opt
        ag1 = sum(ag[k] for k in layers if zero[k] == 1)
        tl.add(dev, "dp", "all_gather params (ZeRO-1)", t, ag1)
        finish[r] = t + ag1
    bubble = 1.0 - max(busy) / pipe_end if pipe_end > 0 else 0.0
    return finish, bubble
