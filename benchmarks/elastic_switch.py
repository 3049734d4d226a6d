"""What a switch of an elastic run costs on this machine: predicted against measured.

    python benchmarks/elastic_switch.py [--repeats N] [--rendezvous-timeout S] [--replan-budget S]

Each repeat runs tests/elastic_support.run_losing_a_node: two "nodes" (each ``autopar run
PLAN --elastic``, a torchrun agent of 2 gloo ranks) train the small GPT's dp2 x tp2 plan; once
step 4 is logged node 1 is killed with SIGKILL (its ``autopar run``, agent and ranks) and never
restarted; node 0 re-plans for itself and finishes.  Printed per repeat, from the switch that
measured.json records (elastic/switches.py):

* predicted: the rendezvous wait (torch's dead-node detection + ``--rendezvous-timeout``), the
  re-plan (the search budget) and the restart (the start-up the first launch measured), and their sum;
* measured: the re-plan's own time, and the switch time from the failure (the first failing
  rank's record) to the first step after it logged, and from the SIGKILL to that step.

The machine's load is printed with each repeat: the figures are wall-clock times on shared
cores.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

STEPS, KILL_AFTER = 8, 4


def one(tmp: Path, timeout_s: int, budget_s: float) -> dict:
    from elastic_support import plan_on_cluster, run_losing_a_node

    plan = plan_on_cluster(tmp)
    ck = tmp / "ck"
    run = run_losing_a_node(tmp, plan, ck, STEPS, KILL_AFTER,
                            ("--checkpoint-every", "2", "--rendezvous-timeout", str(timeout_s),
                             "--replan-budget", str(budget_s)))
    if run.code != 0:
        raise SystemExit(f"the run failed (exit {run.code}):\n{run.node0[-4000:]}")
    (switch,) = json.loads((tmp / "measured.json").read_text())["switches"]
    switch["from_kill_s"] = switch["first_step_after_at"] - run.killed_at
    return switch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rendezvous-timeout", type=int, default=2)
    parser.add_argument("--replan-budget", type=float, default=2.0)
    args = parser.parse_args()
    print(f"elastic switch on this machine ({os.cpu_count()} cores): small GPT dp2 x tp2 on 2 nodes x 2 gloo ranks, "
          f"node 1 killed after step {KILL_AFTER}, --rendezvous-timeout {args.rendezvous_timeout} "
          f"--replan-budget {args.replan_budget:g}")
    for i in range(args.repeats):
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="autopar-elastic-bench-") as d:
            s = one(Path(d), args.rendezvous_timeout, args.replan_budget)
        p = s["predicted_switch_s"]
        restart = "n/a" if p["restart_s"] is None else f"{p['restart_s']:.2f}"
        print(f"repeat {i + 1} (load {load:.1f} before): {s['old_layout']} -> {s['new_layout']}, "
              f"steps lost {s['steps_lost']}")
        print(f"  predicted {p['total']:.2f} s = rendezvous {p['rendezvous_s']:.2f} + re-plan {p['replan_s']:.2f} "
              f"+ restart {restart}")
        print(f"  measured  {s['measured_switch_s']:.2f} s from the failure to the first step after "
              f"({s['from_kill_s']:.2f} s from the SIGKILL); the re-plan took {s['replan_measured_s']:.2f} s")
        sys.stdout.flush()
        time.sleep(1)


if __name__ == "__main__":
    main()
