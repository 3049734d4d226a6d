"""Host offload's optimizer and the NVMe tier's swap against closed forms: the node's ranks share
the host's Adam rate (simulator/axes/offload.py ``host_optimizer_s``), and code that swaps the
optimizer state serially in its step (``TrainingCode.nvme_swap_overlapped`` False, DeepSpeed's
``pipeline_read``/``pipeline_write`` false) pays the whole read and write (simulator/axes/nvme_tier.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.core.cluster_types import Nvme
from autopar.core.plan import ModelRef, uniform_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.training_code import TrainingCode
from autopar.simulator.evaluator import PlanEvaluator
from sim_graphs import PROFILE, dense_graph, toy_cluster

HOST_RATE = 2e9                          # params/s of one node's host, all its cores


def _plan(graph, offload: str, dp: int, m: int = 1):
    ref = ModelRef(graph.model_file, {}, graph.model_name, graph.fingerprint)
    return uniform_plan(model=ref, num_layers=len(graph.layers), dp=dp, micro_batch=1, num_microbatches=m,
                        zero=3, offload=offload, precision="bf16")


def _cm(code: TrainingCode | None = None) -> CostModel:
    cm = CostModel.from_profile(dict(PROFILE, host_adam_params_per_s=HOST_RATE))
    return cm.for_code(code) if code is not None else cm


@pytest.mark.parametrize("nodes, gpus", [(1, 2), (2, 1), (1, 4), (2, 2)])
def test_host_adam_is_the_node_rate_shared_by_its_ranks(nodes, gpus):
    """dp over every device, state offloaded: each rank steps trainable / dp parameters per layer
    on its node's host while the node's other ``gpus - 1`` ranks step theirs, so its step takes
    gpus x trainable / dp / node rate -- two ranks on one host twice as long per parameter as one
    rank alone on its host."""
    n, L = 8e9, 4
    graph = dense_graph(n, L)
    dp = nodes * gpus
    ev = PlanEvaluator(graph, toy_cluster(nodes=nodes, gpus=gpus), _cm())
    _, rows = ev.prepare(_plan(graph, "cpu", dp))
    shard = n / L / dp
    assert [float(x) for x in rows.optimizer_s] == pytest.approx([gpus * shard / HOST_RATE] * L, rel=1e-12)
    # the node's parameters at the node's rate: the same seconds however the node's shards fall
    assert float(rows.optimizer_s[0]) * nodes == pytest.approx(n / L / HOST_RATE, rel=1e-12)


def test_host_adam_per_parameter_doubles_with_two_ranks_on_one_host():
    graph = dense_graph(8e9, 4)
    one = PlanEvaluator(graph, toy_cluster(nodes=2, gpus=1), _cm()).prepare(_plan(graph, "cpu", 2))[1]
    two = PlanEvaluator(graph, toy_cluster(nodes=1, gpus=2), _cm()).prepare(_plan(graph, "cpu", 2))[1]
    assert float(two.optimizer_s[0]) == pytest.approx(2 * float(one.optimizer_s[0]), rel=1e-12)


TIER = Nvme(path="/nvme", capacity_bytes=10**13, read_GBps=10.0, write_GBps=5.0)


@pytest.mark.parametrize("m", [1, 4])
def test_serial_swap_pays_the_whole_read_and_write(m):
    """Against the cpu-offload plan of the same layout and code: where the code swaps serially the
    nvme plan's step is longer by every layer's read + write of the node's moments (no compute
    hides them); where it overlaps (autopar's runtime) by only what the layer's compute does not
    hide, less than that."""
    n, L, dp = 8e9, 4, 8
    graph = dense_graph(n, L, fwd_flops_per_layer=1e12)
    cluster = replace(toy_cluster(), groups=tuple(replace(g, nvme=TIER) for g in toy_cluster().groups))
    moments = n / L / dp * 8                              # per layer and device: two fp32 moments
    io = moments * dp / TIER.read_Bps + moments * dp / TIER.write_Bps
    steps = {}
    for overlapped in (False, True):
        ev = PlanEvaluator(graph, cluster, _cm(TrainingCode(nvme_swap_overlapped=overlapped)))
        cpu, nvme = ev.evaluate(_plan(graph, "cpu", dp, m)), ev.evaluate(_plan(graph, "nvme", dp, m))
        steps[overlapped] = nvme.step_time_s - cpu.step_time_s
    assert steps[False] == pytest.approx(L * io, rel=1e-9)
    assert 0.0 <= steps[True] < steps[False]
    assert TrainingCode().nvme_swap_overlapped                 # autopar's runtime overlaps it
