"""``autopar launch PLAN --slurm -o job.sbatch [run options]``: write a batch script that trains
the plan where a scheduler runs jobs (SLURM), to submit with ``sbatch job.sbatch``.

The plan is checked first (``runtime/plan_check.check_plan``: the model file, its fingerprint,
the layout), then the cluster it was planned for (``core/plan_cluster.load_plan_cluster``, or
``--cluster``) gives the nodes, the ranks and GPUs per node, and the environment its nodes need
(the cluster file's ``env``: network interfaces, NCCL settings).  The run's own options are
``autopar run``'s (``runtime/options.add_run_arguments``) and reach the script as
``autopar run`` forwards them to torchrun (``run_launch.runtime_arguments``), with every path made
absolute, since the job starts in whatever folder SLURM gives it.  The script itself is
``runtime/slurm_script.sbatch_script``.

``--requeue`` needs ``--checkpoint-dir``: a requeued job starts the same command again, which
resumes from the newest checkpoint there (and takes over the lock its dead earlier incarnation
left, ``runtime/checkpoint_lock.py``).  Without a checkpoint folder the script is written with a
warning: a job SLURM restarts would train from step 0.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from autopar.core.errors import UserError
from autopar.runtime.options import add_run_arguments, options_from_args

#: SLURM's --time formats (sbatch manual, -t/--time): minutes, minutes:seconds,
#: hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds
_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE")
#: a value on an ``#SBATCH`` line: sbatch splits the line at white space, so none is allowed
_NAME = re.compile(r"[A-Za-z0-9_.,+@:=/-]+")
#: seconds between SIGTERM and the time limit (sbatch --signal): time for the step in flight and
#: a checkpoint; SLURM itself sends SIGTERM only KillWait (default 30 s, slurm.conf manual) before SIGKILL
DEFAULT_STOP_BEFORE_LIMIT_S = 120
#: the c10d rendezvous port when none is given: torch's own default for c10d
#: (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py, DEFAULT_PORT)
DEFAULT_RDZV_PORT = 29400


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.core import cli_types as T

    add_run_arguments(parser)
    g = parser.add_argument_group("batch script")
    g.add_argument("--slurm", action="store_true", help="write a SLURM batch script (sbatch)")
    g.add_argument("-o", "--output", type=Path, required=True, metavar="SCRIPT", help="the script to write")
    g.add_argument("--partition", default=None, help="#SBATCH --partition")
    g.add_argument("--time", default=None, help="#SBATCH --time: the job's time limit (e.g. 24:00:00, 2-00:00:00)")
    g.add_argument("--account", default=None, help="#SBATCH --account")
    g.add_argument("--job-name", default=None, help="#SBATCH --job-name (default: autopar-<plan file stem>)")
    g.add_argument("--requeue", action="store_true",
                   help="#SBATCH --requeue: SLURM may requeue the job (node failure, preemption); it resumes from "
                        "the newest checkpoint, so --checkpoint-dir is required")
    g.add_argument("--cpus-per-task", type=T.positive, default=None, metavar="N",
                   help="CPU cores for each node's task (default: one per rank on the node)")
    g.add_argument("--stop-before-limit", type=T.non_negative, default=DEFAULT_STOP_BEFORE_LIMIT_S, metavar="S",
                   help="with --time: SIGTERM the run S seconds before the limit, so it checkpoints and stops "
                        "(default: %(default)s; 0: no signal)")
    g.add_argument("--rdzv-port", type=T.count(1, 65535, "a port"), default=DEFAULT_RDZV_PORT, metavar="PORT",
                   help="c10d rendezvous port on the job's first node (default: %(default)s)")
    g.add_argument("--max-restarts", type=T.non_negative, default=0,
                   help="torchrun restarts after a rank fails, within the job (resumes from the latest checkpoint)")
    g.add_argument("--cluster", default=None, metavar="PATH_OR_NAME",
                   help="the cluster the plan runs on (default: the one it was planned for)")


def _check_flags(args: argparse.Namespace) -> None:
    if not args.slurm:
        raise UserError("autopar launch writes a batch script for a scheduler; name it: --slurm (the only one "
                        "supported). To train a plan on this machine, use 'autopar run'.")
    if args.time is not None and not _TIME.fullmatch(args.time):
        raise UserError(f"--time {args.time!r} is not a SLURM time limit; give minutes, hours:minutes:seconds or "
                        f"days-hours:minutes:seconds (e.g. 24:00:00 or 2-00:00:00).")
    for flag in ("partition", "account", "job_name"):
        value = getattr(args, flag)
        if value is not None and not _NAME.fullmatch(value):
            raise UserError(f"--{flag.replace('_', '-')} {value!r} cannot go on an #SBATCH line: use letters, "
                            f"digits and _ . , + @ : = / - only (no spaces).")
    if args.requeue and args.checkpoint_dir is None:
        raise UserError("--requeue needs --checkpoint-dir: a requeued job runs the script again, and only a "
                        "checkpoint folder lets it resume instead of training from step 0. Add --checkpoint-dir "
                        "DIR on a file system every node sees (and --checkpoint-every K).")


def _absolute_paths(args: argparse.Namespace) -> None:
    """Every path argument made absolute (the run options are ``Path``s; the plan is text)."""
    for name, value in vars(args).items():
        if isinstance(value, Path):
            setattr(args, name, Path(os.path.abspath(value.expanduser())))
    args.plan = os.path.abspath(os.path.expanduser(args.plan))


def _layout(plan, plan_path: str, cluster_arg: str | None) -> tuple[object, int, int]:
    """(cluster, nodes, ranks per node) of the plan on its cluster; a UserError where SLURM's
    one-task-per-node job cannot hold it (uneven nodes, node groups of several kinds)."""
    from autopar.core.plan_cluster import load_plan_cluster

    cluster = load_plan_cluster(plan, plan_path, cluster_arg)
    world = plan.world_size
    counts = cluster.ranks_per_node(world)
    if counts is None:
        raise UserError(f"plan file {plan_path} needs {world} ranks, but cluster {cluster.name} ({cluster.source}) "
                        f"has {cluster.world_size} devices. Pass the cluster it runs on with --cluster, or make a "
                        f"plan for this one with 'autopar replan {plan_path} --cluster ...'.")
    if len(counts) > cluster.groups[0].nodes or len(set(counts)) > 1:
        raise UserError(f"plan file {plan_path} puts {', '.join(map(str, counts))} ranks on the nodes of cluster "
                        f"{cluster.name}: a SLURM job of one task per node needs the same count on every node of "
                        f"one node group. Plan for a number of ranks that fills whole nodes of one group.")
    return cluster, len(counts), counts[0]


def main(args: argparse.Namespace) -> int:
    from autopar.core.output_file import check_writable, write_text_atomic
    from autopar.core.profile_schema import load_profile
    from autopar.runtime.plan_check import check_plan
    from autopar.runtime.run_launch import runtime_arguments
    from autopar.runtime.slurm_script import SlurmJob, sbatch_script

    options_from_args(args)                           # the run options' own checks
    _check_flags(args)
    out = check_writable(args.output, "-o")
    _absolute_paths(args)
    plan_path = Path(args.plan)
    plan = check_plan(plan_path, None).plan
    cluster, nodes, per_node = _layout(plan, args.plan, args.cluster)
    on_cpu = load_profile(cluster.groups[0].gpu).get("device") == "cpu"
    job_name = args.job_name or f"autopar-{plan_path.stem}"
    if not _NAME.fullmatch(job_name):
        job_name = "autopar"
    out = Path(os.path.abspath(out))
    job = SlurmJob(
        python=sys.executable, nodes=nodes, ranks_per_node=per_node,
        gpus_per_node=None if on_cpu else per_node, cpus_per_task=args.cpus_per_task or per_node,
        run_arguments=tuple(runtime_arguments(args)), job_name=job_name,
        log_pattern=str(out.parent / "%x-%j.out"), rdzv_port=args.rdzv_port, max_restarts=args.max_restarts,
        partition=args.partition, time=args.time, account=args.account, requeue=args.requeue,
        stop_signal_s=args.stop_before_limit if args.time is not None else 0,
        env=cluster.node_env(0),
        header=("written by autopar launch --slurm",
                f"plan {plan_path}: {plan.world_size} ranks on {nodes} node(s) x {per_node} of cluster "
                f"{cluster.name}",
                f"submit with: sbatch {out}"))
    write_text_atomic(out, sbatch_script(job))
    if args.checkpoint_dir is None:
        print("autopar launch: WARNING: no --checkpoint-dir. If SLURM restarts this job (a node failure, a "
              "preemption, a site that requeues by default), it trains again from step 0; add --checkpoint-dir "
              "DIR to resume instead.", file=sys.stderr)
    elif args.requeue and args.checkpoint_every == 0:
        print("autopar launch: note: --checkpoint-every is 0, so the run saves only when it ends or is stopped "
              "by a signal; a node that fails loses every step since the start. Add --checkpoint-every K.",
              file=sys.stderr)
    print(f"wrote {out}: {nodes} node(s) x {per_node} ranks"
          + ("" if on_cpu else f" ({per_node} GPUs each)") + f" of cluster {cluster.name}. Submit it with: "
          f"sbatch {shlex.quote(str(out))}")
    return 0
