"""Schedules and overlap: the step model against the closed forms of the papers; simulate, evaluate
and a plan's predicted block are one figure (the trace against the step model:
test_simulator_trace.py)."""
import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.core.plan import ModelRef, uniform_plan
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.simulate import simulate_plan
from sim_graphs import dense_graph, gpt_graph

PROFILE = dict(name="t", memory_bandwidth_Bps=2e12, peak_flops={"fp32": 20e12, "bf16": 250e12},
               efficiency={"linear": 1.0, "matmul": 1.0, "memory_bound": 1.0},
               collective_efficiency={"intra": 1.0, "inter": 1.0})
REF = ModelRef("x", {}, "d", "f")


def _cluster(nodes=1, gpus=8, intra_GBps=300.0):
    g = NodeGroup("n", "t", nodes, gpus, 80 * 2**30, Link(intra_GBps, 1.0), 2**40, Link(25.0, 10.0))
    return Cluster("c", (g,), Link(25.0, 5.0))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 8), (4, 32)])
def test_bubble_fraction_uniform_stages(schedule, p, m):
    g = dense_graph(1e6 * 2 * p, 2 * p, fwd_flops_per_layer=1e12)
    cm = CostModel.from_profile(PROFILE)
    plan = uniform_plan(model=REF, num_layers=2 * p, pp=p, num_microbatches=m, schedule=schedule, precision="bf16")
    expected = (p - 1) / (m + p - 1)          # Huang et al. 2019; Narayanan et al. 2021 Sec. 2.2.1
    for r in (simulate_plan(g, plan, _cluster(), cm), PlanEvaluator(g, _cluster(), cm).evaluate(plan)):
        assert r.bubble_fraction == pytest.approx(expected, abs=0.005)
        per_mb = 2 * 3 * 1e12 / 250e12       # two layers, fwd + bwd = 3x forward
        assert r.step_time_s == pytest.approx((m + p - 1) * per_mb, rel=0.01)


def test_interleaved_bubble_divided_by_v():
    p, m, v = 4, 8, 2
    g = dense_graph(1e6 * 16, 16, fwd_flops_per_layer=1e12)
    cm = CostModel.from_profile(PROFILE)
    plan = uniform_plan(model=REF, num_layers=16, pp=p, num_microbatches=m, schedule="interleaved",
                        virtual_stages=v, precision="bf16")
    t = 4 * 3 * 1e12 / 250e12                  # one micro-batch through one rank's 4 layers
    expected = m * t + (p - 1) * t / v         # Narayanan et al. 2021, Sec. 2.2.2
    for r in (simulate_plan(g, plan, _cluster(), cm), PlanEvaluator(g, _cluster(), cm).evaluate(plan)):
        assert r.step_time_s == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("params,expect", [(2e8, "backward"), (2e10, "allreduce")])
def test_ddp_overlap(params, expect):
    """A bucketed all-reduce shorter than backward hides behind it; a longer one sets the pace."""
    layers, dp = 16, 8
    g = dense_graph(params, layers, fwd_flops_per_layer=2e12)
    cm = CostModel.from_profile({**PROFILE, "efficiency": {"linear": 1.0, "memory_bound": 1e6}})
    cl = _cluster(intra_GBps=100.0)
    plan = uniform_plan(model=REF, num_layers=layers, dp=dp, precision="bf16")
    ev = PlanEvaluator(g, cl, cm)
    lc = ev.layer_cost(0, plan.layers[0], plan.mesh, 1, "bf16")
    fwd, bwd = layers * lc.fwd_s, layers * lc.bwd_s
    allreduce = layers * lc.dp_allreduce_s
    # ring all-reduce per layer: 2(N-1) latencies + 2(N-1)/N of its gradients, fp32 under bf16
    # autocast (DDP reduces the fp32 gradients of fp32 parameters: 4 bytes an element)
    assert allreduce == pytest.approx(layers * 2 * (dp - 1) * 1e-6 + 2 * (dp - 1) / dp * 4 * params / 100e9, rel=1e-6)
    opt = layers * lc.optimizer_s
    for r in (simulate_plan(g, plan, cl, cm), ev.evaluate(plan)):
        exposed = r.step_time_s - fwd - opt
        if expect == "backward":
            assert allreduce < bwd
            assert exposed == pytest.approx(bwd, rel=0.08)
        else:
            assert allreduce > bwd
            assert exposed == pytest.approx(allreduce, rel=0.08)


@pytest.mark.parametrize("kw", [
    dict(degrees={"dp": 2, "tp": 4, "pp": 1}, schedule="1f1b", zero=0, recompute="none", global_batch=8),
    dict(degrees={"dp": 2, "tp": 2, "pp": 2}, schedule="1f1b", zero=1, recompute="full", global_batch=16),
    dict(degrees={"dp": 4, "tp": 1, "pp": 2}, schedule="gpipe", zero=2, recompute="selective", global_batch=32),
    dict(degrees={"dp": 8, "tp": 1, "pp": 1}, schedule="1f1b", zero=3, recompute="none", global_batch=16),
    dict(degrees={"dp": 1, "tp": 2, "pp": 4}, schedule="interleaved", zero=0, recompute="full", global_batch=16),
])
def test_simulate_and_evaluate_agree(kw):
    g = gpt_graph(16, 1024, 16, 1024, 8000)
    cm = CostModel.from_profile(PROFILE)
    cl = _cluster(nodes=2, gpus=4)
    plan = config_plan(g, micro_batch=1, virtual_stages=2, offload="none", precision="bf16",
                       sequence_parallel=False, **kw)
    a = simulate_plan(g, plan, cl, cm)
    b = PlanEvaluator(g, cl, cm).evaluate(plan)
    assert a.to_dict() == b.to_dict()


def test_reprice_changes_only_changed_layers():
    from dataclasses import replace

    from autopar.simulator.device.training_code import TrainingCode

    g = gpt_graph(24, 1024, 16, 1024, 8000)
    # a recompute that reruns the whole forward (a reentrant checkpoint; the runtime's stops early,
    # axes/recompute.recompute), so that the closed form below is one forward
    cm = CostModel.from_profile(PROFILE).for_code(TrainingCode(recompute_early_stop=False))
    ev = PlanEvaluator(g, _cluster(), cm)
    plan = config_plan(g, degrees={"dp": 2, "tp": 4, "pp": 1},
                       micro_batch=1, global_batch=8, schedule="1f1b", virtual_stages=1,
                       zero=0, recompute="none", offload="none", precision="bf16", sequence_parallel=False)
    base = ev.evaluate(plan)
    computed = ev.num_layer_costs_computed
    assert computed == 3                          # pre, one block signature, post
    layers = list(plan.layers)
    layers[5] = replace(layers[5], recompute="full")
    r = ev.evaluate(replace(plan, layers=tuple(layers)))
    assert ev.num_layer_costs_computed == computed + 1
    lc_none = ev.layer_cost(5, plan.layers[5], plan.mesh, 1, "bf16")
    m = plan.pipeline.num_microbatches            # one extra forward (with its tp collectives) per micro-batch
    assert r.step_time_s - base.step_time_s == pytest.approx(m * (lc_none.fwd_s + lc_none.tp_comm_fwd_s), rel=0.02)
    assert r.hardware_flops_per_step - base.hardware_flops_per_step == pytest.approx(
        g.layers[5].fwd_flops * plan.global_batch / g.batch_size)


def test_one_step_model_for_evaluate_and_simulate():
    """simulate_plan() and the search's evaluate() give the same figures (to 1e-9) over many plans; the
    trace is held to the step model by tests/simulator/test_simulator_trace.py."""
    import random

    g = gpt_graph(12, 512, 8, 256, 1000)
    cm = CostModel.from_profile(PROFILE)
    cl = _cluster(nodes=2, gpus=4)
    rng = random.Random(0)
    ev = PlanEvaluator(g, cl, cm)
    n = 0
    while n < 40:
        dp, tp, pp = rng.choice([(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4), (1, 8, 1), (2, 4, 1)])
        schedule = rng.choice(["gpipe", "1f1b", "interleaved"] if pp > 1 else ["1f1b"])
        m, mb = rng.choice([1, 2, 4]) * pp, rng.choice([1, 2])
        zero = rng.choice([0, 1, 2, 3]) if dp > 1 else 0
        plan = config_plan(g, degrees={"dp": dp, "tp": tp, "pp": pp}, micro_batch=mb, global_batch=dp * mb * m,
                           schedule=schedule, virtual_stages=2, zero=zero,
                           recompute=rng.choice(["none", "selective", "full"]),
                           offload=rng.choice(["none", "cpu"]) if zero >= 2 else "none",
                           precision="bf16", sequence_parallel=tp > 1 and rng.random() < 0.5)
        fast = ev.evaluate(plan)
        sim = simulate_plan(g, plan, cl, cm, timeline=True)
        assert sim.step_time_s == pytest.approx(fast.step_time_s, rel=1e-9, abs=0)
        assert sim.stage_step_s == pytest.approx(fast.stage_step_s, rel=1e-9, abs=0)
        assert sim.bubble_fraction == pytest.approx(fast.bubble_fraction, rel=1e-9, abs=1e-12)
        assert sim.max_memory_bytes == fast.max_memory_bytes
        assert sim.timeline and fast.timeline is None
        n += 1
