"""Two passes of one rank -- a micro-batch's forward and another's backward -- run in turns on
two threads, handing over at their communication points.

DeepSeek-V3's DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 3.2.1, Fig. 4)
pairs a forward chunk with a backward chunk so that each one's expert-parallel all-to-all runs
while the other computes.  ``Turns.run`` does that on the host: the forward runs on the calling
thread, the backward on a second one, and exactly one of them runs at a time.  A pass that has
just launched a collective (asynchronously) calls ``hand_over``: the other pass runs until its
own next launch (or its end) and hands back, and only then does the first one wait for its
result -- so the collective is in flight while the other pass computes.

Exactly one pass runs at a time, and they hand over only at ``hand_over`` calls and at their
ends, so each rank runs one fixed interleaving of the two passes, the same on every rank of a
group that runs the same pair: the collectives are launched in the same order on every rank
(a launch is matched by its order in the group), nothing the two passes share is touched by
both at once, and the result is the one of running them one after the other.  Each pass keeps its own random
state: a pass that hands over leaves the global generators' state with it and finds its own
again when it resumes (a recomputed forward in the backward sets the state its forward had,
torch.utils.checkpoint, and the forward's dropout must not draw from it); after the pair the
state is the forward's, as when the backward draws nothing outside such a recompute.  The forward keeps
the calling thread's thread-local state (autocast, grad mode, dispatch modes, context
parallelism's attention mode); the backward needs none of it (a recomputed forward restores
what it needs itself, torch.utils.checkpoint).  Outside ``Turns.run`` ``hand_over`` does
nothing.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

_current: "Turns | None" = None


def rng_state():
    """The global random generators' state: the CPU's and every CUDA device's."""
    return torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(state) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def hand_over() -> None:
    """Let the other pass of the running pair run until it hands back (no-op outside a pair)."""
    turns = _current
    if turns is not None:
        turns.hand_over()


def in_pair() -> bool:
    """Whether a pair is running in this process."""
    return _current is not None


class Turns:
    """One forward-backward pair's turn-taking (module docstring).  ``handovers`` counts the
    times a pass handed over while the other still had work."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = "forward"
        self._done: set[str] = set()
        self._forward_thread = threading.get_ident()
        self._rng: dict[str, object] = {}        # each pass's random state while the other runs
        self.handovers = 0

    def _role(self) -> str:
        # the backward may run on autograd's device threads (CUDA), so "not the forward's thread"
        return "forward" if threading.get_ident() == self._forward_thread else "backward"

    @staticmethod
    def _other(role: str) -> str:
        return "backward" if role == "forward" else "forward"

    def hand_over(self) -> None:
        me = self._role()
        other = self._other(me)
        with self._cond:
            if other in self._done:
                return
            self._rng[me] = rng_state()
            self._turn = other
            self.handovers += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == me or other in self._done)
            set_rng_state(self._rng[me])

    def _finish(self, role: str) -> None:
        with self._cond:
            self._rng[role] = rng_state()
            self._done.add(role)
            self._turn = self._other(role)
            self._cond.notify_all()

    def _wait_turn(self, role: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == role or self._other(role) in self._done)
            if role in self._rng:
                set_rng_state(self._rng[role])

    def run(self, forward: Callable[[], None], backward: Callable[[], None],
            backward_setup: Callable[[], None] = lambda: None) -> None:
        """``forward()`` on this thread and ``backward()`` on a second one, in turns, the forward
        first; ``backward_setup()`` runs on the second thread before its first turn (a device's
        current stream).  An error of either pass is raised here once both have stopped (a
        failed forward gives the backward a bounded time to stop: its collectives may wait on
        ranks that failed too)."""
        global _current
        if _current is not None:
            raise RuntimeError("a forward-backward pair is already running in this process")
        errors: list[BaseException] = []

        def second() -> None:
            try:
                backward_setup()
                self._wait_turn("backward")
                backward()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                errors.append(e)
            finally:
                self._finish("backward")

        _current = self
        thread = threading.Thread(target=second, name="autopar-pair-backward", daemon=True)
        try:
            thread.start()
            try:
                forward()
            finally:
                self._finish("forward")
            thread.join()
            set_rng_state(self._rng["forward"])
        except BaseException:
            thread.join(timeout=60.0)
            raise
        finally:
            _current = None
        if errors:
            raise errors[0]
