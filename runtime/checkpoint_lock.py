"""One run per checkpoint folder: ``--checkpoint-dir DIR`` is locked by the run that uses it.

Two runs saving into one folder overwrite each other's step folders and prune each other's
checkpoints (one died mid-save that way).  At start, before anything is read or written there,
rank 0 creates ``DIR/lock.json`` with ``O_CREAT | O_EXCL`` (an atomic create-if-absent on
POSIX file systems, NFS v3+ included) holding its pid, host, plan and start time; every rank
learns the verdict, so all of them refuse alike.  The run removes the lock when it ends, also
when it fails.

A lock already there is another run's, unless it is stale: its pid is this process (an earlier
run in the same process), or it names this host and no process has that pid any more (the
run was killed before it could remove it -- ``kill -9``, or torchrun restarting the group
after a rank died), or it was written by an earlier incarnation of the SLURM job this process
belongs to: the same ``SLURM_JOB_ID`` (kept by a requeue) and a lower ``SLURM_RESTART_COUNT``
(SLURM counts the requeues), whose processes are gone wherever they ran, since SLURM starts a
requeued job only once the previous incarnation has ended (sbatch manual, --requeue).  A stale
lock is taken over; a live one, or one from another host (whose processes cannot be seen from
here) that is not an earlier incarnation of this job, is refused with exit code 2 naming the
folder and the other run's pid and host.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from autopar.core.errors import UserError

LOCK = "lock.json"


class CheckpointLockError(UserError):
    """The checkpoint folder is in use by another run."""


SLURM_JOB_ENV = "SLURM_JOB_ID"     # set by SLURM in every process of a job; kept by a requeue
SLURM_RESTART_ENV = "SLURM_RESTART_COUNT"   # set by SLURM once a job is requeued: 1, 2, ...
ELASTIC_RUN_ENV = "AUTOPAR_ELASTIC_RUN"     # an elastic run's id (autopar run --elastic), recorded in the lock


def _slurm_restart() -> int:
    try:
        return int(os.environ.get(SLURM_RESTART_ENV) or 0)
    except ValueError:
        return 0


def _holder_record(plan_path: Path | str) -> dict:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "plan": str(plan_path),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if os.environ.get(SLURM_JOB_ENV):
        record["slurm_job"] = os.environ[SLURM_JOB_ENV]
        record["slurm_restart"] = _slurm_restart()
    if os.environ.get(ELASTIC_RUN_ENV):            # set by autopar.elastic.worker: it clears its own earlier rounds' locks
        record["elastic_run"] = os.environ[ELASTIC_RUN_ENV]
    return record


def read_holder(directory: Path) -> dict | None:
    try:
        data = json.loads((Path(directory) / LOCK).read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}                      # being written, or damaged: nobody we can name
    return data if isinstance(data, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:            # another user's process
        return True
    return True


def _stale(holder: dict) -> bool:
    here = holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)
    if here and (holder["pid"] == os.getpid() or not _pid_alive(holder["pid"])):
        return True
    job, restart = os.environ.get(SLURM_JOB_ENV), holder.get("slurm_restart", 0)
    return (bool(job) and holder.get("slurm_job") == job and isinstance(restart, int)
            and restart < _slurm_restart())


def _create(path: Path, record: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        path.unlink(missing_ok=True)
        raise CheckpointLockError(f"--checkpoint-dir {path.parent}: its lock file {path.name} cannot be written "
                                  f"({e.strerror or e}). Free space there or give another --checkpoint-dir.") from None
    return True


def acquire(directory: Path, plan_path: Path | str) -> str | None:
    """Lock ``directory`` for this process (it exists); returns a note when a stale lock was
    taken over.  Raises ``CheckpointLockError`` when another run holds it."""
    path = Path(directory) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    note = None
    for _ in range(3):                 # a stale lock removed under us by another starter: try again
        if _create(path, _holder_record(plan_path)):
            return note
        holder = read_holder(directory)
        if holder is None:
            continue
        if not _stale(holder):
            raise CheckpointLockError(_in_use(Path(directory), holder))
        note = _taken_over(path, holder)
        path.unlink(missing_ok=True)
    raise CheckpointLockError(_in_use(Path(directory), read_holder(directory) or {}))


def _taken_over(path: Path, holder: dict) -> str:
    where = "this host" if holder.get("host") == socket.gethostname() else holder.get("host", "?")
    job = holder.get("slurm_job")
    incarnation = (f", incarnation {holder.get('slurm_restart', 0)} of this SLURM job {job}"
                   if job and job == os.environ.get(SLURM_JOB_ENV) else "")
    return (f"took over {path}: the run that held it (pid {holder.get('pid', '?')} on {where}, started "
            f"{holder.get('started', '?')}{incarnation}) is no longer running")


def _in_use(directory: Path, holder: dict) -> str:
    who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (plan {holder.get('plan', '?')}, "
           f"started {holder.get('started', '?')})")
    here = holder.get("host") == socket.gethostname()
    if here:
        gone = f"If that process is not an autopar run, delete {directory / LOCK}."
    else:
        gone = (f"That host's processes cannot be checked from here: if that run has ended (its host crashed), "
                f"delete {directory / LOCK}.")
    return (f"--checkpoint-dir {directory} is in use by another run: {who}. Two runs saving into one folder "
            f"overwrite and prune each other's checkpoints, so this run did not start. Wait for that run to end, "
            f"or give this run another --checkpoint-dir. {gone}")


def release(directory: Path) -> None:
    """Remove the lock if this process holds it."""
    holder = read_holder(directory)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        (Path(directory) / LOCK).unlink(missing_ok=True)


def acquire_on_rank0(directory: Path, plan_path: Path | str) -> str | None:
    """``acquire`` on rank 0; every rank gets its verdict (collective).  Returns rank 0's note."""
    verdict: list = [None]
    if dist.get_rank() == 0:
        try:
            verdict = [("ok", acquire(directory, plan_path))]
        except CheckpointLockError as e:
            verdict = [("refused", str(e))]
    dist.broadcast_object_list(verdict, src=0)
    kind, text = verdict[0]
    if kind == "refused":
        raise CheckpointLockError(text)
    return text
