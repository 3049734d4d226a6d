"""Time torch.distributed collectives over message sizes and group sizes (run under torchrun).

Every rank calls every function here (collective decisions stay in step): groups are the
first ``g`` ranks for each power of two ``g`` up to the world size (and the world itself);
ranks outside a group wait at a barrier.  A sample is ``inner`` back-to-back calls timed with
``time.perf_counter`` after a device synchronize on each rank; the sample's time is the
slowest rank's (all-reduced with MAX over the group), because a collective ends when its last
rank does.  The stop rule is ``RepeatPolicy``'s, decided on that agreed time so all ranks
take the same number of samples.  The figure is the median sample over ``inner``.

Message size convention (``bytes`` in a row): the full buffer the collective is about --
the all-reduced tensor, the all-gather's output, the reduce-scatter's input, the broadcast
tensor, the all-to-all's input on one rank, the tensor sent point to point.  With this
convention a ring all-reduce moves 2*(N-1)/N * bytes per rank and all-gather and
reduce-scatter (N-1)/N * bytes (Patarasuk & Yuan 2009; Thakur et al. 2005).
``send_recv`` is half a ping-pong between the group's first two ranks (one-way time).

The level is ``intra`` when every rank of the group runs on one host, ``inter`` otherwise.

On a CPU the "devices" are processes sharing the machine's cores, and a collective's time
depends on how many processes are busy beside it (each ring step waits for a process to be
scheduled).  So on a CPU every disjoint block of ``g`` consecutive ranks runs the same
collective at the same time -- as the tensor-, data- and pipeline-parallel groups of a
training step do -- and a row records ``processes``, how many processes took part at once
(the group's own ranks on a GPU).  The cost model prices a plan from the rows measured with
as many processes as the plan keeps busy on a node.

On a CPU a collective is also timed *in step*, straight out of a burst of compute, and a
broadcast also as a chain of asynchronous calls (rows ``timing: in_step`` and ``chained``):
profiling/cpu_in_step.py says why and how.  On a GPU the calls are timed back to back
(``"back_to_back"``): the kernels queue behind the compute on the device and nothing waits for
a host thread.
"""
from __future__ import annotations

import socket
import statistics
from typing import Callable

import torch
import torch.distributed as dist

from autopar.profiling.isotonic import monotone_seconds
from autopar.profiling.timing import RepeatPolicy, agreed_seconds, repeat_samples

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
CPU_SIZES_FULL = [1 << p for p in range(10, 27, 2)]      # 1 KiB .. 64 MiB
CPU_SIZES_QUICK = [1 << p for p in (10, 14, 18)]
CUDA_SIZES_FULL = [1 << p for p in range(12, 31, 2)]     # 4 KiB .. 1 GiB
CUDA_SIZES_QUICK = [1 << p for p in (12, 18, 24)]


def group_sizes(world_size: int) -> list[int]:
    sizes = []
    g = 2
    while g <= world_size:
        sizes.append(g)
        g *= 2
    if world_size >= 2 and world_size not in sizes:
        sizes.append(world_size)
    return sizes


def message_sizes(device_type: str, quick: bool) -> list[int]:
    if device_type == "cuda":
        return CUDA_SIZES_QUICK if quick else CUDA_SIZES_FULL
    return CPU_SIZES_QUICK if quick else CPU_SIZES_FULL


def num_cases(world_size: int, device_type: str, quick: bool) -> int:
    """How many (op, size, group) points ``measure_collectives`` times (for a progress bar)."""
    per_group = len(message_sizes(device_type, quick))
    return sum(per_group * sum(1 for op in COLLECTIVE_OPS if op != "send_recv" or g == 2)
               for g in group_sizes(world_size))


def measure_collectives(device: torch.device, policy: RepeatPolicy, quick: bool,
                        on_case: Callable[[str], None] | None = None) -> list[dict]:
    """Rows {op, bytes, group_size, level, seconds, ...}; identical on every rank."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    sizes = message_sizes(device.type, quick)
    # a CPU's collectives are timed in step, straight out of a burst of compute (cpu_in_step.py)
    cpu = None
    if device.type == "cpu":
        from autopar.profiling import cpu_in_step as cpu
    burst = cpu.compute_burst(device) if cpu is not None else None
    rows = []
    for g in group_sizes(world):
        # every disjoint block of g ranks on a CPU (all create every group, in one order)
        starts = range(0, world - g + 1, g) if device.type == "cpu" else range(0, 1)
        group = members = None
        for start in starts:
            block = list(range(start, start + g))
            grp = dist.new_group(block) if g < world else dist.group.WORLD
            if rank in block:
                group, members = grp, block
        if members is None:
            group, members = None, list(range(g))
        processes = g * len(starts)
        level = "intra" if len({hosts[r] for r in members}) == 1 else "inter"
        for op in COLLECTIVE_OPS:
            if op == "send_recv" and g != 2:
                continue                               # point to point is a pair whatever the group
            for size_bytes in sizes:
                if on_case is not None:
                    on_case(f"{op} {size_bytes} B over {g} ranks")
                if group is not None:
                    fn = _make_call(op, size_bytes, g, members, rank, group, device)
                    seconds, num_samples = (_time_back_to_back(fn, device, policy, group) if burst is None
                                            else cpu.time_in_step(fn, device, policy, group, burst))
                    if op == "send_recv":
                        seconds /= 2.0                 # half a ping-pong: the one-way time
                    del fn
                    rows.append({"op": op, "bytes": size_bytes, "group_size": g, "level": level,
                                 "seconds": seconds, "measured_seconds": seconds, "num_samples": num_samples,
                                 "processes": processes, "backend": dist.get_backend(),
                                 "timing": "in_step" if burst is not None else "back_to_back"})
                    if burst is not None and op in cpu.CHAINED_OPS:
                        fn = cpu.make_chain(op, size_bytes, g, members, group, device)
                        seconds, num_samples = cpu.time_in_step(fn, device, policy, group, burst)
                        del fn
                        seconds /= cpu.CHAIN_CALLS
                        rows.append({"op": op, "bytes": size_bytes, "group_size": g, "level": level,
                                     "seconds": seconds, "measured_seconds": seconds, "num_samples": num_samples,
                                     "processes": processes, "backend": dist.get_backend(), "timing": "chained"})
                dist.barrier()
        dist.barrier()
    # ranks outside the largest group hold fewer rows: everyone takes rank 0's
    box = [rows]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def row_processes(row: dict) -> int:
    """Processes busy at once when the row was measured (rows without the key: the group's ranks)."""
    return int(row.get("processes", row["group_size"]))


def monotone_collective_rows(rows: list[dict]) -> list[dict]:
    """Sorted by bytes within (op, group_size, level); ``seconds`` non-decreasing (isotonic fit)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["group_size"], r["level"], row_processes(r), r.get("timing", "")),
                          []).append(dict(r))
    out = []
    for key in sorted(groups):
        grp = sorted(groups[key], key=lambda r: r["bytes"])
        fitted = monotone_seconds([r.get("measured_seconds", r["seconds"]) for r in grp])
        for r, sec in zip(grp, fitted):
            r["seconds"] = float(sec)
        out.extend(grp)
    return out


def _make_call(op: str, size_bytes: int, g: int, members: list[int], rank: int, group, device: torch.device):
    numel = max(g, size_bytes // 4 // g * g)           # fp32, divisible by the group size
    if op == "all_reduce":
        x = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        shard = torch.ones(numel // g, device=device)
        out = torch.empty(numel, device=device)
        return lambda: dist.all_gather_into_tensor(out, shard, group=group)
    if op == "reduce_scatter":
        full = torch.ones(numel, device=device)
        out = torch.empty(numel // g, device=device)
        return lambda: dist.reduce_scatter_tensor(out, full, group=group)
    if op == "broadcast":
        x = torch.ones(numel, device=device)
        return lambda: dist.broadcast(x, src=members[0], group=group)
    if op == "all_to_all":
        x = torch.ones(numel, device=device)
        out = torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if op == "send_recv":
        x = torch.ones(numel, device=device)
        peer = members[1] if rank == members[0] else members[0]

        def ping_pong():
            if rank == members[0]:
                dist.send(x, dst=peer)
                dist.recv(x, src=peer)
            else:
                dist.recv(x, src=peer)
                dist.send(x, dst=peer)
        return ping_pong
    raise ValueError(f"unknown collective {op!r}; one of {COLLECTIVE_OPS}")


def _time_back_to_back(fn, device: torch.device, policy: RepeatPolicy, group) -> tuple[float, int]:
    """Median seconds per call and the number of samples; each sample is the slowest rank's
    time of ``inner`` back-to-back calls, so every rank takes the same number of samples."""
    for _ in range(policy.warmup):
        fn()
    samples, _ = repeat_samples(lambda inner: (agreed_seconds(fn, device, inner, group),) * 2, policy)
    return statistics.median(samples), len(samples)
