"""What the switches of an elastic run cost on this machine: predicted against measured.

    python benchmarks/elastic_switch.py [--repeats N] [--rendezvous-timeout S] [--replan-budget S]

Each repeat runs tests/elastic_support.run_losing_a_node: two "nodes" (each ``autopar run
PLAN --elastic``, a torchrun agent of 2 gloo ranks) train the small GPT's dp2 x tp2 plan; once
step 4 is logged node 1 is killed with SIGKILL (its ``autopar run``, agent and ranks); node 0
re-plans for itself and goes on; once it logged step 6 alone, node 1 is started again, torch's
agent on node 0 restarts the round, and the two nodes re-plan for both and finish.  Printed
per repeat and switch, from the switches that measured.json records (elastic/switches.py):

* predicted: the rendezvous wait (a node lost: torch's dead-node detection +
  ``--rendezvous-timeout``; a node joined: torchrun's monitor interval), the re-plan (the
  search budget) and the restart (the start-up the previous launch measured), and their sum;
* measured: the re-plan's own time, and the switch time to the first step after it logged:
  a node lost, from the failure (the first failing rank's record) and from the SIGKILL; a node
  joined, from the time its ``autopar run`` launched and from the test's start of it.

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

STEPS, KILL_AFTER, RETURN_AFTER = 12, 4, 6


def one(tmp: Path, timeout_s: int, budget_s: float) -> list[dict]:
    from elastic_support import plan_on_cluster, run_losing_a_node

    plan = plan_on_cluster(tmp)
    ck = tmp / "ck"
    run = run_losing_a_node(tmp, plan, ck, STEPS, KILL_AFTER,
                            ("--checkpoint-every", "2", "--rendezvous-timeout", str(timeout_s),
                             "--replan-budget", str(budget_s)), return_after=RETURN_AFTER, timeout_s=600)
    if run.code != 0 or run.back_code != 0:
        raise SystemExit(f"the run failed (exit {run.code}, the returning node's {run.back_code}):\n"
                         f"{run.node0[-4000:]}\n{run.node1_back[-2000:]}")
    lost, joined = json.loads((tmp / "measured.json").read_text())["switches"]
    lost["from_event_s"] = lost["first_step_after_at"] - run.killed_at
    joined["from_event_s"] = joined["first_step_after_at"] - run.returned_at
    return [lost, joined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rendezvous-timeout", type=int, default=2)
    parser.add_argument("--replan-budget", type=float, default=2.0)
    args = parser.parse_args()
    print(f"elastic switches on this machine ({os.cpu_count()} cores): small GPT dp2 x tp2 on 2 nodes x 2 gloo "
          f"ranks, node 1 killed after step {KILL_AFTER} and started again once node 0 logged step {RETURN_AFTER} "
          f"alone, --rendezvous-timeout {args.rendezvous_timeout} --replan-budget {args.replan_budget:g}")
    for i in range(args.repeats):
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="autopar-elastic-bench-") as d:
            switches = one(Path(d), args.rendezvous_timeout, args.replan_budget)
        print(f"repeat {i + 1} (load {load:.1f} before):")
        for s in switches:
            p = s["predicted_switch_s"]
            restart = "n/a" if p["restart_s"] is None else f"{p['restart_s']:.2f}"
            event = "the SIGKILL" if s["reason"] == "node lost" else "the test's start of the node"
            start = "the failure" if s["reason"] == "node lost" else "the node's launch"
            print(f"  {s['reason']}: {s['old_layout']} -> {s['new_layout']}, steps lost {s['steps_lost']}")
            print(f"    predicted {p['total']:.2f} s = rendezvous {p['rendezvous_s']:.2f} + re-plan "
                  f"{p['replan_s']:.2f} + restart {restart}")
            print(f"    measured  {s['measured_switch_s']:.2f} s from {start} to the first step after "
                  f"({s['from_event_s']:.2f} s from {event}); the re-plan took {s['replan_measured_s']:.2f} s")
        sys.stdout.flush()
        time.sleep(1)


if __name__ == "__main__":
    main()
