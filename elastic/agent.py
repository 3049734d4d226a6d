"""``python -m autopar.elastic.agent <torchrun arguments>``: one node's torchrun agent of an elastic run.

It is ``autopar.runtime.launch`` (torchrun's own agent, reporting a failure once) with three
additions for ``autopar run --elastic``:

* after every rendezvous the agent exports the rendezvous round to the workers it starts
  (``runtime/mesh.ATTEMPT_ENV``).  torchrun's restart count does not tell two rounds apart
  (a membership change restarts the workers without counting a restart, and each node counts
  its own restarts), but the workers of one round must agree on the store prefix of their
  process group; the round is the c10d rendezvous's shared state, the same on every node;
* every rendezvous round publishes the address of the store the workers bootstrap from.
  torch's c10d rendezvous, when the agents share their TCP store with the workers (its
  default), publishes it in a round's keys only at a node's first rendezvous
  (``DynamicRendezvousHandler.next_rendezvous`` keeps ``_bootstrap_store_info`` after that):
  when a node joins a running job, the node that stays rank 0 does not publish it for the new
  round and the newcomer waits for ``MASTER_ADDR`` until its store times out; a node that was
  rank 0 and is no longer keeps pointing its workers at its own store.  Here rank 0 publishes
  its store's address every round and the others read it every round
  (``RendezvousStoreInfo.build``, as torch does the first time);
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
# the attribute that marks torch's methods as wrapped here
_MARK = "_autopar_elastic"


def _round_of(handler) -> int | None:
    """The c10d rendezvous round the handler last joined (``DynamicRendezvousHandler``'s shared
    state), or None for another handler."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) else None


def _wrap_once(cls, name: str, wrap) -> None:
    """Replace ``cls.name`` by ``wrap(original)``, marked, unless it is already ours (torch's own
    methods may carry a ``__wrapped__`` -- its @prof -- so the mark is an attribute of our own)."""
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return
    wrapped = wrap(original)
    setattr(wrapped, _MARK, True)
    setattr(cls, name, wrapped)


def install_round_export() -> None:
    """Wrap the agent's ``_rendezvous`` so the workers it starts next carry the round."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    def wrap(original):
        def rendezvous(self, worker_group):
            original(self, worker_group)
            number = _round_of(worker_group.spec.rdzv_handler)
            os.environ[ATTEMPT_ENV] = f"round_{number}" if number is not None else \
                f"restart_{worker_group.spec.max_restarts - self._remaining_restarts}"
        return rendezvous

    _wrap_once(SimpleElasticAgent, "_rendezvous", wrap)


def install_store_info_every_round() -> None:
    """Wrap the c10d handler's ``next_rendezvous`` so each round publishes (rank 0) and reads (the
    others) the workers' bootstrap store address (module docstring)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    def wrap(original):
        def next_rendezvous(self):
            info = original(self)
            server = getattr(self, "_shared_tcp_store_server", None)
            if not self.use_agent_store or (info.rank == 0 and server is None):
                # torch's opt-out (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) publishes a new address every round itself
                return info
            fresh = RendezvousStoreInfo.build(info.rank, info.store, local_addr=self._this_node.addr,
                                              server_port=server.port if info.rank == 0 else None)
            self._bootstrap_store_info = fresh
            return RendezvousInfo(info.store, info.rank, info.world_size, fresh)
        return next_rendezvous

    _wrap_once(DynamicRendezvousHandler, "next_rendezvous", wrap)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    from autopar.runtime import launch

    install_round_export()
    install_store_info_every_round()
    try:
        return launch.main(argv)
    except (RendezvousTimeoutError, RendezvousConnectionError) as e:
        kind = "timed out" if isinstance(e, RendezvousTimeoutError) else "could not reach its store"
        print(f"autopar elastic agent: the rendezvous {kind}: {e}", file=sys.stderr, flush=True)
        return RENDEZVOUS_FAILED


if __name__ == "__main__":
    sys.exit(main())
