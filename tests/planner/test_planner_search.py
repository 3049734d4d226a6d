"""The planner end to end on spaces small enough to enumerate, and its feasibility guarantees."""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest

from autopar.core.capture import capture_model_file
from autopar.core.cluster import load_cluster
from autopar.core.errors import NoFeasiblePlanError
from autopar.core.sharding import megatron_styles
from autopar.planner.candidate import Candidate
from autopar.planner.search import PlanOptions, Planner, search
from autopar.planner.space import LayerChoice, mesh_candidates, microbatch_candidates
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator

GPT = "examples/gpt.py"


@pytest.fixture(scope="module")
def tiny_gpt():
    # 4 layers: pre (embeddings), 2 blocks, post (norm + head + loss)
    return capture_model_file(GPT, {"layers": 2, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024}, 2)


def _cluster(gpus: int, memory_bytes: float | None = None):
    c = load_cluster("dgx-a100-1x8")
    g = replace(c.groups[0], gpus_per_node=gpus)
    if memory_bytes is not None:
        g = replace(g, gpu_memory_bytes=int(memory_bytes))
    return replace(c, groups=(g,))


def _cost_model():
    return CostModel.from_profile("a100-80gb-sxm")


SMALL = dict(recompute=("none", "full"), allow_offload=False, zero_families=("ddp", "zero1"),
             schedules=("1f1b",), max_virtual_stages=1, sequence_parallel=False)


def _exhaustive(graph, cluster, cm, options):
    """Price every plan of the restricted space with the same simulator; the fastest that fits."""
    L = len(graph.layers)
    styles = [megatron_styles(graph, i) for i in range(L)]
    planner = Planner(graph, cluster, cm, options, evaluator=PlanEvaluator(graph, cluster, cm))
    best, count = math.inf, 0
    meshes = mesh_candidates(cluster.world_size, gpus_per_node=cluster.gpus_per_node, num_layers=L,
                             global_batch=options.global_batch, sequence_parallel=False)
    for mesh in meshes:
        for zero in ((0,) if mesh.dp == 1 else (0, 1)):
            per_layer = [[LayerChoice(tp=split, zero=zero, recompute=rc)
                          for split in ((False, True) if mesh.tp > 1 and styles[i] else (False,))
                          for rc in options.recompute] for i in range(L)]
            for mb, m in microbatch_candidates(options.global_batch, mesh.dp, max_micro_batch=options.max_micro_batch):
                for cuts in itertools.combinations(range(1, L), mesh.pp - 1):
                    bounds = (0,) + cuts + (L,)
                    for choices in itertools.product(*per_layer):
                        c = Candidate(mesh, mb, m, "1f1b", bounds, tuple(choices))
                        ev = planner.price(c)
                        count += 1
                        if ev is not None:
                            best = min(best, ev.step_time_s)
    return best, count


@pytest.mark.parametrize("gpus,memory_gib", [(4, None), (4, 0.25), (2, 0.12)])
def test_plan_within_one_percent_of_exhaustive_optimum(tiny_gpt, gpus, memory_gib):
    cm = _cost_model()
    cluster = _cluster(gpus, None if memory_gib is None else memory_gib * 2**30)
    options = PlanOptions(global_batch=8, time_budget_s=8, seed=0, max_micro_batch=8, **SMALL)
    want, count = _exhaustive(tiny_gpt, cluster, cm, options)
    assert math.isfinite(want) and count > 100
    got = search(tiny_gpt, cluster, cm, options)
    assert got.best.result.fits
    assert got.best.step_time_s <= want * 1.01
    assert got.best.step_time_s >= want * (1 - 1e-9)      # the enumeration is exhaustive


def test_every_returned_plan_fits_and_carries_prediction_and_provenance(tiny_gpt):
    cm = _cost_model()
    cluster = _cluster(4, 0.25 * 2**30)
    res = search(tiny_gpt, cluster, cm, PlanOptions(global_batch=8, time_budget_s=5, top_k=2))
    for ev in [res.best] + res.runner_ups:
        plan = ev.plan
        plan.validate(len(tiny_gpt.layers))
        assert plan.predicted["max_memory_bytes"] <= cluster.groups[0].gpu_memory_bytes
        assert all(mb["total_bytes"] <= plan.predicted["capacity_bytes"] for mb in plan.predicted["memory_per_stage"])
        assert plan.model.fingerprint == tiny_gpt.fingerprint == plan.provenance["graph_fingerprint"]
        assert plan.provenance["num_evaluated"] >= 1 and plan.provenance["seed"] == 0
    assert all(ev.step_time_s >= res.best.step_time_s for ev in res.runner_ups)


def test_search_is_reproducible_with_a_seed(tiny_gpt):
    cm = _cost_model()
    cluster = _cluster(4, 0.25 * 2**30)
    opts = PlanOptions(global_batch=8, time_budget_s=60, algo="mcmc", mcmc_iterations=300, seed=5)
    a = search(tiny_gpt, cluster, cm, opts).best
    b = search(tiny_gpt, cluster, cm, opts).best
    assert a.candidate == b.candidate


def test_impossible_budget_raises_with_a_checked_suggestion(tiny_gpt):
    cm = _cost_model()
    # one GPU per node, too little memory for the model; more nodes shard it (ZeRO-3)
    from autopar.planner.feasibility import frugal_fit

    frugal = PlanOptions(global_batch=8, time_budget_s=5, allow_offload=False)
    fits, least = frugal_fit(tiny_gpt, _cluster(1, 2**30), cm, frugal, all_meshes=True)
    assert fits
    small = _cluster(1, least * 0.9)
    with pytest.raises(NoFeasiblePlanError) as e:
        search(tiny_gpt, small, cm, frugal)
    msg = str(e.value)
    assert "more node" in msg
    extra = int(msg.split(" more node")[0].rsplit(" ", 1)[-1])
    # the suggestion holds: with that many more nodes the planner finds a plan
    grown = replace(small, groups=(replace(small.groups[0], nodes=1 + extra),))
    assert search(tiny_gpt, grown, cm, frugal).best.result.fits


def test_cli_exit_code_3_and_plan_json(tmp_path, tiny_gpt):
    from autopar.cli import main

    src = open("examples/clusters/dgx-a100-1x8.yaml").read()
    tight = tmp_path / "tight.yaml"
    tight.write_text(src.replace("gpu_memory_GB: 80", "gpu_memory_GB: 0.00001").replace("name: dgx-a100-1x8", "name: tight"))
    args = [GPT, "--model-arg", "layers=2", "--model-arg", "hidden=256", "--model-arg", "heads=8",
            "--model-arg", "seq=128", "--model-arg", "vocab=1024", "--global-batch", "8", "--time-budget", "3",
            "--no-runtime-check"]     # the exit code and the plan file are checked, not the runtime's kinds
    assert main(["plan", *args, "--cluster", str(tight), "-o", str(tmp_path / "x.json")]) == 3
    out = tmp_path / "plan.json"
    assert main(["plan", *args, "--cluster", "dgx-a100-1x8", "-o", str(out), "--json"]) == 0
    d = json.loads(out.read_text())
    assert d["mesh"]["dp"] * d["mesh"]["tp"] * d["mesh"]["pp"] == 8
    assert d["predicted"]["step_time_s"] > 0 and d["predicted"]["max_memory_bytes"] > 0
    assert d["model"]["fingerprint"] == tiny_gpt.fingerprint


def test_tidy_prefers_uniform_choices_within_tolerance(tiny_gpt):
    """The returned plan is within TIDY_TOLERANCE of the fastest plan the search priced, and a
    mixed plan whose uniform version is as fast comes back uniform."""
    from autopar.planner.search import TIDY_TOLERANCE

    cluster, cm = _cluster(2), _cost_model()
    options = PlanOptions(global_batch=8, seed=0, time_budget_s=5, **SMALL)
    planner = Planner(tiny_gpt, cluster, cm, options)
    result = planner.run()
    fastest = min(ev.step_time_s for ev in planner.seen.values() if ev is not None)
    assert result.best.step_time_s <= fastest * (1 + TIDY_TOLERANCE) + 1e-12
    # a deliberately mixed recompute choice on a layer whose recompute costs ~nothing (pre):
    best = result.best.candidate
    mixed = replace(best, choices=(replace(best.choices[0], recompute="full"),) + best.choices[1:])
    ev = planner.price(mixed)
    assert ev is not None
    tidied = planner.tidy(ev)
    uniform = len({ch.recompute for ch in tidied.candidate.choices}) == 1
    assert uniform and tidied.step_time_s <= ev.step_time_s * (1 + TIDY_TOLERANCE)


def test_plan_remembers_rescaled_cluster_for_report(tmp_path):
    """A plan made with --nodes is re-priced by 'autopar report' on the same rescaled cluster."""
    from autopar.cli import main
    from autopar.core.plan import load_plan
    from autopar.core.plan_cluster import load_plan_cluster

    out = tmp_path / "plan.json"
    args = [GPT, "--model-arg", "layers=2", "--model-arg", "hidden=256", "--model-arg", "heads=8",
            "--model-arg", "seq=128", "--model-arg", "vocab=1024", "--global-batch", "32", "--time-budget", "3",
            "--no-runtime-check"]     # the cluster the plan remembers is checked, not the runtime's kinds
    assert main(["plan", *args, "--cluster", "dgx-a100-1x8", "--nodes", "2", "-o", str(out), "--json"]) == 0
    plan = load_plan(out)
    assert plan.world_size == 16
    assert load_plan_cluster(plan, out, None).world_size == 16


def _mixed(first_gpu: str = "a100-80gb-sxm", second_gpu: str = "h100-sxm"):
    """One node of 2 A100s and one node of 2 H100s (examples/clusters/mixed-a100-h100.yaml,
    shrunk); the second node's GPU type and NVLink replaced on request, the fabric kept."""
    c = load_cluster("mixed-a100-h100")
    a, h = (replace(g, nodes=1, gpus_per_node=2) for g in c.groups)
    a = replace(a, gpu=first_gpu, intra_node=a.intra_node if first_gpu == "a100-80gb-sxm" else h.intra_node)
    h = replace(h, gpu=second_gpu, intra_node=h.intra_node if second_gpu == "h100-sxm" else a.intra_node)
    return replace(c, groups=(a, h))


def test_heterogeneous_cluster_priced_by_the_slowest_device_of_each_stage(tiny_gpt):
    """Data parallel over an A100 and an H100 node runs at the A100s' pace: the same step as on
    two A100 nodes over the same fabric.  A 2-stage pipeline whose second stage holds the H100
    node sits strictly between the all-A100 and the all-H100 clusters.  The planner's plan for
    the mixed cluster fits and is no slower than either fixed layout."""
    from autopar.simulator.configure import config_plan

    mixed, all_a100, all_h100 = _mixed(), _mixed(second_gpu="a100-80gb-sxm"), _mixed(first_gpu="h100-sxm")
    cms = {"a100-80gb-sxm": CostModel.from_profile("a100-80gb-sxm"), "h100-sxm": CostModel.from_profile("h100-sxm")}

    def step(cluster, **kw):
        plan = config_plan(tiny_gpt, micro_batch=2, schedule="1f1b", virtual_stages=1, zero=0, recompute="none",
                           offload="none", precision="bf16", sequence_parallel=False, cluster_name=cluster.name, **kw)
        return PlanEvaluator(tiny_gpt, cluster, cms).evaluate(plan).step_time_s

    dp = dict(degrees={"dp": 4}, global_batch=8)
    t_mixed, t_a100, t_h100 = step(mixed, **dp), step(all_a100, **dp), step(all_h100, **dp)
    assert t_mixed == pytest.approx(t_a100, rel=1e-9)
    assert t_h100 < t_a100
    # ranks = arange(4).view(dp=1, pp=2, tp=2): pipeline rank 0 on the A100 node, 1 on the H100 node
    pp = dict(degrees={"tp": 2, "pp": 2}, global_batch=8)
    p_mixed, p_a100, p_h100 = step(mixed, **pp), step(all_a100, **pp), step(all_h100, **pp)
    assert p_h100 < p_mixed < p_a100

    options = PlanOptions(global_batch=8, time_budget_s=6, seed=0, max_micro_batch=8, **SMALL)
    got = search(tiny_gpt, mixed, cms, options)
    assert got.best.result.fits
    assert got.best.step_time_s <= min(t_mixed, p_mixed) * (1 + 1e-9)
