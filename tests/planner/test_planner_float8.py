"""The planner's float8 knob (planner/float8_choice.py): offered on an H100 cluster with torchao,
never on a CPU (gloo) cluster, a GPU without fp8 tensor cores, or without torchao; --precision
bf16 forbids it, --precision fp8 is refused where it cannot run; the two step times it reports
are the simulator's for the plan with and without its fp8 layers."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt.py")
H100 = str(ROOT / "examples" / "clusters" / "h100-16x8.yaml")
A100 = str(ROOT / "examples" / "clusters" / "dgx-a100-1x8.yaml")
# GPT-3 6.7B's shapes (hidden 4096): float8's GEMM savings beat its casts (simulator/float8.py)
BIG = ["--model-arg", "size=gpt3-6.7b"]
SMALL = ["--model-arg", "layers=4", "--model-arg", "hidden=32", "--model-arg", "heads=4", "--model-arg", "seq=16",
         "--model-arg", "vocab=64"]


def _plan(capsys, tmp_path, model, cluster, *extra, rc_want=0):
    from autopar.cli import main

    out = tmp_path / ("refused.json" if rc_want else "plan.json")
    rc = main(["plan", GPT, *model, "--cluster", cluster, "--global-batch", "64" if model is BIG else "4",
               "--time-budget", "3", "--no-runtime-check", "--json", "-o", str(out), *extra])
    captured = capsys.readouterr()
    assert rc == rc_want, (captured.out, captured.err)
    if rc_want:
        assert not out.exists()
        return " ".join(captured.err.split())
    return json.loads(captured.out), json.loads(out.read_text())


def _cluster_and_models(cluster_arg: str, nodes: int | None = None):
    from autopar.core.cluster import load_cluster
    from autopar.simulator.device.cost_model import CostModel

    cluster = load_cluster(cluster_arg, nodes=nodes)
    return cluster, {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}


@pytest.mark.parametrize("torchao", [True, False])
def test_where_float8_may_be_offered(monkeypatch, torchao):
    import autopar.runtime.apply_fp8 as apply_fp8
    from autopar.planner.float8_choice import fp8_unavailable

    monkeypatch.setattr(apply_fp8, "torchao_available", lambda: torchao)
    h100, h100_cms = _cluster_and_models(H100, nodes=1)
    why = fp8_unavailable(h100, h100_cms, "bf16")
    if torchao:
        assert why is None
    else:
        assert "pip install autopar[fp8]" in why
    assert "precision is fp32" in fp8_unavailable(h100, h100_cms, "fp32")
    assert "gloo" in fp8_unavailable(*_cluster_and_models("local-cpu"), "bf16")
    assert "no fp8 peak" in fp8_unavailable(*_cluster_and_models(A100), "bf16")


def test_h100_plan_offers_float8_and_reports_what_it_bought(capsys, tmp_path):
    pytest.importorskip("torchao")
    from autopar.core.plan import Plan
    from autopar.planner.float8_choice import with_fp8
    from autopar.simulator.plan_price import price_plan

    shown, d = _plan(capsys, tmp_path, BIG, H100, "--nodes", "1")
    choice = d["provenance"]["float8_choice"]
    assert choice["why"] == "faster" and choice["layers"] and d["fp8_recipe"] == "tensorwise"
    # every block of GPT-3 6.7B in fp8; the embeddings (no linear) and the head (50257 outputs, not a
    # multiple of 16) stay bf16
    blocks = [i for i, l in enumerate(d["layers"]) if 0 < i < len(d["layers"]) - 1]
    assert choice["layers"] == blocks
    assert [l.get("precision") == "fp8" for l in d["layers"]] == [i in blocks for i in range(len(d["layers"]))]
    assert "float8 on" in shown["float8"]
    # the two step times are the simulator's for the plan as written and with every layer bf16
    plan = Plan.from_dict(d)
    cluster, cms = _cluster_and_models(H100, nodes=1)
    assert plan.predicted["step_time_s"] == pytest.approx(choice["fp8_step_s"], rel=1e-9)
    assert price_plan(with_fp8(plan, ()), cluster, cms).step_time_s == pytest.approx(choice["bf16_step_s"], rel=1e-9)
    assert choice["fp8_step_s"] < choice["bf16_step_s"]


def test_precision_bf16_forbids_float8(capsys, tmp_path):
    _, d = _plan(capsys, tmp_path, BIG, H100, "--nodes", "1", "--precision", "bf16")
    assert d["precision"] == "bf16" and not any(l.get("precision") for l in d["layers"])
    assert d["provenance"]["float8_choice"]["why"] == "--precision bf16"


def test_without_torchao_float8_is_never_offered(capsys, tmp_path, monkeypatch):
    import autopar.runtime.apply_fp8 as apply_fp8

    monkeypatch.setattr(apply_fp8, "torchao_available", lambda: False)
    _, d = _plan(capsys, tmp_path, BIG, H100, "--nodes", "1")
    assert not any(l.get("precision") for l in d["layers"])
    assert "pip install autopar[fp8]" in d["provenance"]["float8_choice"]["why"]
    # the refusal reads the cluster and the missing torchao, not the model: the small GPT is captured for it
    message = _plan(capsys, tmp_path, SMALL, H100, "--nodes", "1", "--precision", "fp8", rc_want=2)
    assert "--precision fp8" in message and "pip install autopar[fp8]" in message


def test_cpu_cluster_never_offers_float8(capsys, tmp_path):
    _, d = _plan(capsys, tmp_path, SMALL, "local-cpu")
    assert d["precision"] == "fp32" and not any(l.get("precision") for l in d["layers"])
    _, d = _plan(capsys, tmp_path, SMALL, "local-cpu", "--precision", "bf16")
    assert not any(l.get("precision") for l in d["layers"])
    message = _plan(capsys, tmp_path, SMALL, "local-cpu", "--precision", "fp8", rc_want=2)
    assert "gloo" in message and "no fp8 matrix units" in message


def test_runtime_check_applies_float8_on_fake_ranks():
    """The planner's runtime check runs a float8 plan of the model on fake ranks (torchao's
    conversion on the meta model, FSDP2 with the fp8 all-gather over 2 fake ranks, a forward and
    backward) and reports what the runtime converts for the picked plan."""
    pytest.importorskip("torchao")
    from autopar.core.capture import capture_model_file
    from autopar.core.modelfile import load_model_file
    from autopar.core.plan import ModelRef, uniform_plan
    from autopar.runtime.meta_apply import float8_conversion
    from autopar.planner.runtime_check import find_executable, whole_plan_error

    args = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 60, "dropout": 0.0}
    g = capture_model_file(GPT, args, 2)
    mf = load_model_file(GPT)
    ex = find_executable(g, mf, tp_degrees=(), precision="bf16", max_pipeline_probes=0, float8=True)
    assert ex.float8 and ex.to_dict()["float8"] is True
    ref = ModelRef(file=GPT, args=args, name="gpt", fingerprint=g.fingerprint)
    plan = uniform_plan(model=ref, num_layers=len(g.layers), dp=2, micro_batch=2, zero=3, precision="bf16",
                        layer_precision="fp8")
    assert whole_plan_error(plan, g, mf) is None
    record = float8_conversion(plan, g, mf)
    assert sorted(record.converted) == sorted(f"blocks.{b}.{m}" for b in range(2)
                                              for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))
    assert list(record.left_bf16) == ["head"] and record.fsdp_float8_all_gather


def test_simulate_precision_fp8(capsys):
    """``autopar simulate --precision fp8`` prices the configuration with every layer's linears in
    float8 (a bf16 plan): GPT-3 6.7B under ZeRO-3 on one H100 node steps faster than in bf16 (the
    terms of simulator/float8.py), and holds the fp8 copies of a linear's backward on top of its
    activations; FSDP's largest unsharded buffers are the bf16 embedding's and head's, unchanged."""
    from autopar.cli import main

    got = {}
    for precision in ("bf16", "fp8"):
        rc = main(["simulate", GPT, *BIG, "--cluster", H100, "--nodes", "1", "--zero", "3", "--micro-batch", "2",
                   "--precision", precision, "--json"])
        out = capsys.readouterr().out
        assert rc == 0, out
        got[precision] = json.loads(out)
    assert got["fp8"]["step_time_s"] < got["bf16"]["step_time_s"]
    mem = {p: got[p]["memory_breakdown"] for p in got}
    assert mem["fp8"]["activations_bytes"] > mem["bf16"]["activations_bytes"]
    assert mem["fp8"]["comm_buffer_bytes"] == mem["bf16"]["comm_buffer_bytes"]
