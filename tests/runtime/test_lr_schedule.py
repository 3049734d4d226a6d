"""The learning-rate schedule (runtime/lr_schedule.py) against its closed forms, the optimizer
flags, and the resume rule -- one process, no torch.distributed."""
from __future__ import annotations

import argparse
import math

import pytest

from autopar.core.errors import UserError
from autopar.runtime.lr_schedule import LrSchedule, lr_at, set_group_values

LR, FLOOR = 3e-4, 3e-5


def cosine(t, w, T):
    return FLOOR + (LR - FLOOR) * 0.5 * (1 + math.cos(math.pi * (t - w) / max(1, T - w)))


def linear(t, w, T):
    return LR - (LR - FLOOR) * (t - w) / max(1, T - w)


@pytest.mark.parametrize("w,T", [(0, 10), (3, 10), (10, 10), (4, 5)])
@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_at_matches_the_closed_forms(kind, w, T):
    for t in range(T):
        got = lr_at(t, lr=LR, schedule=kind, warmup=w, min_lr=FLOOR, steps=T)
        if t < w:
            want = LR * (t + 1) / w
        else:
            want = {"constant": LR, "linear": linear(t, w, T), "cosine": cosine(t, w, T)}[kind]
        assert got == pytest.approx(want, rel=1e-12, abs=0), (kind, w, T, t)


def test_named_points():
    # warm-up ends at the peak; a decay starts from the peak right after it and nears the floor at the end
    assert lr_at(4, lr=LR, schedule="cosine", warmup=5, min_lr=FLOOR, steps=20) == pytest.approx(LR)
    assert lr_at(5, lr=LR, schedule="cosine", warmup=5, min_lr=FLOOR, steps=20) == pytest.approx(LR)
    assert lr_at(5, lr=LR, schedule="linear", warmup=5, min_lr=FLOOR, steps=20) == pytest.approx(LR)
    # the half-way point of a cosine is the mean of peak and floor
    assert lr_at(15, lr=LR, schedule="cosine", warmup=5, min_lr=FLOOR, steps=25) == pytest.approx((LR + FLOOR) / 2)
    # W = 0: the first step is at the peak; T = W: every step warms up, the last at the peak
    assert lr_at(0, lr=LR, schedule="cosine", warmup=0, min_lr=FLOOR, steps=4) == pytest.approx(LR)
    assert [lr_at(t, lr=LR, schedule="linear", warmup=4, steps=4) for t in range(4)] == \
        pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR])


def test_settings_are_checked():
    with pytest.raises(UserError, match="--min-lr"):
        LrSchedule(lr=1e-4, schedule="cosine", min_lr=1e-3)
    with pytest.raises(UserError, match="--lr-schedule"):
        LrSchedule(lr=1e-4, schedule="step")


def test_resume_with_another_schedule_is_refused():
    saved = LrSchedule(lr=LR, schedule="cosine", warmup=10, min_lr=FLOOR, steps=100)
    saved.check_resume(saved.record(), "checkpoint X")             # the same: goes on
    with pytest.raises(UserError, match=r"--steps 100.*--steps 200.*decays over --steps") as e:
        LrSchedule(lr=LR, schedule="cosine", warmup=10, min_lr=FLOOR, steps=200).check_resume(saved.record(), "ck")
    assert e.value.exit_code == 2
    with pytest.raises(UserError, match="--lr-warmup"):
        LrSchedule(lr=LR, schedule="cosine", warmup=5, min_lr=FLOOR, steps=100).check_resume(saved.record(), "ck")
    # a constant schedule does not depend on --steps: training on longer resumes
    LrSchedule(lr=LR, steps=50).check_resume(LrSchedule(lr=LR, steps=20).record(), "ck")
    # a checkpoint written before schedules existed ran at a constant --lr
    LrSchedule(lr=LR, steps=50).check_resume(None, "ck")
    with pytest.raises(UserError):
        LrSchedule(lr=LR, schedule="cosine", steps=50).check_resume(None, "ck")


def test_set_group_values_reaches_every_group():
    import torch

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opts = [torch.optim.AdamW([{"params": a.parameters()}, {"params": b.parameters()}], lr=1.0)]
    set_group_values(opts, lr=0.25, betas=(0.5, 0.6))
    assert [(g["lr"], g["betas"]) for g in opts[0].param_groups] == [(0.25, (0.5, 0.6))] * 2


def _parse(*argv):
    from autopar.runtime.options import add_run_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return options_from_args(parser.parse_args(["plan.json", *argv]))


def test_optimizer_flags(capsys):
    opts = _parse("--steps", "50", "--lr-schedule", "cosine", "--lr-warmup", "5", "--min-lr", "1e-5",
                  "--grad-clip", "1.0", "--weight-decay", "0", "--betas", "0.9,0.999", "--timing-warmup", "3")
    assert (opts.lr_schedule, opts.lr_warmup, opts.min_lr, opts.grad_clip) == ("cosine", 5, 1e-5, 1.0)
    assert (opts.weight_decay, opts.betas, opts.timing_warmup_steps) == (0.0, (0.9, 0.999), 3)
    assert opts.schedule().at(49) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 44 / 45)))
    defaults = _parse()
    assert (defaults.lr_schedule, defaults.grad_clip, defaults.betas, defaults.weight_decay) == \
        ("constant", None, (0.9, 0.95), 0.1)
    assert "warmup-steps" not in capsys.readouterr().err


def test_warmup_steps_still_works_with_a_note(capsys):
    assert _parse("--warmup-steps", "4").timing_warmup_steps == 4
    err = capsys.readouterr().err
    assert err.count("--warmup-steps is now --timing-warmup") == 1


@pytest.mark.parametrize("bad", [["--betas", "0.9"], ["--betas", "1.2,0.9"], ["--grad-clip", "0"],
                                 ["--lr-schedule", "step"], ["--min-lr", "-1"]])
def test_bad_optimizer_flags_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        _parse(*bad)
    assert e.value.code == 2


def test_min_lr_above_lr_is_a_user_error():
    with pytest.raises(UserError, match="--min-lr"):
        _parse("--lr", "1e-4", "--min-lr", "1e-3", "--lr-schedule", "cosine")


def test_run_forwards_the_optimizer_flags():
    from autopar.runtime import run_cli, run_launch
    from autopar.runtime.options import options_from_args

    parser = argparse.ArgumentParser()
    run_cli.add_arguments(parser)
    args = parser.parse_args(["plan.json", "--lr-schedule", "linear", "--grad-clip", "2", "--betas", "0.8,0.9",
                              "--warmup-steps", "1"])
    options_from_args(args)
    argv = run_launch.runtime_arguments(args)
    assert argv[argv.index("--betas") + 1] == "0.8,0.9" and argv[argv.index("--grad-clip") + 1] == "2.0"
    assert argv[argv.index("--timing-warmup") + 1] == "1" and "--warmup-steps" not in argv
    from autopar.runtime.options import add_run_arguments, options_from_args

    p2 = argparse.ArgumentParser()
    add_run_arguments(p2)
    again = options_from_args(p2.parse_args(argv))
    assert (again.lr_schedule, again.grad_clip, again.betas, again.timing_warmup_steps) == ("linear", 2.0, (0.8, 0.9), 1)
