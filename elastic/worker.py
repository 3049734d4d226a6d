"""``python -m autopar.elastic.worker ELASTIC_ARGS -- PLAN RUN_ARGS``: one rank of an elastic run.

torchrun starts it on every rank of a rendezvous round (``autopar.elastic.agent``).  Before
training, the round agrees on its plan through the agent's store (the rendezvous store, which
every rank reaches before any process group exists): each node's local rank 0 names its node
(host and the pid of its ``autopar run``) and the time its ``autopar run`` made this launch,
and the round's rank 0 decides (``switches.decide``: the current plan,
or a re-plan through the planner when the round's world size differs from it) and publishes
the plan file's path; the others wait for it.  Then every rank runs ``python -m
autopar.runtime`` with that plan and the run's own options, which resumes from the newest
checkpoint.  Rank 0 watches the metrics file for the first step after (the measured start-up
and switch time) and, when the run ends well, writes the switches into measured.json.

This module sits above both the planner and the runtime: the runtime never learns that a plan
was made again.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

#: the node's name, set by its ``autopar run --elastic`` (host and that process's pid: the same
#: across the node's launches)
NODE_ENV = "AUTOPAR_ELASTIC_NODE"
# how long the ranks wait for rank 0's decision (a re-plan is a planner search)
DECISION_TIMEOUT = timedelta(minutes=30)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autopar.elastic.worker")
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--measured", type=Path, required=True)
    p.add_argument("--max-nodes", type=int, required=True)
    p.add_argument("--rendezvous-timeout", type=float, required=True)
    p.add_argument("--replan-budget", type=float, required=True)
    p.add_argument("--launched-at", type=float, required=True)
    return p


def _store():
    import torch.distributed as dist

    from autopar.runtime.mesh import ATTEMPT_ENV

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=DECISION_TIMEOUT)
    return dist.PrefixStore(f"autopar/elastic/{os.environ.get(ATTEMPT_ENV, 'none')}", store)


def _log(msg: str) -> None:
    print(f"[autopar elastic] {msg}", flush=True)


def main(argv: list[str]) -> int:
    from autopar.core.errors import UserError
    from autopar.elastic import switches
    from autopar.runtime.rank_errors import report_failure

    started = time.time()
    split = argv.index("--")
    args, run_args = _parser().parse_args(argv[:split]), argv[split + 1:]
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world, nodes = int(os.environ["WORLD_SIZE"]), int(os.environ["GROUP_WORLD_SIZE"])
    store = _store()
    if local == 0:            # this node's name, and when its autopar run made the launch (a joining node's arrival)
        store.set(f"node/{os.environ['GROUP_RANK']}", json.dumps(
            {"name": os.environ.get(NODE_ENV) or socket.gethostname(), "launched_at": args.launched_at}))
    from autopar.runtime.checkpoint_lock import ELASTIC_RUN_ENV

    run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}@{args.checkpoint_dir.resolve()}"
    os.environ[ELASTIC_RUN_ENV] = run_id                  # the runtime records it in the checkpoint lock
    watcher = None
    if rank == 0:
        named = [json.loads(store.get(f"node/{i}").decode()) for i in range(nodes)]
        names = [n["name"] for n in named]
        switches.clear_earlier_round_lock(args.checkpoint_dir, run_id, _log)
        try:
            decision = switches.decide(
                directory=args.state, given_plan=Path(run_args[0]), checkpoint_dir=args.checkpoint_dir,
                metrics=args.metrics, world=world, nodes=names, max_nodes=args.max_nodes,
                rendezvous_timeout_s=args.rendezvous_timeout, budget_s=args.replan_budget,
                launched_at=args.launched_at, arrived={n["name"]: n["launched_at"] for n in named}, log=_log)
        except UserError as e:
            decision = {"error": True, "code": report_failure(e)}
        store.set("decision", json.dumps(decision))
        if "plan" in decision:
            watcher = switches.watch_first_step(args.state, args.metrics, decision["resume_step"], args.launched_at,
                                                started, decision.get("switch"), _log)
    else:
        decision = json.loads(store.get("decision").decode())
    if "plan" not in decision:
        return int(decision.get("code", 2))
    from autopar.runtime.__main__ import main as run_rank

    code = run_rank([decision["plan"], *run_args[1:]])
    if rank == 0 and code == 0:
        if watcher is not None:
            watcher.join(timeout=5)
        switches.add_to_measured(args.state, args.measured)
    return code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
