"""Does the CPU loop carry over to other models?  The planner's own plans for several GPT shapes
on the local-cpu cluster, predicted against measured.

    OMP_NUM_THREADS=1 python benchmarks/cpu_shapes.py [--fresh-profile] [--repeats 3] [--steps 12] [--save PATH]

For each shape below (depth, width and sequence length each moved away from the accuracy
benchmark's model, examples/gpt.py layers 4, hidden 128, heads 4, seq 64, vocab 512) it runs
``autopar plan examples/gpt.py --cluster local-cpu --global-batch G`` as a user would, reads
the plan it writes (the plan and the step time the planner predicted for it), runs that plan
with ``python -m torch.distributed.run --nproc-per-node W -m autopar.runtime plan.json`` (the
command ``autopar plan`` prints) and reads the measured.json the runtime writes.  It prints,
per shape, the plan, the predicted and measured step time and the error; then the median
|error| over the shapes and its ratio to the 15% target of issue 16.

The runs follow benchmarks/accuracy_local_cpu.py: before each run the script waits (up to
--idle-wait-s) for the CPU to be idle; every plan runs --repeats times in rounds (every plan
once a round, the order reversed every other round) and the run with the lowest median step
time is kept, the one least disturbed by other work (Python docs, timeit, "Note").  The CPU
busy fraction seen before the kept run, the load average at the start and at the end, and the
steps of a one-process plan of the accuracy benchmark's own model run before and after the rounds
(no communication in its prediction: how fast the shared machine was) are recorded, and so is,
before each run, how many times their profiled time three of the profile's own op rows take now
on two processes (profiling/cpu_speed_check.py; 1.0: as fast as when the profile was made).
``--fresh-profile`` first measures the machine as it is now into a copy of the profile (the
three commands that made it, ~13 min) and plans and prices with the copy: profile, plan and run
in one invocation, on one state of a shared machine.  ``--breakdown`` runs with the runtime's
``--profile`` and prints the forward / backward / communication / optimizer times beside the
simulated ones (the profiler slows the steps a little).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy_local_cpu as acc  # noqa: E402  (same run, idle-wait and error helpers)
from autopar.core.plan import LayerPlan, Plan, load_plan  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL_FILE = REPO / "examples" / "gpt.py"
BASE = {"layers": 4, "hidden": 128, "heads": 4, "seq": 64, "vocab": 512}
#: (name, model arguments over BASE): depth, width, sequence length, and all three at once
SHAPES = [
    ("wide h256", {"hidden": 256}),
    ("deep l8", {"layers": 8}),
    ("long s256", {"seq": 256}),
    ("l6 h192 s128", {"layers": 6, "hidden": 192, "heads": 6, "seq": 128}),
]
TARGET = 0.15   # issue 16: median |error| over the shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--global-batch", type=int, default=16, help="samples per step given to autopar plan")
    ap.add_argument("--batch-size", type=int, default=4, help="samples the model is captured with")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run (2 warm-up steps left out)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per plan; the fastest median step time is kept")
    ap.add_argument("--time-budget", type=float, default=10.0, help="autopar plan's search budget, seconds")
    ap.add_argument("--profile", default=None, help="profile passed to autopar plan (default: the cluster's)")
    ap.add_argument("--fresh-profile", action="store_true",
                    help="first measure this machine as it is now: copy the profile to OUT/profile.json, time it "
                         "again with the three `autopar profile` commands it was made with (PROFILE_COMMANDS, "
                         "~13 min), and plan and price with it")
    ap.add_argument("--quick-profile", action="store_true",
                    help="first re-time only the op table of a copy of the profile on this machine "
                         "(QUICK_PROFILE_COMMANDS: one sweep on 2 processes, by the thread clock, ~3 min) and plan "
                         "and price with it; collectives, overheads and meeting waits stay the profile's")
    ap.add_argument("--only", default=None, help="comma-separated shape names to run (default: all)")
    ap.add_argument("--out", default=None, help="directory for plans and measurements (default: a temp dir)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--idle-wait-s", type=float, default=60.0,
                    help="wait up to this long before each run for the CPU to be idle (< 25%% busy)")
    ap.add_argument("--breakdown", action="store_true",
                    help="run with the runtime's --profile and print the per-phase times too")
    ap.add_argument("--replan", action="store_true", help="plan again even if OUT/<shape>/plan.json exists")
    ap.add_argument("--save", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="autopar-cpu-shapes-"))
    shapes = [(n, {**BASE, **kw}) for n, kw in SHAPES if args.only is None or n in args.only.split(",")]
    load = load_start = os.getloadavg()
    print(f"cluster local-cpu, global batch {args.global_batch}, {len(shapes)} shapes, {args.repeats} repeats; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; runs in {out}", flush=True)
    fresh = None
    if args.fresh_profile and args.quick_profile:
        raise SystemExit("--fresh-profile and --quick-profile each make the profile; give one")
    if args.fresh_profile or args.quick_profile:
        fresh = _fresh_profile(args.profile or "local-cpu", out / "profile.json", args.idle_wait_s,
                               QUICK_PROFILE_COMMANDS if args.quick_profile else PROFILE_COMMANDS)
        args.profile = str(out / "profile.json")
        args.replan = True                     # plans made with another profile do not count

    staged = []
    for name, model in shapes:
        run_dir = out / name.replace(" ", "_")
        plan_path = run_dir / "plan.json"
        if args.replan or not plan_path.is_file():
            _plan(model, args, plan_path)
        plan = load_plan(plan_path)
        staged.append({"name": name, "model": model, "dir": run_dir, "plan": plan, "measured": None,
                       "world": plan.world_size, "predicted_s": plan.predicted["step_time_s"]})
        print(f"  {name:<14} {_describe(plan)}: predicted {staged[-1]['predicted_s'] * 1e3:.1f} ms", flush=True)

    from autopar.report.resimulate import load_profile_dict
    from autopar.profiling.cpu_speed_check import speed_ratio

    profile = load_profile_dict(args.profile or "local-cpu")
    reference = _reference(out, args)
    print(f"reference (accuracy benchmark's model, one process): predicted {reference['predicted_s'] * 1e3:.1f} ms, "
          f"measured {reference['before_s'] * 1e3:.1f} ms before the rounds", flush=True)
    for round_index in range(max(1, args.repeats)):
        order = staged if round_index % 2 == 0 else staged[::-1]
        print(f"round {round_index + 1} of {args.repeats}", flush=True)
        for st in order:
            busy = acc._wait_for_idle(args.idle_wait_s)
            slow = speed_ratio(profile)["ratio"]
            run = acc._run(st["dir"] / "plan.json", st["world"], args.steps, args.timeout, args.breakdown)
            m = None if run is None else run.to_json()      # measured.json's keys (core/measured.py)
            if m is None:
                print(f"  {st['name']}: the run failed (see {st['dir']}/run.log)", flush=True)
                continue
            print(f"  {st['name']:<14} measured {m['step_time_s'] * 1e3:.1f} ms (busy {busy:.0%} before; ops at "
                  f"{slow:.2f}x their profiled time)", flush=True)
            if st["measured"] is None or m["step_time_s"] < st["measured"]["step_time_s"]:
                st["measured"] = {**m, "cpu_busy_before_run": busy, "slowdown_before_run": slow}

    reference["after_s"] = _reference_step(out, args)
    print(f"reference measured {reference['after_s'] * 1e3:.1f} ms after the rounds", flush=True)
    rows = [st for st in staged if st["measured"] is not None]
    print(f"\n{'shape':<14} {'model':<36} {'plan':<34} {'predicted':>10} {'measured':>10} {'error':>8}")
    for st in rows:
        st["error"] = acc._err(st["predicted_s"], st["measured"]["step_time_s"])
        dims = " ".join(f"{k[0]}{st['model'][k]}" for k in ("layers", "hidden", "heads", "seq"))
        print(f"{st['name']:<14} {dims:<36} {_describe(st['plan']):<34} {st['predicted_s'] * 1e3:>8.1f}ms "
              f"{st['measured']['step_time_s'] * 1e3:>8.1f}ms {st['error']:>+8.1%}")
    if args.breakdown:
        _print_breakdown(rows)
    if not rows:
        print("no plan ran")
        return 1
    med = statistics.median(abs(st["error"]) for st in rows)
    slows = [st["measured"]["slowdown_before_run"] for st in rows if st["measured"].get("slowdown_before_run")]
    if slows:
        print(f"\nthe profile's reference ops took {statistics.median(slows):.2f}x (median; {min(slows):.2f}-"
              f"{max(slows):.2f}x) their profiled time before the kept runs (profiling/cpu_speed_check.py)")
    print(f"\nmedian |error| {med:.1%} over {len(rows)} shapes: {med / TARGET:.2f} of the 15% target (issue 16); "
          f"mean signed {statistics.mean(st['error'] for st in rows):+.1%}")
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.save:
        fresh_kind = "quick" if args.quick_profile else "full" if args.fresh_profile else None
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps({
            "command": " ".join(["OMP_NUM_THREADS=1", "python", *sys.argv]),
            "shapes": [{"name": st["name"], "model": st["model"], "plan": _describe(st["plan"]),
                        "predicted_s": st["predicted_s"], "measured_s": st["measured"]["step_time_s"],
                        "error": st["error"], "cpu_busy_before_run": st["measured"].get("cpu_busy_before_run"),
                        "slowdown_before_run": st["measured"].get("slowdown_before_run")}
                       for st in rows],
            "median_abs_error": med, "target": TARGET, "reference_one_process": reference,
            "profile": args.profile or "local-cpu", "fresh_profile": fresh, "fresh_profile_kind": fresh_kind,
            "load_average_start": list(load_start), "machine": _machine(),
            "load_average_end": list(load)}, indent=1) + "\n")
        print(f"wrote {args.save}")
    return 0


#: how profiles/local-cpu.json was measured (its ``measured_by``): the collectives on 4 processes; the
#: ops, the collectives on 2, the framework overheads and the meeting waits on 2; the meeting
#: waits on 4.  ``--fresh-profile`` runs the same three into a copy.
PROFILE_COMMANDS = (
    (4, ["--skip-ops", "--skip-overheads", "--skip-sync-wait", "--target-s", "0.3"]),
    (2, ["--passes", "3", "--target-s", "0.3"]),
    (4, ["--skip-ops", "--skip-collectives", "--skip-overheads"]),
)
#: ``--quick-profile``: the op table alone, one sweep on 2 processes (one per core), timed by the
#: thread clock (profiling/timing.py), so the machine's other work does not inflate it: what
#: changes between machines and hours is the op speed (this host has been an AMD EPYC with
#: AVX2 and an Intel Xeon with AVX-512 on different days, profiles/local-cpu.json ``machine``)
QUICK_PROFILE_COMMANDS = (
    (2, ["--skip-collectives", "--skip-overheads", "--skip-sync-wait"]),
)


def _fresh_profile(base: str, path: Path, idle_wait_s: float, profile_commands=PROFILE_COMMANDS) -> dict:
    """Measure this machine now into ``path``, a copy of the profile ``base`` (PROFILE_COMMANDS):
    the profile the plans are made and priced with describes the machine they run on, not the one
    of another hour (a shared host's speed drifts by up to 1.5-2x, docs/profiling.md).  Returns the
    commands, the seconds they took and, per op kind, the median of new over old op-row times."""
    from autopar.profiles import profile_path
    from autopar.report.resimulate import load_profile_dict

    old = load_profile_dict(base)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = Path(base) if Path(base).is_file() else profile_path(base)
    path.write_bytes(source.read_bytes())
    commands, t0 = [], time.monotonic()
    for nproc, flags in profile_commands:
        acc._wait_for_idle(idle_wait_s)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "autopar.cli",
               "profile", "-o", str(path), *flags]
        shown = " ".join(["OMP_NUM_THREADS=1", "torchrun", *cmd[3:]])
        print(f"profiling this machine: {shown}", flush=True)
        t = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        with (path.parent / "profile.log").open("a") as log:
            log.write(f"$ {shown}\n{proc.stdout}{proc.stderr}\n")
        if proc.returncode != 0:
            raise SystemExit(f"autopar profile failed (exit {proc.returncode}); see {path.parent}/profile.log")
        commands.append({"command": shown, "seconds": round(time.monotonic() - t, 1)})
    new = load_profile_dict(str(path))
    ratios = _op_time_ratios(old, new)
    print(f"profiled in {time.monotonic() - t0:.0f} s; op rows now take, per kind, the median of "
          + ", ".join(f"{k} {v:.2f}x" for k, v in sorted(ratios.items())) + " their time in " + base, flush=True)
    return {"base": base, "commands": commands, "op_time_new_over_old": ratios}


def _machine() -> dict:
    """This host's CPU, as the profile's ``machine`` names it (profiling/machine.py)."""
    import torch

    from autopar.profiling.machine import describe

    d = describe(torch.device("cpu"), 1, None)
    return {k: d.get(k) for k in ("cpu_model", "num_cpu_cores", "cpu_capability")}


def _op_time_ratios(old: dict, new: dict) -> dict[str, float]:
    """Per op kind, the median over the rows both profiles hold of new / old measured seconds (a row
    named as the speed check names it, cpu_speed_check._case_key)."""
    from autopar.profiling.cpu_speed_check import _case_key

    def rows(p):
        return {_case_key(r["kind"], r.get("variant"), r["dtype"], r["shape"]): r["measured_seconds"]
                for r in p.get("op_table", []) if r.get("measured_seconds")}
    a, b = rows(old), rows(new)
    by_kind: dict[str, list[float]] = {}
    for k in a.keys() & b.keys():
        by_kind.setdefault(k[0], []).append(b[k] / a[k])
    return {k: round(statistics.median(v), 3) for k, v in by_kind.items()}


def _plan(model: dict, args, plan_path: Path) -> None:
    """``autopar plan`` for ``model`` on local-cpu, writing ``plan_path`` (a failure stops the benchmark)."""
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "autopar.cli", "plan", str(MODEL_FILE), "--cluster", "local-cpu",
           "--global-batch", str(args.global_batch), "--batch-size", str(args.batch_size),
           "--time-budget", str(args.time_budget), "-o", str(plan_path)]
    cmd += [a for k, v in model.items() for a in ("--model-arg", f"{k}={v}")]
    if args.profile:
        cmd += ["--profile", args.profile]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (plan_path.parent / "plan.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"autopar plan failed for {model} (exit {proc.returncode}); see {plan_path.parent}/plan.log")


def _reference(out: Path, args) -> dict:
    """The accuracy benchmark's model on one process, planned and priced as that benchmark does
    (its ``reference``), run once now: {predicted_s, before_s}."""
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster_file import load_cluster
    from autopar.report.resimulate import PlanContext, load_profile_dict

    profile = args.profile or "local-cpu"
    graph = capture_model_file(acc.MODEL_FILE, acc.MODEL_ARGS, batch_size=acc.MICRO_BATCH)
    ctx = PlanContext(graph=graph, cluster=load_cluster("local-cpu"), profile=load_profile_dict(profile),
                      profile_name=profile)
    _, sim = acc._write_plan(acc.REFERENCE, ctx, profile, out / "reference")
    return {"predicted_s": sim["step_time_s"], "before_s": _reference_step(out, args)}


def _reference_step(out: Path, args) -> float:
    acc._wait_for_idle(args.idle_wait_s)
    m = acc._run(out / "reference" / "plan.json", 1, args.steps, args.timeout)
    return float("nan") if m is None else m.step_time_s


def _describe(plan: Plan) -> str:
    """The plan in a few words: mesh, micro-batches and the layer choices seen."""
    kinds = sorted({_layer_kind(layer) for layer in plan.layers})
    return (f"{plan.mesh.describe('{name}{size}', sep=' ')} mb{plan.micro_batch}x{plan.pipeline.num_microbatches} "
            + "/".join(k for k in kinds if k))


def _layer_kind(layer: LayerPlan) -> str:
    parts = []
    if layer.zero:
        parts.append(f"z{layer.zero}")
    if layer.recompute != "none":
        parts.append(f"rc-{layer.recompute}")
    if layer.tp:
        parts.append("tp")
    return "+".join(parts)


def _print_breakdown(rows) -> None:
    keys = ("fwd_s", "bwd_s", "comm_s", "optimizer_s")
    print(f"\n{'measured per phase (ms)':<26}" + "".join(f"{k[:-2]:>10}" for k in keys))
    for st in rows:
        m = st["measured"]
        print(f"{st['name']:<26}" + "".join(f"{m.get(k, float('nan')) * 1e3:>10.1f}" for k in keys))


if __name__ == "__main__":
    sys.exit(main())
