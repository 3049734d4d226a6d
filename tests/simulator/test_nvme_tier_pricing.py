"""The NVMe tier's price (simulator/nvme_tier.py) against closed forms, the cluster file's
``nvme`` entry, and the planner's choice of the tier only where host memory does not suffice
(planner/nvme_choice.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.core.cluster_file import parse_cluster
from autopar.core.cluster_types import Nvme
from autopar.core.errors import ClusterFileError
from autopar.core.plan import ModelRef, uniform_plan
from autopar.simulator.axes import nvme_tier
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from sim_graphs import PROFILE, dense_graph, toy_cluster

TIER = Nvme(path="/nvme", capacity_bytes=10**13, read_GBps=10.0, write_GBps=5.0)


def test_moment_io_is_the_node_bytes_over_its_bandwidths():
    # 8 devices x 1 GB each = 8 GB read at 10 GB/s (0.8 s), then written at 5 GB/s (1.6 s)
    assert nvme_tier.moment_io_s(1e9, 8, TIER) == pytest.approx(2.4)
    assert nvme_tier.exposed_io_s(2.4, 1.0) == pytest.approx(1.4)
    assert nvme_tier.exposed_io_s(2.4, 3.0) == 0.0


def _plan(graph, offload: str, dp: int = 8, m: int = 1):
    ref = ModelRef(graph.model_file, {}, graph.model_name, graph.fingerprint)
    return uniform_plan(model=ref, num_layers=len(graph.layers), dp=dp, micro_batch=1, num_microbatches=m,
                        zero=3, offload=offload, precision="bf16")


def _with_tier(cluster, tier):
    return replace(cluster, groups=tuple(replace(g, nvme=tier) for g in cluster.groups))


@pytest.mark.parametrize("m, read_GBps, offload, per_param", [
    (1, 10.0, "nvme", 8), (4, 10.0, "nvme", 8), (1, 1e4, "nvme", 8),
    (1, 10.0, "nvme+grads", 8 + 4), (1, 10.0, "nvme+params+grads", 8 + 4 + 4)])
def test_nvme_plan_moves_the_states_and_stalls_by_what_compute_does_not_hide(m, read_GBps, offload, per_param):
    """Against the cpu-offload plan of the same layout: each layer's states on the tier (trainable
    / dp x 8 bytes of moments, + 4 of fp32 gradient shard, + 4 of fp32 parameter shard) leave host
    memory for the tier, and the step is longer by the sum over layers of max(0, the node's
    states read + written - m x the layer's forward + backward): the read and write hide behind
    the step's compute and the rest stalls (a fast tier: none)."""
    n, L, dp = 8e9, 4, 8
    tier = replace(TIER, read_GBps=read_GBps, write_GBps=read_GBps / 2)
    graph = dense_graph(n, L, fwd_flops_per_layer=1e12)
    ev = PlanEvaluator(graph, _with_tier(toy_cluster(), tier), CostModel.from_profile(PROFILE))
    cpu, nvme = ev.evaluate(_plan(graph, "cpu", dp, m)), ev.evaluate(_plan(graph, offload, dp, m))
    moments = n / L / dp * per_param                      # per layer and device: the states on the tier
    assert nvme.nvme_bytes_per_node == pytest.approx(moments * L * dp)      # the node's 8 devices
    assert cpu.host_bytes_per_node - nvme.host_bytes_per_node == pytest.approx(moments * L * dp)
    assert nvme.nvme_fits and nvme.fits and nvme.nvme_capacity_bytes == TIER.capacity_bytes
    io = moments * dp / (read_GBps * 1e9) + moments * dp / (read_GBps / 2 * 1e9)
    plan = _plan(graph, "cpu", dp, m)                     # the layer's compute per micro-batch, as priced
    ctx, rows = ev.prepare(plan)
    windows = [m * float(rows.fwd_s[i] + rows.bwd_s[i] + rows.recompute_s[i]) for i in range(L)]
    stall = sum(max(0.0, io - w) for w in windows)
    assert nvme.step_time_s - cpu.step_time_s == pytest.approx(stall, rel=1e-9, abs=1e-12)
    if read_GBps < 100:
        assert io > max(windows)                          # the slow tier does stall the step


def test_moments_beyond_the_tier_do_not_fit_and_no_tier_holds_nothing():
    graph = dense_graph(8e9, 4)
    cm = CostModel.from_profile(PROFILE)
    small = PlanEvaluator(graph, _with_tier(toy_cluster(), replace(TIER, capacity_bytes=10**10)), cm)
    r = small.evaluate(_plan(graph, "nvme"))
    assert r.nvme_bytes_per_node == pytest.approx(8e9 * 8) and not r.nvme_fits and not r.fits
    assert r.device_fits and r.host_fits
    none = PlanEvaluator(graph, toy_cluster(), cm).evaluate(_plan(graph, "nvme"))
    assert not none.nvme_fits and none.nvme_capacity_bytes == 0.0


CLUSTER = """
inter_node: {bandwidth_GBps: 25, latency_us: 5}
groups:
  - name: a
    gpu: a100-80gb-sxm
    nodes: 1
    gpus_per_node: 8
    host_memory_GB: 2048
    %s
"""


def test_cluster_file_nvme_entry():
    c = parse_cluster(CLUSTER % "nvme: {path: /raid/x, capacity_GB: 3840, read_GBps: 12.5, write_GBps: 6}")
    assert c.groups[0].nvme == Nvme(path="/raid/x", capacity_bytes=3840 * 10**9, read_GBps=12.5, write_GBps=6.0)
    assert parse_cluster(CLUSTER % "").groups[0].nvme is None
    with pytest.raises(ClusterFileError, match=r"groups\[0\]\.nvme\.read_GBps.*-1"):
        parse_cluster(CLUSTER % "nvme: {path: /raid/x, capacity_GB: 3840, read_GBps: -1, write_GBps: 6}")
    with pytest.raises(ClusterFileError, match=r"groups\[0\]\.nvme.*write_GBps"):
        parse_cluster(CLUSTER % "nvme: {path: /raid/x, capacity_GB: 3840, read_GBps: 1}")


def _search(cluster, graph, time_budget_s=30.0, **kw):
    from autopar.planner.search import PlanOptions, search

    options = PlanOptions(global_batch=8, time_budget_s=time_budget_s, algo="ilp", recompute=("full",), zero_families=("fsdp",),
                          schedules=("1f1b",), max_virtual_stages=1, sequence_parallel=False, precision="bf16", **kw)
    return search(graph, cluster, CostModel.from_profile(PROFILE), options)


def test_planner_takes_the_tier_only_where_host_memory_does_not_suffice():
    """16 GB devices cannot hold a 16e9-parameter model's state (16 B/param over 8 = 32 GB): it
    must offload.  With 150 GB of host memory the host cannot hold 256 GB of offloaded state
    either; with an NVMe tier the moments (128 GB) go there and the rest (128 GB) fits."""
    graph = dense_graph(16e9, 16)
    tight = toy_cluster(mem=16 * 10**9)
    tight = replace(tight, groups=(replace(tight.groups[0], host_memory_bytes=150 * 10**9),))
    result = _search(_with_tier(tight, TIER), graph)     # (the host-offload search found none first)
    offloads = {lp.offload for lp in result.best.plan.layers}
    assert "nvme" in offloads and "cpu" not in offloads
    assert "no plan fits host memory" in result.tier_note
    # where the host holds the state the tier is not searched: host offload, no note
    roomy = replace(tight, groups=(replace(tight.groups[0], host_memory_bytes=2 * 10**12),))
    b = _search(_with_tier(roomy, TIER), graph)
    assert b.tier_note == "" and "nvme" not in {lp.offload for lp in b.best.plan.layers}
    assert "cpu" in {lp.offload for lp in b.best.plan.layers}


def test_fast_path_prices_nvme_layers_as_a_fresh_evaluator():
    """The evaluator's per-layer memo (a plan differing in a few layers) gives the figures a fresh
    evaluator computes from the whole table, with NVMe, host and no offload mixed."""
    import random

    from autopar.simulator.evaluator import closed_form_step

    graph = dense_graph(8e9, 8)
    cluster = _with_tier(toy_cluster(), replace(TIER, read_GBps=20.0, write_GBps=10.0))
    cm = CostModel.from_profile(PROFILE)
    walker, plan, rng = PlanEvaluator(graph, cluster, cm), _plan(graph, "nvme", 8, 2), random.Random(7)
    layers = list(plan.layers)
    for _ in range(30):
        i = rng.randrange(len(layers))
        layers[i] = replace(layers[i], zero=rng.choice((2, 3)), offload=rng.choice(("none", "cpu", "nvme")))
        p = replace(plan, layers=tuple(layers))
        fast = walker.evaluate(p)
        fresh = PlanEvaluator(graph, cluster, cm)
        ctx, rows = fresh.prepare(p)
        scratch = fresh.assemble(p, ctx, rows, *closed_form_step(ctx, rows))
        assert (fast.step_time_s, fast.nvme_bytes_per_node, fast.host_bytes_per_node, fast.fits) == \
            (scratch.step_time_s, scratch.nvme_bytes_per_node, scratch.host_bytes_per_node, scratch.fits)


def test_profile_disk_writes_an_nvme_entry_the_cluster_file_takes(tmp_path):
    """``autopar profile --disk``: a scratch file written (fsync), read back and removed; the line
    it writes is a group's ``nvme`` entry of the disk's free space and bandwidths."""
    import yaml

    from cli_inprocess import run_cli

    out = run_cli("profile", "--disk", tmp_path, "-o", tmp_path / "nvme.yaml", "--disk-size-mb", 4)
    assert out.returncode == 0, out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["nvme.yaml"]          # the scratch file is gone
    entry = yaml.safe_load((tmp_path / "nvme.yaml").read_text())["nvme"]
    c = parse_cluster(CLUSTER % ("nvme: " + yaml.safe_dump(entry, default_flow_style=True).strip()))
    tier = c.groups[0].nvme
    assert tier.path == str(tmp_path.resolve()) and tier.read_GBps > 0 and tier.write_GBps > 0
    assert 0 < tier.capacity_bytes <= nvme_free(tmp_path) * 1.01 + 1e8
    bad = run_cli("profile", "--disk", tmp_path / "missing", "-o", tmp_path / "x.yaml")
    assert bad.returncode == 2 and "no such folder" in bad.stderr


def nvme_free(path) -> int:
    import os

    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _tight(host_GB: float):
    """16 GB devices that cannot hold a 16e9-parameter model's state, ``host_GB`` of host memory
    per node, an NVMe tier."""
    tight = toy_cluster(mem=16 * 10**9)
    return _with_tier(replace(tight, groups=(replace(tight.groups[0], host_memory_bytes=host_GB * 10**9),)), TIER)


@pytest.mark.parametrize("host_GB, tier, said", [
    (100, "nvme+grads", "AdamW's moments and the gradients go to the NVMe tier"),
    (40, "nvme+params+grads", "AdamW's moments, the gradients and the parameters go to the NVMe tier")])
def test_the_tier_takes_gradients_then_parameters_only_where_the_moments_are_not_enough(host_GB, tier, said):
    """The 16e9-parameter model (bf16: 16 B/param offloaded, 256 GB on the node): with the
    moments on the tier 128 GB stay on the host, with the gradients too 64 GB (fp32 shards: 4
    B/param), with the parameters too none.  100 GB of host memory takes the gradients to the
    tier, 40 GB the parameters as well; the reason says why at each step."""
    from autopar.planner.nvme_choice import nvme_retry
    from autopar.planner.search import PlanOptions

    options = PlanOptions(global_batch=8, recompute=("full",), zero_families=("fsdp",), schedules=("1f1b",),
                          max_virtual_stages=1, sequence_parallel=False, precision="bf16")
    retry, why = nvme_retry(dense_graph(16e9, 16), _tight(host_GB), CostModel.from_profile(PROFILE), options)
    assert retry.offload_tier == tier
    assert why.startswith("no plan fits host memory (offloading to the host needs at least 256.0 GB per node")
    assert "with AdamW's moments on the NVMe tier it still needs at least 128.0 GB per node" in why
    assert why.endswith(said), why


def test_planner_puts_parameters_and_gradients_on_the_tier_with_the_reason():
    """The search (planner/search.py) takes the tier nvme_retry names: 40 GB of host memory hold
    none of the state, so the plan keeps moments, gradients and parameters on the NVMe tier and
    its host memory fits."""
    result = _search(_tight(40), dense_graph(16e9, 16), time_budget_s=2.0)     # (the machine may be busy)
    offloads = {lp.offload for lp in result.best.plan.layers}
    assert "nvme+params+grads" in offloads and offloads <= {"nvme+params+grads", "none"}, offloads
    pred = result.best.plan.predicted
    assert pred["host_bytes_per_node"] <= 40 * 10**9 and pred["nvme_fits"]
    assert result.tier_note.endswith("AdamW's moments, the gradients and the parameters go to the NVMe tier")
