"""The evaluator's fast path (step/layer_memo.LayerMemo) against the full computation.

PlanEvaluator.evaluate keeps each context's last derived table and looks up only the changed
layers' neighbourhoods in a memo.  That is exact only while a layer's derived terms read no
layer beyond its neighbours: the locality tests below hold sharded_dp.with_sharded_dp_costs and
compose.layer_effective_times to what _LayerMemo relies on, on random tables, and the walk
test prices plans that change a few layers at a time (as the search does) with one evaluator and
compares every figure, bit for bit, with the same plan priced from scratch on a fresh evaluator
by the path that keeps nothing (``simulate``'s: prepare, closed_form_step, assemble).
"""
import random
from dataclasses import replace

import numpy as np
import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.simulator.axes import sharded_dp
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator, closed_form_step
from autopar.simulator.step.layer_table import COLUMN_INDEX, COLUMNS, LayerTable
from autopar.simulator.step.compose import layer_effective_times
from autopar.simulator.step.step_model import chunk_masks
from sim_graphs import gpt_graph

#: the columns layer_effective_times reads of a layer's successor (its forward communication)
_SUCCESSOR_COLUMNS = [COLUMN_INDEX[c] for c in ("dp_allgather_s", "h2d_s", "zero", "offload")]


def _random_table(rng: np.random.Generator, n: int) -> np.ndarray:
    rows = rng.random((n, len(COLUMNS))) * 10.0 ** rng.integers(-4, 2, (n, len(COLUMNS)))
    rows[:, COLUMN_INDEX["zero"]] = rng.integers(0, 4, n)
    rows[:, COLUMN_INDEX["offload"]] = rng.integers(0, 2, n)
    rows[:, COLUMN_INDEX["recompute"]] = rng.integers(0, 3, n)
    rows[0, COLUMN_INDEX["zero"]] = 3          # some layer sharded before and after the change
    return rows


@pytest.mark.parametrize("runtime,bandwidth_scale", [(sharded_dp.FSDP2, 1.0), (sharded_dp.FSDP2, 3.0),
                                                     (sharded_dp.DEEPSPEED_ZERO3_2021, 2.5),
                                                     (sharded_dp.FSDP1_TORCH_2_2, 1.0)])
def test_sharded_dp_rows_are_local(runtime, bandwidth_scale):
    """Row k of with_sharded_dp_costs reads rows k-1, k, k+1 only; its successor columns row k alone."""
    rng = np.random.default_rng(3)
    kw = dict(slowdown=0.3, reduce_factor=2.0, runtime=runtime, bandwidth_scale=bandwidth_scale, latency_s=1e-5)
    for _ in range(40):
        n = int(rng.integers(3, 30))
        rows = _random_table(rng, n)
        before = sharded_dp.with_sharded_dp_costs(rows, COLUMN_INDEX, COLUMN_INDEX["zero"], 2e12, 0.8, **kw)
        i = int(rng.integers(1, n))
        changed = rows.copy()
        changed[i] = _random_table(rng, 1)[0]
        after = sharded_dp.with_sharded_dp_costs(changed, COLUMN_INDEX, COLUMN_INDEX["zero"], 2e12, 0.8, **kw)
        far = [k for k in range(n) if abs(k - i) > 1]
        assert np.array_equal(before[far], after[far])
        near = [k for k in (i - 1, i + 1) if 0 <= k < n]
        assert np.array_equal(before[near][:, _SUCCESSOR_COLUMNS], after[near][:, _SUCCESSOR_COLUMNS])


def test_effective_times_are_local():
    """layer_effective_times of layer k reads rows k and k+1 (and k's place in its chunk) only."""
    rng = np.random.default_rng(4)
    for _ in range(40):
        n = int(rng.integers(3, 30))
        starts = np.unique(np.concatenate(([0], rng.integers(1, n, int(rng.integers(0, 4))))))
        masks = chunk_masks(starts, n)
        rows = _random_table(rng, n)
        fwd, bwd = layer_effective_times(LayerTable(rows), *masks)
        i = int(rng.integers(0, n))
        rows[i] = _random_table(rng, 1)[0]
        fwd2, bwd2 = layer_effective_times(LayerTable(rows), *masks)
        far = [k for k in range(n) if k not in (i - 1, i)]
        assert np.array_equal(fwd[far], fwd2[far]) and np.array_equal(bwd[far], bwd2[far])


def _figures(r) -> tuple:
    w = r.work
    return (r.step_time_s, r.stage_step_s, r.bubble_fraction, r.max_memory_bytes, r.fits, r.device_fits,
            r.host_fits, r.host_bytes_per_node, [a.tolist() for a in r.memory_arrays],
            w.hardware_flops_per_step, w.comm_bytes, w.sources)


@pytest.mark.parametrize("dp,tp,pp,schedule,v,network_GBps", [
    (2, 2, 4, "1f1b", 1, 1.0), (2, 1, 4, "interleaved", 2, 4.0), (1, 2, 8, "gpipe", 1, 1.0),
    (4, 4, 1, "1f1b", 1, 50.0), (4, 1, 4, "1f1b", 1, 400.0)])
def test_a_walk_of_plans_matches_pricing_each_from_scratch(dp, tp, pp, schedule, v, network_GBps, monkeypatch):
    graph = gpt_graph(16, 512, 8, 256, 1000)
    # a slow network, so that the neighbours' gathers outlast compute in some layers and not in
    # others (the terms that cross layers take the smaller of the two)
    group = NodeGroup("n", "h100-sxm", 4, 4, 80 * 2**30, Link(20.0, 1.0), 2**40, Link(network_GBps, 10.0))
    cluster = Cluster("c", (group,), Link(network_GBps, 5.0))
    cm = CostModel.from_profile("h100-sxm")
    plan = config_plan(graph, degrees={"dp": dp, "tp": tp, "pp": pp}, micro_batch=1, global_batch=32, schedule=schedule,
                       virtual_stages=v, zero=3, recompute="selective", offload="none", precision="bf16",
                       sequence_parallel=tp > 1)
    rng = random.Random(dp * 100 + pp)
    walker = PlanEvaluator(graph, cluster, cm)
    full = []                                   # the walker's computations of a whole table
    derive = walker._derive
    monkeypatch.setattr(walker, "_derive", lambda rows, ctx: full.append(1) or derive(rows, ctx))
    layers = list(plan.layers)
    warm, steps = 600, 150
    for step in range(warm + steps):
        # one to three layers a move (now and then many), mostly among ZeRO 2/3 and the recompute
        # choices so that neighbourhoods recur; now and then ZeRO 0/1 or an offloaded layer
        for i in rng.sample(range(len(layers)), rng.choice((1, 2, 3) * 10 + (len(layers) // 2,))):
            odd = rng.random() < 0.02
            layers[i] = replace(layers[i], zero=rng.choice((0, 1) if odd else (2, 3)),
                                recompute=rng.choice(("none", "full")),
                                offload="cpu" if odd and rng.random() < 0.5 else "none")
        p = replace(plan, layers=tuple(layers))
        if step == warm:
            full.clear()
        fast = walker.evaluate(p)
        if step < warm and step % 10:
            continue
        fresh = PlanEvaluator(graph, cluster, cm)
        ctx, rows = fresh.prepare(p)
        scratch = fresh.assemble(p, ctx, rows, *closed_form_step(ctx, rows))
        assert _figures(fast) == _figures(scratch), f"plan {step} of the walk"
    assert len(full) < steps / 2               # most plans were priced from the memo
