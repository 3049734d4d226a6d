"""Float8 in the runtime (runtime/apply_fp8.py) on the CPU.

Without torchao: a plan asking for fp8 is refused before launch, naming the install command.
With torchao (the ``autopar[fp8]`` extra; skipped without it):
the conversion's filter converts exactly the plain ``nn.Linear`` modules of fp8 layers whose
dims divide by 16, and a one-rank run of fp8 plans through the runtime's own path trains as a
plain PyTorch loop with torchao's float8 linears does.

``torch._scaled_mm`` has a CPU kernel in torch 2.13, so torchao's float8 forward and backward
run here (slowly: ~1 s a step for the small GPT); the runtime's refusal of fp8 on a machine
without fp8 tensor cores is lifted for the run by tests/fp8_worker.py alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime_support import GPT, ROOT, make_plan, torchrun, worker_env  # noqa: E402

from autopar.cli import main as cli_main  # noqa: E402

# a 2-block GPT whose head (60 outputs) does not divide by 16: it stays bf16
ARGS = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 60, "dropout": 0.0}
GLOBAL_BATCH = 8
STEPS = 5


def _refused(tmp_path, capsys, monkeypatch, plan_path: Path, torchao: bool) -> str:
    import autopar.runtime.apply_fp8 as apply_fp8
    import autopar.runtime.fp8_check as fp8_check

    monkeypatch.setattr(fp8_check, "device_fp8_support", lambda: (True, "an fp8 GPU (test)"))
    monkeypatch.setattr(apply_fp8, "torchao_available", lambda: torchao)
    before = plan_path.read_text()
    rc = cli_main(["run", str(plan_path), "--steps", "1"])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "Traceback" not in err and "autopar run: " + sys.executable not in err   # nothing launched
    assert plan_path.read_text() == before and not (tmp_path / "measured.json").exists()
    return " ".join(err.split("error:", 1)[1].split())


def test_fp8_plan_refused_without_torchao(tmp_path, capsys, monkeypatch):
    path = make_plan(tmp_path / "fp8.json", dp=2, micro_batch=2, precision="bf16", layer_precision="fp8")
    message = _refused(tmp_path, capsys, monkeypatch, path, torchao=False)
    assert "torchao" in message and "pip install autopar[fp8]" in message and "--precision bf16" in message


def test_filter_converts_exactly_the_suitable_linears_of_fp8_layers():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from autopar.runtime.apply_fp8 import apply_fp8

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(32, 64)            # converted
            self.odd = nn.Linear(32, 30)           # 30 outputs: not a multiple of 16
            self.attn = nn.MultiheadAttention(32, 4)   # out_proj: an nn.Linear subclass

    with torch.device("meta"):                     # as the runtime converts: on the meta model
        model = nn.ModuleDict({"a": Block(), "b": Block()})
    record = apply_fp8(model, [(["a"], "fp8", "none"), (["b"], "bf16", "none")], "tensorwise", fsdp=True)
    assert record.converted == ["a.up"]
    assert isinstance(model["a"].up, Float8Linear)
    assert type(model["a"].odd) is nn.Linear and type(model["b"].up) is nn.Linear
    assert not isinstance(model["a"].attn.out_proj, Float8Linear)
    assert set(record.left_bf16) == {"a.odd", "a.attn.out_proj", "b.up", "b.odd", "b.attn.out_proj"}
    assert "divisible by 16" in record.left_bf16["a.odd"] and "subclass" in record.left_bf16["a.attn.out_proj"]
    assert record.left_bf16["b.up"] == "its layer's precision is bf16"
    assert record.fsdp_float8_all_gather and model["a"].up.config.enable_fsdp_float8_all_gather
    # split over tp = 2: both dims must divide by 32 (the shard's GEMM by 16)
    with torch.device("meta"):
        split = nn.ModuleDict({"a": Block()})
    record = apply_fp8(split, [(["a"], "fp8", "none")], "tensorwise", fsdp=True,
                       tp_split={"a.up": "colwise", "a.odd": "rowwise"}, tp=2)
    assert record.converted == ["a.up"] and "x tp = 32" in record.left_bf16["a.odd"]
    # FSDP2 over a tp model all-gathers bf16 (the scales' precompute cannot mix the dp and dp x tp meshes)
    assert not record.fsdp_float8_all_gather and not split["a"].up.config.enable_fsdp_float8_all_gather
    with torch.device("meta"):
        wide = nn.ModuleDict({"a": nn.ModuleDict({"up": nn.Linear(48, 64)})})
    record = apply_fp8(wide, [(["a"], "fp8", "none")], "tensorwise", fsdp=False, tp_split={"a.up": "colwise"}, tp=2)
    assert not record.converted and "x tp = 32" in record.left_bf16["a.up"]      # 48 in features
    assert apply_fp8(wide, [(["a"], "fp8", "none")], "tensorwise", fsdp=False).converted == ["a.up"]   # not split
    # rowwise: no float8 all-gather (torchao supports it for tensorwise scaling only)
    with torch.device("meta"):
        other = nn.ModuleDict({"a": Block()})
    assert not apply_fp8(other, [(["a"], "fp8", "none")], "rowwise", fsdp=True).fsdp_float8_all_gather


def _fsdp_reference(tmp_path: Path, args: dict, global_batch: int, steps: int, chunks: int) -> list[float]:
    """The losses of tests/fp8_fsdp_reference.py: torch FSDP2 and torchao's float8 recipe, no autopar."""
    from runtime_support import free_port

    out = tmp_path / f"fsdp_reference_{chunks}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "fp8_fsdp_reference.py"), str(out), str(steps),
                           json.dumps(args), str(global_batch), str(chunks), str(free_port())], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _plans(tmp_path: Path) -> list[Path]:
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = capture_model_file(str(GPT), dict(ARGS), 1)
    ref = ModelRef(file=str(GPT), args=dict(ARGS), name="gpt", fingerprint=g.fingerprint)
    out = []
    for name, kw in [("plain_rowwise", dict(zero=0, fp8_recipe="rowwise")),
                     ("plain_tensorwise", dict(zero=0, fp8_recipe="tensorwise")),
                     ("fsdp_tensorwise", dict(zero=3, fp8_recipe="tensorwise"))]:
        path = tmp_path / f"{name}.json"
        save_plan(uniform_plan(model=ref, num_layers=len(g.layers), micro_batch=GLOBAL_BATCH, precision="bf16",
                               layer_precision="fp8", **kw), path)
        out.append(path)
    return out


def _plain_float8_loop(recipe: str | None, args: dict = ARGS, global_batch: int = GLOBAL_BATCH, steps: int = STEPS,
                       chunks: int = 1) -> list[float]:
    """The reference: a plain loop (tests/plain_loop.py's model, batches and AdamW) whose linears
    whose dims divide by 16 are torchao's Float8Linear (``recipe``; None: no float8), the forward
    under bf16 autocast with fp32 weights, as the runtime runs a bf16 plan without FSDP.
    ``chunks`` > 1: the forward and backward of each of ``chunks`` equal row blocks of the batch
    in turn, gradients summed (the rows of one data-parallel rank or one micro-batch: torchao's
    dynamic scales are then each block's own amax, as on the ranks)."""
    from plain_loop import BETAS, EPS, LR, SEED, WEIGHT_DECAY, _loss, draw_batch, load

    module = load(GPT)
    torch.manual_seed(SEED)
    model = module.build_model(**args)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda mod, fqn: mod.out_features % 16 == 0 and
                                   mod.in_features % 16 == 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        inputs, target = draw_batch(module, global_batch, args, SEED, step)
        total = 0.0
        for i in range(chunks):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(module, model(*(x.chunk(chunks)[i] for x in inputs)), target.chunk(chunks)[i]) / chunks
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


@pytest.mark.multiproc
def test_float8_runs_match_a_plain_float8_loop(tmp_path):
    """Three fp8 plans (ZeRO-0 rowwise and tensorwise, ZeRO-3 tensorwise with the FSDP2 float8
    all-gather) in one worker process, 5 steps each.

    References: for ZeRO-0, a plain loop with torchao's Float8Linear under bf16 autocast and fp32
    master weights (the runtime's mixed precision without FSDP); for ZeRO-3, plain torch FSDP2
    with torchao's float8 all-gather (tests/fp8_fsdp_reference.py).  Each computes the same ops
    in the same order as the run: 1e-6 (measured: equal).  That the float8 GEMMs ran: the
    losses differ from the same loop without float8 by more than that.  (The loss of this small
    model at its init sits near ln(vocab) and moves little -- fp8 against bf16 is 5e-5 at the
    first step --, so only such tight tolerances tell a float8 path from another.)"""
    pytest.importorskip("torchao")
    plans = _plans(tmp_path)
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "fp8_worker.py"), str(out), str(STEPS),
                           *map(str, plans)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert "float8 (tensorwise): 8 linear(s) converted, 1 left in bf16; FSDP float8 all-gather on" in proc.stdout
    blocks = [f"blocks.{b}.{m}" for b in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    for name, row in got.items():
        assert sorted(row["float8"]["converted"]) == sorted(blocks), name
        assert list(row["float8"]["left_bf16"]) == ["head"] and "divisible by 16" in row["float8"]["left_bf16"]["head"]
        assert row["float8"]["fsdp_float8_all_gather"] is name.startswith("fsdp")
    rowwise, tensorwise, without = (_plain_float8_loop(r) for r in ("rowwise", "tensorwise", None))
    assert got["plain_rowwise.json"]["losses"] == pytest.approx(rowwise, abs=1e-6)
    assert got["plain_tensorwise.json"]["losses"] == pytest.approx(tensorwise, abs=1e-6)
    fsdp = _fsdp_reference(tmp_path, ARGS, GLOBAL_BATCH, STEPS, chunks=1)
    assert got["fsdp_tensorwise.json"]["losses"] == pytest.approx(fsdp, abs=1e-6)
    assert max(abs(a - b) for a, b in zip(got["plain_tensorwise.json"]["losses"], without)) > 1e-5
    assert max(abs(a - b) for a, b in zip(got["plain_rowwise.json"]["losses"], without)) > 1e-5


@pytest.mark.multiproc
def test_float8_on_two_ranks_matches_a_plain_float8_loop(tmp_path):
    """DDP (dp = 2), a 2-stage pipeline (1F1B, 2 micro-batches), FSDP2 ZeRO-3 with the float8
    all-gather over gloo (dp = 2, the scales' one all-reduce after each step) and tensor
    parallelism (tp = 2, the blocks split Megatron-style; with and without sequence parallelism)
    of the small GPT with every layer fp8, one torchrun launch, 3 steps.  Tensor parallelism's
    reference is plain DTensor TP of torchao's float8 linears (tests/fp8_tp_reference.py), the
    others' the plain loops above.  Each rank (micro-batch) scales its own
    rows, so the references run the batch as 2 row blocks (``chunks``; for FSDP2,
    tests/fp8_fsdp_reference.py); the runs then compute the same ops as their references, up to
    the order of the gradient sum over the ranks: 1e-6."""
    pytest.importorskip("torchao")
    from runtime_support import GLOBAL_BATCH as GB, MODEL_ARGS

    plans = [make_plan(tmp_path / "ddp.json", dp=2, micro_batch=2, precision="bf16", layer_precision="fp8"),
             make_plan(tmp_path / "pp.json", pp=2, micro_batch=2, num_microbatches=2, precision="bf16",
                       layer_precision="fp8"),
             make_plan(tmp_path / "fsdp.json", dp=2, micro_batch=2, zero=3, precision="bf16", layer_precision="fp8"),
             make_plan(tmp_path / "tp.json", tp=2, micro_batch=4, precision="bf16", layer_precision="fp8"),
             make_plan(tmp_path / "tpsp.json", tp=2, micro_batch=4, precision="bf16", layer_precision="fp8",
                       sequence_parallel=True)]
    out = tmp_path / "out.json"
    proc = torchrun(2, str(Path(__file__).parents[1] / "fp8_worker.py"), str(out), "3", *map(str, plans), timeout_s=600,
                    env=worker_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    for name, row in got.items():       # measured.json merges the ranks' records: every linear, head too
        assert len(row["float8"]["converted"]) == 17 and not row["float8"]["left_bf16"], name
    assert got["fsdp.json"]["float8"]["fsdp_float8_all_gather"] is True
    want = _plain_float8_loop("tensorwise", MODEL_ARGS, GB, 3, chunks=2)
    assert got["ddp.json"]["losses"] == pytest.approx(want, abs=1e-6)
    assert got["pp.json"]["losses"] == pytest.approx(want, abs=1e-6)
    fsdp = _fsdp_reference(tmp_path, MODEL_ARGS, GB, 3, chunks=2)
    assert got["fsdp.json"]["losses"] == pytest.approx(fsdp, abs=1e-6)
    ref = tmp_path / "tp_reference.json"
    proc = torchrun(2, str(Path(__file__).parents[1] / "fp8_tp_reference.py"), str(ref), "3", timeout_s=600,
                    env=worker_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tp = json.loads(ref.read_text())
    assert got["tp.json"]["losses"] == pytest.approx(tp, abs=1e-6)
    assert got["tpsp.json"]["losses"] == pytest.approx(tp, abs=1e-6)


@pytest.mark.multiproc
def test_float8_fsdp_checkpoint_resumes(tmp_path):
    """FSDP2 with the float8 all-gather keeps its weights as torchao's fp8-casting tensor
    subclass: a run checkpointed after 2 steps and resumed to 4 trains as 4 uninterrupted steps
    of the plain FSDP2 + torchao reference (1e-6, as above)."""
    pytest.importorskip("torchao")
    plan = _plans(tmp_path)[2]                  # fsdp_tensorwise
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FP8_WORKER_CHECKPOINTS=str(tmp_path / "ck"))
    runs = []
    for steps in (2, 4):
        out = tmp_path / f"out{steps}.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "fp8_worker.py"), str(out), str(steps),
                               str(plan)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs.append(json.loads(out.read_text())[plan.name]["losses"])
    assert "resumed from" in proc.stdout
    want = _fsdp_reference(tmp_path, ARGS, GLOBAL_BATCH, 4, chunks=1)
    assert runs[0] == pytest.approx(want[:2], abs=1e-6) and runs[1] == pytest.approx(want, abs=1e-6)
