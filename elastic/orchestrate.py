"""``autopar run PLAN --checkpoint-dir CK --elastic``: train on the nodes there are, re-planning
when they change.

Every node runs the same command (``--rdzv-endpoint`` names node 0, which hosts the rendezvous
store).  Membership is torch's: each launch is one torchrun agent per node
(``autopar.elastic.agent``) with ``--nnodes MIN:MAX`` and torch's c10d rendezvous.  MAX is the
number of nodes the plan's cluster has; the first launch waits for all of them (MIN = MAX) up
to ``--start-timeout`` (torch's default join timeout, 600 s), a later one for ``--min-nodes``, and then ``--rendezvous-timeout``
more for the others (torch's ``last_call_timeout``) before it goes on with those that came.
The ranks of each round agree on the plan (``autopar.elastic.worker``): the current one, or a
re-plan through the planner for the round's node count (``autopar replan --nodes N``, the global
batch kept), and resume from the newest checkpoint.

This process only decides to launch again.  When a launch fails (ranks failed and torchrun's
``--max-restarts`` are spent -- a node that died takes its ranks' collectives down with it),
it records the failure (``CK/elastic/failure.json``) and launches again: the rendezvous then
holds the nodes that remain, and nodes that returned meanwhile.  While a launch runs, a node
that joins the rendezvous makes torch restart the round (a membership change), so it too is
taken in at once, through a re-plan.  It stops

* when a launch ends well (exit 0), or with a user error (2, 3) or a non-finite loss (4), or
  after a stop signal (128 + the signal): that launch's code;
* when fewer than ``--min-nodes`` nodes come to the rendezvous within ``--start-timeout`` (the
  first launch) or ``--rendezvous-timeout`` (a later one): exit 2;
* when a launch fails again without a checkpoint or a switch since the last failure (a failure
  that is not the cluster's): that launch's code.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from autopar.core.errors import UserError

# codes a launch ends with that are not a lost node: the run's own verdict (rank_errors)
_FINAL = {0, 2, 3, 4}
# the re-plan's search budget, seconds (autopar plan's default is 40; a switch waits for it)
DEFAULT_REPLAN_BUDGET_S = 20.0
# the first launch waits this long for all the plan's nodes: torch's c10d join_timeout default
# (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, RendezvousTimeout)
DEFAULT_START_TIMEOUT_S = 600
DEFAULT_RENDEZVOUS_TIMEOUT_S = 60      # whole seconds: torch's c10d rendezvous reads integers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.core import cli_types as T

    g = parser.add_argument_group("elastic (docs/runtime.md, 'Clusters that change')")
    g.add_argument("--elastic", action="store_true",
                   help="go on when nodes are lost: re-plan for the nodes that remain and resume from the newest "
                        "checkpoint (needs --checkpoint-dir; every node runs the same command)")
    g.add_argument("--min-nodes", type=T.positive, default=None, metavar="N",
                   help="with --elastic: stop (exit 2) rather than train on fewer than N nodes (default 1)")
    g.add_argument("--rendezvous-timeout", type=T.positive, default=None, metavar="SECONDS",
                   help=f"with --elastic: how long the rendezvous waits for a missing node before it goes on "
                        f"without it (default {DEFAULT_RENDEZVOUS_TIMEOUT_S:g})")
    g.add_argument("--start-timeout", type=T.positive, default=None, metavar="SECONDS",
                   help=f"with --elastic: how long the first rendezvous waits for all the plan's nodes before it goes "
                        f"on with those that came (default {DEFAULT_START_TIMEOUT_S}, torch's join_timeout)")
    g.add_argument("--replan-budget", type=T.positive_number, default=None, metavar="SECONDS",
                   help=f"with --elastic: the re-plan's search budget (default {DEFAULT_REPLAN_BUDGET_S:g})")


def _local_host(host: str) -> bool:
    """Whether torch's c10d rendezvous would host the store here (its rule:
    ``_matches_machine_hostname``)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(host)


def check_reachable(endpoint: str, timeout_s: float) -> None:
    """A rendezvous on another host must accept a connection within ``timeout_s``."""
    host, _, port = endpoint.rpartition(":")
    if _local_host(host):
        return
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise UserError(f"the rendezvous at {endpoint} (--rdzv-endpoint) could not be reached within "
                    f"--rendezvous-timeout {timeout_s:g} s ({last}). Start node 0 first -- it hosts the rendezvous "
                    f"-- and give every node its host:port; check the address and that the port is open.")


def _plan_shape(args: argparse.Namespace, plan) -> tuple[int, int]:
    """(ranks per node, nodes) of the plan's cluster."""
    from autopar.runtime.run_launch import plan_nodes

    shape = plan_nodes(plan)
    if shape is None:
        raise UserError(f"plan file {args.plan} does not name a cluster that loads (provenance.cluster_ref, written "
                        f"by 'autopar plan'), so --elastic cannot re-plan it for fewer nodes. Make the plan with "
                        f"'autopar plan MODEL --cluster CLUSTER' and run that.")
    name, counts = shape
    if len(set(counts)) > 1:
        raise UserError(f"plan file {args.plan} spreads its ranks unevenly over the nodes of cluster {name} "
                        f"({counts}); --elastic needs the same number of ranks on every node.")
    return counts[0], len(counts)


def _check_same_model(plan_path: str, plan, checkpoint_dir: Path) -> None:
    """The newest checkpoint's model fingerprint must be the plan's."""
    from autopar.elastic.switches import read_json
    from autopar.runtime.checkpointing import ELASTIC_DIR, MANIFEST, latest_checkpoint

    found = latest_checkpoint(checkpoint_dir)
    if found is None:
        return
    saved = (read_json(found[1] / MANIFEST) or {}).get("fingerprint")   # the ranks check the rest when they resume
    known = {plan.model.fingerprint}
    current = (read_json(checkpoint_dir / ELASTIC_DIR / "state.json") or {}).get("plan")
    if current:                                       # an elastic run that switched plans before
        from autopar.core.plan import load_plan

        with contextlib.suppress(UserError):
            known.add(load_plan(Path(current)).model.fingerprint)
    if saved is not None and saved not in known:
        raise UserError(f"plan file {plan_path} is for another "
                        f"model than the checkpoint {found[1]} under --checkpoint-dir (model fingerprint {saved}, "
                        f"the plan's {plan.model.fingerprint}). Give the plan of the run that saved it, or a "
                        f"new --checkpoint-dir.")


def main(args: argparse.Namespace) -> int:
    from autopar.elastic import switches
    from autopar.elastic.agent import RENDEZVOUS_FAILED
    from autopar.runtime.options import options_from_args
    from autopar.runtime.output_paths import check_output_paths
    from autopar.core.plan import load_plan
    from autopar.runtime.ports import free_port
    from autopar.runtime.run_launch import _call_and_report, runtime_arguments

    opts = options_from_args(args)
    if opts.checkpoint_dir is None:
        raise UserError("--elastic resumes from the newest checkpoint after a node is lost, so it needs "
                        "--checkpoint-dir DIR (and --checkpoint-every K, or a lost node costs every step since the "
                        "start).")
    if args.nnodes is not None:
        raise UserError("--nnodes and --elastic go apart: an elastic run takes the nodes that come to the rendezvous "
                        "(at most the plan's); give --min-nodes for the fewest it may train on.")
    timeout = args.rendezvous_timeout or DEFAULT_RENDEZVOUS_TIMEOUT_S
    start = args.start_timeout or DEFAULT_START_TIMEOUT_S
    budget = args.replan_budget or DEFAULT_REPLAN_BUDGET_S
    least = args.min_nodes or 1
    # the plan file alone (its model is captured by every rank, which report a bad one once, exit 2)
    plan = load_plan(Path(args.plan))
    per_node, max_nodes = _plan_shape(args, plan)
    if least > max_nodes:
        raise UserError(f"--min-nodes {least} is more than the {max_nodes} node(s) plan file {args.plan} runs on; "
                        f"an elastic run trains on at most the plan's nodes. Give --min-nodes {max_nodes} or less, "
                        f"or plan for a larger cluster.")
    ck = Path(opts.checkpoint_dir)
    _check_same_model(args.plan, plan, ck)
    endpoint = args.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    check_reachable(endpoint, timeout)
    state = switches.state_dir(ck)
    if not args.dry_run:                               # a dry run writes nothing
        check_output_paths(opts)
        state.mkdir(parents=True, exist_ok=True)
    args.measured = opts.measured_file                 # beside the given plan, not a re-plan
    if args.metrics is None:
        args.metrics = state / "metrics.jsonl"         # the steps the switches count
    run_args = runtime_arguments(args)
    from autopar.elastic.worker import NODE_ENV

    os.environ[NODE_ENV] = f"{socket.gethostname()}:{os.getpid()}"     # the workers' name for this node
    first, failed_before, mark = True, False, None
    while True:
        launched = time.time()
        low = max_nodes if first else least
        # torch's join_timeout bounds the whole rendezvous (dynamic_rendezvous._RendezvousJoinOp):
        # the wait for MIN nodes, then, where MIN < MAX, the last call for the others
        join = start if first else (timeout if low == max_nodes else 2 * timeout)
        # close_timeout: an agent leaving a rendezvous whose store died gives up after it
        conf = (f"join_timeout={join},last_call_timeout={timeout},close_timeout={timeout},"
                f"keep_alive_interval={switches.KEEP_ALIVE_INTERVAL_S},"
                f"keep_alive_max_attempt={switches.KEEP_ALIVE_MAX_ATTEMPT}")
        cmd = [sys.executable, "-m", "autopar.elastic.agent", "--nnodes", f"{low}:{max_nodes}",
               "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-id", f"autopar-elastic-{Path(args.plan).stem}", "--rdzv-conf", conf,
               "--max-restarts", str(args.max_restarts), "-m", "autopar.elastic.worker",
               "--state", str(state), "--checkpoint-dir", str(ck), "--metrics", str(args.metrics),
               "--measured", str(args.measured), "--max-nodes", str(max_nodes), "--rendezvous-timeout", f"{timeout:g}",
               "--replan-budget", f"{budget:g}", "--launched-at", repr(launched), "--", *run_args]
        if args.dry_run:
            print(shlex.join(cmd))
            return 0
        print(f"autopar run --elastic: launching on {low} to {max_nodes} node(s) of {per_node} rank(s): "
              f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
        failure: dict = {}
        code = _call_and_report(cmd, failure=failure)
        if code == RENDEZVOUS_FAILED:
            if first and least < max_nodes:
                print(f"autopar run --elastic: not all {max_nodes} node(s) came within {start} s; going on with "
                      f"at least --min-nodes {least}.", file=sys.stderr, flush=True)
                switches.record_failure(state, {"time": time.time(), "why": f"not all {max_nodes} node(s) came to "
                                                f"the rendezvous within --start-timeout {start} s"})
                first = False
                continue
            waited = f"--start-timeout {start}" if first else f"--rendezvous-timeout {timeout}"
            raise UserError(f"fewer than --min-nodes {low} node(s) came to the rendezvous at {endpoint} within "
                            f"{waited} s, so the run stops here; its newest checkpoint "
                            f"under {ck} is kept. Start the missing nodes (each runs this same command), lower "
                            f"--min-nodes, or wait longer ({waited.split()[0]}).")
        if code in _FINAL or code >= 128:
            return code
        progress = (switches.checkpoint_step(ck), len((switches.read_json(state / switches.STATE) or {})
                                                      .get("switches", [])))
        if failed_before and progress == mark:
            print(f"autopar run --elastic: the launch failed again (exit {code}) with no new checkpoint or node "
                  f"change since the last failure: stopping.", file=sys.stderr, flush=True)
            return code
        failed_before, mark, first = True, progress, False
        said = (str(failure.get("message") or "").strip().splitlines() or [""])[-1][:200]
        why = (f"ranks failed (exit {code}; first: rank {failure.get('rank', '?')}{': ' + said if said else ''}) "
               f"and torchrun's --max-restarts {args.max_restarts} were spent")
        switches.record_failure(state, {"time": failure.get("time", time.time()), "code": code, "why": why})
        print(f"autopar run --elastic: {why}; launching again with the nodes that remain.", file=sys.stderr,
              flush=True)
