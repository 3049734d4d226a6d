"""Tensor-parallel and FSDP overheads timed on real groups of CPU ranks, in step.

profiling/overheads.py times a tensor-parallel module and an FSDP unit on a one-rank mesh: no
collective runs, so what it finds is dispatch and hook bookkeeping alone.  On CPU ranks that
share the machine's cores that is a fraction of what the features cost in training: measured
on the 2-core machine of profiles/local-cpu.json, a ``ColwiseParallel``/``RowwiseParallel`` pair
on [4, 64, 128] activations costs ~2.0-2.5 ms of forward beyond the same arithmetic at half
width followed by a directly called all-reduce (the one-rank figure: 0.73 ms a pair), and a
``fully_shard`` unit of 33K / 526K parameters ~0.9 / ~0.65 ms of forward and ~0.4 / ~3.4 ms of
backward beyond the plain module with the same all-gathers and reduce-scatter called directly
(one-rank figure: 0.15 / 0.31 ms): the asynchronous collectives these features issue put gloo's
worker threads on the cores the ranks compute on, and FSDP's copies into and out of its flat
buffers grow with the unit's bytes.

So under torchrun on a CPU every disjoint pair of ranks forms a group (as the tensor- and
data-parallel groups of a 2-way plan do, every core busy) and times, in step -- each sample
after a burst of matmuls, the burst alone taken out, the trimmed mean of the samples as the
collective table's in-step rows (profiling/cpu_in_step.py) -- each feature against a *composite*
that does the same arithmetic and calls the same collectives directly at the same points:

* tensor parallelism: a Linear(h, 4h) / GELU / Linear(4h, h) MLP with ``ColwiseParallel`` on the
  first linear and ``RowwiseParallel`` on the second, against the plain MLP at half width with
  an all-reduce of its output (forward) and of its input gradient (backward).  Half the
  difference is ``tp_module_fwd_s`` / ``tp_module_bwd_s``: the cost model adds it per
  tensor-parallel module on top of the collective table's all-reduces.
* FSDP: the same MLP under ``fully_shard`` (resharding after forward), against [all-gather;
  plain forward] and [all-gather; plain backward; reduce-scatter] of its (padded) flat
  parameter, at three widths; a least-squares line over the unit's parameter bytes gives
  ``fsdp_unit_*_s`` (per unit) and ``fsdp_unit_*_per_byte_s`` (per byte of the unit's full
  parameters), each clipped at zero.

The composites put the meetings of the ranks where the features put them, so the waiting that
grows with the compute before a meeting (profiling/cpu_sync_wait.py, priced by the cost model
separately) is in both and cancels.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.profiling.cpu_in_step import InStepTimer
from autopar.profiling.timing import median_of_runs

#: [batch, seq, hidden] of the probes' activations: one micro-batch of the accuracy benchmark's GPT
BATCH, SEQ = 4, 64
TP_HIDDEN = 128
FSDP_HIDDENS = (64, 128, 256)          # 33K, 132K, 526K parameters a unit
ROUNDS, ROUNDS_QUICK = 120, 6
#: whole measurements whose median is kept: one swings by up to 2x between runs on a shared
#: machine (a tensor-parallel module's backward has measured from 0.7 to 1.8 ms in four
#: profiles of the same machine)
REPEATS = 3
BURST_MATMULS, MATMUL_N = 8, 128       # ~0.4 ms of compute before each sample (and again, timed, inside it)


def _mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))


def measure_in_step_overheads(quick: bool = False) -> dict[str, float]:
    """``tp_module_{fwd,bwd}_s`` and ``fsdp_unit_{fwd,bwd}[_per_byte]_s`` on pairs of ranks; every
    rank of the default group calls it (a world of at least 2); the mean over pairs is returned
    on every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world - 1, 2):            # every rank creates every group, in one order
        grp = dist.new_group([start, start + 1])
        if rank in (start, start + 1):
            mine = grp
    rounds = ROUNDS_QUICK if quick else ROUNDS
    out: dict[str, float] = {}
    if mine is not None:
        mesh = DeviceMesh.from_group(mine, "cpu")
        a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)

        def burst() -> None:
            for _ in range(BURST_MATMULS):
                torch.mm(a, b)
        timer = InStepTimer(mine, rounds, lead=burst, burst=burst)
        def measure() -> dict[str, float]:
            return {**_tp_pair(mesh, timer), **_fsdp_units(mesh, timer, FSDP_HIDDENS[:2] if quick else FSDP_HIDDENS)}
        out = median_of_runs(measure, 1 if quick else REPEATS)
    keys = ("tp_module_fwd_s", "tp_module_bwd_s", "fsdp_unit_fwd_s", "fsdp_unit_bwd_s",
            "fsdp_unit_fwd_per_byte_s", "fsdp_unit_bwd_per_byte_s")
    vals = torch.tensor([out.get(k, 0.0) for k in keys] + [1.0 if out else 0.0], dtype=torch.float64)
    dist.all_reduce(vals)                           # mean over the ranks that measured (an odd one out adds zeros)
    measured_ranks = max(1.0, float(vals[-1]))
    return {k: max(0.0, float(v) / measured_ranks) for k, v in zip(keys, vals[:-1].tolist())}


def _tp_pair(mesh, timer: InStepTimer) -> dict[str, float]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n, group = mesh.size(), mesh.get_group()
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, TP_HIDDEN)
    pair = _mlp(TP_HIDDEN)
    parallelize_module(pair, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    half = nn.Sequential(nn.Linear(TP_HIDDEN, 4 * TP_HIDDEN // n), nn.GELU(), nn.Linear(4 * TP_HIDDEN // n, TP_HIDDEN))
    x_grad = x.clone().requires_grad_(True)
    grad_in = torch.zeros_like(x)

    def tp_fwd():
        return pair(x_grad) + 1.0                    # first use of the output: the all-reduce's wait

    def tp_fwd_bwd():
        tp_fwd().sum().backward()

    def half_fwd():
        y = half(x_grad)
        dist.all_reduce(y.detach(), group=group)
        return y + 1.0

    def half_fwd_bwd():
        half_fwd().sum().backward()
        dist.all_reduce(grad_in, group=group)        # the column-wise input gradient's all-reduce

    t = timer({"tp_f": tp_fwd, "tp_fb": tp_fwd_bwd, "half_f": half_fwd, "half_fb": half_fwd_bwd})
    fwd = t["tp_f"] - t["half_f"]
    bwd = (t["tp_fb"] - t["tp_f"]) - (t["half_fb"] - t["half_f"])
    return {"tp_module_fwd_s": fwd / 2, "tp_module_bwd_s": bwd / 2}


def _fsdp_units(mesh, timer: InStepTimer, hiddens) -> dict[str, float]:
    from torch.distributed.fsdp import fully_shard

    n, group = mesh.size(), mesh.get_group()
    sizes, fwd, bwd = [], [], []
    for h in hiddens:
        torch.manual_seed(0)
        plain = _mlp(h)
        torch.manual_seed(0)
        unit = _mlp(h)
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
        x = torch.randn(BATCH, SEQ, h)
        numel = -(-sum(p.numel() for p in plain.parameters()) // n) * n
        full, shard = torch.zeros(numel), torch.zeros(numel // n)

        def gather():
            dist.all_gather_into_tensor(full, shard, group=group)

        def comp_f():
            gather()
            return plain(x)

        def comp_fb():
            gather()
            y = plain(x)
            gather()
            y.sum().backward()
            dist.reduce_scatter_tensor(shard, full, group=group)

        t = timer({"fsdp_f": lambda: unit(x), "fsdp_fb": lambda: unit(x).sum().backward(),
                   "comp_f": comp_f, "comp_fb": comp_fb})
        sizes.append(numel * 4.0)                    # fp32 bytes of the unit's full parameters
        fwd.append(t["fsdp_f"] - t["comp_f"])
        bwd.append((t["fsdp_fb"] - t["fsdp_f"]) - (t["comp_fb"] - t["comp_f"]))
    out = {}
    for name, ys in (("fwd", fwd), ("bwd", bwd)):
        fixed, per_byte = _nonnegative_line(sizes, ys)
        out[f"fsdp_unit_{name}_s"] = fixed
        out[f"fsdp_unit_{name}_per_byte_s"] = per_byte
    return out


def _nonnegative_line(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line, both >= 0: a negative slope falls back to a
    flat line at the mean, a negative intercept to a line through the origin."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return max(0.0, float(y.mean())), 0.0
    if intercept < 0:
        return 0.0, max(0.0, float((x @ y) / (x @ x)))
    return float(intercept), float(slope)
