"""Start torchrun for a plan (one node), or print the per-node commands: what ``autopar run``
does (``launch``), and ``run_plan``, the same launch as a function for other verbs
(``autopar plan --trial-steps``).

Single node (the plan's world size fits on this machine): checks the plan here first (so a
bad plan fails once, with exit code 2, before any process starts), then runs
``python -m torch.distributed.run --nproc-per-node W -m autopar.runtime PLAN ...`` and returns
its exit code.  With ``--nnodes N`` (N > 1) nothing is started: it prints the torchrun
command every node runs, with a c10d rendezvous at ``--rdzv-endpoint`` (host:port of node 0).

The node count defaults to the plan's: the cluster it was planned for (``provenance.cluster_ref``
and ``cluster_nodes``, written by ``autopar plan``) places rank r on the cluster's r-th device,
so a plan whose ranks span 4 nodes prints the command for those 4 nodes instead of starting
all its ranks on this host; an ``--nnodes`` that puts more ranks on a node than the cluster's
nodes hold is refused.  The processes themselves are torchrun's; autopar launches none of its own.
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import subprocess
import sys
from pathlib import Path

from autopar.core.errors import UserError
from autopar.core.rules import nvme_states
from autopar.runtime.options import add_run_arguments, options_from_args
from autopar.runtime.ports import free_port

_FORWARDED = ("steps", "lr", "seed", "timing_warmup_steps", "checkpoint_dir", "checkpoint_every", "measured", "init",
              "log_every", "keep_checkpoints", "metrics", "tensorboard", "progress",
              "init_from", "data", "data_dtype", "shuffle", "val_data", "eval_every", "eval_batches",
              "lr_schedule", "lr_warmup", "min_lr", "grad_clip", "weight_decay", "betas", "nvme_path")
# flags whose name is not the argument's with '-' for '_'
_FLAG_OF = {"timing_warmup_steps": "--timing-warmup"}


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of how ``autopar run`` starts torchrun (the run's own are runtime/options.py's)."""
    from autopar.core import cli_types as T

    g = parser.add_argument_group("launch")
    g.add_argument("--nnodes", type=T.positive, default=None,
                   help="nodes the plan runs on (default: the nodes of the cluster it was planned for; "
                        "1: start it here)")
    g.add_argument("--rdzv-endpoint", type=T.host_port, default=None, metavar="HOST:PORT",
                   help="c10d rendezvous address (node 0); default 127.0.0.1:<free port> on one node")
    g.add_argument("--max-restarts", type=T.non_negative, default=0,
                   help="torchrun restarts after a rank fails (resumes from the latest checkpoint)")
    g.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")


def runtime_arguments(args: argparse.Namespace) -> list[str]:
    out = [str(args.plan)]
    for name in _FORWARDED:
        value = getattr(args, name)
        if value is None:
            continue
        if isinstance(value, tuple):                  # --betas B1,B2
            value = ",".join(str(v) for v in value)
        out += [_FLAG_OF.get(name, f"--{name.replace('_', '-')}"), str(value)]
    if args.profile:
        out.append("--profile")
    return out


def torchrun_command(args: argparse.Namespace, nproc_per_node: int | str, rdzv_endpoint: str) -> list[str]:
    launch = ["--nnodes", str(args.nnodes), "--nproc-per-node", str(nproc_per_node),
              "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--max-restarts", str(args.max_restarts)]
    if args.nnodes > 1:
        launch += ["--rdzv-id", f"autopar-{Path(args.plan).stem}"]
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "autopar.runtime",
            *runtime_arguments(args)]


def run_plan(plan_path: str | Path, *, steps: int, timing_warmup_steps: int | None = None, profile: bool = False,
             log=None) -> int:
    """``autopar run PLAN --steps N [--timing-warmup W]`` as a function: the launch path other
    verbs reuse (``autopar plan --trial-steps``), so they start a plan exactly as a user would.

    Writes measured.json beside the plan; returns the exit code (a plan for several nodes prints
    its per-node commands and starts nothing).  ``profile``: ``--profile`` (the per-phase breakdown
    in measured.json).  ``log``: an open text file that takes torchrun's output and the command
    line instead of this process's stdout and stderr."""
    parser = argparse.ArgumentParser(prog="autopar run")
    add_run_arguments(parser)
    add_launch_arguments(parser)
    argv = [str(plan_path), "--steps", str(steps)]
    if timing_warmup_steps is not None:
        argv += ["--timing-warmup", str(timing_warmup_steps)]
    if profile:
        argv.append("--profile")
    return launch(parser.parse_args(argv), log=log)


def launch(args: argparse.Namespace, log=None) -> int:
    """What ``autopar run`` does with its parsed flags (``args``; see the module docstring): checks,
    then torchrun started here, or the per-node commands printed; returns the exit code.  ``log``:
    an open text file that takes torchrun's output and the command line."""
    from autopar.runtime.plan_check import check_plan

    from autopar.runtime.output_paths import check_output_paths

    opts = options_from_args(args)                    # argument errors before anything starts
    if args.nnodes is not None and args.nnodes < 1:
        raise UserError(f"--nnodes is {args.nnodes}; it must be a positive integer.")
    from autopar.runtime import data_check

    here = args.nnodes in (None, 1) and not args.dry_run   # started here (else only printed: the ranks check)
    data_check.check_options(opts)
    if here:
        data_check.check_files(opts)                  # a missing or truncated token file: before anything
    weights = None
    if opts.init_from is not None:                    # headers only: a missing or damaged file fails first
        from autopar.runtime.weights_in import WeightsFile

        weights = WeightsFile.open(opts.init_from)
    fresh_dir = opts.checkpoint_dir is not None and not Path(opts.checkpoint_dir).exists()
    if here:
        check_output_paths(opts)                      # before the plan check's capture: nothing is wasted
    try:
        checked = check_plan(Path(args.plan), None)
        if here:
            check_output_paths(opts)                  # again: the plan's model file is now known as an input
            data_check.check_for_plan(opts, checked)  # the token files' length and ids < vocabulary
            if any(nvme_states(lp.offload) for lp in checked.plan.layers):   # a missing or read-only folder
                from autopar.runtime.nvme_tier import check_nvme_path

                check_nvme_path(opts.nvme_path, f"plan file {args.plan}")
        if weights is not None:                       # names, shapes, dtypes, before any rank starts
            from autopar.runtime.materialize import build_meta_model
            from autopar.runtime.weights_in import check_weights

            check_weights(weights, build_meta_model(checked.model_file, dict(checked.plan.model.args)))
    except UserError:
        if fresh_dir:                                 # the empty folder check_output_paths made
            with contextlib.suppress(OSError):
                Path(opts.checkpoint_dir).rmdir()
        raise
    world = checked.plan.world_size
    layout = plan_nodes(checked.plan)                 # ranks per node of the planned cluster, or None
    if args.nnodes is None:
        args.nnodes = len(layout[1]) if layout else 1
    if world % args.nnodes:
        raise UserError(f"plan file {args.plan} needs {world} ranks, which do not divide over --nnodes "
                        f"{args.nnodes}; use a node count that divides {world}.")
    per_node: int | str = world // args.nnodes
    if layout is not None:
        cluster_name, counts = layout
        if per_node > max(counts) and args.nnodes != len(counts):
            raise UserError(f"plan file {args.plan} was planned for cluster {cluster_name}, whose nodes hold at most "
                            f"{max(counts)} of its ranks; --nnodes {args.nnodes} would start {per_node} on each. "
                            f"Use --nnodes {len(counts)} (the plan's nodes), or plan again for this launch.")
        if args.nnodes == len(counts) and len(set(counts)) > 1:
            per_node = "RANKS_ON_THIS_NODE"           # heterogeneous nodes: each starts its own count
    if args.nnodes > 1:
        endpoint = args.rdzv_endpoint or "NODE0_HOST:29500"
        cmd = torchrun_command(args, per_node, endpoint)
        each = (f"{per_node} processes each" if isinstance(per_node, int) else
                "RANKS_ON_THIS_NODE = " + ", ".join(f"{c} on node {i}" for i, c in enumerate(layout[1])))
        print(f"# plan file {args.plan} runs on {args.nnodes} nodes ({each}); autopar run starts nothing here. "
              f"Run this on each node; the rendezvous is node 0 at {endpoint}:")
        print(shlex.join(cmd))
        return 0
    endpoint = args.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    cmd = torchrun_command(args, per_node, endpoint)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    print(f"autopar run: {shlex.join(cmd)}", file=log or sys.stderr, flush=True)
    return _call_and_report(cmd, log)


def _call_and_report(cmd: list[str], log=None, failure: dict | None = None) -> int:
    """Run torchrun (through ``autopar.runtime.launch``, which drops its failure traceback); on
    failure, exit with the first failing rank's code and message (``autopar.runtime.rank_errors``).

    torchrun runs in a session of its own, and SIGTERM, SIGINT (Ctrl-C) and SIGHUP sent to
    ``autopar run`` are forwarded to it -- once, so torchrun passes them on to the ranks, which
    stop after the step in flight, checkpoint and say how to resume
    (``autopar.runtime.stop_signals``).  Were torchrun in this process's group, Ctrl-C would
    reach it twice (from the terminal and from here); were nothing forwarded, a SIGTERM to
    ``autopar run`` would leave torchrun and the ranks training on.  If ``autopar run`` itself
    is killed outright, the kernel sends torchrun SIGTERM (``PR_SET_PDEATHSIG``), and likewise
    each rank when torchrun dies.  ``failure``: a dict that takes the first failing rank's
    record (``rank_errors``: rank, exit code, message, time) when one was written."""
    import os
    import signal
    import tempfile
    import threading

    from autopar.runtime.rank_errors import ERROR_FILE_ENV, relaunch_exit

    cmd = [("autopar.runtime.launch" if c == "torch.distributed.run" else c) for c in cmd]
    with tempfile.TemporaryDirectory(prefix="autopar-run-") as d:
        error_file = os.path.join(d, "first_failure.json")
        proc = subprocess.Popen(cmd, env={**os.environ, ERROR_FILE_ENV: error_file}, start_new_session=True,
                                preexec_fn=_die_with_parent, stdout=log,
                                stderr=None if log is None else subprocess.STDOUT)
        forwarded = {"n": 0}

        def forward(signum, frame):
            forwarded["n"] += 1
            if forwarded["n"] == 1:
                print(f"autopar run: {signal.Signals(signum).name}: stopping the ranks after the step in flight.",
                      file=log or sys.stderr, flush=True)
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass

        # handlers can be set only from the main thread (a caller running trials elsewhere keeps its own)
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)} if main else {}
        try:
            code = proc.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        if failure is not None and code != 0:
            import json

            with contextlib.suppress(OSError, ValueError):
                failure.update(json.loads(Path(error_file).read_text()))
        return relaunch_exit(code, error_file, log)


def _die_with_parent() -> None:
    """In torchrun's process (after fork): SIGTERM it when ``autopar run`` dies."""
    from autopar.runtime.stop_signals import term_when_parent_dies

    term_when_parent_dies()


def plan_nodes(plan) -> tuple[str, list[int]] | None:
    """(cluster name, ranks on each node used) of the cluster the plan was made for, or None when
    the plan does not name a cluster that loads.  Rank r sits on the cluster's r-th device."""
    from autopar.core.cluster_file import load_cluster

    ref, nodes = plan.provenance.get("cluster_ref"), plan.provenance.get("cluster_nodes")
    if not isinstance(ref, str) or not (nodes is None or (isinstance(nodes, int) and not isinstance(nodes, bool))):
        return None
    try:
        cluster = load_cluster(ref, nodes=nodes)
    except UserError:
        return None
    counts = cluster.ranks_per_node(plan.world_size)
    return (cluster.name, counts) if counts is not None else None
