"""A signal to a rank: raised before training, recorded inside the loop and while the rank leaves.

The leaving case is the one torchrun makes when a peer exits with an error: it sends SIGTERM to
the other ranks, which may be destroying their process group by then; a raise there printed a
traceback after the failing rank's one-paragraph message (seen in
tests/integration/test_faults_runtime.py's last-stage loss case on a loaded machine).
"""
from __future__ import annotations

import os
import signal

import pytest

from autopar.runtime import stop_signals


@pytest.fixture
def handlers():
    old = {s: signal.getsignal(s) for s in stop_signals.SIGNALS}
    saved = dict(stop_signals._state)
    stop_signals.install()
    try:
        yield
    finally:
        stop_signals._state.clear()
        stop_signals._state.update(saved)
        for s, h in old.items():
            signal.signal(s, h)


def test_before_training_a_signal_stops_at_once(handlers):
    with pytest.raises(stop_signals.RunStopped) as e:
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.exit_code == 128 + signal.SIGTERM
    assert stop_signals.received() == signal.SIGTERM


def test_while_leaving_a_signal_is_only_recorded(handlers):
    stop_signals.ending()
    os.kill(os.getpid(), signal.SIGTERM)          # raises RunStopped without ending()
    assert stop_signals.received() == signal.SIGTERM
