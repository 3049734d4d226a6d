"""Accuracy here: simulated against measured for plans of a small GPT on the local-cpu cluster.

    OMP_NUM_THREADS=1 python benchmarks/accuracy_local_cpu.py [--steps 10] [--repeats 2] [--profile local-cpu]

For each configuration below (2 and 4 gloo ranks, one thread each: DDP, ZeRO-1/3, tensor
parallel, pipeline, recompute, gradient accumulation and mixes) it builds the plan, prices it
with the simulator, runs it with ``python -m torch.distributed.run ... -m autopar.runtime
plan.json`` and reads the measured.json it writes.  It prints, per plan, simulated and measured
step time and peak memory with their errors; then the median and worst step-time error and
Kendall's tau between simulated and measured step times (scipy.stats.kendalltau); then it
calibrates the profile on every other plan and prints the median step-time error of the
held-back plans before and after (and of the fitted ones).

The machine is shared: before each run the script waits (up to --idle-wait-s) until the CPU
is idle, and it runs each plan --repeats times -- in rounds, every plan once per round, the
order reversed every other round -- and keeps the run with the lowest median step
time -- the one least disturbed by other work, as ``timeit`` keeps the best of its repeats
(Python docs, timeit, "Note": higher values are caused by other processes interfering).
Other tenants of the host slow every plan without showing in /proc/stat, and a one-process
run does not notice one that holds one of the two cores; so before each run the script also
times three of the profile's own op rows again on two processes at once
(profiling/cpu_speed_check.py), records how many times their profiled time they took, and with
--max-slowdown waits (up to --speed-wait-s) until it is at most that.  The check is itself
noisy (four checks within 20 s read 1.09 to 1.34) and reads ~1.05-1.1 on a quiet machine (the
profile keeps each row's fastest of three 0.3 s sweeps, the check one 0.1 s sweep), so it is
off by default.
The CPU busy fraction and that ratio seen before each kept run are recorded, and a one-process plan (no
communication in its prediction) runs before and after the rounds as a reading of how fast the
machine was: other tenants of the host slow every plan without showing in /proc/stat.  When
measured.json holds the runtime's ``model_state_bytes_per_rank``, the parameter, gradient and
optimizer-state bytes of every rank are compared with the simulator's per-stage breakdown.

``--model-arg KEY=VALUE`` and ``--micro-batch`` run the same twelve plans on another GPT shape;
``--calibrate-out PROFILE_JSON`` also calibrates the profile on every plan of the run and writes
it (a profile fitted on one shape, to price another with ``--profile``).

Targets: median step-time error <= 10%, tau >= 0.8, and calibration no worse on
the held-back half and better on the fitted half.  Measured memory on CPU is the growth of
the process's peak RSS (runtime/measure.py), which also holds the Python heap, gloo's buffers
and allocator slack; the simulator models tensors only, so the memory error is printed
for information.
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
from dataclasses import dataclass, replace
from pathlib import Path

from autopar.core.measured import BREAKDOWN_KEYS, Measured, read_measured
from autopar.runtime.ports import free_port

REPO = Path(__file__).resolve().parent.parent
MODEL_FILE = REPO / "examples" / "gpt.py"
MODEL_ARGS = {"layers": 4, "hidden": 128, "heads": 4, "seq": 64, "vocab": 512}
MICRO_BATCH = 4


@dataclass(frozen=True)
class Config:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    recompute: str = "none"
    num_microbatches: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


CONFIGS = [
    Config("ddp-2", dp=2),
    Config("zero3-2", dp=2, zero=3),
    Config("tp-2", tp=2),
    Config("pp-2 1f1b m4", pp=2, num_microbatches=4),
    Config("ddp-2 recompute", dp=2, recompute="full"),
    Config("ddp-2 accum-2", dp=2, num_microbatches=2),
    Config("zero1-2", dp=2, zero=1),
    Config("ddp-4", dp=4),
    Config("dp2 x tp2", dp=2, tp=2),
    Config("dp2 x pp2 gpipe m2", dp=2, pp=2, num_microbatches=2, schedule="gpipe"),
    Config("zero3-4 selective", dp=4, zero=3, recompute="selective"),
    Config("tp2 sp x pp2", tp=2, pp=2, num_microbatches=2, sequence_parallel=True),
]
#: one process, no communication: a reading of how fast the machine is (run before and after)
REFERENCE = Config("reference")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="training steps per plan (2 warm-up steps left out)")
    ap.add_argument("--profile", default="local-cpu", help="profile name or file to simulate with")
    ap.add_argument("--out", default=None, help="directory for plans and measurements (default: a temp dir)")
    ap.add_argument("--only", default=None, help="comma-separated config names to run (default: all)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--breakdown", action="store_true",
                    help="run with the runtime's --profile and print forward/backward/communication/optimizer "
                         "errors too (the profiler slows the measured steps a little)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a measured.json already in --out for a plan whose file is unchanged (re-analysis)")
    ap.add_argument("--save", default=None, help="write the figures as JSON here (e.g. benchmarks/results/...)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per plan; the fastest median step time is kept")
    ap.add_argument("--idle-wait-s", type=float, default=60.0,
                    help="wait up to this long before each run for the CPU to be idle (< 25%% busy)")
    ap.add_argument("--max-slowdown", type=float, default=0.0,
                    help="before each run, wait (up to --speed-wait-s) until three of the profile's op rows, timed "
                         "again on two processes, take at most this many times their profiled time (e.g. 1.25; "
                         "default 0: only record the ratio; profiling/cpu_speed_check.py)")
    ap.add_argument("--speed-wait-s", type=float, default=60.0,
                    help="longest wait for the machine to be back within --max-slowdown before a run")
    ap.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="override one of the GPT's arguments (default model: %s)" % MODEL_ARGS)
    ap.add_argument("--micro-batch", type=int, default=None, help=f"micro-batch size (default: {MICRO_BATCH})")
    ap.add_argument("--calibrate-out", default=None, metavar="PROFILE_JSON",
                    help="also calibrate the profile on every plan of this run and write it here")
    args = ap.parse_args()
    _set_model(args.model_arg, args.micro_batch)

    from autopar.core.capture import capture_model_file
    from autopar.core.cluster_file import load_cluster
    from autopar.report.resimulate import PlanContext, load_profile_dict

    cluster = load_cluster("local-cpu")
    profile = load_profile_dict(args.profile)
    graph = capture_model_file(MODEL_FILE, MODEL_ARGS, batch_size=MICRO_BATCH)
    ctx = PlanContext(graph=graph, cluster=cluster, profile=profile, profile_name=str(args.profile))
    out = Path(args.out or tempfile.mkdtemp(prefix="autopar-accuracy-"))
    configs = [c for c in CONFIGS if args.only is None or c.name in args.only.split(",")]
    print(f"model {MODEL_FILE.name} {MODEL_ARGS}, micro-batch {MICRO_BATCH}; cluster {cluster.name}; "
          f"profile {args.profile}; {len(configs)} plans; runs in {out}", flush=True)

    # plans and predictions first; then the runs in rounds -- every plan once per round, the
    # order reversed on every other round (as AB/BA) -- so a slow spell of the shared machine
    # falls on different plans in different rounds instead of on all repeats of one plan
    staged = []
    for cfg in configs:
        run_dir = out / cfg.name.replace(" ", "_")
        old = (run_dir / "plan.json").read_text() if (run_dir / "plan.json").is_file() else None
        plan, sim = _write_plan(cfg, ctx, args.profile, run_dir)
        reuse = args.reuse and (run_dir / "measured.json").is_file() and _same_plan(old, run_dir / "plan.json")
        staged.append({"cfg": cfg, "plan": plan, "sim": sim, "dir": run_dir, "wall_s": 0.0,
                       "measured": read_measured(run_dir / "measured.json") if reuse else None,
                       "reused": reuse})
    to_run = [st for st in staged if not st["reused"]]
    reference = None
    if to_run:
        # a one-process plan, run before and after the rounds: its prediction has no communication
        # in it, so its measured step tells how fast the shared machine was at the time
        _, ref_sim = _write_plan(REFERENCE, ctx, args.profile, out / "reference")
        reference = {"sim_s": ref_sim["step_time_s"], "measured_before_s": _reference_step(out, args, profile)}
    def run_one(st):
        busy = _wait_for_idle(args.idle_wait_s)
        slow = _wait_for_speed(profile, args)
        t0 = time.perf_counter()
        m = _run(st["dir"] / "plan.json", st["cfg"].world_size, args.steps, args.timeout, args.breakdown)
        st["wall_s"] += time.perf_counter() - t0
        return None if m is None else replace(m, extra={**m.extra, "cpu_busy_before_run": busy,
                                                        "slowdown_before_run": slow})

    run_in_rounds(to_run, args.repeats, run_one)

    if reference is not None:
        reference["measured_after_s"] = _reference_step(out, args, profile)
        print(f"reference, one process (no communication): simulated {reference['sim_s'] * 1e3:.2f} ms, measured "
              f"{reference['measured_before_s'] * 1e3:.2f} ms before the rounds and "
              f"{reference['measured_after_s'] * 1e3:.2f} ms after (how fast the machine was)", flush=True)

    rows = []
    for st in staged:
        cfg, sim, measured = st["cfg"], st["sim"], st["measured"]
        if measured is None:
            print(f"  {cfg.name}: the run failed (see {st['dir']}/run.log); left out", flush=True)
            continue
        rows.append({"name": cfg.name, "world_size": cfg.world_size, "plan": st["plan"], "sim": sim,
                     "measured": measured, "sim_step_s": sim["step_time_s"], "meas_step_s": measured.step_time_s,
                     "sim_mem_bytes": sim["max_memory_bytes"], "meas_mem_bytes": measured.max_memory_bytes})
        print(f"  {cfg.name:<22} ranks {cfg.world_size}  simulated {sim['step_time_s'] * 1e3:8.2f} ms  measured "
              f"{measured.step_time_s * 1e3:8.2f} ms  error {_err(sim['step_time_s'], measured.step_time_s):+7.1%}"
              f"   (runs {st['wall_s']:.0f} s{_slow_note(measured)})", flush=True)
    if len(rows) < 2:
        print("fewer than two plans ran; nothing to summarise")
        return 1
    _print_table(rows)
    slows = [r["measured"].extra["slowdown_before_run"] for r in rows if r["measured"].extra.get("slowdown_before_run")]
    if slows:
        print(f"the profile's reference ops took {statistics.median(slows):.2f}x (median; {min(slows):.2f}-"
              f"{max(slows):.2f}x) their profiled time before the kept runs (profiling/cpu_speed_check.py)")
    _print_breakdown(rows)
    summary = _summary(rows)
    summary["model_state"] = _model_state(rows)
    calib = _calibration(rows, ctx, profile)
    if args.calibrate_out:
        _calibrate_all(rows, ctx, profile, Path(args.calibrate_out), sys.argv)
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps({
            "command": " ".join(["OMP_NUM_THREADS=1", "python", *sys.argv]),
            "model": MODEL_ARGS, "micro_batch": MICRO_BATCH, "profile": str(args.profile), "steps": args.steps,
            "repeats": args.repeats,
            "plans": [{**{k: r[k] for k in ("name", "world_size", "sim_step_s", "meas_step_s", "sim_mem_bytes",
                                            "meas_mem_bytes")},
                       "cpu_busy_before_run": r["measured"].extra.get("cpu_busy_before_run"),
                       "slowdown_before_run": r["measured"].extra.get("slowdown_before_run")} for r in rows],
            "summary": summary, "calibration": calib, "reference_one_process": reference}, indent=1) + "\n")
        print(f"wrote {args.save}")
    return 0


def _set_model(pairs: list[str], micro_batch: int | None) -> None:
    """Apply --model-arg / --micro-batch to the module's model (a calibration run uses another shape)."""
    global MICRO_BATCH
    from autopar.core.modelfile import parse_model_args

    MODEL_ARGS.update(parse_model_args(pairs))
    MICRO_BATCH = micro_batch or MICRO_BATCH


def _write_plan(cfg: Config, ctx, profile: str, run_dir: Path):
    """(plan, simulated figures) of ``cfg``, the plan written with its prediction to run_dir/plan.json."""
    from autopar.core.plan import save_plan
    from autopar.report.resimulate import simulate_figures
    from autopar.simulator.configure import config_plan

    cluster = ctx.cluster
    plan = config_plan(ctx.graph, degrees={"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp}, micro_batch=MICRO_BATCH,
                       global_batch=cfg.dp * MICRO_BATCH * cfg.num_microbatches, schedule=cfg.schedule,
                       virtual_stages=1, zero=cfg.zero, recompute=cfg.recompute, offload="none",
                       precision="fp32", sequence_parallel=cfg.sequence_parallel, cluster_name=cluster.name)
    sim, _ = simulate_figures(ctx, plan, timeline=True)
    plan = plan.with_predicted(dict(sim), profile=str(profile), cluster_file=cluster.source)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_plan(plan, run_dir / "plan.json")
    return plan, sim


def _reference_step(out: Path, args, profile: dict) -> float:
    _wait_for_idle(args.idle_wait_s)
    _wait_for_speed(profile, args)
    m = _run(out / "reference" / "plan.json", 1, args.steps, args.timeout)
    return float("nan") if m is None else m.step_time_s


def _run(plan_path: Path, world: int, steps: int, timeout_s: int, breakdown: bool = False) -> Measured | None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "autopar.runtime", str(plan_path), "--steps", str(steps)] + (["--profile"] if breakdown else [])
    log = plan_path.with_name("run.log")
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.write_text(f"timed out after {timeout_s} s: {' '.join(cmd)}\n")
        return None
    log.write_text(proc.stdout + proc.stderr)
    measured = plan_path.with_name("measured.json")
    if proc.returncode != 0 or not measured.is_file():
        return None
    return read_measured(measured)


def run_in_rounds(staged: list[dict], repeats: int, run_one) -> None:
    """Run every staged plan ``repeats`` times in rounds -- each plan once per round, the order
    reversed on every other round -- keeping in ``st["measured"]`` the run (``run_one(st)``: a
    Measured, or None when it failed) with the lowest median step, and write the kept run's
    measured.json back over the last run's."""
    for round_index in range(max(1, repeats) if staged else 0):
        order = staged if round_index % 2 == 0 else staged[::-1]
        print(f"round {round_index + 1} of {repeats}: {len(order)} runs", flush=True)
        for st in order:
            m = run_one(st)
            if m is not None and (st["measured"] is None or m.step_time_s < st["measured"].step_time_s):
                st["measured"] = m
    for st in staged:
        if st["measured"] is not None:
            (st["dir"] / "measured.json").write_text(st["measured"].to_json_text())


def _cpu_busy_fraction(interval_s: float = 1.0) -> float:
    """Fraction of the CPU time not idle over ``interval_s`` (/proc/stat: idle + iowait columns)."""
    def read():
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]
    total0, idle0 = read()
    time.sleep(interval_s)
    total1, idle1 = read()
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1e-9)


def _wait_for_idle(max_wait_s: float, busy_below: float = 0.25) -> float | None:
    """Wait until the CPU is less than ``busy_below`` busy (or ``max_wait_s`` passed); the last reading."""
    if not Path("/proc/stat").is_file():
        return None
    deadline = time.monotonic() + max_wait_s
    busy = _cpu_busy_fraction()
    while busy >= busy_below and time.monotonic() < deadline:
        time.sleep(1.0)
        busy = _cpu_busy_fraction()
    return busy


def _slow_note(measured: Measured) -> str:
    slow = measured.extra.get("slowdown_before_run")
    return "" if slow is None else f"; ops at {slow:.2f}x their profiled time before the kept run"


def _wait_for_speed(profile: dict, args) -> float | None:
    """The profile's reference op rows timed again (profiling/cpu_speed_check.py): now / profiled.
    With ``--max-slowdown``, wait until the ratio is at most that (or ``--speed-wait-s``
    passed); the last ratio."""
    from autopar.profiling.cpu_speed_check import speed_ratio

    deadline = time.monotonic() + args.speed_wait_s
    ratio = speed_ratio(profile)["ratio"]
    while args.max_slowdown and ratio is not None and ratio > args.max_slowdown and time.monotonic() < deadline:
        time.sleep(5.0)
        ratio = speed_ratio(profile)["ratio"]
    return ratio


def _same_plan(old_text: str | None, new_path: Path) -> bool:
    """Same model, mesh, batch, pipeline and layers (the predicted block may differ)."""
    if old_text is None:
        return False
    old, new = json.loads(old_text), json.loads(new_path.read_text())
    keys = ("model", "mesh", "global_batch", "micro_batch", "precision", "pipeline", "layers")
    return all(old.get(k) == new.get(k) for k in keys)


def _err(sim: float, meas: float) -> float:
    return (sim - meas) / meas


def _print_table(rows) -> None:
    print()
    print(f"{'plan':<22} {'ranks':>5} {'sim step':>10} {'meas step':>10} {'error':>8}   {'sim mem':>10} "
          f"{'meas mem':>10} {'error':>8}")
    for r in rows:
        print(f"{r['name']:<22} {r['world_size']:>5} {r['sim_step_s'] * 1e3:>8.2f}ms {r['meas_step_s'] * 1e3:>8.2f}ms "
              f"{_err(r['sim_step_s'], r['meas_step_s']):>+8.1%}   {r['sim_mem_bytes'] / 2**20:>7.1f}MiB "
              f"{r['meas_mem_bytes'] / 2**20:>7.1f}MiB {_err(r['sim_mem_bytes'], r['meas_mem_bytes']):>+8.1%}")


def _print_breakdown(rows) -> None:
    keys = BREAKDOWN_KEYS
    have = [r for r in rows if all(k in r["measured"].figures() for k in keys)]
    if not have:
        return
    print(f"\n{'plan (ms: simulated / measured)':<32}" + "".join(f"{k[:-2]:>22}" for k in keys))
    for r in have:
        meas = r["measured"].figures()
        cells = "".join(f"{r['sim'][k] * 1e3:>8.1f} /{meas[k] * 1e3:>7.1f} {_err(r['sim'][k], meas[k]):>+5.0%}"
                        if meas[k] > 0 else f"{'-':>22}" for k in keys)
        print(f"{r['name']:<32}{cells}")


def _summary(rows) -> dict:
    from scipy.stats import kendalltau

    errs = [abs(_err(r["sim_step_s"], r["meas_step_s"])) for r in rows]
    mem_errs = [abs(_err(r["sim_mem_bytes"], r["meas_mem_bytes"])) for r in rows]
    tau = kendalltau([r["sim_step_s"] for r in rows], [r["meas_step_s"] for r in rows])
    s = {"num_plans": len(rows), "median_abs_step_error": statistics.median(errs), "worst_abs_step_error": max(errs),
         "kendall_tau": float(tau.statistic), "kendall_p": float(tau.pvalue),
         "median_abs_memory_error": statistics.median(mem_errs)}
    print(f"\nstep time: median |error| {s['median_abs_step_error']:.1%} (target <= 10%), worst "
          f"{s['worst_abs_step_error']:.1%}; Kendall tau {s['kendall_tau']:.3f} (target >= 0.8, p = {s['kendall_p']:.3g}) "
          f"over {len(rows)} plans")
    print(f"peak memory (RSS growth, for information): median |error| {s['median_abs_memory_error']:.1%}")
    return s


def _model_state(rows) -> dict | None:
    """Parameter / gradient / optimizer bytes per rank, simulated against what the runtime counted.

    Needs measured.json's ``model_state_bytes_per_rank`` (one {params_bytes, grads_bytes,
    optimizer_bytes} per rank: the bytes of the local shards of the parameters, their
    gradients and the optimizer state); runs without it are skipped.
    """
    worst = 0.0
    checked = exact = 0
    mismatches = []
    for r in rows:
        per_rank = r["measured"].model_state_bytes_per_rank
        if not per_rank:
            continue
        stages = r["sim"].get("memory_per_stage") or []
        for rank, meas in enumerate(per_rank):
            stage = stages[min(r["plan"].mesh.coords(rank)[1], len(stages) - 1)]
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                got = getattr(meas, key)
                checked += 1
                if float(stage[key]) == float(got):
                    exact += 1
                    continue
                err = _err(stage[key], got) if got else float("inf")
                worst = max(worst, abs(err))
                mismatches.append({"plan": r["name"], "rank": rank, "figure": key, "simulated": stage[key],
                                   "measured": got, "error": err})
    if not checked:
        print("model state memory: measured.json holds no model_state_bytes_per_rank; not checked")
        return None
    print(f"model state memory (params, grads, optimizer per rank): {exact} of {checked} figures exact, worst "
          f"|error| {worst:.2%} (target: exact)")
    seen = set()
    for m in mismatches:
        if (m["plan"], m["figure"]) in seen:
            continue
        seen.add((m["plan"], m["figure"]))
        print(f"  {m['plan']:<22} rank {m['rank']} {m['figure']:<16} simulated {m['simulated']:>12.0f}  measured "
              f"{m['measured']:>12.0f}  ({m['error']:+.2%})")
    return {"checked": checked, "exact": exact, "worst_abs_error": worst, "mismatches": mismatches}


def _calibration(rows, ctx, profile) -> dict:
    from autopar.report.calibrate import calibrate
    from autopar.report.resimulate import simulate_figures

    fit, held = rows[0::2], rows[1::2]
    t0 = time.perf_counter()
    res = calibrate(profile, [_observation(r, ctx) for r in fit])
    fit_s = time.perf_counter() - t0

    def median_err(subset, prof) -> float:
        return statistics.median(abs(_err(simulate_figures(ctx, r["plan"], prof, timeline=False)[0]["step_time_s"],
                                          r["meas_step_s"])) for r in subset)

    out = {"fitted_on": [r["name"] for r in fit], "held_back": [r["name"] for r in held],
           "fitted_before": median_err(fit, profile), "fitted_after": median_err(fit, res.profile),
           "held_before": median_err(held, profile), "held_after": median_err(held, res.profile),
           "changes": {c.factor: {"old": c.old_efficiency, "new": c.new_efficiency, "time_scale": c.time_scale}
                       for c in res.changes}, "fit_s": fit_s}
    print(f"\ncalibration on {len(fit)} plans ({fit_s:.1f} s): " +
          (", ".join(f"{c.factor} {c.old_efficiency:.3g} -> {c.new_efficiency:.3g} (time x{c.time_scale:.2f})"
                     for c in res.changes) or "no change"))
    out["ridge"], out["cv_errors"] = res.ridge, {str(k): v for k, v in res.cv_errors.items()}
    if res.cv_errors:
        print(f"  ridge {res.ridge:g} chosen by leave-one-out (mean |log error| of the left-out step time: " +
              ", ".join(f"{k:g}: {v:.1%}" for k, v in res.cv_errors.items()) + ")")
    print(f"  fitted half   median |step error| {out['fitted_before']:.1%} -> {out['fitted_after']:.1%}")
    print(f"  held-back half median |step error| {out['held_before']:.1%} -> {out['held_after']:.1%} "
          f"(target: no worse)")
    return out


def _observation(r, ctx):
    """A measured plan as a calibration observation, re-simulated with the profile it is given."""
    from autopar.report.calibrate import Observation
    from autopar.report.resimulate import simulate_figures

    return Observation(name=r["name"], measured=r["measured"].figures(),
                       predict=lambda prof, plan=r["plan"]: simulate_figures(ctx, plan, prof, timeline=True)[0])


def _calibrate_all(rows, ctx, profile, out: Path, argv) -> None:
    """Calibrate on every plan of this run and write the profile (for use on other models)."""
    from autopar.report.calibrate import calibrate

    res = calibrate(profile, [_observation(r, ctx) for r in rows])
    model = ", ".join(f"{k}={v}" for k, v in MODEL_ARGS.items())
    src = dict(res.profile.get("sources", {}))
    src["calibration_run"] = (f"{' '.join(['OMP_NUM_THREADS=1', 'python', *argv])}: GPT {model}, micro-batch "
                              f"{MICRO_BATCH}, {len(rows)} plans, fitted on their median step times")
    res.profile["sources"] = src
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res.profile, indent=1) + "\n")
    print(f"calibrated on all {len(rows)} plans: " + (", ".join(f"{c.factor} time x{c.time_scale:.2f}"
                                                               for c in res.changes) or "no change") + f"; wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
