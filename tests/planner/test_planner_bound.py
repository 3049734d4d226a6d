"""The structured phase's lower bound (planner/screen_bound.py) against what it bounds: every entry
of the per-layer tables, the screen score, and the simulator's price of the assembled plan."""
from __future__ import annotations

import math

import numpy as np
import pytest

from autopar.core.capture import capture_model_file
from autopar.core.cluster import load_cluster
from autopar.core.errors import InfeasibleError
from autopar.planner.search import PlanOptions, Planner
from autopar.simulator.device.cost_model import CostModel

GPT = "examples/gpt.py"
# (cluster, its profile) over the GPU profiles and the CPU one (whose tables add no sharded terms)
CLUSTERS = [("dgx-a100-1x8", "a100-80gb-sxm"), ("h100-16x8", "h100-sxm"), ("local-cpu", "local-cpu")]


@pytest.fixture(scope="module")
def gpt4():
    # 6 layers: embeddings, 4 blocks, head
    return capture_model_file(GPT, {"layers": 4, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024}, 2)


def _planner(graph, cluster_name, sequence_parallel, **kw):
    cluster = load_cluster(cluster_name)
    cms = {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}
    return Planner(graph, cluster, cms, PlanOptions(global_batch=32, sequence_parallel=sequence_parallel,
                                                    max_virtual_stages=3, **kw))


@pytest.mark.parametrize("cluster_name,profile", CLUSTERS)
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_bound_is_below_every_table_entry_the_screen_and_the_price(gpt4, cluster_name, profile, sequence_parallel):
    """Every setting: the per-layer floor is at most each strategy the tables hold for the layer
    (time per micro-batch), the bound at most the screen score, and at most the simulator's
    step time of the plan the structured phase assembles for the setting."""
    from autopar.planner.screen_bound import layer_time_floor

    P = _planner(gpt4, cluster_name, sequence_parallel)
    settings = P.settings()
    assert len(settings) > 50
    families, priced = set(), 0
    for s in settings:
        tables, allowed = P.tables(s)
        for r, (t, cm) in enumerate(zip(tables, P.evaluator.rank_cost_models(s.mesh))):
            floor = layer_time_floor(P.evaluator, styles=P.styles, signatures=P.signatures, mesh=s.mesh,
                                     micro_batch=s.micro_batch, zero_family=s.zero_family, precision="bf16",
                                     cost_model=cm)
            ok = t.valid if allowed is None else t.valid & allowed
            entries = np.where(ok, t.time_mb_s, np.inf)
            assert (floor[:, None] <= entries * (1 + 1e-12)).all(), (s, r)
            assert (entries.min(axis=1) < np.inf).all()
        bound = P.bound(s)
        score = P.screen(s, tables, allowed)
        assert 0 < bound <= score * (1 + 1e-12), s
        try:
            c = P.solve(s, tables, allowed)      # as the search solves it (a tp mesh splits a layer)
        except InfeasibleError:
            continue
        ev = P.price(c)
        if ev is not None:
            assert bound <= ev.step_time_s, s
            priced += 1
            families.add(s.zero_family)
    assert priced > 50 and families == {"ddp", "zero1", "fsdp"}


def test_bound_follows_the_screen_formulas():
    """screen_bound on hand-made floors: one rank m * sum; interleaved chunks by rank; 1F1B from the
    sum over p and the costliest layer."""
    from autopar.planner.screen_bound import screen_bound

    f = np.array([[1.0, 2.0, 3.0, 4.0]])
    assert screen_bound(f, 5, "1f1b", 1) == pytest.approx(50.0)
    two = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    # interleaved, p = 2, v = 2: chunks [0], [1], [2], [3]; rank 0 holds 0 and 2, rank 1 holds 1 and 3
    # (rank 1's floors): lat = (1 + 3, 20 + 40); m = 4: 4 * 60 + 4 / 2
    assert screen_bound(two, 4, "interleaved", 2) == pytest.approx(4 * 60 + 4 / 2)
    # 1F1B, p = 2: each layer on its cheapest rank (rank 0), sum 10, slowest stage >= max(10/2, 4)
    assert screen_bound(two, 3, "1f1b", 1) == pytest.approx(10 + 2 * 5)
    steep = np.array([[1.0, 1.0, 1.0, 9.0]] * 2)
    assert screen_bound(steep, 3, "1f1b", 1) == pytest.approx(12 + 2 * 9)


@pytest.mark.parametrize("cluster_name", ["dgx-a100-1x8", "local-cpu"])
def test_pruned_screening_assembles_the_same_settings_as_screening_all(gpt4, cluster_name):
    """The structured phase with the bound prices the same candidates as with every setting
    screened (the bound replaced by 0, which rules nothing out), and the bound rules some out."""
    got_p = _planner(gpt4, cluster_name, True, num_screened=4, time_budget_s=600)
    got = got_p.structured(math.inf)
    ref_p = _planner(gpt4, cluster_name, True, num_screened=4, time_budget_s=600)
    ref_p.bound = lambda s: 0.0
    ref = ref_p.structured(math.inf)
    assert [e.candidate for e in got] == [e.candidate for e in ref]
    assert [e.step_time_s for e in got] == [e.step_time_s for e in ref]
    assert got_p.num_pruned > 0 and ref_p.num_pruned == 0
    assert len(got_p.table_cache) < len(ref_p.table_cache)
