"""A free local TCP port, for the rendezvous of a job started on this machine.

The operating system picks an unused port when a socket binds to port 0; the socket is closed
before the port is handed on, so another process could take it in between -- a race the callers
accept (torchrun's own ``--standalone`` picks its port the same way).
"""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
