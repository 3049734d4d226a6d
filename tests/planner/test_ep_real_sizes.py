"""Expert parallelism plans at real sizes: the planner's runtime check runs a model above the dry
run's real-tensor size (runtime/dry_run.REAL_TENSOR_BYTES) under FakeTensorMode, where the routed
token counts have no values; the exchange then takes a balanced stand-in routing
(runtime/apply_ep._balanced_splits) and ep is offered.  The models: a Qwen3-30B-A3B-shaped slice
and DeepSeek-V3's shape on examples/moe.py, Mixtral 8x7B's width on transformers' Mixtral
(tests/zoo/hf_mixtral.py).  Their structure, shrunk, trains like the plain loop under ep in
tests/integration/test_runtime_ep.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cli_inprocess import run_cli

#: Qwen3-30B-A3B's routing and attention (Qwen/Qwen3-30B-A3B config.json: hidden 2048, 32 heads,
#: 4 K/V heads, 128 experts, top 8, expert ffn 768) cut to 4 layers and 64 experts
QWEN_SLICE = dict(layers=4, hidden=2048, heads=16, kv_heads=8, experts=64, top_k=8, expert_ffn=1024, seq=2048,
                  vocab=32000)
#: DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 4.2, and its config.json):
#: 61 layers, hidden 7168, 128 heads of 128, 256 routed experts of ffn 2048 with top 8 and one
#: shared expert, the first 3 layers dense (ffn 18432), vocabulary 129280, sequences of 4096
#: (multi-head latent attention and multi-token prediction are not modelled: plain attention)
DEEPSEEK_V3 = dict(layers=61, hidden=7168, heads=128, kv_heads=128, head_dim=128, experts=256, top_k=8,
                   expert_ffn=2048, shared_ffn=2048, dense_layers=3, dense_ffn=18432, seq=4096, vocab=129280)
#: Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json) at 2 layers
MIXTRAL = dict(layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, experts=8, top_k=2, seq=4096, vocab=32000)


def _flags(args: dict) -> list[str]:
    return [x for k, v in args.items() for x in ("--model-arg", f"{k}={v}")]


def _fp32_bytes(path: str, args: dict) -> int:
    from autopar.core.modelfile import load_model_file
    from autopar.runtime.materialize import build_meta_model

    model = build_meta_model(load_model_file(path), args)
    return sum(p.numel() for p in model.parameters()) * 4


def test_balanced_stand_in_routing_by_hand():
    """10 rows over 4 experts, 2 per rank of an ep group of 2: experts get 3, 3, 2, 2 rows; rank 1
    sends 6 rows to rank 0 and 4 to itself, and receives its own 2 + 2 from each rank."""
    from autopar.runtime.apply_ep import _balanced_splits

    recv_counts, send, recv = _balanced_splits(10, 4, SimpleNamespace(ep=2, rank_in_group=1))
    assert recv_counts.tolist() == [[2, 2], [2, 2]] and send == [6, 4] and recv == [4, 4]
    assert sum(send) == 10


def _plan(tmp_path, model: str, args: dict, *flags) -> dict:
    out = tmp_path / "plan.json"
    r = run_cli("plan", model, *_flags(args), "--cluster", "h100-16x8", *flags, "--time-budget", "2", "-o", out,
                "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_qwen3_slice_plans_at_ep8(tmp_path):
    from autopar.runtime.dry_run import REAL_TENSOR_BYTES

    assert _fp32_bytes("examples/moe.py", QWEN_SLICE) > REAL_TENSOR_BYTES      # checked on fake tensors
    plan = _plan(tmp_path, "examples/moe.py", QWEN_SLICE, "--nodes", "1", "--global-batch", "64", "--ep", "8")
    assert plan["mesh"]["ep"] == 8


@pytest.mark.slow
def test_hf_mixtral_at_real_width_plans_with_ep(tmp_path):
    """transformers' grouped experts call ``torch._grouped_mm`` on the weights' dtype (float32),
    which its meta function refuses under FakeTensorMode while the kernels run it
    (runtime/dry_run._GroupedMMAnyDtype)."""
    pytest.importorskip("transformers")
    from autopar.runtime.dry_run import REAL_TENSOR_BYTES

    assert _fp32_bytes("tests/zoo/hf_mixtral.py", MIXTRAL) > REAL_TENSOR_BYTES
    plan = _plan(tmp_path, "tests/zoo/hf_mixtral.py", MIXTRAL, "--nodes", "1", "--global-batch", "64", "--ep", "8")
    assert plan["mesh"]["ep"] == 8


@pytest.mark.slow
def test_deepseek_v3_check_offers_ep():
    """The runtime check of the DeepSeek-V3-shaped model (on fake tensors) lets ep run, inside
    pipeline stages too; sequence parallelism is left out for its shared expert, a column/row
    pair called on the flattened tokens (runtime/apply_tp.GatherSequence), not for its routers."""
    from autopar.core.capture import capture_model_file
    from autopar.core.modelfile import load_model_file
    from autopar.planner.runtime_check import find_executable

    graph = capture_model_file("examples/moe.py", DEEPSEEK_V3, 1)
    # one tp degree: sequence parallelism is probed at the first degree kept, whatever the others
    ex = find_executable(graph, load_model_file("examples/moe.py"), tp_degrees=(2,), precision="bf16")
    assert ex.ep and ex.ep_pipeline, ex.left_out
    assert set(ex.experts) == {256}
    left = {x.kind: x.reason for x in ex.left_out}
    assert "2-D activation" in left["sequence parallel"] and "router" not in left["sequence parallel"], left


# The free search of the DeepSeek-V3-shaped model on 2048 H100s (40 CPU-s) runs in
# benchmarks/moe_layouts.py, which prints how the search treated ep (its line "expert
# parallelism in the free search"); the runtime check above is what decides whether ep is offered.
