"""torchtitan's op-level selective checkpointing recomputes every second mm of a block, where
autopar's runtime saves them all (simulator/selective_mm_policy.py): first the fact, counted in
plain PyTorch with a policy written out in the test, then the price."""
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.core.capture import capture_model_file
from autopar.core.plan import LayerPlan, Mesh
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.axes.recompute import recomputed_matmuls
from autopar.simulator.device.training_code import AUTOPAR, TrainingCode

ROOT = Path(__file__).resolve().parents[2]
LLAMA = {"size": "llama-tiny", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 172, "seq": 32,
         "vocab": 128}


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def _every_other_mm_context():
    """The policy as torchtitan's op-level option states it: save compute ops' outputs, but every
    second aten.mm of a forward (counted per forward and per recompute) is recomputed."""
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func is torch.ops.aten.mm.default:
            meta[key] += 1
            return CheckpointPolicy.PREFER_RECOMPUTE if meta[key] % 2 == 0 else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _backward_mms(block, context_fn=None) -> int:
    x = torch.randn(2, LLAMA["seq"], LLAMA["hidden"], requires_grad=True)
    out = block(x) if context_fn is None else checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    with _CountMM() as counter:
        out.sum().backward()
    return counter.count


def test_every_other_mm_policy_reruns_three_of_a_llama_blocks_seven_linears():
    """Plain PyTorch on a block of examples/llama.py: its backward runs two mms per linear (7
    bias-free linears); autopar's selective recompute adds none, torchtitan's policy adds three."""
    from autopar.examples.llama import Block
    from autopar.runtime.recompute import wrap_for_recompute

    torch.manual_seed(0)
    block = Block(LLAMA["hidden"], LLAMA["heads"], LLAMA["kv_heads"], LLAMA["ffn"])
    plain = _backward_mms(block)
    assert plain == 14
    assert _backward_mms(wrap_for_recompute(block, "selective")) == plain
    assert _backward_mms(block, _every_other_mm_context) == plain + 3


def _layer_cost(policy: str):
    graph = capture_model_file(str(ROOT / "examples" / "llama.py"), LLAMA, 2)
    from autopar.core.cluster import load_cluster

    cm = CostModel.from_profile("h100-sxm").for_code(TrainingCode(selective_mm_policy=policy))
    ev = PlanEvaluator(graph, load_cluster("h100-16x8", nodes=1), cm)
    return graph, cm, ev.layer_cost(1, LayerPlan(1, (), recompute="selective"), Mesh(dp=1, pp=1, tp=1), 2, "bf16", cm)


def test_the_price_reruns_wk_wo_and_w3_and_keeps_their_outputs_out():
    """The ops the policy reruns are the block's 2nd, 4th and 6th linears in call order -- wk, wo,
    w3 -- and the block's recompute grows by exactly their forward times from the cost model."""
    graph, cm, every_other = _layer_cost("every_other")
    _, _, all_saved = _layer_cost("all")
    ops = graph.layer_ops(1)
    rerun = recomputed_matmuls(ops, "every_other")
    assert sorted(o.module_path.rsplit(".", 1)[1] for o in ops if o.name in rerun) == ["w3", "wk", "wo"]
    assert recomputed_matmuls(ops, "all") == frozenset() and AUTOPAR.selective_mm_policy == "all"
    extra_s = sum(cm.op_time(o, "bf16") for o in ops if o.name in rerun)
    assert every_other.recompute_s - all_saved.recompute_s == pytest.approx(extra_s)
    assert every_other.hw_flops - all_saved.hw_flops == pytest.approx(sum(o.fwd_flops for o in ops if o.name in rerun))
    assert every_other.activation_bytes < all_saved.activation_bytes
    with pytest.raises(ValueError, match="every_other"):
        recomputed_matmuls(ops, "odd")


def test_the_steps_hardware_flops_count_the_rerun_matmuls():
    """A step's hardware FLOPs (HFU) under the policy exceed autopar's by the rerun matmuls' forward
    FLOPs of every block, per sample of the global batch."""
    from autopar.core.cluster import load_cluster
    from autopar.simulator.configure import config_plan
    from autopar.simulator.simulate import simulate_plan

    graph = capture_model_file(str(ROOT / "examples" / "llama.py"), LLAMA, 2)
    cluster = load_cluster("h100-16x8", nodes=1)
    plan = config_plan(graph, degrees={"dp": 1, "tp": 1, "pp": 1},
                       micro_batch=2, global_batch=4, schedule="1f1b", virtual_stages=1,
                       zero=0, recompute="selective", offload="none", precision="bf16", sequence_parallel=False,
                       cluster_name=cluster.name)

    def hw_flops(policy):
        cm = CostModel.from_profile("h100-sxm").for_code(TrainingCode(selective_mm_policy=policy))
        res = simulate_plan(graph, plan, cluster, cm)
        return res.hw_tflops_per_gpu * res.step_time_s * 1e12
    rerun = sum(o.fwd_flops for lp in plan.layers if lp.recompute == "selective"
                for ops in [graph.layer_ops(lp.layer)] for o in ops if o.name in recomputed_matmuls(ops, "every_other"))
    assert rerun > 0
    assert hw_flops("every_other") - hw_flops("all") == pytest.approx(rerun * 4 / 2, rel=1e-6)
