"""``python -m autopar.elastic.agent <torchrun arguments>``: one node's torchrun agent of an elastic run.

It is ``autopar.runtime.launch`` (torchrun's own agent, reporting a failure once) with two
additions for ``autopar run --elastic``:

* after every rendezvous the agent exports the rendezvous round to the workers it starts
  (``runtime/mesh.ATTEMPT_ENV``).  torchrun's restart count does not tell two rounds apart
  (a membership change restarts the workers without counting a restart, and each node counts
  its own restarts), but the workers of one round must agree on the store prefix of their
  process group; the round is the c10d rendezvous's shared state, the same on every node;
* a rendezvous that does not gather ``--nnodes``' minimum within its ``join_timeout``
  (torch's ``RendezvousTimeoutError``) or cannot reach the rendezvous store
  (``RendezvousConnectionError``) ends this process with ``RENDEZVOUS_FAILED`` and one line
  naming the endpoint, instead of torchrun's traceback.  ``autopar run --elastic`` turns it
  into its message (exit 2).
"""
from __future__ import annotations

import os
import sys

from autopar.runtime.mesh import ATTEMPT_ENV

#: this process's exit code when the rendezvous failed (the workers never started)
RENDEZVOUS_FAILED = 75


def _round_of(handler) -> int | None:
    """The c10d rendezvous round the handler last joined (``DynamicRendezvousHandler``'s shared
    state), or None for another handler."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) else None


def install_round_export() -> None:
    """Wrap the agent's ``_rendezvous`` so the workers it starts next carry the round."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    original = SimpleElasticAgent._rendezvous
    if hasattr(original, "__wrapped__"):
        return

    def rendezvous(self, worker_group):
        original(self, worker_group)
        number = _round_of(worker_group.spec.rdzv_handler)
        os.environ[ATTEMPT_ENV] = f"round_{number}" if number is not None else \
            f"restart_{worker_group.spec.max_restarts - self._remaining_restarts}"

    rendezvous.__wrapped__ = original
    SimpleElasticAgent._rendezvous = rendezvous


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    from autopar.runtime import launch

    install_round_export()
    try:
        return launch.main(argv)
    except (RendezvousTimeoutError, RendezvousConnectionError) as e:
        kind = "timed out" if isinstance(e, RendezvousTimeoutError) else "could not reach its store"
        print(f"autopar elastic agent: the rendezvous {kind}: {e}", file=sys.stderr, flush=True)
        return RENDEZVOUS_FAILED


if __name__ == "__main__":
    sys.exit(main())
