"""Host Adam shared by a node's ranks, measured on this machine: the simulator prices a rank's host
optimizer step as its shard x the ranks on the node / the node's rate (simulator/axes/offload.py
``host_optimizer_s``).  This times torch's AdamW on the CPU -- the optimizer autopar's runtime steps
an offloaded shard with (runtime/apply_dp.py ``build_optimizer``) -- over ``--params`` fp32
parameters per process, k processes at once (k ranks of one node stepping their shards together
after their backward), each with one thread as torchrun starts a node's ranks (OMP_NUM_THREADS=1
by default), started together at a barrier each step.  A step's time is from the first rank's
start to the last one's end (what a rank waits before it meets the others).

* the node's rate: k = the machine's cores (every core busy, one rank each);
* the closed form for every k: k x params / node rate; printed beside the measurement.

k above the cores tests the sharing (more ranks than cores: each step takes longer by k / cores);
k = 1 shows what the cost model cannot say (it holds no core count): one one-thread rank uses one
core, not the node's rate.  One process with every thread is printed too, not used: torch's
intra-op threads on a machine other work shares wait for each other.  No fit.

    OMP_NUM_THREADS=1 python benchmarks/host_adam_sharing.py [--params 4194304] [--steps 12] [--ranks 1,2,4]

Writes benchmarks/results/host_adam_sharing.txt (unless --no-write).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TENSORS = 4                      # the shard in a few equal tensors, as a layer's parameters


def _rank(params: int, steps: int, threads: int, barrier, out) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    n = params // TENSORS
    ps = [torch.nn.Parameter(torch.randn(n)) for _ in range(TENSORS)]
    for p in ps:
        p.grad = torch.randn(n)
    opt = torch.optim.AdamW(ps, lr=1e-3)
    opt.step()                   # the state allocated (AdamW creates it at the first step)
    spans = []
    for _ in range(steps):
        barrier.wait()           # the node's ranks step together
        t0 = time.perf_counter()
        opt.step()
        spans.append((t0, time.perf_counter()))
    out.put(spans)


def node_step_s(k: int, params: int, steps: int, threads: int) -> float:
    """Median over steps of the seconds from the first of ``k`` processes starting its AdamW step
    to the last one ending it (``time.perf_counter``: CLOCK_MONOTONIC, one clock for the
    machine's processes): the wait of a rank that meets the others after its step."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(params, steps, threads, barrier, out)) for _ in range(k)]
    for p in procs:
        p.start()
    res = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(max(r[i][1] for r in res) - min(r[i][0] for r in res) for i in range(steps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=4 * 2**20, help="fp32 parameters each process steps")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ranks", default="1,2,4", help="process counts to run, one thread each (the core count, which gives the node's rate, is added)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    ks = sorted({int(x) for x in args.ranks.split(",")})
    lines = [f"$ OMP_NUM_THREADS=1 python benchmarks/host_adam_sharing.py --params {args.params} --steps {args.steps} "
             f"--ranks {args.ranks}",
             f"{cores} cores; torch AdamW (CPU, fp32) over {args.params} parameters per process in {TENSORS} tensors; "
             f"load average before: {os.getloadavg()[0]:.2f}"]
    one = node_step_s(1, args.params, args.steps, cores)
    lines.append(f"one process, {cores} threads (not used): {one * 1e3:.1f} ms a step")
    measured = {k: node_step_s(k, args.params, args.steps, 1) for k in sorted(set(ks) | {cores})}
    rate = cores * args.params / measured[cores]
    lines.append(f"node rate: {cores} one-thread ranks step {cores} x {args.params} parameters in "
                 f"{measured[cores] * 1e3:.1f} ms -> {rate:.3g} params/s")
    for k, med in measured.items():
        pred = k * args.params / rate                       # shard x k / node rate
        lines.append(f"k={k}: {med * 1e3:.1f} ms a step (first start to last end); k x params / node rate = "
                     f"{pred * 1e3:.1f} ms; measured / closed form {med / pred:.2f}; each rank at the node's "
                     f"rate would take {args.params / rate * 1e3:.1f} ms")
    lines.append(f"load average after: {os.getloadavg()[0]:.2f}")
    print("\n".join(lines))
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "host_adam_sharing.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
