"""A fused cross-entropy kernel allocates no gradient pair at the loss's backward
(TrainingCode.fused_cross_entropy; simulator/layer_cost.py ``_unfused_ops``), against closed forms.

On a bf16 Llama's last layer (tokens T, vocabulary V, hidden H), with no recompute:

* the model's own loss: the largest backward pair is the log-softmax's -- the fp32 gradient of its
  output and the fp32 gradient of its input (the upcast logits), 2 x 4 T V bytes;
* fused: the loss's chain (views, the cast, the log-softmax, the loss) leaves the pairs, and the
  largest is the head's -- its bf16 output gradient and its input's, 2 T V + 2 T H bytes.

What the layer keeps for backward does not change (the kernel keeps one fp32 [T, V] gradient, the
size of the log-softmax output the rows keep)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.core.plan import LayerPlan, Mesh
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.device.training_code import AUTOPAR

ROOT = Path(__file__).resolve().parents[2]
SEQ, VOCAB, HIDDEN = 16, 256, 64
PROFILE = dict(name="t", memory_bandwidth_Bps=2e12, peak_flops={"fp32": 20e12, "bf16": 250e12},
               efficiency={"linear": 0.8, "matmul": 0.8, "memory_bound": 0.8},
               collective_efficiency={"intra": 0.7, "inter": 0.9})


def _transient(fused: bool) -> tuple[float, float]:
    from autopar.core.capture import capture_model_file

    g = capture_model_file(ROOT / "examples" / "llama.py", dict(layers=2, hidden=HIDDEN, heads=4, kv_heads=2, ffn=128,
                                                                seq=SEQ, vocab=VOCAB, dtype="bfloat16"), 1)
    cm = CostModel.from_profile(PROFILE).for_code(replace(AUTOPAR, fused_cross_entropy=fused))
    cluster = Cluster("c", (NodeGroup("n", "t", 1, 1, 80 * 2**30, Link(300.0, 3.0), 2**40, Link(25.0, 10.0)),),
                      Link(25.0, 5.0))
    post = len(g.layers) - 1
    c = PlanEvaluator(g, cluster, cm).layer_cost(post, LayerPlan(layer=post), Mesh(), 1, "bf16", cm)
    return c.transient_bytes, c.activation_bytes


def test_fused_cross_entropy_allocates_no_gradient_pair():
    (plain, kept), (fused, kept_fused) = _transient(False), _transient(True)
    tokens_vocab = SEQ * VOCAB
    assert plain == 2 * 4.0 * tokens_vocab
    assert fused == 2.0 * tokens_vocab + 2.0 * SEQ * HIDDEN
    assert kept_fused == kept
