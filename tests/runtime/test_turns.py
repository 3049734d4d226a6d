"""A forward and a backward run in turns (runtime/turns.py): one at a time, handing over at each
``hand_over`` and at their ends, in one fixed order; DualPipeV's pairs run through it
(runtime/dualpipe_overlap.py, whose parity with the plain loop tests/integration/test_runtime_ep.py
checks on 4 gloo ranks)."""
from __future__ import annotations

import threading

import pytest
import torch

from autopar.runtime.turns import Turns, hand_over, in_pair


def _passes(f: int, b: int, log: list):
    def forward():
        for i in range(f):
            log.append(f"F{i}")
            hand_over()
        log.append("F end")

    def backward():
        for i in range(b):
            log.append(f"B{i}")
            hand_over()
        log.append("B end")
    return forward, backward


@pytest.mark.parametrize("f, b", [(3, 2), (3, 5), (2, 2), (0, 3), (3, 0)])
def test_passes_alternate_at_each_hand_over(f, b):
    """The forward first, then each hand-over gives the turn to the other pass while it has work:
    F0 B0 F1 B1 ...; a pass left alone runs to its end.  Hand-overs counted: 2 min(f, b), one
    more when the forward has more (its hand-over after the backward's last one still finds the
    backward running)."""
    log: list[str] = []
    turns = Turns()
    turns.run(*_passes(f, b, log))
    want: list[str] = []
    for i in range(max(f, b)):
        want += [f"F{i}"] * (i < f) + [f"B{i}"] * (i < b)
    assert [e for e in log if not e.endswith("end")] == want
    assert turns.handovers == 2 * min(f, b) + (f > b)
    assert not in_pair()


def test_hand_over_outside_a_pair_does_nothing():
    hand_over()
    assert not in_pair()


class _HandOver(torch.autograd.Function):
    """Identity both ways, handing over in forward and in backward (as apply_ep's exchange)."""

    @staticmethod
    def forward(ctx, x, log, name):
        ctx.log, ctx.name = log, name
        log.append(f"{name} forward on {threading.current_thread().name}")
        hand_over()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(f"{ctx.name} backward on {threading.current_thread().name}")
        hand_over()
        return grad, None, None


def _net(x, w, log, tag):
    h = _HandOver.apply(torch.tanh(x @ w), log, f"{tag}1")
    return (_HandOver.apply(torch.sin(h @ w), log, f"{tag}2") ** 2).sum()


def test_a_backward_in_turns_with_a_forward_matches_running_them_in_order():
    """The backward of one micro-batch (autograd on the second thread, handing over inside its
    backward functions) in turns with the forward of another: the same loss and gradients as
    the two run one after the other, the passes interleaved at every hand-over."""
    torch.manual_seed(0)
    w0 = torch.randn(4, 4)
    xa, xb = torch.randn(3, 4), torch.randn(3, 4)

    def sequential():
        w = w0.clone().requires_grad_()
        loss_a = _net(xa, w, [], "a")
        loss_b = _net(xb, w, [], "b")
        loss_a.backward()
        return loss_b.detach(), w.grad.clone()

    want_loss, want_grad = sequential()
    w = w0.clone().requires_grad_()
    log: list[str] = []
    loss_a = _net(xa, w, log, "a")
    log.clear()                                   # (its forward, outside the pair, handed over nothing)
    out = {}

    def forward():
        out["loss_b"] = _net(xb, w, log, "b")

    turns = Turns()
    turns.run(forward, lambda: loss_a.backward())
    assert torch.equal(out["loss_b"].detach(), want_loss)
    assert torch.equal(w.grad, want_grad)
    main = threading.main_thread().name
    assert log == [f"b1 forward on {main}", "a2 backward on autopar-pair-backward",
                   f"b2 forward on {main}", "a1 backward on autopar-pair-backward"]
    assert turns.handovers == 4


def test_an_error_in_either_pass_is_raised_after_both_stop():
    log: list[str] = []

    def failing():
        hand_over()
        raise ValueError("backward failed")

    with pytest.raises(ValueError, match="backward failed"):
        Turns().run(_passes(3, 0, log)[0], failing)
    assert log[-1] == "F end" and not in_pair()

    log.clear()

    def failing_forward():
        hand_over()
        raise ValueError("forward failed")

    with pytest.raises(ValueError, match="forward failed"):
        Turns().run(failing_forward, _passes(0, 3, log)[1])
    assert log[-1] == "B end" and not in_pair()


def test_each_pass_draws_from_its_own_random_state():
    """A backward that recomputes a forward sets the random state its forward had (as
    torch.utils.checkpoint does) and hands over inside it: the forward's draws around its own
    hand-overs continue its own stream, the recompute's its own -- what each draws when the two
    run one after the other -- and after the pair the state is the forward's."""
    def forward(out):
        out.append(torch.rand(3))
        hand_over()
        out.append(torch.rand(3))

    def backward(out):
        with torch.random.fork_rng():
            torch.manual_seed(5)                   # the recomputed forward's state
            out.append(torch.rand(3))
            hand_over()
            out.append(torch.rand(3))

    torch.manual_seed(0)
    want_f, want_b = [], []
    forward(want_f)
    after = torch.rand(1)
    backward(want_b)
    torch.manual_seed(0)
    got_f, got_b = [], []
    Turns().run(lambda: forward(got_f), lambda: backward(got_b))
    assert all(torch.equal(a, b) for a, b in zip(got_f + got_b, want_f + want_b)) and len(got_b) == 2
    assert torch.equal(torch.rand(1), after)
