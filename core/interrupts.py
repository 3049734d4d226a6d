"""Ctrl-C as the CLI sees it: a real SIGINT, told apart from a ``KeyboardInterrupt`` that code
raised by itself (a model file's ``raise KeyboardInterrupt``).

``install_sigint_flag()`` (``autopar.cli``, main thread) puts a handler on SIGINT that records the signal and
then raises ``KeyboardInterrupt`` as Python's default handler does; ``sigint_received()`` says
whether one arrived.  A ``KeyboardInterrupt`` without a SIGINT is the model file's doing
(``autopar.core.modelfile.user_code`` reports it as the file's error).
"""
from __future__ import annotations

import signal
import threading

_state = {"sigint": False}


def _handler(signum, frame) -> None:
    _state["sigint"] = True
    raise KeyboardInterrupt


def install_sigint_flag() -> None:
    _state["sigint"] = False
    if threading.current_thread() is threading.main_thread():
        try:
            signal.signal(signal.SIGINT, _handler)
        except (ValueError, OSError):
            pass


def sigint_received() -> bool:
    return _state["sigint"]
