"""The plan's compile flag and per-layer precision: JSON form, old files, checks; a float8 plan
refused before launch where the device has no fp8 (the CPU); the runtime's compile wrapper."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime_support import make_plan  # noqa: E402

from autopar.cli import main as cli_main  # noqa: E402
from autopar.core.errors import PlanFileError  # noqa: E402
from autopar.core.plan import Plan, load_plan  # noqa: E402


def test_compile_and_layer_precision_round_trip(tmp_path):
    path = make_plan(tmp_path / "p.json", dp=2, micro_batch=2, compile=True, precision="bf16", layer_precision="fp8")
    d = json.loads(path.read_text())
    assert d["compile"] is True and all(l["precision"] == "fp8" for l in d["layers"])
    plan = load_plan(path)
    assert plan.compile and plan.uses_fp8 and plan.layer_precision(0) == "fp8"
    assert Plan.from_dict(plan.to_dict()) == plan


def test_plan_without_the_new_keys_loads_as_eager_and_plan_precision(tmp_path):
    """A plan file written before the keys existed: no compile, every layer in the plan's precision."""
    path = make_plan(tmp_path / "old.json", dp=2, micro_batch=2, precision="bf16")
    d = json.loads(path.read_text())
    del d["compile"]
    assert all("precision" not in l for l in d["layers"])      # unset per-layer precision is not written
    plan = Plan.from_dict(d)
    assert plan.compile is False and not plan.uses_fp8 and plan.layer_precision(1) == "bf16"


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(compile="yes"), ("field compile", "true or false")),
    (lambda d: d["layers"][1].update(precision="fp4"), ("layers[1].precision", "bf16, fp8")),
    (lambda d: d.update(precision="fp32") or d["layers"][1].update(precision="fp8"),
     ("layers[1].precision", "on top of bf16")),
])
def test_bad_compile_or_precision_refused(tmp_path, edit, words):
    d = json.loads(make_plan(tmp_path / "p.json", dp=2, micro_batch=2, precision="bf16").read_text())
    edit(d)
    with pytest.raises(PlanFileError) as e:
        Plan.from_dict(d)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without fp8")
def test_fp8_plan_refused_before_launch_on_cpu(tmp_path, capsys):
    path = make_plan(tmp_path / "fp8.json", dp=2, micro_batch=2, precision="bf16", layer_precision="fp8")
    before = path.read_text()
    rc = cli_main(["run", str(path), "--steps", "1"])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    message = " ".join(err.split("error:", 1)[1].split())
    assert "precision fp8" in message and "no CUDA device" in message and "--precision bf16" in message
    assert "Traceback" not in err and "autopar run: " + sys.executable not in err   # nothing launched
    assert path.read_text() == before and not (tmp_path / "measured.json").exists()


def test_apply_compile_replaces_only_the_listed_blocks_forward():
    """In place: the module keeps its path, class and parameter names; its forward is a compiled
    function that computes what the eager forward does (on the CPU, through inductor's C++)."""
    from autopar.runtime.apply_compile import apply_compile, is_compiled

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.GELU())
                                                          for _ in range(2)]))
    names = [n for n, _ in model.named_parameters()]
    x = torch.randn(3, 4)
    want = [blk(x) for blk in model[1]]
    done = apply_compile(model, [["1.0"], ["1.1"]])
    assert done == ["1.0", "1.1"] and is_compiled(model[1][0]) and not is_compiled(model[0])
    assert [n for n, _ in model.named_parameters()] == names and type(model[1][0]) is nn.Sequential
    assert model[1][0].forward is not nn.Sequential.forward.__get__(model[1][0])
    got = [blk(x) for blk in model[1]]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_fp8_recipe_in_the_plan(tmp_path):
    """fp8_recipe: written with fp8 layers, read back; absent (older files, or no fp8 layer):
    tensorwise; anything else refused; part of the plan's identity only when fp8 layers use it."""
    path = make_plan(tmp_path / "rw.json", dp=2, micro_batch=2, precision="bf16", layer_precision="fp8",
                     fp8_recipe="rowwise")
    d = json.loads(path.read_text())
    assert d["fp8_recipe"] == "rowwise" and load_plan(path).fp8_recipe == "rowwise"
    tw = dict(d, fp8_recipe="tensorwise")
    assert Plan.from_dict(tw).identity != Plan.from_dict(d).identity
    del d["fp8_recipe"]
    assert Plan.from_dict(d).fp8_recipe == "tensorwise"
    with pytest.raises(PlanFileError, match="fp8_recipe"):
        Plan.from_dict(dict(d, fp8_recipe="blockwise"))
    plain = json.loads(make_plan(tmp_path / "bf16.json", dp=2, micro_batch=2, precision="bf16").read_text())
    assert "fp8_recipe" not in plain
    assert Plan.from_dict(plain).identity == Plan.from_dict(dict(plain, fp8_recipe="rowwise")).identity
