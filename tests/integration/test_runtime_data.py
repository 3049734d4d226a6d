"""Training on a token file (``--data``) under every layout, evaluation (``--val-data``), and a
resume under another layout: each equal to a plain PyTorch loop on the test's own reading of
the file (tests/token_reference.py: numpy and the documented rule, no autopar).

One 2-rank torchrun launch (gloo, fp32) runs every case in turn: the 4-block test GPT under
dp 2 with ``--shuffle`` and ``--val-data``, ZeRO-3, tp 2 with sequence parallelism (and
``--val-data``), pp 2 under GPipe (with ``--shuffle`` and ``--val-data``) and 1F1B; the zoo's
Llama under cp 2 (with ``--val-data``) and the zoo's MoE under dp 2 x ep 2; and a chain: 2 steps
under pp 2 (GPipe), checkpointed, then resumed under ZeRO-3 for the last 2 (with ``--shuffle``
and ``--val-data``: the evaluation of step 2 comes back from the checkpoint).  The training file holds 7 GPT samples (plus a few tokens that
make no sample), so 4 steps of 4 rows run through three passes -- three different
permutations under ``--shuffle``; the validation file holds 5, so 2 evaluation batches wrap
around it.  Losses and final parameters (read back from the last DCP checkpoint by DCP's own
converter) must match the plain loop within 1e-5, and each evaluation the plain model's mean
loss on the validation rows after as many steps.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime_support import GPT, LOSS_ATOL, MODEL_ARGS, ROOT, assert_matches_reference, make_plan, run_cases

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plain_loop  # noqa: E402
import token_reference as ref_tokens  # noqa: E402

ZOO = ROOT / "tests" / "zoo"
LLAMA, MOE = ZOO / "hf_llama.py", ZOO / "moe.py"
ZOO_ARGS = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "seq": 8, "vocab": 64}
GLOBAL_BATCH = 4
STEPS = 4
SEQ = MODEL_ARGS["seq"]
TRAIN_TOKENS = 7 * SEQ + 1 + 5            # 7 GPT samples and 5 tokens that make none
VAL_TOKENS = 5 * SEQ + 1
SHUFFLE = 7
EVAL = {"val_data_path": "VAL", "eval_every": 2, "eval_batches": 2}

# name -> (model, uniform_plan arguments, ep, further options)
CASES = {
    "gpt_ddp_shuffle_val": ("gpt", dict(dp=2, micro_batch=2), 1, {"shuffle_seed": SHUFFLE, **EVAL}),
    # on a token file with a warm-up + cosine schedule and clipping that bites (runtime/lr_schedule.py)
    "gpt_zero3_cosine_clip": ("gpt", dict(dp=2, micro_batch=2, zero=3), 1,
                              {"lr_schedule": "cosine", "lr_warmup": 1, "min_lr": 1e-4, "grad_clip": 0.5}),
    "gpt_tp2_sp_val": ("gpt", dict(tp=2, micro_batch=4, sequence_parallel=True), 1, EVAL),
    "gpt_pp2_gpipe_shuffle_val": ("gpt", dict(pp=2, micro_batch=2, num_microbatches=2, schedule="gpipe"), 1,
                                  {"shuffle_seed": SHUFFLE, **EVAL}),
    "gpt_pp2_1f1b": ("gpt", dict(pp=2, micro_batch=1, num_microbatches=4, schedule="1f1b"), 1, {}),
    "llama_cp2_val": ("llama", dict(cp=2, micro_batch=4), 1, EVAL),
    "moe_dp2_ep2": ("moe", dict(dp=2, micro_batch=2), 2, {}),
}
# 2 steps under pp 2, then ZeRO-3 resumes the same folder for steps 3 and 4
RESUME = [("pp2_gpipe", dict(pp=2, micro_batch=2, num_microbatches=2, schedule="gpipe"), 2),
          ("zero3", dict(dp=2, micro_batch=2, zero=3), STEPS)]
RESUME_OPTIONS = {"shuffle_seed": SHUFFLE, **EVAL}
MODELS = {"gpt": (GPT, MODEL_ARGS), "llama": (LLAMA, ZOO_ARGS), "moe": (MOE, {})}
# a model file with its own data: examples/gpt.py and a batches() over the training file
OWN_BATCHES = """
import importlib.util

import numpy as np
import torch

_spec = importlib.util.spec_from_file_location("gpt_for_own_batches", {gpt!r})
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)
build_model, make_batch, loss_fn = _gpt.build_model, _gpt.make_batch, _gpt.loss_fn


def batches(batch_size, dp_rank, dp_size, seed, start_step, seq=16, **_ignored):
    tokens = np.fromfile({data!r}, dtype="<u2").astype(np.int64)
    n = (len(tokens) - 1) // seq
    step = start_step
    while True:
        rows = [(3 * (step * batch_size * dp_size + dp_rank * batch_size + r) + seed) % n for r in range(batch_size)]
        x = np.stack([tokens[j * seq:(j + 1) * seq] for j in rows])
        y = np.stack([tokens[j * seq + 1:(j + 1) * seq + 1] for j in rows])
        yield torch.from_numpy(x), torch.from_numpy(y)
        step += 1
"""


@functools.lru_cache(maxsize=None)
def _graph(model: str, micro_batch: int):
    from capture_memo import captured   # the ranks' plan checks read this capture (tests/capture_memo.py)

    path, args = MODELS[model]
    return captured(str(path), dict(args), micro_batch)


def _plan(path: Path, model: str, kw: dict, ep: int) -> Path:
    if model == "gpt":
        return make_plan(path, **kw)
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = _graph(model, kw["micro_batch"])
    file, args = MODELS[model]
    plan = uniform_plan(model=ModelRef(str(file), dict(args), model, g.fingerprint), num_layers=len(g.layers), **kw)
    plan = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, ep=ep))
    save_plan(plan, path)
    return path


def _options(options: dict, tmp: Path) -> dict:
    out = {"data_path": str(tmp / "train.bin"), **options}
    if out.get("val_data_path") == "VAL":
        out["val_data_path"] = str(tmp / "val.bin")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data2")
    rng = np.random.default_rng(43)
    ref_tokens.write_tokens(tmp / "train.bin", rng.integers(0, 64, TRAIN_TOKENS))
    ref_tokens.write_tokens(tmp / "val.bin", rng.integers(0, 64, VAL_TOKENS))
    specs = []
    for name, (model, kw, ep, options) in CASES.items():
        specs.append({"name": name, "model": model, "plan": str(_plan(tmp / f"{name}.json", model, kw, ep)),
                      "measured": str(tmp / f"{name}.measured.json"), "checkpoint_dir": str(tmp / f"{name}.ckpt"),
                      "steps": STEPS, "options": _options(options, tmp)})
    own = tmp / "own_batches.py"
    own.write_text(OWN_BATCHES.format(gpt=str(GPT), data=str(tmp / "train.bin")))
    MODELS["own"] = (own, MODEL_ARGS)
    specs.append({"name": "own_batches_dp2", "model": "own", "plan": str(_plan(tmp / "own.json", "own",
                                                                               dict(dp=2, micro_batch=2), 1)),
                  "measured": str(tmp / "own.measured.json"), "checkpoint_dir": str(tmp / "own.ckpt"),
                  "steps": STEPS})
    for name, kw, steps in RESUME:
        specs.append({"name": f"resume.{name}", "model": "gpt", "plan": str(_plan(tmp / f"resume.{name}.json", "gpt",
                                                                                 kw, 1)),
                      "measured": str(tmp / f"resume.{name}.measured.json"), "checkpoint_dir": str(tmp / "resume.ckpt"),
                      "steps": steps, "options": _options(RESUME_OPTIONS, tmp)})
    run_cases(2, specs, tmp, timeout_s=600)
    return {"tmp": tmp, **{s["name"]: s for s in specs}}


def _cosine_lr(t: int) -> float:
    """gpt_zero3_cosine_clip's learning rate, written out: 1 warm-up step, then cosine from 1e-3 to 1e-4."""
    lr, floor, w = 1e-3, 1e-4, 1
    return lr * (t + 1) / w if t < w else floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * (t - w) / (STEPS - w)))


@functools.lru_cache(maxsize=None)
def _plain(model: str, steps: int, shuffle: int | None, train: str, cosine_clip: bool = False):
    path, args = MODELS[model]
    seq = args.get("seq", 8)
    optimizer = {"lr_at": _cosine_lr, "grad_clip": 0.5} if cosine_clip else {}
    return plain_loop.train_plain(path, dict(args), GLOBAL_BATCH, steps,
                                  batches=ref_tokens.batches(Path(train), seq, GLOBAL_BATCH, shuffle), **optimizer)


def _check_val(case: dict, tmp: Path, shuffle: int | None, model_name: str = "gpt") -> None:
    measured = json.loads(Path(case["measured"]).read_text())
    got = measured["val_losses"]
    assert [s for s, _ in got] == [2, 4], got
    path, args = MODELS[model_name]
    module = plain_loop.load(path)
    for step, value in got:
        model = _plain(model_name, step, shuffle, str(tmp / "train.bin")).model
        want = ref_tokens.plain_val_loss(model, module.loss_fn, tmp / "val.bin", args.get("seq", 8), GLOBAL_BATCH,
                                         EVAL["eval_batches"])
        assert abs(value - want) <= LOSS_ATOL, (case["name"], step, value, want)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES))
def test_layout_on_a_token_file_matches_the_plain_loop(runs, name):
    case = runs[name]
    model, _, _, options = CASES[name]
    ref = _plain(model, STEPS, options.get("shuffle_seed"), str(runs["tmp"] / "train.bin"), "grad_clip" in options)
    if "grad_clip" in options:
        assert min(ref.grad_norms) > options["grad_clip"], ref.grad_norms    # the clip bites at every step
    if model == "moe":
        # the router's near-tie elements are checked by test_runtime_ep.py's own bound; the losses here
        losses = json.loads(Path(case["measured"]).read_text())["losses"]
        assert max(abs(a - b) for a, b in zip(losses, ref.losses)) <= LOSS_ATOL, (losses, ref.losses)
    else:
        assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), ref, name, steps=STEPS)
    if "val_data_path" in options:
        _check_val(case, runs["tmp"], options.get("shuffle_seed"), model)


@pytest.mark.multiproc
def test_resume_under_another_layout_reads_the_batches_of_an_uninterrupted_run(runs):
    last = runs["resume.zero3"]
    measured = json.loads(Path(last["measured"]).read_text())
    assert measured["first_step"] == 2, measured["first_step"]              # it resumed
    ref = _plain("gpt", STEPS, SHUFFLE, str(runs["tmp"] / "train.bin"))
    assert_matches_reference(Path(last["measured"]), Path(last["checkpoint_dir"]), ref, "resume", steps=STEPS)
    _check_val(last, runs["tmp"], SHUFFLE)                   # the evaluation of step 2 came from the checkpoint
    latest = json.loads((Path(last["checkpoint_dir"]) / "latest.json").read_text())
    assert latest["data"]["step"] == STEPS and latest["data"]["samples_read"] == STEPS * GLOBAL_BATCH
    assert latest["data"]["shuffle_seed"] == SHUFFLE
    assert latest["data"]["file"]["bytes"] == TRAIN_TOKENS * 2 and latest["data"]["file"]["dtype"] == "uint16"


@pytest.mark.multiproc
def test_a_model_files_batches_feed_each_rank_its_rows(runs):
    """No --data: the model file's batches(batch_size, dp_rank, dp_size, seed, start_step) is read,
    each rank its own rows; the reference takes the global batch from the same function with one
    rank holding every row."""
    case = runs["own_batches_dp2"]
    path, args = MODELS["own"]
    module = plain_loop.load(path)

    def whole(step):
        x, y = next(module.batches(GLOBAL_BATCH, 0, 1, plain_loop.SEED, step, **args))
        return (x,), y

    ref = plain_loop.train_plain(path, dict(args), GLOBAL_BATCH, STEPS, batches=whole)
    assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), ref, "own_batches", steps=STEPS)
    latest = json.loads((Path(case["checkpoint_dir"]) / "latest.json").read_text())
    assert latest["data"]["source"] == "batches()"


@pytest.mark.multiproc
def test_shuffle_changes_the_batches(runs):
    """The shuffled runs really read other batches than the unshuffled ones (so their parity
    cases test the permutation)."""
    tmp = runs["tmp"]
    a = _plain("gpt", STEPS, SHUFFLE, str(tmp / "train.bin")).losses
    b = _plain("gpt", STEPS, None, str(tmp / "train.bin")).losses
    assert max(abs(x - y) for x, y in zip(a, b)) > 1e-3
