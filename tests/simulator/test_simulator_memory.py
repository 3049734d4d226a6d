"""Memory model against closed forms: ZeRO (Rajbhandari et al. 2020) and Korthikanti et al. 2022."""
import pytest

from autopar.core.plan import ModelRef, uniform_plan
from autopar.core.sharding import megatron_styles
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.step.memory import inflight_microbatches
from sim_graphs import PROFILE, dense_graph, gpt_graph
from sim_graphs import toy_cluster as _cluster

GB = 1e9


@pytest.mark.parametrize("zero,expected", [(0, (14, 14, 84)), (1, (14, 14, 10.5)), (2, (14, 1.75, 10.5)),
                                           (3, (1.75, 1.75, 10.5))])
def test_7b_on_8_gpus_state_bytes(zero, expected):
    g = dense_graph(7e9, 32)
    ev = PlanEvaluator(g, _cluster(), CostModel.from_profile(PROFILE))
    plan = uniform_plan(model=ModelRef("x", {}, "d", "f"), num_layers=32, dp=8, zero=zero, precision="bf16")
    r = ev.evaluate(plan)
    m = r.memory[0]
    assert (m.params_bytes / GB, m.grads_bytes / GB, m.optimizer_bytes / GB) == pytest.approx(expected, rel=1e-6)


def test_fp32_state_and_offload_to_host():
    g = dense_graph(7e9, 32)
    ev = PlanEvaluator(g, _cluster(), CostModel.from_profile(PROFILE))
    ref = ModelRef("x", {}, "d", "f")
    r = ev.evaluate(uniform_plan(model=ref, num_layers=32, dp=8, zero=0, precision="fp32"))
    assert (r.memory[0].params_bytes, r.memory[0].grads_bytes, r.memory[0].optimizer_bytes) == pytest.approx((28e9, 28e9, 56e9))
    r = ev.evaluate(uniform_plan(model=ref, num_layers=32, dp=8, zero=3, offload="cpu", precision="bf16"))
    m = r.memory[0]
    assert m.params_bytes == m.grads_bytes == m.optimizer_bytes == 0
    assert m.host_bytes == pytest.approx(16 * 7e9 / 8)


def _layer_activation(tp, sp, recompute="none", h=1024, a=16, s=512, b=2):
    g = gpt_graph(2, h, a, s, 1000, batch=b, with_embeddings=False)
    ev = PlanEvaluator(g, _cluster(), CostModel.from_profile(PROFILE))
    styles = {i: megatron_styles(g, i) for i in range(2)} if tp > 1 else None
    plan = uniform_plan(model=ModelRef("x", {}, "g", "f"), num_layers=2, tp=tp, sequence_parallel=sp,
                        tp_styles_per_layer=styles, recompute=recompute, precision="bf16", micro_batch=b)
    return ev.layer_cost(0, plan.layers[0], plan.mesh, b, "bf16"), (s, b, h, a)


@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (8, False), (4, True), (8, True)])
def test_activations_per_layer_korthikanti(tp, sp):
    """Korthikanti et al. 2022, Eq. 1-2 and Sec. 4.2.2: sbh(34 + 5as/h) bytes; with tensor
    parallelism sbh(10 + 24/t + 5as/(ht)); with sequence parallelism sbh(34 + 5as/h)/t where
    Megatron-LM keeps the column-parallel linears' inputs sharded.  autopar's runtime (DTensor's
    ColwiseParallel after SequenceParallel) keeps them gathered: the attention's and the first MLP
    linear's inputs, 2sbh bytes each, whole instead of 1/t (measured on the runtime:
    tests/integration/test_collective_counts.py)."""
    c, (s, b, h, a) = _layer_activation(tp, sp)
    sbh = s * b * h
    if tp == 1:
        expected = sbh * (34 + 5 * a * s / h)
    elif not sp:
        expected = sbh * (10 + 24 / tp + 5 * a * s / (h * tp))
    else:
        expected = sbh * (34 + 5 * a * s / h) / tp + 2 * (2 * sbh) * (1 - 1 / tp)
    assert c.activation_bytes == pytest.approx(expected, rel=1e-3)


def test_full_recompute_keeps_layer_input():
    c, (s, b, h, a) = _layer_activation(1, False, "full")
    assert c.activation_bytes == pytest.approx(2 * s * b * h)
    # plus the largest pair of gradients one op's backward holds (memory.backward_gradient_bytes): at
    # the attention mask, the masked scores' gradient [b, a, s, s] and those of its inputs, the scores
    # and the [s, s] mask (this synthetic graph marks every op as requiring grad), 2 bytes each
    assert c.transient_bytes == pytest.approx(s * b * h * (34 + 5 * a * s / h) + 2 * (2 * a * s * s * b + s * s),
                                              rel=1e-3)


def test_inflight_microbatches_by_schedule():
    p, m = 4, 16
    assert [inflight_microbatches("1f1b", p, r, m) for r in range(p)] == [4, 3, 2, 1]
    assert all(inflight_microbatches("gpipe", p, r, m) == m for r in range(p))
    # interleaved, v chunks: first rank holds p + (p-1)/v stages' worth (Korthikanti et al. 2022, Sec. 5)
    v = 2
    assert inflight_microbatches("interleaved", p, 0, m, v) / v == pytest.approx(p + (p - 1) / v)


def test_first_stage_activations_1f1b_p_gpipe_m():
    g = gpt_graph(8, 512, 8, 256, 1000, batch=1, with_embeddings=False)
    ev = PlanEvaluator(g, _cluster(), CostModel.from_profile(PROFILE))
    per_layer = g.layers[0].saved_bytes            # bf16 graph, micro-batch 1: bytes kept per layer
    p, m = 4, 12
    for sched, held in (("1f1b", p), ("gpipe", m)):
        plan = config_plan(g, degrees={"dp": 1, "tp": 1, "pp": p},
                           micro_batch=1, global_batch=m, schedule=sched, virtual_stages=1,
                           zero=0, recompute="none", offload="none", precision="bf16", sequence_parallel=False)
        r = ev.evaluate(plan)
        # 2 layers per stage, and the backward's gradient pair at the attention mask (see above)
        a, s = 8, 256
        assert r.memory[0].activations_bytes == pytest.approx(held * 2 * per_layer + 2 * (2 * a * s * s + s * s))
