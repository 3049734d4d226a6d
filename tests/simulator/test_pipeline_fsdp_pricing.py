"""A pipeline's FSDP traffic priced per step (simulator/pipeline_fsdp.py), against closed forms of
the counts tests/integration/test_collective_counts.py measures on the runtime.

* the step's data-parallel bytes: each layer's ring all-gather and reduce-scatter bytes ((N-1)/N
  of its bf16 parameters, Patarasuk & Yuan 2009) times the collectives a step runs -- ZeRO-2 one
  each, ZeRO-3 m + 1 gathers and one reduce-scatter; without a pipeline 1 or 2 gathers and one
  reduce-scatter per micro-batch;
* the time after each rank's last backward: the sum of its first model chunk's reduce-scatters,
  where without a pipeline it is the chunk's first layer's alone;
* the memory: the stage's unsharded gradients in fp32 (the runtime's reduce dtype) on top of the
  sharded state, and under ZeRO-3 its unsharded bf16 parameters.
"""
from __future__ import annotations

import numpy as np
import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from sim_graphs import gpt_graph

PROFILE = dict(name="t", memory_bandwidth_Bps=2e12, peak_flops={"fp32": 20e12, "bf16": 250e12},
               efficiency={"linear": 0.8, "matmul": 0.8, "memory_bound": 0.8},
               collective_efficiency={"intra": 0.7, "inter": 0.9})
GRAPH = gpt_graph(8, 512, 8, 256, 1000)
DP = 4


def _plan(zero: int, m: int, pp: int):
    return config_plan(GRAPH, degrees={"dp": DP, "tp": 1, "pp": pp},
                       micro_batch=1, global_batch=DP * m, schedule="1f1b",
                       zero=zero, recompute="none", offload="none", precision="bf16", virtual_stages=1,
                       sequence_parallel=False)


def _evaluator():
    cluster = Cluster("c", (NodeGroup("n", "t", 2, 4, 80 * 2**30, Link(300.0, 3.0), 2**40, Link(25.0, 10.0)),),
                      Link(25.0, 5.0))
    return PlanEvaluator(GRAPH, cluster, CostModel.from_profile(PROFILE))


def _ring(numel) -> np.ndarray:
    return (DP - 1) / DP * 2.0 * np.asarray(numel, dtype=float)      # bf16 parameters and gradients


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("m", [2, 4])
def test_step_bytes_are_the_counted_collectives(pp, zero, m):
    _, rows = _evaluator().prepare(_plan(zero, m, pp))
    numel = np.array([layer.param_numel for layer in GRAPH.layers])
    if pp > 1:
        gathers, scatters = (m + 1 if zero == 3 else 1), 1
    else:
        gathers, scatters = (2 if zero == 3 else 1) * m, m
    want = (gathers + scatters) * _ring(numel)
    got = rows.dp_wire_bytes_per_step + m * rows.dp_wire_bytes_per_mb
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("zero", [2, 3])
def test_pipeline_reduce_scatters_end_the_step(zero):
    from autopar.simulator.axes.dp_sync import fsdp_tails

    ev = _evaluator()
    ctx, rows = ev.prepare(_plan(zero, 4, 2))
    rs = rows.dp_reducescatter_s
    stage_of = ctx.layer_stage
    want = [rs[stage_of == r].sum() for r in range(ctx.p)]
    assert all(w > 0 for w in want)
    assert fsdp_tails(ctx, rows) == pytest.approx(want, rel=1e-12)
    ctx1, rows1 = ev.prepare(_plan(zero, 4, 1))
    assert fsdp_tails(ctx1, rows1) == pytest.approx([rows1.dp_reducescatter_s[0]], rel=1e-12)


@pytest.mark.parametrize("zero", [2, 3])
def test_pipeline_holds_the_stage_unsharded(zero):
    ev = _evaluator()
    piped, flat = _plan(zero, 4, 2), _plan(zero, 4, 1)
    k = 3                                                        # a block, the same plan on both meshes
    a = ev.layer_cost(k, piped.layers[k], piped.mesh, 1, "bf16")
    b = ev.layer_cost(k, flat.layers[k], flat.mesh, 1, "bf16")
    numel = GRAPH.layers[k].param_numel
    assert a.grad_bytes - b.grad_bytes == pytest.approx(4.0 * numel)
    assert a.param_bytes - b.param_bytes == pytest.approx(2.0 * numel if zero == 3 else 0.0)
