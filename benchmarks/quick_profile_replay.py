"""Is re-timing the op table alone enough?  Run F of benchmarks/cpu_shapes.py priced again.

    OMP_NUM_THREADS=1 python benchmarks/quick_profile_replay.py [--save PATH]

Run F (benchmarks/results/cpu_shapes.json, 2026-11-24, an idle machine) profiled the host afresh
with the three commands that made profiles/local-cpu.json (~13 min; the profile it made is
benchmarks/results/cpu_shapes_run_f_profile.json) and then ran the planner's plans for four GPT
shapes and a one-process reference.  Its host was not the one the bundled profile was measured
on: the bundled profile records an AMD EPYC on which torch ran AVX2 kernels, run F's profile an
AMD EPYC with AVX-512 (the ``machine`` of each file).  This script prices run F's plans again,
with the simulator of this checkout, from three profiles:

* ``bundled``: profiles/local-cpu.json as committed;
* ``quick``: the bundled profile with run F's op table in place of its own -- what the quick
  profile (``autopar profile --skip-collectives --skip-overheads --skip-sync-wait`` on 2
  processes, ~3.5 min here) re-measures, everything else (collectives, framework overheads,
  meeting waits) kept from the bundled file;
* ``full``: run F's own profile, all of it measured that day;

and prints each against run F's measured step times: the median |error| over the four shapes
and its ratio to the 15% target of issue 34.  Nothing is run; the figures are the committed
measurements.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MODEL_FILE = REPO / "examples" / "gpt.py"
TARGET = 0.15


def _profiles() -> dict[str, dict]:
    from autopar.profiles import load_profile

    bundled = load_profile("local-cpu")
    full = load_profile(str(RESULTS / "cpu_shapes_run_f_profile.json"))
    quick = dict(bundled, op_table=full["op_table"], machine=full["machine"])
    for key in ("peak_flops", "memory_bandwidth_Bps", "efficiency"):   # derived from the op rows
        quick[key] = full[key]
    return {"bundled": bundled, "quick": quick, "full": full}


def _predict(model: dict, dp: int, micro_batch: int, global_batch: int, profile: dict) -> float:
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster_file import load_cluster
    from autopar.report.resimulate import PlanContext, simulate_figures
    from autopar.simulator.configure import config_plan

    graph = capture_model_file(MODEL_FILE, model, batch_size=micro_batch)
    ctx = PlanContext(graph=graph, cluster=load_cluster("local-cpu"), profile=profile, profile_name="replay")
    plan = config_plan(graph, degrees={"dp": dp, "tp": 1, "pp": 1}, micro_batch=micro_batch, global_batch=global_batch,
                       schedule="1f1b", virtual_stages=1, zero=0, recompute="none", offload="none",
                       precision="fp32", sequence_parallel=False, cluster_name="local-cpu")
    return float(simulate_figures(ctx, plan, timeline=False)[0]["step_time_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    run = json.loads((RESULTS / "cpu_shapes.json").read_text())
    profiles = _profiles()
    print(f"run F: {run['command']}")
    for name, p in profiles.items():
        m = p.get("machine") or {}
        print(f"  {name:<8} profile measured on {m.get('cpu_model')} ({m.get('cpu_capability')})")
    rows = []
    for s in run["shapes"]:
        dp, mb, n = _parse(s["plan"])
        pred = {k: _predict(s["model"], dp, mb, dp * mb * n, p) for k, p in profiles.items()}
        rows.append({"name": s["name"], "plan": s["plan"].strip(), "measured_s": s["measured_s"], "predicted_s": pred})
    ref = run["reference_one_process"]
    ref_model = {"layers": 4, "hidden": 128, "heads": 4, "seq": 64, "vocab": 512}
    ref_pred = {k: _predict(ref_model, 1, 4, 4, p) for k, p in profiles.items()}
    ref_meas = min(ref["before_s"], ref["after_s"])
    print(f"\n{'shape':<14} {'plan':<20} {'measured':>9} " + "".join(f"{k:>18}" for k in profiles))
    for r in rows:
        print(f"{r['name']:<14} {r['plan']:<20} {1e3 * r['measured_s']:7.1f}ms "
              + "".join(f"{1e3 * v:9.1f}ms {_err(v, r['measured_s']):+6.1%}" for v in r["predicted_s"].values()))
    print(f"{'reference':<14} {'one process mb4':<20} {1e3 * ref_meas:7.1f}ms "
          + "".join(f"{1e3 * v:9.1f}ms {_err(v, ref_meas):+6.1%}" for v in ref_pred.values()))
    summary = {}
    for k in profiles:
        errs = [_err(r["predicted_s"][k], r["measured_s"]) for r in rows]
        med = statistics.median(abs(e) for e in errs)
        summary[k] = {"median_abs_error": med, "mean_signed_error": statistics.mean(errs)}
        print(f"{k:<8} median |error| {med:.1%} over {len(rows)} shapes ({med / TARGET:.2f} of the 15% target), "
              f"mean signed {statistics.mean(errs):+.1%}")
    if args.save:
        Path(args.save).write_text(json.dumps({"command": " ".join(["OMP_NUM_THREADS=1", "python", *sys.argv]),
                                               "rows": rows, "reference": {"measured_s": ref_meas,
                                                                           "predicted_s": ref_pred},
                                               "summary": summary}, indent=1) + "\n")
    return 0


def _parse(desc: str) -> tuple[int, int, int]:
    """(dp, micro-batch, micro-batches) of a cpu_shapes plan description ("dp4 tp1 pp1 mb4x1 ")."""
    parts = desc.split()
    if parts[1:3] != ["tp1", "pp1"] or len(parts) > 4:
        raise SystemExit(f"replay prices DDP plans only; run F's plan was {desc!r}")
    mb, n = parts[3][2:].split("x")
    return int(parts[0][2:]), int(mb), int(n)


def _err(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


if __name__ == "__main__":
    sys.exit(main())
