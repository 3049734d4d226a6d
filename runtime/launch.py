"""``python -m autopar.runtime.launch <torchrun arguments>``: torchrun, reporting a failure once.

``autopar run`` starts torchrun through this module.  It is torchrun's own entry point
(``torch.distributed.run.parse_args`` and ``run``, the same elastic agent) with four differences:

* when a worker fails, torchrun raises ``ChildFailedError`` and Python would print the
  launcher's traceback and a summary table after the workers' output, burying the failing
  rank's message (recorded by that rank, ``autopar.runtime.rank_errors``, and printed once by
  ``autopar run``).  Here that exception becomes the first failed worker's exit code, and one
  line only where no rank recorded a message (a rank killed outright);
* torchrun's per-worker log lines about stopping the others ("Sending process ... closing
  signal", "failed (exitcode ...)", "Received ... death signal", "Unable to shutdown process")
  are dropped: the run's one
  message says what failed, ``autopar run`` says what it does on a signal;
* after a worker fails, the others get ``FAILED_RUN_GRACE_S`` to leave after SIGTERM before
  SIGKILL, instead of torchrun's 30 s.  A rank that takes SIGTERM in Python leaves at once; one
  blocked in C++ waiting for the dead peer (a rendezvous, a store wait) cannot take it at all,
  so a longer grace only delays the end.  The grace of a stop asked by a signal (Ctrl-C,
  SIGTERM: the ranks finish the step and checkpoint) stays torchrun's ``--shutdown-timeout``;
* a stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT), which torchrun's handler turns into a
  ``SignalException`` wherever the agent is, waits while the agent is inside a logging call
  (raised there, the exception is caught by ``logging.Handler.handleError``, which prints a
  "--- Logging error ---" traceback and loses the signal) and is raised when the call returns;
  a further signal while the agent already stops the ranks is not raised again (it would cut
  their checkpoint short).  The stop ends this process with 128 + the signal number and no
  traceback: the ranks say what they saved (``autopar.runtime.stop_signals``).
"""
from __future__ import annotations

import logging
import os
import sys
import threading

# seconds a worker gets after SIGTERM when a peer failed (module docstring); autopar's choice
FAILED_RUN_GRACE_S = 5
# torchrun's log lines that repeat what the run's own message says (their format strings,
# torch/distributed/elastic/multiprocessing/api.py and agent/server/api.py)
_QUIET = ("Sending process %s closing signal %s", "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
          "Received %s death signal, shutting down workers",
          "Unable to shutdown process %s via %s, forcefully exiting via %s")

_signals = {"count": 0, "logging": 0, "pending": None}


def _signal_exception(signum: int):
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    sigval = signal.Signals(signum)
    return SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def stop_handler(signum: int, frame) -> None:
    """torchrun's termination handler (``_terminate_process_handler``), but never inside a logging
    call of the main thread, and once."""
    _signals["count"] += 1
    if _signals["count"] > 1:
        return                                   # the agent is already stopping the ranks
    if _signals["logging"]:
        _signals["pending"] = signum             # raised when the logging call returns
        return
    raise _signal_exception(signum)


def _handle_then_signal(handle):
    """``logging.Handler.handle`` that marks the main thread as logging while it runs."""
    def wrapped(self, record):
        if threading.current_thread() is not threading.main_thread():
            return handle(self, record)
        _signals["logging"] += 1
        try:
            return handle(self, record)
        finally:
            _signals["logging"] -= 1
            pending = _signals["pending"]
            if pending is not None and not _signals["logging"]:
                _signals["pending"] = None
                raise _signal_exception(pending)
    wrapped.__wrapped__ = handle
    return wrapped


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _QUIET


def _quick_close(close):
    """``PContext.close`` whose default grace (used by the agent when a worker failed) is
    ``FAILED_RUN_GRACE_S``; the agent's shutdown on a signal passes its own timeout."""
    def wrapped(self, death_sig=None, timeout=None):
        return close(self, death_sig, FAILED_RUN_GRACE_S if timeout is None else timeout)
    wrapped.__wrapped__ = close
    return wrapped


def patch_torchelastic() -> None:
    """Put the differences of the module docstring into torch's elastic agent (this process only)."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing import api as mp_api

    if not hasattr(logging.Handler.handle, "__wrapped__"):
        logging.Handler.handle = _handle_then_signal(logging.Handler.handle)
    if not hasattr(mp_api.PContext.close, "__wrapped__"):
        mp_api.PContext.close = _quick_close(mp_api.PContext.close)
    mp_api._terminate_process_handler = stop_handler
    for logger in (mp_api.logger, agent_api.logger):
        logger.addFilter(_Quiet())


def _recorded_failure() -> bool:
    """Whether a rank recorded its failure for ``autopar run`` (``rank_errors.ERROR_FILE_ENV``)."""
    from autopar.runtime.rank_errors import ERROR_FILE_ENV

    path = os.environ.get(ERROR_FILE_ENV)
    try:
        return bool(path) and os.path.getsize(path) > 0
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    patch_torchelastic()
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except SignalException as e:                   # the ranks were sent the same signal and have stopped
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if not _recorded_failure():
            print(f"autopar run: torchrun stopped the run: global rank {rank} exited first, with code "
                  f"{failure.exitcode}.", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
