"""Does the op table carry over between model shapes?  One-process steps timed by CPU time.

    OMP_NUM_THREADS=1 python benchmarks/cpu_time_shapes.py [--profile mine.json] [--steps 8] [--save PATH]

On a shared machine a run's step time is its work plus the time its process waited for a core,
and the second part is the other tenants' (issue 34: the bundled profile read +41% on an idle
hour, -5% on a loaded one, for the same plan).  This benchmark leaves the waits out on both
sides: the profile's op rows timed by the thread's CPU time (profiling/timing.py, the default for
CPU rows) against a one-process training step timed by the same clock, so what it compares is
the op table's price of a step with what the step's arithmetic costs on this CPU, whatever the
load.  For each GPT shape of benchmarks/cpu_shapes.py and the accuracy benchmark's own model it:

1. prices the one-process plan (micro-batch ``--micro-batch``, no recompute) on local-cpu with
   each profile given (``--profile``, repeatable; default the bundled local-cpu);
2. runs the same step in a plain PyTorch loop in this process -- the model file's
   ``build_model`` / ``make_batch`` / loss, AdamW as the runtime builds it (runtime/options.py),
   one intra-op thread -- and takes the median over ``--steps`` steps (after two warm-up steps)
   of ``time.thread_time`` around forward, backward and optimizer step.

Prints per shape the predicted and measured step and the error, and per profile the median
|error| and its ratio to the 15% target of issue 34.  What it does not check: the parts of a
multi-process step that are waits by nature (collectives, meeting waits, compute slots), for
which benchmarks/cpu_shapes.py runs the plans whole (a figure only an idle machine gives).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_shapes  # noqa: E402  (the shapes)

REPO = Path(__file__).resolve().parent.parent
MODEL_FILE = REPO / "examples" / "gpt.py"
TARGET = 0.15


def predicted_step_s(model: dict, micro_batch: int, profile: str) -> float:
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster_file import load_cluster
    from autopar.report.resimulate import PlanContext, load_profile_dict, simulate_figures
    from autopar.simulator.configure import config_plan

    graph = capture_model_file(MODEL_FILE, model, batch_size=micro_batch)
    ctx = PlanContext(graph=graph, cluster=load_cluster("local-cpu"), profile=load_profile_dict(profile),
                      profile_name=profile)
    plan = config_plan(graph, degrees={"dp": 1, "tp": 1, "pp": 1}, micro_batch=micro_batch, global_batch=micro_batch,
                       schedule="1f1b", virtual_stages=1, zero=0, recompute="none", offload="none",
                       precision="fp32", sequence_parallel=False, cluster_name="local-cpu")
    return float(simulate_figures(ctx, plan, timeline=False)[0]["step_time_s"])


def measured_step_cpu_s(model: dict, micro_batch: int, steps: int) -> tuple[float, float]:
    """(median thread CPU seconds, median wall seconds) of a plain training step."""
    import torch

    from autopar.core.modelfile import load_model_file
    from autopar.runtime.options import ADAM_BETAS, ADAM_EPS, DEFAULT_LR, WEIGHT_DECAY

    torch.set_num_threads(1)
    mf = load_model_file(MODEL_FILE)
    torch.manual_seed(0)
    net = mf.build(**model)
    opt = torch.optim.AdamW(net.parameters(), lr=DEFAULT_LR, betas=ADAM_BETAS, eps=ADAM_EPS,
                            weight_decay=WEIGHT_DECAY)
    inputs, target = mf.make_batch(micro_batch, **model)
    cpu, wall = [], []
    for i in range(steps + 2):
        t0, c0 = time.perf_counter(), time.thread_time()
        opt.zero_grad(set_to_none=True)
        loss = mf.loss(net(*inputs), target)
        loss.backward()
        opt.step()
        c1, t1 = time.thread_time(), time.perf_counter()
        if i >= 2:
            cpu.append(c1 - c0)
            wall.append(t1 - t0)
    return statistics.median(cpu), statistics.median(wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="append", default=None, help="profile to price with (repeatable)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    profiles = args.profile or ["local-cpu"]
    shapes = [("base", dict(cpu_shapes.BASE))] + [(n, {**cpu_shapes.BASE, **kw}) for n, kw in cpu_shapes.SHAPES]
    load0 = os.getloadavg()
    print(f"one process, micro-batch {args.micro_batch}, {args.steps} steps; load average {load0[0]:.2f} "
          f"{load0[1]:.2f} {load0[2]:.2f}", flush=True)
    rows = []
    for name, model in shapes:
        pred = {p: predicted_step_s(model, args.micro_batch, p) for p in profiles}
        cpu_s, wall_s = measured_step_cpu_s(model, args.micro_batch, args.steps)
        rows.append({"name": name, "model": model, "predicted_s": pred, "measured_cpu_s": cpu_s,
                     "measured_wall_s": wall_s})
        print(f"  {name:<14} measured {1e3 * cpu_s:7.1f} ms CPU ({1e3 * wall_s:7.1f} ms wall)  "
              + "  ".join(f"{Path(p).stem}: {1e3 * v:7.1f} ms {(v - cpu_s) / cpu_s:+6.1%}" for p, v in pred.items()),
              flush=True)
    summary = {}
    for p in profiles:
        errs = [(r["predicted_s"][p] - r["measured_cpu_s"]) / r["measured_cpu_s"] for r in rows]
        med = statistics.median(abs(e) for e in errs)
        summary[p] = {"median_abs_error": med, "mean_signed_error": statistics.mean(errs)}
        print(f"{p}: median |error| {med:.1%} over {len(rows)} shapes ({med / TARGET:.2f} of the 15% target), "
              f"mean signed {statistics.mean(errs):+.1%}")
    load1 = os.getloadavg()
    print(f"load average at the end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps({
            "command": " ".join(["OMP_NUM_THREADS=1", "python", *sys.argv]), "micro_batch": args.micro_batch,
            "rows": rows, "summary": summary, "load_average_start": list(load0), "load_average_end": list(load1)},
            indent=1) + "\n")
        print(f"wrote {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
