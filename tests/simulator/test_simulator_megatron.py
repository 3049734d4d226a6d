"""Against a published measurement: Megatron-LM Table 1 (Narayanan et al. 2021).

Throughput is counted with Megatron's formula 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per
iteration (Narayanan et al. 2021, Sec. 5.1, recompute included).  The A100 profile's
efficiencies are documented measurements (profiles/a100-80gb-sxm.json, "sources"), not
fitted to this table.
"""
import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.simulate import simulate_plan
from sim_graphs import gpt_graph


def megatron_flops(B, s, l, h, V):
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def dgx_a100(nodes):
    # DGX A100: 8 GPUs on NVSwitch (NVLink3 300 GB/s per direction per GPU), 8 x 200 Gb/s HDR
    # InfiniBand per node = 25 GB/s per GPU (NVIDIA DGX A100 system architecture white paper).
    g = NodeGroup("dgx-a100", "a100-80gb-sxm", nodes, 8, 80 * 2**30, Link(300.0, 3.0), 2 * 2**40, Link(25.0, 10.0))
    return Cluster("dgx-a100", (g,), Link(25.0, 5.0))


@pytest.mark.parametrize("row", [
    # params, layers, hidden, heads, tp, pp, gpus, batch, micro, schedule, published TFLOP/s per GPU;
    # micro-batch and schedule as NVIDIA/Megatron-LM 6985e58938 examples/sc21/run_table_1.sh ran them
    ("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 2, "interleaved", 148.0),
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, "1f1b", 137.0),
])
def test_megatron_table1(row):
    from autopar.simulator.device import autocast
    from autopar.simulator.device.training_code import TrainingCode

    name, l, h, a, tp, pp, gpus, B, mb, schedule, published = row
    s, V = 2048, 51200
    g = gpt_graph(l, h, a, s, V, fused_softmax=True)      # Megatron-LM's fused scale-mask-softmax
    # Megatron-LM keeps fp16 parameters and runs no torch.autocast (simulator/autocast.py)
    cm = CostModel.from_profile("a100-80gb-sxm").for_code(TrainingCode(autocast=autocast.OFF))
    cl = dgx_a100(gpus // 8)
    dp = gpus // (tp * pp)
    plan = config_plan(g, degrees={"dp": dp, "tp": tp, "pp": pp},
                       micro_batch=mb, global_batch=B, schedule=schedule, virtual_stages=2,
                       zero=0, recompute="full", offload="none", precision="bf16", sequence_parallel=False)
    fast = PlanEvaluator(g, cl, cm).evaluate(plan)
    full = simulate_plan(g, plan, cl, cm)
    for r in (fast, full):
        tflops = megatron_flops(B, s, l, h, V) / r.step_time_s / gpus / 1e12
        assert tflops == pytest.approx(published, rel=0.10), f"{name}: {tflops:.1f} vs {published}"
        # the graph's own hardware FLOPs agree with Megatron's closed form
        assert r.hardware_flops_per_step == pytest.approx(megatron_flops(B, s, l, h, V), rel=0.02)
        assert r.fits


def test_megatron_145b_from_captured_model_file():
    """The same check on examples/gpt.py captured on the meta device (dropout 0.1 as in Megatron)."""
    from pathlib import Path

    capture = pytest.importorskip("autopar.core.capture")
    l, h, a, s, V, B = 80, 12288, 96, 2048, 51200, 2304
    g = capture.capture_model_file(str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py"),
                                   dict(layers=l, hidden=h, heads=a, seq=s, vocab=V, dropout=0.1), 1)
    plan = config_plan(g, degrees={"dp": 24, "tp": 8, "pp": 8},
                       micro_batch=1, global_batch=B, schedule="interleaved", virtual_stages=2,
                       zero=0, recompute="full", offload="none", precision="bf16", sequence_parallel=False)
    r = PlanEvaluator(g, dgx_a100(192), CostModel.from_profile("a100-80gb-sxm")).evaluate(plan)
    assert megatron_flops(B, s, l, h, V) / r.step_time_s / 1536 / 1e12 == pytest.approx(148.0, rel=0.10)
    assert r.hardware_flops_per_step == pytest.approx(megatron_flops(B, s, l, h, V), rel=0.02)
    assert r.fits and r.max_memory_bytes < 80 * 2**30


def test_megatron_fused_softmax_is_one_op_and_computes_plain_causal_attention():
    """examples/gpt.py attention="megatron": scale, causal mask and softmax captured as one softmax
    op over the scores (Megatron-LM's fused kernel, Narayanan et al. 2021 Sec. 4.2), and the model
    computes what a plain PyTorch causal attention computes."""
    import math
    from pathlib import Path

    import torch
    import torch.nn.functional as F

    capture = pytest.importorskip("autopar.core.capture")
    path = str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
    args = dict(layers=2, hidden=64, heads=4, seq=32, vocab=50)   # head dim 16, scores 32 x 32
    fused = capture.capture_model_file(path, args | {"attention": "megatron"}, 2)
    plain = capture.capture_model_file(path, args | {"attention": "math"}, 2)
    block = [i for i, layer in enumerate(fused.layers) if layer.kind not in ("pre", "post")][0]
    kinds = [o.kind for o in fused.layer_ops(block)]
    def score_ops(graph):        # the ops on the [b, heads, s, s] scores
        return [o for o in graph.layer_ops(block)
                if len(o.output_shape) == 4 and tuple(o.output_shape[-2:]) == (32, 32) and o.kind != "view"]

    # on the [b, heads, s, s] scores: Q K^T, the one fused softmax, dropout -- no separate scale or mask
    assert kinds.count("softmax") == 1
    assert sorted(o.kind for o in score_ops(fused)) == ["dropout", "matmul", "softmax"]
    assert len(score_ops(plain)) == len(score_ops(fused)) + 2      # the unfused path's scale and mask
    # numerics: a plain causal softmax attention on the model's own q, k, v
    from importlib import util

    spec = util.spec_from_file_location("gpt_example", path)
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16, 8)
    scores = x @ x.transpose(-2, -1)
    want = F.softmax((scores / math.sqrt(8)).masked_fill(torch.ones(16, 16).triu(1).bool(), float("-inf")), dim=-1)
    got = mod.scaled_upper_triang_masked_softmax(scores, 1 / math.sqrt(8))
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(2, 4, 16))
    assert (got.triu(1) == 0).all()
