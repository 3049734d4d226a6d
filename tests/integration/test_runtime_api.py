"""The Python API (``autopar.prepare``) inside a loop of the test's own, on its own token tensors,
against the plain PyTorch loop: dp (the model from a ``build_model`` function), tp with sequence
parallelism, pp (1F1B) stopped in the middle of the schedule and resumed under ZeRO-3, each with
a warm-up + cosine schedule, gradient clipping that bites, and non-default betas and weight
decay.  All in one torchrun launch (tests/api_worker.py).

Per case: the global losses, the gradient norms before clipping and the learning rates of every
step, and the final parameters (read back from the ``job.save`` checkpoint by DCP's own
converter), within 1e-5 of ``plain_loop.train_plain`` -- one process, ``clip_grad_norm_`` on the
whole model, the learning rate of the closed form below.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from runtime_support import (GLOBAL_BATCH, GPT, LOSS_ATOL, MODEL_ARGS, assert_matches_reference, failure_summary,
                             make_plan, torchrun)

WORKER = Path(__file__).resolve().parents[1] / "api_worker.py"
# 5 steps: 2 of warm-up, 3 on the cosine (the pp chain stops after step 3 and resumes for steps 4, 5)
STEPS = 5
LR, MIN_LR, WARMUP = 1e-3, 1e-4, 2
CLIP = 0.5                  # the gradient norms of this model and data are ~2: clipping bites at every step
BETAS, WEIGHT_DECAY = (0.8, 0.99), 0.05
OPTIONS = {"steps": STEPS, "lr": LR, "lr_schedule": "cosine", "lr_warmup": WARMUP, "min_lr": MIN_LR,
           "grad_clip": CLIP, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY}
CASES = {
    "ddp_functions": (dict(dp=2, micro_batch=2), {"functions": str(GPT)}),
    "tp2_sp": (dict(tp=2, micro_batch=4, sequence_parallel=True), {}),
    "pp2_1f1b_to_step3": (dict(pp=2, micro_batch=1, num_microbatches=4, schedule="1f1b"), {"stop_at": 3}),
    # resumes pp2_1f1b_to_step3's checkpoint in the middle of the schedule, under another layout
    "zero3_from_pp2": (dict(dp=2, micro_batch=2, zero=3), {"resume_of": "pp2_1f1b_to_step3"}),
}


def lr_closed_form(t: int) -> float:
    """Warm-up then cosine to MIN_LR over STEPS (the documented schedule, written out)."""
    if t < WARMUP:
        return LR * (t + 1) / WARMUP
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (t - WARMUP) / (STEPS - WARMUP)))


@functools.lru_cache(maxsize=None)
def plain(grad_clip: float | None = CLIP):
    from api_worker import own_batches
    from plain_loop import train_plain

    return train_plain(GPT, dict(MODEL_ARGS), GLOBAL_BATCH, STEPS, lr=LR,
                       batches=own_batches(MODEL_ARGS["vocab"], MODEL_ARGS["seq"], GLOBAL_BATCH, STEPS),
                       lr_at=lr_closed_form, grad_clip=grad_clip, betas=BETAS, weight_decay=WEIGHT_DECAY)


@pytest.fixture(scope="module")
def api_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    cases = []
    for name, (kw, extra) in CASES.items():
        extra = dict(extra)
        source = extra.pop("resume_of", name)
        cases.append({"name": name, "plan": str(make_plan(tmp / f"{name}.json", **kw)), "options": OPTIONS,
                      "measured": str(tmp / f"{name}.measured.json"), "checkpoint_dir": str(tmp / f"{source}.ckpt"),
                      **extra})
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    out = torchrun(2, str(WORKER), str(spec), timeout_s=300)
    assert out.returncode == 0, failure_summary(out.stdout + out.stderr)
    return {c["name"]: c for c in cases}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES))
def test_own_loop_matches_the_plain_loop(api_runs, name):
    case = api_runs[name]
    ref = plain()
    m = json.loads(Path(case["measured"]).read_text())
    first, last = m["first_step"], m["first_step"] + len(m["losses"])
    assert (first, last) == ((3, STEPS) if name == "zero3_from_pp2" else (0, case.get("stop_at", STEPS))), m
    assert m["lrs"] == pytest.approx([lr_closed_form(t) for t in range(first, last)], rel=1e-12, abs=0)
    for got, want in zip(m["grad_norms"], ref.grad_norms[first:last]):
        assert abs(got - want) <= 1e-5 * max(1.0, want), (name, m["grad_norms"], ref.grad_norms)
    diffs = [abs(a - b) for a, b in zip(m["losses"], ref.losses[first:last])]
    assert max(diffs) <= LOSS_ATOL, (name, m["losses"], ref.losses)
    if last == STEPS:      # the final parameters (the chain's after its resume)
        measured = Path(case["measured"]).with_suffix(".all.json")
        measured.write_text(json.dumps({"losses": ref.losses[:first] + m["losses"]}))
        assert_matches_reference(measured, Path(case["checkpoint_dir"]), ref, name, steps=STEPS)


@pytest.mark.multiproc
def test_rows_and_data_ranks(api_runs):
    for name, rows, ranks in (("ddp_functions", 2, 2), ("tp2_sp", 4, 1), ("pp2_1f1b_to_step3", 4, 1)):
        m = json.loads(Path(api_runs[name]["measured"]).read_text())
        assert (m["rows"], m["data_ranks"]) == (rows, ranks), (name, m)


def test_clipping_bites():
    """The clip changes the run: the reference without it ends elsewhere (so the parity above
    checks the clip), and every step's norm is above the threshold."""
    clipped, free = plain(), plain(None)
    assert min(clipped.grad_norms) > CLIP
    diff = max((clipped.params[n] - free.params[n]).abs().max().item() for n in clipped.params)
    assert diff > 100 * LOSS_ATOL, diff
