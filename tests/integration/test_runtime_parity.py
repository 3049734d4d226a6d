"""Parity: every parallel layout trains like the single-process reference (fp32, gloo).

Each case is a uniform plan for a 4-block GPT (global batch 4); all 2-rank cases run in one
torchrun launch (the worker runs the plans one after another in one process group), and each
must give, over 5 steps, the reference's losses within 1e-5 and, at the end, the reference's
parameters (read back from its final DCP checkpoint, consolidated by DCP's own converter).
"""
from __future__ import annotations

import pytest

from runtime_support import (PARAM_ATOL, ROOT, TP_STYLES, assert_matches_reference, make_plan, reference,
                             run_cases)

# name -> uniform_plan arguments (dp * micro_batch * num_microbatches = 4)
TWO_RANK_CASES = {
    "ddp": dict(dp=2, micro_batch=2),
    "zero1": dict(dp=2, micro_batch=2, zero=1),
    "zero2": dict(dp=2, micro_batch=2, zero=2),
    "zero3": dict(dp=2, micro_batch=2, zero=3),
    "tp2": dict(tp=2, micro_batch=4),
    "tp2_sp": dict(tp=2, micro_batch=4, sequence_parallel=True),
    "pp2_gpipe": dict(pp=2, micro_batch=2, num_microbatches=2, schedule="gpipe"),
    "pp2_1f1b": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="1f1b"),
    # fewer micro-batches than stages: torch's Schedule1F1B refuses it; it runs as GPipe
    "pp2_1f1b_one_microbatch": dict(pp=2, micro_batch=4, num_microbatches=1, schedule="1f1b"),
    "pp2_interleaved": dict(pp=2, micro_batch=2, num_microbatches=2, schedule="interleaved", virtual_stages=2),
    # the split-backward schedules (torch's ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
    # ScheduleDualPipeV), each under full recompute and FSDP (ZeRO-2: FSDP2 units per block at dp = 1);
    # zbv and dualpipev place the stages in a V, the first and the last on pp rank 0
    "pp2_interleaved_zb_full_zero2": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="interleaved-zb",
                                          virtual_stages=2, recompute="full", zero=2),
    "pp2_zbv_full_zero2": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="zbv", virtual_stages=2,
                               recompute="full", zero=2),
    "pp2_dualpipev_full_zero2": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="dualpipev",
                                     virtual_stages=2, recompute="full", zero=2),
    "recompute_full": dict(dp=2, micro_batch=2, zero=3, recompute="full"),
    "recompute_selective": dict(dp=2, micro_batch=2, recompute="selective"),
    "offload": dict(dp=2, micro_batch=2, zero=3, offload="cpu"),
    "grad_accum2_ddp": dict(dp=2, micro_batch=1, num_microbatches=2),
    "grad_accum2_fsdp": dict(dp=2, micro_batch=1, num_microbatches=2, zero=2),
    # the "never build the full model" init path (each rank fills only its half of every TP layer)
    "tp2_per_module_init": dict(tp=2, micro_batch=4),
    # the vocabulary split too: token embedding row-wise, LM head column-wise
    "tp2_vocab": dict(tp=2, micro_batch=4, tp_styles_per_layer={
        0: {"tok_emb": "rowwise"}, **{i: {f"blocks.{i - 1}.{k}": v for k, v in TP_STYLES.items()} for i in range(1, 5)},
        5: {"head": "colwise"}}),
}
RUN_OPTIONS = {"tp2_per_module_init": {"init": "per-module"}, "ddp": {"profile": True},
               "pp2_1f1b": {"profile": True}, "pp2_interleaved": {"profile": True}}
# the case that also writes --metrics (logging every 2 steps): under a pipeline the logging rank
# (rank 0, the first stage) logs the losses the last stage computed
METRICS_CASE = "pp2_gpipe"
# autopar run's optimizer options (the Trainer's path; the Python API's: test_runtime_api.py):
# warm-up + linear decay with clipping that bites (this model's gradient norms are ~2), on the
# ZeroRedundancyOptimizer (ZeRO-1) and on the vocabulary-parallel tp split
SCHEDULE = {"lr_schedule": "linear", "lr_warmup": 2, "min_lr": 2e-4, "grad_clip": 0.5, "weight_decay": 0.02,
            "betas": [0.85, 0.98]}
SCHEDULE_CASES = {
    "zero1_schedule_clip": dict(dp=2, micro_batch=2, zero=1),
    "tp2_vocab_schedule_clip": TWO_RANK_CASES["tp2_vocab"],
}


def linear_lr(t: int, steps: int = 5) -> float:
    """SCHEDULE's learning rate of step t, written out: warm-up, then linear to min_lr over the run."""
    lr, w, floor = 1e-3, SCHEDULE["lr_warmup"], SCHEDULE["min_lr"]
    return lr * (t + 1) / w if t < w else lr - (lr - floor) * (t - w) / (steps - w)
# gradient compression (the plan's grad_compression) on the DDP hooks and FSDP2's reduce_dtype,
# each against its own plain reduce (tests/grad_compression_reference.py)
COMPRESSION_CASES = {
    "ddp_bf16_wire": dict(dp=2, micro_batch=2, grad_compression="bf16"),
    "zero2_fp16_wire": dict(dp=2, micro_batch=2, zero=2, grad_compression="fp16"),
    "ddp_powersgd2": dict(dp=2, micro_batch=2, grad_compression="powersgd:2"),
}


# ZeRO-3 of a model whose every parameter has an odd dim 0 (uneven FSDP2 shards); checked for
# its model-state bytes only
MLP = ROOT / "examples" / "mlp.py"
MLP_ARGS = {"layers": 2, "hidden": 33, "inputs": 7, "outputs": 5}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity2")
    cases = []
    for name, kw in TWO_RANK_CASES.items():
        cases.append({"name": name, "plan": str(make_plan(tmp / f"{name}.json", **kw)),
                      "measured": str(tmp / f"{name}.measured.json"), "checkpoint_dir": str(tmp / f"{name}.ckpt"),
                      **RUN_OPTIONS.get(name, {})})
        if name == METRICS_CASE:
            cases[-1]["options"] = {"metrics_path": str(tmp / f"{name}.metrics.jsonl"), "log_every": 2}
    for name, kw in SCHEDULE_CASES.items():
        cases.append({"name": name, "plan": str(make_plan(tmp / f"{name}.json", **kw)), "options": SCHEDULE,
                      "measured": str(tmp / f"{name}.measured.json"), "checkpoint_dir": str(tmp / f"{name}.ckpt"),
                      "grad_norms": str(tmp / f"{name}.norms.json")})
    cases[0]["grad_norms"] = str(tmp / "ddp.norms.json")    # without clipping: the norm reduced with the losses
    for name, kw in COMPRESSION_CASES.items():
        cases.append({"name": name, "plan": str(make_plan(tmp / f"{name}.json", **kw)),
                      "measured": str(tmp / f"{name}.measured.json"), "checkpoint_dir": str(tmp / f"{name}.ckpt")})
    cases.append({"name": "zero3_uneven_mlp", "plan": str(_mlp_plan(tmp / "zero3_uneven_mlp.json")),
                  "measured": str(tmp / "zero3_uneven_mlp.measured.json"), "steps": 2})
    run_cases(2, cases, tmp, timeout_s=240)
    return {c["name"]: c for c in cases}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(TWO_RANK_CASES))
def test_two_rank_layout_matches_reference(two_rank_runs, name):
    from pathlib import Path

    case = two_rank_runs[name]
    ref = reference(init=case.get("init", "auto"))
    assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), ref, name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ddp", *SCHEDULE_CASES])
def test_schedule_clip_and_grad_norms_match_reference(two_rank_runs, name):
    """The learning-rate schedule, clipping, betas and weight decay of autopar run's options, and
    ``Trainer.last_grad_norm`` every step, against the plain loop (``clip_grad_norm_`` on the
    whole model, the schedule written out)."""
    import json
    from pathlib import Path

    from plain_loop import train_plain
    from runtime_support import GLOBAL_BATCH, GPT, MODEL_ARGS

    case = two_rank_runs[name]
    if name == "ddp":
        ref = reference()
    else:
        ref = train_plain(GPT, dict(MODEL_ARGS), GLOBAL_BATCH, 5, lr_at=linear_lr, grad_clip=SCHEDULE["grad_clip"],
                          betas=tuple(SCHEDULE["betas"]), weight_decay=SCHEDULE["weight_decay"])
        assert min(ref.grad_norms) > SCHEDULE["grad_clip"]           # the clip bites at every step
        assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), ref, name)
    norms = json.loads(Path(case["grad_norms"]).read_text())
    assert norms == pytest.approx(ref.grad_norms, rel=1e-5), (norms, ref.grad_norms)


@pytest.mark.multiproc
def test_per_module_init_differs_from_model_file_init(two_rank_runs):
    """The per-module init really is another init (so its parity case tests that path)."""
    a, b = reference(init="per-module"), reference()
    assert abs(a.losses[0] - b.losses[0]) > 1e-4


@pytest.mark.multiproc
def test_measured_json_fields_and_profile_breakdown(two_rank_runs):
    import json
    from pathlib import Path

    from runtime_support import MODEL_ARGS, graph

    case = two_rank_runs["ddp"]
    m = json.loads(Path(case["measured"]).read_text())
    assert m["world_size"] == 2 and m["device_kind"] == "cpu" and m["fingerprint"] == graph().fingerprint
    assert m["step_time_s"] > 0 and len(m["step_times_s"]) == 5
    assert m["samples_per_s"] == pytest.approx(4 / m["step_time_s"])
    assert m["tokens_per_s"] == pytest.approx(4 * MODEL_ARGS["seq"] / m["step_time_s"])
    assert len(m["memory_per_rank_bytes"]) == 2 and m["max_memory_bytes"] == max(m["memory_per_rank_bytes"]) > 0
    # forward, backward and optimizer are disjoint phases of each profiled step (steps 2..5)
    mean_step_s = _assert_breakdown_fits_step(m)
    assert m["comm_s"] <= mean_step_s * 1.05
    trace = Path(m["trace_file"])
    assert trace.is_file() and "traceEvents" in trace.read_text()[:2000]


@pytest.mark.multiproc
def test_metrics_file_has_the_logged_steps_figures(two_rank_runs):
    """--metrics: one line per logged step (2, 4 and the last, 5), whose loss and step time are
    measured.json's for that step, tokens/s = global batch x sequence / step time, no MFU (the
    plan names no cluster), and rank 0's peak memory so far, at most its peak over the run."""
    import json
    from pathlib import Path

    from runtime_support import GLOBAL_BATCH, MODEL_ARGS

    case = two_rank_runs[METRICS_CASE]
    m = json.loads(Path(case["measured"]).read_text())
    rows = [json.loads(line) for line in Path(case["options"]["metrics_path"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 5]
    for r in rows:
        assert r["loss"] == m["losses"][r["step"] - 1]
        assert r["step_time_s"] == m["step_times_s"][r["step"] - 1]
        assert r["tokens_per_s"] == pytest.approx(GLOBAL_BATCH * MODEL_ARGS["seq"] / r["step_time_s"], rel=1e-12)
        assert r["samples_per_s"] == pytest.approx(GLOBAL_BATCH / r["step_time_s"], rel=1e-12)
        assert r["mfu"] is None and r["lr"] == 1e-3
        assert 0 < r["peak_memory_bytes"] <= m["memory_per_rank_bytes"][0]
        # the logged step's gradient norm (over both stages, reduced with the losses) is the plain loop's
        assert r["grad_norm"] == pytest.approx(reference().grad_norms[r["step"] - 1], rel=1e-5)


def _mlp_plan(path):
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = capture_model_file(str(MLP), dict(MLP_ARGS), 1)
    save_plan(uniform_plan(model=ModelRef(str(MLP), dict(MLP_ARGS), "mlp", g.fingerprint), num_layers=len(g.layers),
                           dp=2, micro_batch=1, zero=3), path)
    return path


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["pp2_1f1b", "pp2_interleaved"])
def test_pipeline_profile_breakdown(two_rank_runs, name):
    """Pipeline stages label their own forward and backward compute: the breakdown is not 0,
    and forward, backward and optimizer (disjoint on one rank) fit in the step."""
    import json
    from pathlib import Path

    m = json.loads(Path(two_rank_runs[name]["measured"]).read_text())
    _assert_breakdown_fits_step(m)


# ---------------------------------------------------------------- model state per rank
FP32_BYTES = 4
ADAMW_STATE_PER_ELEMENT = 2      # exp_avg and exp_avg_sq (Loshchilov & Hutter 2019, Alg. 2)


def _state(two_rank_runs, name):
    import json
    from pathlib import Path

    rows = json.loads(Path(two_rank_runs[name]["measured"]).read_text())["model_state_bytes_per_rank"]
    assert [r["rank"] for r in rows] == [0, 1], rows
    return rows


def _fsdp_shard_numel(shape, rank: int, world: int) -> int:
    """FSDP2 shards dim 0 like ``torch.chunk``: ceil(dim0 / world) rows per rank, the last ranks
    taking what is left (possibly none)."""
    rows_per_rank = -(-shape[0] // world)
    rows = max(0, min(rows_per_rank, shape[0] - rank * rows_per_rank))
    rest = 1
    for d in shape[1:]:
        rest *= d
    return rows * rest


@pytest.mark.multiproc
def test_model_state_bytes_ddp_is_full_on_every_rank(two_rank_runs):
    shapes = [p.shape for p in reference().params.values()]
    numel = sum(p.numel() for p in reference().params.values())
    for r in _state(two_rank_runs, "ddp"):
        assert r["params_bytes"] == FP32_BYTES * numel, r
        assert r["grads_bytes"] == FP32_BYTES * numel, r
        assert r["optimizer_bytes"] == ADAMW_STATE_PER_ELEMENT * FP32_BYTES * numel, r
        # AdamW's step counter: one 0-d fp32 tensor per parameter tensor, reported apart
        assert r["optimizer_step_bytes"] == FP32_BYTES * len(shapes), r


@pytest.mark.multiproc
def test_model_state_bytes_zero1_partitions_only_the_optimizer(two_rank_runs):
    numel = sum(p.numel() for p in reference().params.values())
    rows = _state(two_rank_runs, "zero1")
    for r in rows:
        assert r["params_bytes"] == r["grads_bytes"] == FP32_BYTES * numel, r
        assert 0 < r["optimizer_bytes"] < ADAMW_STATE_PER_ELEMENT * FP32_BYTES * numel, r
    assert sum(r["optimizer_bytes"] for r in rows) == ADAMW_STATE_PER_ELEMENT * FP32_BYTES * numel


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["zero3", "zero3_uneven_mlp"])
def test_model_state_bytes_zero3_shards_everything(two_rank_runs, name):
    if name == "zero3":
        shapes = [p.shape for p in reference().params.values()]
    else:
        import torch

        from autopar.core.modelfile import load_model_file

        with torch.device("meta"):
            shapes = [p.shape for p in load_model_file(MLP).build(**MLP_ARGS).parameters()]
        assert all(s[0] % 2 for s in shapes)           # every shard really is uneven
    rows = _state(two_rank_runs, name)
    for rank, r in enumerate(rows):
        shard = sum(_fsdp_shard_numel(s, rank, 2) for s in shapes)
        assert r["params_bytes"] == FP32_BYTES * shard, (rank, r, shard)
        assert r["grads_bytes"] == FP32_BYTES * shard, (rank, r, shard)
        assert r["optimizer_bytes"] == ADAMW_STATE_PER_ELEMENT * FP32_BYTES * shard, (rank, r, shard)
    total = sum(s.numel() for s in shapes)
    assert sum(r["params_bytes"] for r in rows) == FP32_BYTES * total


@pytest.mark.multiproc
def test_model_state_bytes_tp_holds_gradients_at_their_parameters_shard(two_rank_runs):
    """Under TP every gradient is held at its parameter's shard -- the row-wise token embedding
    too, whose DTensor backward computes the full [vocab, hidden] gradient -- and the shards are
    smaller than the whole model."""
    numel = sum(p.numel() for p in reference().params.values())
    for r in _state(two_rank_runs, "tp2_vocab"):
        assert r["grads_bytes"] == r["params_bytes"] < FP32_BYTES * numel, r
        assert r["optimizer_bytes"] == ADAMW_STATE_PER_ELEMENT * r["params_bytes"], r


def _assert_breakdown_fits_step(m: dict) -> float:
    """Every phase of the --profile breakdown was seen, and forward + backward + optimizer
    (disjoint on one rank) fit in the mean profiled step; returns that mean step."""
    profiled = m["step_times_s"][m["warmup_steps"]:]
    assert m["profiled_steps"] == len(profiled)
    for key in ("fwd_s", "bwd_s", "comm_s", "optimizer_s"):
        assert m[key] > 0, (key, m)
    mean_step_s = sum(profiled) / len(profiled)
    assert m["fwd_s"] + m["bwd_s"] + m["optimizer_s"] <= mean_step_s * 1.05, (m, mean_step_s)
    return mean_step_s


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(COMPRESSION_CASES))
def test_compressed_reduce_matches_plain_reduce(two_rank_runs, name):
    """bf16 / fp16 on the wire: the plain loop whose gradients are rounded the same way before
    the average; PowerSGD (rank 2): Algorithm 1 of Vogels et al. 2019 as torch's hook runs it,
    step by step (plain averages for 2 steps, then 3 compressed ones with error feedback and warm
    start) -- both written in tests/grad_compression_reference.py.  Tolerance 1e-5 (LOSS_ATOL,
    PARAM_ATOL)."""
    from pathlib import Path

    from grad_compression_reference import compression_reference
    from runtime_support import GLOBAL_BATCH, GPT, MODEL_ARGS

    case = two_rank_runs[name]
    ref = compression_reference(GPT, dict(MODEL_ARGS), GLOBAL_BATCH, 5, COMPRESSION_CASES[name]["grad_compression"])
    # the compressed reduce trains measurably differently from the fp32 one (so parity tells them apart)
    plain = reference()
    assert max((ref.params[n] - plain.params[n]).abs().max().item() for n in plain.params) > 100 * PARAM_ATOL
    assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), ref, name)
