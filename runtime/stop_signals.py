"""SIGTERM, SIGINT (Ctrl-C) and SIGHUP to a training rank: stop at a step boundary, resumable.

``autopar run`` forwards these signals to torchrun, which forwards them to every rank
(torch.distributed.elastic sends the signal it received to its workers, then waits for them
before killing them).  A rank must not die where the signal finds it -- mid-collective its
peers would hang or print "Connection closed by peer", mid-checkpoint the save would be lost.

``install()`` (called first thing in ``python -m autopar.runtime``) replaces the handlers:

* before the training loop (plan checks, model build, resume) a signal raises ``RunStopped``
  at once: nothing has been trained, there is nothing to save;
* once the rank is leaving (``ending()``: the run trained, failed or stopped, and the process
  group is being destroyed) it only records the signal too: torchrun sends SIGTERM to every
  rank when one exits with an error, and raising then, inside ``destroy_process_group``, would
  print a traceback after the failing rank's message;
* inside the loop (``in_loop()``) it only records the signal.  After each step every rank
  calls ``agreed_signal`` -- one all-reduce (MAX) of the signal number, outside the step's
  clock -- so all ranks see the request after the same step, even when the signal reached
  them a step apart.  The trainer then saves a checkpoint where ``--checkpoint-dir`` is given
  and raises ``RunStopped`` with the command that resumes.

``RunStopped`` is a ``BaseException`` (like ``KeyboardInterrupt``), so the model file's
error handling (``except Exception``) never swallows it.  The rank exits with 128 + the
signal number, the shell's convention for a process stopped by a signal.
"""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_state = {"signal": 0, "in_loop": False, "ending": False}


class RunStopped(BaseException):
    """The run was asked to stop by a signal; ``message`` says what was saved and how to resume."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _handler(signum, frame) -> None:
    if not _state["signal"]:
        _state["signal"] = signum
    if not _state["in_loop"] and not _state["ending"]:
        raise RunStopped(signum, f"stopped by {signal_name(signum)} before training began; nothing was trained "
                                 f"or saved.")


def term_when_parent_dies() -> None:
    """Ask the kernel to send this process SIGTERM when its parent dies (Linux ``prctl(2)``,
    ``PR_SET_PDEATHSIG`` = 1); elsewhere nothing.  A rank whose torchrun was killed outright
    then stops like one sent SIGTERM, instead of training on, orphaned."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def install() -> None:
    term_when_parent_dies()
    for sig in SIGNALS:
        try:
            signal.signal(sig, _handler)
        except (ValueError, OSError):       # not the main thread: leave the defaults
            pass


def in_loop(flag: bool) -> None:
    """Inside the loop a signal is only recorded; outside it stops the rank at once."""
    _state["in_loop"] = flag


def ending() -> None:
    """The rank is leaving (module docstring): from now on a signal is only recorded."""
    _state["ending"] = True


def received() -> int:
    return _state["signal"]


def agreed_signal(device) -> int:
    """The signal any rank received so far (0: none): the same answer on every rank."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([_state["signal"]], dtype=torch.int32, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
