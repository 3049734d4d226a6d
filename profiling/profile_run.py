"""One profiling run: set up the process group when under torchrun, time, merge, write."""
from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.profiling import collectives, machine, ops, overheads
from autopar.profiling.op_sweeps import op_cases
from autopar.profiling.profile_file import build_profile, read_profile_json, write_profile
from autopar.profiling.timing import RepeatPolicy


@dataclass(frozen=True)
class ProfileOptions:
    output: Path
    quick: bool
    dtypes: list[str]
    device: torch.device
    name: str
    measure_ops: bool = True
    measure_collectives: bool = True
    measure_sync_wait: bool = True      # CPU under torchrun only (profiling/cpu_sync_wait.py)
    measure_overheads: bool = True      # framework overheads (profiling/overheads.py)
    argv: tuple[str, ...] = ()          # the verb's arguments, for measured_by
    target_s: float | None = None       # seconds of samples per point (RepeatPolicy.target_total_s)
    passes: int = 1                     # op sweeps; each row keeps its fastest pass (``best_of_passes``)


def run_profile(opts: ProfileOptions) -> dict | None:
    """Measure and write; returns the profile on the writing rank, None on the others."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    started_group = False
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if opts.device.type == "cuda" else "gloo"
        if opts.device.type == "cuda":
            torch.cuda.set_device(opts.device)
        dist.init_process_group(backend)
        started_group = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    finished = False
    try:
        out = _run(opts, world, rank)
        finished = True
        return out
    finally:
        if started_group:
            if finished:
                # the ranks leave together: the other ranks returned straight after the last
                # measurement while rank 0 still wrote the profile, and a rank tearing its gloo
                # pairs down while a peer still held them once aborted ("terminate called without
                # an active exception", rank 1, test_collectives_under_torchrun_merge_into_existing_profile)
                dist.barrier()
            dist.destroy_process_group()


def _run(opts: ProfileOptions, world: int, rank: int) -> dict | None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    policy = RepeatPolicy.quick() if opts.quick else RepeatPolicy()
    if opts.target_s is not None:
        policy = replace(policy, target_total_s=opts.target_s, max_samples=max(policy.max_samples, 200))
    torch.manual_seed(0)
    cases = op_cases(opts.device.type, opts.dtypes, opts.quick) if opts.measure_ops else []
    num_coll = collectives.num_cases(world, opts.device.type, opts.quick) \
        if opts.measure_collectives and world > 1 else 0
    console = Console(file=sys.stderr)
    progress = Progress(TextColumn("[bold]{task.description:<44}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=rank != 0, transient=False)
    do_sync = opts.measure_sync_wait and world > 1 and opts.device.type == "cpu"
    op_rows = coll_rows = overhead_s = sync_row = None
    with progress:
        task = progress.add_task("ops", total=len(cases) * opts.passes + num_coll + opts.measure_overheads + do_sync)

        def step(label: str) -> None:
            progress.update(task, description=label[:44])
            progress.advance(task)

        if cases:
            sweeps = []
            for i in range(opts.passes):
                if world > 1:
                    dist.barrier()
                tag = f"pass {i + 1}/{opts.passes} " if opts.passes > 1 else ""
                rows = ops.measure_ops(cases, opts.device, policy, on_case=lambda c: step(tag + c.label))
                sweeps.append(_mean_over_ranks(rows, world) if world > 1 else rows)
            op_rows = ops.make_monotone(ops.best_of_passes(sweeps))
        if opts.measure_overheads:
            step("framework overheads")
            if world > 1:
                dist.barrier()
            overhead_s = overheads.measure_overheads(opts.device, policy, opts.quick)
            if world > 1:
                overhead_s = _mean_dict_over_ranks(overhead_s, world)
        if num_coll:
            coll_rows = collectives.monotone_collective_rows(
                collectives.measure_collectives(opts.device, policy, opts.quick, on_case=step))
        if do_sync:
            from autopar.profiling.cpu_sync_wait import measure_sync_wait

            step("meeting after compute (sync wait)")
            dist.barrier()
            sync_row = measure_sync_wait(opts.quick)
    if rank != 0:
        return None
    base = read_profile_json(opts.output) if opts.output.exists() else None
    backend = dist.get_backend() if dist.is_initialized() else None
    desc = machine.describe(opts.device, world, backend)
    label = desc.get("gpu_name") or (f"{desc['cpu_model']}, {desc['num_cpu_cores']} cores, one process per device "
                                     f"with {desc['torch_num_threads']} thread(s)")
    mem = desc.get("gpu_memory_bytes") or (desc["host_memory_bytes"] // max(1, world) if desc["host_memory_bytes"] else None)
    prof = build_profile(base=base, name=opts.name, device_kind="gpu" if opts.device.type == "cuda" else "cpu",
                         description=label, machine=desc,
                         measured_by=machine.command_line(["profile", *opts.argv]), op_rows=op_rows, collective_rows=coll_rows,
                         memory_bytes=mem, overheads=overhead_s, sync_wait=sync_row)
    _check_with_loader(prof, opts.output)
    write_profile(prof, opts.output)
    return prof


def _mean_over_ranks(rows: list[dict], world: int) -> list[dict]:
    """Every rank timed the same cases at the same time; each row keeps the mean of the medians."""
    gathered: list[list[dict] | None] = [None] * world
    dist.all_gather_object(gathered, rows)
    out = []
    for i, r in enumerate(rows):
        per_rank = [g[i]["measured_seconds"] for g in gathered if g is not None]
        out.append({**r, "seconds": statistics.fmean(per_rank), "measured_seconds": statistics.fmean(per_rank),
                    "ranks": len(per_rank)})
    return out


def _mean_dict_over_ranks(values: dict[str, float], world: int) -> dict[str, float]:
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, values)
    return {k: statistics.fmean(g[k] for g in gathered if g is not None) for k in values}


def _check_with_loader(prof: dict, path: Path) -> None:
    """Refuse to write a profile the cost model would not load."""
    from autopar.profiles import load_profile

    load_profile(prof)
