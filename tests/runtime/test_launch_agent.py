"""``autopar.runtime.launch``'s changes to torch's elastic agent, each against torch's own behaviour.

* A stop signal that lands while the agent's main thread is inside a logging call: with torch's
  handler the ``SignalException`` is raised inside ``Handler.emit``, whose ``handleError``
  prints "--- Logging error ---" with a traceback and drops the signal (what Ctrl-C to
  ``autopar run`` sometimes printed: the agent logs "Received ... death signal" and "Sending
  process ... closing signal" as it stops, and a second signal landing in those lines hit it).
  The real race is a matter of microseconds; here the stream the handler writes to sends the
  signal itself, so it lands inside ``emit`` every time.  With ``launch.patch_torchelastic()`` the signal
  waits for the call to return and is raised there, and a further one is not raised again.
* After a worker failed, the agent closes the others with ``PContext.close()`` and no timeout
  (torch's 30 s); launch makes that default ``FAILED_RUN_GRACE_S``, and an explicit timeout (the
  agent's shutdown on a signal, which lets the ranks checkpoint) stays as given.
* torchrun's per-worker stop lines are dropped from its loggers.
"""
from __future__ import annotations

import inspect
import io
import logging
import os
import signal
import types

import pytest

from autopar.runtime import launch


class SignallingStream(io.StringIO):
    """A stream that sends this process SIGINT from inside its first write (inside ``emit``)."""

    def __init__(self):
        super().__init__()
        self.sent = False

    def write(self, text):
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)      # the handler runs at the next bytecode, still in emit
        return super().write(text)


@pytest.fixture
def agent(monkeypatch):
    """torch's classes and handlers as they were, restored after the test (patch_torchelastic() patches them)."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing import api as mp_api

    monkeypatch.setattr(logging.Handler, "handle", logging.Handler.handle)
    monkeypatch.setattr(mp_api.PContext, "close", mp_api.PContext.close)
    monkeypatch.setattr(mp_api, "_terminate_process_handler", mp_api._terminate_process_handler)
    for lg in (mp_api.logger, agent_api.logger):
        monkeypatch.setattr(lg, "filters", list(lg.filters))
    monkeypatch.setattr(launch, "_signals", {"count": 0, "logging": 0, "pending": None})
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield mp_api
    finally:
        signal.signal(signal.SIGINT, previous)


def _logger(stream) -> logging.Logger:
    lg = logging.getLogger("autopar.test.launch_agent")
    lg.handlers[:] = [logging.StreamHandler(stream)]
    lg.propagate = False
    lg.setLevel(logging.WARNING)
    return lg


def test_torchs_handler_inside_a_logging_call_prints_a_logging_error(agent, capfd):
    signal.signal(signal.SIGINT, agent._terminate_process_handler)
    stream = SignallingStream()
    _logger(stream).warning("Sending process %s closing signal %s", 1, "SIGINT")   # no exception escapes
    err = capfd.readouterr().err
    assert stream.sent and "--- Logging error ---" in err and "SignalException" in err


def test_the_signal_waits_for_the_logging_call_and_is_raised_once(agent, capfd):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    launch.patch_torchelastic()
    signal.signal(signal.SIGINT, agent._terminate_process_handler)   # what PContext.start installs
    assert agent._terminate_process_handler is launch.stop_handler
    stream = SignallingStream()
    lg = _logger(stream)
    with pytest.raises(SignalException) as e:
        lg.warning("Received %s death signal, shutting down workers", 2)
    assert e.value.sigval == signal.SIGINT
    assert stream.getvalue() == "Received 2 death signal, shutting down workers\n"   # the line was written whole
    lg.warning("Sending process %s closing signal %s", 7, "SIGINT")
    os.kill(os.getpid(), signal.SIGINT)                   # a second signal while the agent stops: not raised
    assert "Logging error" not in capfd.readouterr().err


def test_after_a_failure_the_others_get_the_short_grace(agent):
    launch.patch_torchelastic()
    calls = []
    fake = types.SimpleNamespace(_close=lambda death_sig, timeout: calls.append((death_sig, timeout)),
                                 _tail_logs=[], filtered_stdout=None, filtered_stderr=None)
    agent.PContext.close(fake)                            # the failure path: no timeout given
    agent.PContext.close(fake, signal.SIGINT, 30)         # the agent's shutdown on a signal
    assert calls == [(signal.SIGTERM, launch.FAILED_RUN_GRACE_S), (signal.SIGINT, 30)]
    # torch's failure path still closes without a timeout (else the default would not apply)
    assert "self.close()" in inspect.getsource(agent.SubprocessContext._poll)


def test_torchruns_stop_lines_are_dropped(agent):
    launch.patch_torchelastic()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    agent.logger.addHandler(handler)
    try:
        agent.logger.warning("Sending process %s closing signal %s", 1, "SIGTERM")
        agent.logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 1, 3, "python")
        agent.logger.warning("something else")
    finally:
        agent.logger.removeHandler(handler)
    assert stream.getvalue() == "something else\n"
