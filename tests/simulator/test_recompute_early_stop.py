"""A full recompute by non-reentrant torch.utils.checkpoint stops at the last saved tensor
(simulator/layer_cost.py ``_recompute``): first the fact, counted in plain PyTorch, then the price."""
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from autopar.core.capture import capture_model_file
from autopar.core.plan import LayerPlan, Mesh
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.device.training_code import TrainingCode

ROOT = Path(__file__).resolve().parents[2]
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _Block(nn.Module):
    """A pre-norm MLP block: norm, linear, GELU, linear, residual add."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm, self.fc, self.act, self.proj = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), \
            nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.norm(x))))


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in _MATMULS
        return func(*args, **(kwargs or {}))


def _backward_matmuls(run) -> int:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(2, 8, 16, requires_grad=True)
    loss = run(block, x).sum()
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count


def test_non_reentrant_checkpoint_does_not_rerun_the_last_matmul():
    """Plain PyTorch, no autopar code: the backward of a plain block runs two matmuls per linear
    (input and weight gradients); a reentrant checkpoint adds the whole forward's two; the
    non-reentrant one adds only the first linear -- the output projection's operands are the last
    tensors the forward saved, packed before its kernel runs, so the recompute stops there."""
    plain = _backward_matmuls(lambda m, x: m(x))
    reentrant = _backward_matmuls(lambda m, x: checkpoint(m, x, use_reentrant=True))
    non_reentrant = _backward_matmuls(lambda m, x: checkpoint(m, x, use_reentrant=False))
    assert plain == 4
    assert reentrant == plain + 2
    assert non_reentrant == plain + 1


def test_the_runtime_wrapper_stops_early_too():
    """runtime/recompute.py's full recompute is the non-reentrant wrapper: the same count."""
    from autopar.runtime.recompute import wrap_for_recompute

    plain = _backward_matmuls(lambda m, x: m(x))
    assert _backward_matmuls(lambda m, x: wrap_for_recompute(m, "full")(x)) == plain + 1


def _block_cost(early_stop: bool):
    graph = capture_model_file(str(ROOT / "examples" / "gpt.py"),
                               {"layers": 2, "hidden": 256, "heads": 4, "seq": 128, "vocab": 512,
                                "attention": "sdpa"}, 2)
    cm = CostModel.from_profile("a100-80gb-sxm").for_code(TrainingCode(recompute_early_stop=early_stop))
    ev = PlanEvaluator(graph, _one_gpu_cluster(), cm)
    return graph, cm, ev.layer_cost(1, LayerPlan(1, (), recompute="full"), Mesh(dp=1, pp=1, tp=1), 2, "fp32", cm)


def _one_gpu_cluster():
    from autopar.core.cluster import load_cluster

    return load_cluster("dgx-a100-192x8", nodes=1)


def test_the_price_leaves_out_what_the_recompute_skips():
    """A block of examples/gpt.py ends with the MLP's output projection, dropout with p = 0 (no
    mask saved) and the residual add: an early-stopped recompute is the full one less those ops'
    forward times and the projection's FLOPs, each taken from the cost model op by op."""
    graph, cm, early = _block_cost(True)
    _, _, full = _block_cost(False)
    ops = graph.layer_ops(1)
    last = max(i for i, o in enumerate(ops) if o.kind == "linear")
    tail = ops[last:]
    assert tail[0].module_path.endswith("mlp.proj")
    assert all(o.saved_bytes == 0 for o in tail[1:]) and len(tail) >= 2
    skipped_s = sum(cm.op_time(o, "fp32") for o in tail)
    assert skipped_s > 0
    assert full.recompute_s - early.recompute_s == pytest.approx(skipped_s)
    assert full.hw_flops - early.hw_flops == pytest.approx(sum(o.fwd_flops for o in tail))
    assert early.fwd_s == pytest.approx(full.fwd_s) and early.bwd_s == pytest.approx(full.bwd_s)
