"""Micro-batch sizes a model cannot take are left out of the search, with the reason.

The zoo's ResNet-18 (BatchNorm, 1x1 feature maps in its last stage on 32x32 images) cannot
train on one sample per micro-batch; every other size trains.  ``autopar plan`` plans it
without that size and says why in ``left out``; a fixed ``--micro-batch 1`` or a global batch
of one sample is refused with the reason (exit 2, no plan written); a model whose forward
fails at every size still gets the model-file error.  (The plan's run matches the plain loop:
tests/integration/test_zoo_plan_run.py.)
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESNET = str(ROOT / "tests" / "zoo" / "resnet18_bn.py")
BATCH_NORM_ERROR = "Expected more than 1 value per channel when training"


def _plan(tmp_path: Path, *extra: str, model: str = RESNET) -> tuple[int, Path]:
    from autopar.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", model, "--cluster", "local-cpu", "--time-budget", "2", "-o", str(out), "--json", *extra])
    return rc, out


def test_refused_sizes_are_the_ones_the_forward_fails_at():
    """On meta, the ResNet fails at one sample only; a model without BatchNorm at no size."""
    from autopar.core.micro_batch_probe import refused_sizes
    from autopar.core.modelfile import load_model_file

    got = refused_sizes(load_model_file(RESNET), {}, 8, [1, 2, 4, 8, 16])
    assert list(got) == [1] and BATCH_NORM_ERROR in got[1] and "make_batch(1)" in got[1], got
    gpt = load_model_file(ROOT / "examples" / "gpt.py")
    assert refused_sizes(gpt, {"layers": 2, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64}, 8, [1, 2, 4]) == {}


def test_batch_norm_resnet_plans_without_one_sample_micro_batches(tmp_path, capsys):
    """The ResNet plans (exit 0) at a micro-batch of 2 or more, runner-ups included, and the
    plan's ``left out`` names micro-batch 1 with BatchNorm's error; the other kinds stay."""
    rc, out = _plan(tmp_path, "--global-batch", "8")
    printed = json.loads(capsys.readouterr().out)
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["micro_batch"] >= 2
    assert all("micro-batch 1 x" not in r["difference"] for r in printed["runner_ups"]), printed["runner_ups"]
    left = {x["kind"]: x["reason"] for x in plan["provenance"]["left_out"]}
    assert BATCH_NORM_ERROR in left.get("micro-batch 1", ""), left
    assert not any(k.startswith("micro-batch") and k != "micro-batch 1" for k in left), left
    assert not any(k in left for k in ("pipeline", "ZeRO-2/3 (FSDP)", "recompute full")), left


def test_fixed_micro_batch_the_model_cannot_take_is_refused(tmp_path, capsys):
    rc, out = _plan(tmp_path, "--global-batch", "8", "--micro-batch", "1")
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and not out.exists()
    assert "--micro-batch 1" in err and BATCH_NORM_ERROR in err and "larger --micro-batch" in err, err
    rc, out = _plan(tmp_path, "--global-batch", "1")
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and not out.exists()
    assert "--global-batch 1" in err and BATCH_NORM_ERROR in err and "larger --global-batch" in err, err


def test_a_forward_that_fails_at_every_size_is_the_model_files_error(tmp_path, capsys):
    model = tmp_path / "broken_bn.py"
    model.write_text(Path(RESNET).read_text().replace(
        "        return self.fc(torch.flatten(self.avgpool(x), 1))",
        "        return self.fc(torch.flatten(self.avgpool(x), 1)[:, :3])"))
    rc, out = _plan(tmp_path, "--global-batch", "8", model=str(model))
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and not out.exists()
    assert "the model's forward (ResNet18) raised RuntimeError" in err and "Fix build_model or make_batch" in err, err
