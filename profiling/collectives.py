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

On a CPU a collective is also timed *in step*: in a training step every rank reaches a
collective straight out of a burst of compute, with every core busy, and the threads that
move and reduce gloo's data must first be woken and scheduled.  A loop of back-to-back calls
never pays that (its ranks sit waiting in the collective); on this kind of machine it adds
0.5-3 ms to a 128 KiB all-reduce over 2 processes (measured: 2 gloo ranks, ~7 ms of matmuls
then the all-reduce, against the same matmuls alone).  So on a CPU a sample is ``inner``
rounds of [``BURST_S`` of matmuls; the call] minus ``inner`` rounds of the matmuls alone,
taken one after the other, each the slowest rank's; the row's ``timing`` says
``"in_step"``, and its figure is the (trimmed) mean of the samples, not their median
(``in_step_mean``), and never less than the same call timed back to back (a difference of two
noisy times can otherwise come out below what the call physically takes).  On a GPU the
calls are timed back to back (``"back_to_back"``): the kernels queue behind the compute on
the device and nothing waits for a host thread.
"""
from __future__ import annotations

import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from autopar.profiling.isotonic import monotone_seconds
from autopar.profiling.timing import RepeatPolicy

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
CPU_SIZES_FULL = [1 << p for p in range(10, 27, 2)]      # 1 KiB .. 64 MiB
CPU_SIZES_QUICK = [1 << p for p in (10, 14, 18)]
CUDA_SIZES_FULL = [1 << p for p in range(12, 31, 2)]     # 4 KiB .. 1 GiB
CUDA_SIZES_QUICK = [1 << p for p in (12, 18, 24)]
#: compute between two collectives of an in-step sample on a CPU: about what a layer of a small
#: model computes between two collectives of a tensor-parallel step (the forward of one block of
#: the accuracy benchmark's GPT takes ~2 ms on one core)
BURST_S = 1e-3
BURST_MATMUL_N = 128     # the burst is a chain of N x N fp32 matmuls
#: collectives a step issues as a chain of asynchronous calls waited together: on a CPU they are
#: also timed as such (``timing: chained``), per call of a chain of CHAIN_CALLS issued straight
#: out of a burst -- ZeroRedundancyOptimizer broadcasts every parameter tensor this way
#: (its ``_sync_params``), and only the chain's first call finds gloo's thread asleep
CHAINED_OPS = ("broadcast",)
CHAIN_CALLS = 16
#: share of in-step samples cut from each end before their mean (``in_step_mean``)
IN_STEP_TRIM = 0.05


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
    burst = _compute_burst(device) if device.type == "cpu" else None
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
                    seconds, num_samples = _time_collective(fn, device, policy, group, burst)
                    if op == "send_recv":
                        seconds /= 2.0                 # half a ping-pong: the one-way time
                    del fn
                    rows.append({"op": op, "bytes": size_bytes, "group_size": g, "level": level,
                                 "seconds": seconds, "measured_seconds": seconds, "num_samples": num_samples,
                                 "processes": processes, "backend": dist.get_backend(),
                                 "timing": "in_step" if burst is not None else "back_to_back"})
                    if op in CHAINED_OPS and burst is not None:
                        fn = _make_chain(op, size_bytes, g, members, group, device)
                        seconds, num_samples = _time_collective(fn, device, policy, group, burst)
                        del fn
                        seconds /= CHAIN_CALLS
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


def make_monotone(rows: list[dict]) -> list[dict]:
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


def _make_chain(op: str, size_bytes: int, g: int, members: list[int], group, device: torch.device):
    """CHAIN_CALLS asynchronous calls of ``op`` on separate tensors, then a wait on each."""
    if op != "broadcast":
        raise ValueError(f"no chained form of {op!r}; chained ops: {CHAINED_OPS}")
    numel = max(g, size_bytes // 4 // g * g)
    xs = [torch.ones(numel, device=device) for _ in range(CHAIN_CALLS)]

    def chain():
        handles = [dist.broadcast(x, src=members[0], group=group, async_op=True) for x in xs]
        for h in handles:
            h.wait()
    return chain


def _compute_burst(device: torch.device) -> Callable[[], None]:
    """A chain of matmuls lasting about ``BURST_S`` on this machine, the same length on every rank
    (the count is agreed with MAX over the world, so every rank computes the same work)."""
    a = torch.randn(BURST_MATMUL_N, BURST_MATMUL_N, device=device)
    b = torch.randn(BURST_MATMUL_N, BURST_MATMUL_N, device=device)
    # the fastest rank's time: the largest count any rank would take, as every rank must run it
    n = max(1, round(BURST_S / max(agreed_matmul_seconds(a, b, agree=dist.ReduceOp.MIN), 1e-9)))

    def burst() -> None:
        for _ in range(n):
            torch.mm(a, b)
    return burst


def agreed_matmul_seconds(a: torch.Tensor, b: torch.Tensor, warmup: int = 3, reps: int = 20,
                          agree=dist.ReduceOp.MAX) -> float:
    """Seconds of one ``a @ b``, reduced over the ranks of the default group with ``agree`` (the
    slowest rank's by default), so that every rank sizes its bursts of compute alike."""
    for _ in range(warmup):
        torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    t = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64)
    dist.all_reduce(t, op=agree)
    return float(t.item())


class InStepTimer:
    """Times closures in step on a group, ``rounds`` times each, every closure of a set once per
    round so that slow spells fall on all of them: [barrier; ``lead``; t0; ``burst``; closure].
    A closure's figure is the ``in_step_mean`` of its samples, less that of ``burst`` alone
    (when there is one); ``warmup`` untimed calls of each closure come first."""

    def __init__(self, group, rounds: int, lead: Callable[[], None], burst: Callable[[], None] | None = None,
                 warmup: int = 2):
        self.group, self.rounds, self.lead, self.burst, self.warmup = group, rounds, lead, burst, warmup

    def __call__(self, cases: dict) -> dict:
        burst = self.burst
        cases = {**cases, "_burst": lambda: None} if burst is not None else dict(cases)
        for fn in cases.values():                   # warm-up: allocator, lazy init, first collectives
            for _ in range(self.warmup):
                fn()
        samples: dict = {k: [] for k in cases}
        for _ in range(self.rounds):
            for k, fn in cases.items():
                dist.barrier(group=self.group)
                self.lead()
                t0 = time.perf_counter()
                if burst is not None:
                    burst()
                fn()
                samples[k].append(time.perf_counter() - t0)
        means = {k: in_step_mean(v) for k, v in samples.items()}
        base = means.pop("_burst", 0.0)
        return {k: v - base for k, v in means.items()}


def _time_collective(fn, device: torch.device, policy: RepeatPolicy, group,
                     burst: Callable[[], None] | None = None) -> tuple[float, int]:
    """Median seconds per call and the number of samples.  The stop rule counts the wall time
    the samples took (in step: the bursts too), so a case costs about ``target_total_s``."""
    for _ in range(policy.warmup):
        fn()
    if burst is None:
        sample = lambda inner: (_agreed_sample(fn, device, inner, group),) * 2     # noqa: E731
    else:
        sample = lambda inner: _agreed_in_step_sample(fn, burst, inner, group)     # noqa: E731
    _, first_wall = sample(1)       # batch calls when one sample is too short to time well
    inner = 1 if first_wall >= policy.min_sample_s else int(policy.min_sample_s / max(first_wall, 1e-9)) + 1
    samples: list[float] = []
    wall = 0.0
    while len(samples) < policy.max_samples:
        s, s_wall = sample(inner)
        samples.append(s / inner)
        wall += s_wall
        if len(samples) >= policy.min_samples and wall >= policy.target_total_s:
            break
    if burst is None:
        return statistics.median(samples), len(samples)
    # An in-step figure is a difference of two noisy times and can come out below the call's
    # own cost -- even below zero -- when the bursts alone happen to run slower than beside the
    # calls.  No call costs less in step than back to back, with gloo's threads already awake
    # (the in-step excess is their wake-up, see the module docstring), so the figure is held to
    # at least the median of back-to-back samples of the same call, measured now.
    floor = statistics.median([_agreed_sample(fn, device, inner, group) / inner
                               for _ in range(policy.min_samples)])
    return max(in_step_mean(samples), floor), len(samples)


def in_step_mean(samples: list[float]) -> float:
    """The figure of in-step samples: their mean, less the top and bottom ``IN_STEP_TRIM``.

    In step, a collective's cost is skewed: most calls find gloo's thread at once, some wait a
    scheduler time slice for a core (measured in the accuracy benchmark's 2-rank
    tensor-parallel step: 19 waits per step, most 0.2-0.9 ms, a quarter 4-9 ms).  A step is the
    sum of its calls, so its expected time is the sum of their means (linearity of
    expectation); the median of such a distribution sits near its common case and prices the
    step short.  The trim only drops the rare spell of another tenant of the host.
    """
    from scipy.stats import trim_mean

    return float(trim_mean(samples, IN_STEP_TRIM))


def _agreed_sample(fn, device: torch.device, inner: int, group) -> float:
    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def _agreed_in_step_sample(fn, burst: Callable[[], None], inner: int, group) -> tuple[float, float]:
    """(``inner`` rounds of [burst; call] less ``inner`` bursts alone, the wall time of both),
    each figure the slowest rank's."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(inner):
        burst()
        fn()
    with_calls = time.perf_counter() - t0
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(inner):
        burst()
    alone = time.perf_counter() - t0
    elapsed = torch.tensor([with_calls, alone], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed[0] - elapsed[1]), float(elapsed[0] + elapsed[1])
