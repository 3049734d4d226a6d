"""The text of a SLURM batch script that trains a plan: ``#SBATCH`` lines, then one ``srun``
task per node, each running torchrun with a c10d rendezvous.

What SLURM provides and the script relies on (SLURM's sbatch and srun manuals, "OUTPUT
ENVIRONMENT VARIABLES"): ``SLURM_JOB_ID`` (kept when the job is requeued, so a requeued job
meets at a rendezvous of the same id), ``SLURM_RESTART_COUNT`` (set once requeued: with the job
id, it lets rank 0 recognise the checkpoint lock of an earlier incarnation,
``runtime/checkpoint_lock.py``), ``SLURM_NNODES`` and
``SLURM_JOB_NODELIST`` (expanded to host names by ``scontrol show hostnames``; the first is
the rendezvous host), ``SLURM_CPUS_PER_TASK`` (which srun no longer inherits from sbatch since
SLURM 22.05, so the script passes it on).

The script checks that SLURM gave it the plan's node count (a plan is for a fixed number of
ranks; ``autopar replan`` makes one for another count) and exits 2 otherwise.  Each node runs
``python -m autopar.runtime.launch`` -- torchrun's own entry point with a one-line failure
message instead of its traceback (``runtime/launch.py``) -- with ``--nnodes $SLURM_NNODES``,
the plan's ranks per node, ``--rdzv-backend c10d``, the first host as ``--rdzv-endpoint`` and
the job id as ``--rdzv-id``; then ``-m autopar.runtime PLAN`` and the run's own options.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SlurmJob:
    """What the script says; every path already absolute."""
    python: str                         # the interpreter the nodes run (sys.executable here)
    nodes: int
    ranks_per_node: int
    gpus_per_node: int | None           # None: a CPU cluster (no --gpus-per-node line)
    cpus_per_task: int
    run_arguments: tuple[str, ...]      # PLAN and the run's options, as ``autopar.runtime`` takes them
    job_name: str
    log_pattern: str                    # --output (SLURM filename pattern: %x job name, %j job id)
    rdzv_port: int
    max_restarts: int = 0
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    requeue: bool = False
    stop_signal_s: int = 0              # SIGTERM this long before the time limit (0: none)
    env: dict[str, str] = field(default_factory=dict)
    header: tuple[str, ...] = ()        # comment lines: what wrote the script, for which plan


def sbatch_script(job: SlurmJob) -> str:
    """The batch script for ``job``: runs as it is under ``sbatch`` (or ``bash`` where ``srun``
    and ``scontrol`` are on PATH and SLURM's variables are set)."""
    q = shlex.quote
    sbatch = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.gpus_per_node is not None:
        sbatch.append(f"--gpus-per-node={job.gpus_per_node}")
    sbatch.append(f"--cpus-per-task={job.cpus_per_task}")
    for flag, value in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if value is not None:
            sbatch.append(f"--{flag}={value}")
    # a requeued job appends to the log of its earlier incarnation instead of truncating it
    sbatch += [f"--output={job.log_pattern}", "--open-mode=append"]
    sbatch.append("--requeue" if job.requeue else "--no-requeue")
    if job.stop_signal_s:
        # the ranks stop after the step in flight and checkpoint on SIGTERM (runtime/stop_signals.py)
        sbatch.append(f"--signal=TERM@{job.stop_signal_s}")
    lines = ["#!/bin/bash", *(f"# {h}" for h in job.header), *(f"#SBATCH {s}" for s in sbatch), "",
             "set -euo pipefail"]
    if job.env:
        lines.append("# from the cluster file's env")
        lines += [f"export {name}={q(value)}" for name, value in job.env.items()]
    torchrun = [q(job.python), "-m", "autopar.runtime.launch", "--nnodes", '"$SLURM_NNODES"',
                "--nproc-per-node", str(job.ranks_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f'"$RDZV_HOST:{job.rdzv_port}"', "--rdzv-id", '"$SLURM_JOB_ID"',
                "--max-restarts", str(job.max_restarts), "-m", "autopar.runtime",
                *(q(a) for a in job.run_arguments)]
    srun = ["srun", '--nodes="$SLURM_NNODES"', "--ntasks-per-node=1", '--cpus-per-task="$SLURM_CPUS_PER_TASK"',
            "--kill-on-bad-exit=1", *torchrun]
    lines += [
        "",
        f'if [ "${{SLURM_NNODES:-}}" != "{job.nodes}" ]; then',
        f'    echo "autopar: this job has ${{SLURM_NNODES:-no}} nodes; the plan runs on {job.nodes}. Submit it with '
        f'--nodes={job.nodes}, or make a plan for this node count with autopar replan." >&2',
        "    exit 2",
        "fi",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'RDZV_HOST="${HOSTS[0]}"',
        f'echo "autopar: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_NNODES nodes '
        f'(${{HOSTS[*]}}), {job.ranks_per_node} ranks each; rendezvous at $RDZV_HOST:{job.rdzv_port}"',
        "",
        " \\\n    ".join(_wrap(srun)),
        "",
    ]
    return "\n".join(lines)


def _wrap(words: list[str], width: int = 100) -> list[str]:
    """``words`` joined into lines of about ``width`` characters (continued with a backslash),
    broken only before a flag so that a flag and its value stay on one line."""
    out, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width and w.startswith("-"):
            out.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return out + [line]
