"""The sharded-data-parallel cost terms (simulator/sharded_dp.py) and the ring bandwidth over nodes
(simulator/network.py) against their closed forms."""
import numpy as np
import pytest

from autopar.core.plan import Mesh
from autopar.simulator.step.layer_cost import LAYER_COST_FIELDS
from autopar.simulator.device.network import ring_bus_bandwidth_GBps
from autopar.simulator.axes.sharded_dp import copy_out_s, overlap_slowdown_s, reduce_scale, with_sharded_dp_costs


def test_ring_bandwidth_over_nodes():
    # 8 ranks a node, 25 GB/s a GPU: the node's 200 GB/s, under NVLink's 300
    assert ring_bus_bandwidth_GBps(25.0, 300.0, 8) == 200.0
    assert ring_bus_bandwidth_GBps(50.0, 300.0, 8) == 300.0      # NVLink bounds it
    assert ring_bus_bandwidth_GBps(25.0, 300.0, 1) == 25.0       # one rank a node: one adapter


def test_copy_and_overlap_closed_forms():
    # 1 GB read and written at 2 TB/s x 0.8
    assert copy_out_s(1e9, 2e12, 0.8) == pytest.approx(2e9 / 1.6e12)
    assert copy_out_s(0.0, 2e12, 0.8) == 0.0
    assert overlap_slowdown_s(np.array([1.0, 0.2]), np.array([0.5, 0.5]), 0.5).tolist() == [0.25, 0.1]


def _sharded_pair():
    """(column index, ZeRO column, rows) of two ZeRO-3 layers: 1 s forward, 2 s backward, a 0.4 s
    gather and a 0.3 s reduce-scatter each, 1 GB of unsharded parameters and gradients."""
    col = {n: i for i, n in enumerate(LAYER_COST_FIELDS)}
    zero_col = len(LAYER_COST_FIELDS)
    rows = np.zeros((2, zero_col + 1))
    for k in range(2):
        rows[k, col["fwd_s"]], rows[k, col["bwd_s"]] = 1.0, 2.0
        rows[k, col["dp_allgather_s"]], rows[k, col["dp_reducescatter_s"]] = 0.4, 0.3
        rows[k, col["fsdp_param_buffer_bytes"]] = rows[k, col["fsdp_grad_buffer_bytes"]] = 1e9
        rows[k, zero_col] = 3
    return col, zero_col, rows


def test_rows_of_a_sharded_pair_of_layers():
    col, zero_col, rows = _sharded_pair()
    out = with_sharded_dp_costs(rows, col, zero_col, 1e12, 1.0, slowdown=0.5)
    cp = 2e9 / 1e12                                       # 2 ms per copy
    # layer 0: forward under layer 1's gather (0.4 s), backward under its reduce-scatter and copy-in
    assert out[0, col["fwd_s"]] == pytest.approx(1.0 + cp + 0.5 * 0.4)
    assert out[0, col["bwd_s"]] == pytest.approx(2.0 + cp + 0.5 * (0.3 + cp))
    # layer 1: nothing gathered after it in forward; in backward layer 0's gather runs too
    assert out[1, col["fwd_s"]] == pytest.approx(1.0 + cp)
    assert out[1, col["bwd_s"]] == pytest.approx(2.0 + cp + 0.5 * (0.3 + cp + 0.4))
    assert out[0, col["dp_reducescatter_s"]] == pytest.approx(0.3 + cp)
    rows[:, zero_col] = 0                                 # DDP rows are left alone
    assert with_sharded_dp_costs(rows, col, zero_col, 1e12, 1.0, slowdown=0.5) is rows


def test_fsdp1_prices_no_copy_out_and_its_gradient_concat_on_compute():
    """FSDP1 gathers into the buffer its parameters view (no copy-out), while autograd concatenates
    each unit's gradient on the compute stream, and its post-backward pre-divides (and, in torch
    1.13, pads) the gradient on the reduce-scatter's stream (sharded_dp.py item 5): against the
    closed form of a copy, 2 x bytes / HBM bandwidth, for a 1 GB unit at 1 TB/s (2 ms)."""
    from autopar.simulator.axes.sharded_dp import FSDP1_TORCH_1_13, FSDP1_TORCH_2_2, FSDP2

    col, zero_col, rows = _sharded_pair()
    cp = 2 * 1e9 / 1e12
    fsdp2 = with_sharded_dp_costs(rows, col, zero_col, 1e12, 1.0, slowdown=0.0, runtime=FSDP2)
    new = with_sharded_dp_costs(rows, col, zero_col, 1e12, 1.0, slowdown=0.0, runtime=FSDP1_TORCH_2_2)
    old = with_sharded_dp_costs(rows, col, zero_col, 1e12, 1.0, slowdown=0.0, runtime=FSDP1_TORCH_1_13)
    for k in range(2):
        # FSDP2: a copy-out in forward and in backward; FSDP1: none in forward
        assert fsdp2[k, col["fwd_s"]] == pytest.approx(1.0 + cp)
        assert new[k, col["fwd_s"]] == old[k, col["fwd_s"]] == pytest.approx(1.0)
        assert fsdp2[k, col["fwd_s"]] - new[k, col["fwd_s"]] == pytest.approx(copy_out_s(1e9, 1e12, 1.0))
        # backward: FSDP2 copies the parameters out; FSDP1 concatenates the gradient instead
        assert fsdp2[k, col["bwd_s"]] == pytest.approx(2.0 + cp)
        assert new[k, col["bwd_s"]] == old[k, col["bwd_s"]] == pytest.approx(2.0 + cp)
        # the reduce-scatter's stream: FSDP2's copy-in, FSDP1's pre-divide, 1.13's pre-divide and pad
        assert fsdp2[k, col["dp_reducescatter_s"]] == new[k, col["dp_reducescatter_s"]] == pytest.approx(0.3 + cp)
        assert old[k, col["dp_reducescatter_s"]] == pytest.approx(0.3 + 2 * cp)
    # with the overlap slowdown on, FSDP1's forward is the bare compute plus the slowdown under the
    # next layer's gather (0.5 x 0.4 s), no copy
    slow = with_sharded_dp_costs(rows, col, zero_col, 1e12, 1.0, slowdown=0.5, runtime=FSDP1_TORCH_2_2)
    assert slow[0, col["fwd_s"]] == pytest.approx(1.0 + 0.5 * 0.4)


def test_reduce_in_fp32_doubles_a_mixed_precision_reduce_scatter():
    assert reduce_scale("bf16", 4.0) == 2.0 and reduce_scale("bf16", 2.0) == 1.0
    assert reduce_scale("fp32", 4.0) == 1.0
    col = {n: i for i, n in enumerate(LAYER_COST_FIELDS)}
    zero_col = len(LAYER_COST_FIELDS)
    rows = np.zeros((1, zero_col + 1))
    rows[0, col["dp_reducescatter_s"]], rows[0, col["fsdp_grad_buffer_bytes"]] = 0.3, 1e9
    rows[0, zero_col] = 3
    out = with_sharded_dp_costs(rows, col, zero_col, 1e12, 1.0, slowdown=0.0, reduce_factor=2.0)
    # the reduce-scatter's wire time and its copy-in of the fp32 gradients both double
    assert out[0, col["dp_reducescatter_s"]] == pytest.approx(2 * 0.3 + 2 * 2e9 / 1e12)


def test_autocast_modes_follow_the_runtime_and_fp32_ops_double():
    from autopar.simulator.device import autocast as A

    # DDP / ZeRO-1 alone, or one dp rank: autocast with fp32 parameters; FSDP2 paths: none; fp32: none
    assert A.autocast_mode(0, Mesh(dp=8), "bf16") == A.FP32_PARAMS
    assert A.autocast_mode(1, Mesh(dp=8), "bf16") == A.FP32_PARAMS
    assert A.autocast_mode(0, Mesh(tp=8, pp=4), "bf16") == A.FP32_PARAMS
    assert A.autocast_mode(0, Mesh(dp=8, tp=2), "bf16") == A.OFF          # replicate on FSDP2
    assert A.autocast_mode(3, Mesh(dp=8), "bf16") == A.OFF
    assert A.autocast_mode(0, Mesh(dp=8), "fp32") == A.OFF
    assert A.bytes_factor("norm", "layer_norm", A.FP32_PARAMS) == 2.0
    assert A.bytes_factor("loss", None, A.LOW_PARAMS) == 2.0
    assert A.bytes_factor("elementwise", "add", A.FP32_PARAMS) == 2.0      # the fp32 residual stream
    assert A.bytes_factor("elementwise", "add", A.LOW_PARAMS) == 1.0
    assert A.bytes_factor("elementwise", "gelu", A.FP32_PARAMS) == 1.0     # on a linear's bf16 output
    assert A.bytes_factor("linear", "linear", A.FP32_PARAMS) == 1.0
    assert A.bytes_factor("norm", "layer_norm", A.OFF) == 1.0


def test_deepspeed_2021_gathers_again_for_recompute_at_one_adapter_share():
    from autopar.simulator.axes.sharded_dp import DEEPSPEED_ZERO3_2021, FSDP2, gather_bandwidth_scale
    from autopar.simulator.step.layer_table import COLUMN_INDEX, COLUMNS, RECOMPUTE_CODE

    # one GPU's 25 GB/s share of a node whose ring reaches 200 GB/s: 8 times the wire time
    assert gather_bandwidth_scale(DEEPSPEED_ZERO3_2021, "inter", 200.0, 25.0, 0.85, 0.39) == 8.0
    assert gather_bandwidth_scale(DEEPSPEED_ZERO3_2021, "intra", 300.0, 25.0, 0.85, 0.39) == 1.0
    assert gather_bandwidth_scale(FSDP2, "intra", 300.0, 25.0, 0.85, 0.39) == 1.0
    col = COLUMN_INDEX
    rows = np.zeros((2, len(COLUMNS)))
    for k in range(2):
        rows[k, col["fwd_s"]], rows[k, col["bwd_s"]], rows[k, col["recompute_s"]] = 1.0, 2.0, 1.0
        # 0.01 s of ring latency + 0.04 s of wire time for the gather, 0.01 + 0.03 for the reduce-scatter
        rows[k, col["dp_allgather_s"]], rows[k, col["dp_reducescatter_s"]] = 0.05, 0.04
        rows[k, col["fsdp_param_buffer_bytes"]] = 1e9
        rows[k, col["zero"]] = 3
        rows[k, col["recompute"]] = RECOMPUTE_CODE["full"]
    cp = 2e9 / 1e12
    out = with_sharded_dp_costs(rows, col, col["zero"], 1e12, 1.0, slowdown=0.0,
                                runtime=DEEPSPEED_ZERO3_2021, bandwidth_scale=8.0, latency_s=0.01)
    ag, rs = 0.01 + 8 * 0.04, 0.01 + 8 * 0.03
    assert out[0, col["dp_allgather_s"]] == pytest.approx(ag)
    # backward stream: the reduce-scatter and the recomputed forward's gather; its copy-out in recompute
    assert out[0, col["dp_reducescatter_s"]] == pytest.approx(rs + ag)
    assert out[0, col["recompute_s"]] == pytest.approx(1.0 + cp)
    # FSDP2 on the same rows: two gathers, wire time as priced
    fsdp = with_sharded_dp_costs(rows, col, col["zero"], 1e12, 1.0, slowdown=0.0, runtime=FSDP2)
    assert fsdp[0, col["dp_reducescatter_s"]] == pytest.approx(0.04)
    assert fsdp[0, col["recompute_s"]] == pytest.approx(1.0)


def test_planner_tables_carry_the_sharded_terms_of_the_full_price():
    """planner/layer_tables.py prices an FSDP block as the simulator prices it inside a model of
    identical blocks: per micro-batch, max(compute, gather) forward and max(compute, backward
    traffic) backward after the copies and the overlap slowdown (simulator/sharded_dp.py)."""
    from autopar.core.cluster import load_cluster
    from autopar.core.plan import LayerPlan, Mesh
    from autopar.planner.layer_tables import build_layer_tables
    from autopar.planner.space import LayerChoice
    from autopar.simulator.configure import config_plan
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator
    from autopar.simulator.step.compose import layer_effective_times
    from sim_graphs import gpt_graph

    g = gpt_graph(8, 1024, 16, 1024, 50304)
    cluster = load_cluster("dgx-a100-4x8")
    ev = PlanEvaluator(g, cluster, CostModel.from_profile("a100-80gb-sxm"))
    plan = config_plan(g, degrees={"dp": 32, "tp": 1, "pp": 1},
                       micro_batch=2, global_batch=128, schedule="1f1b", virtual_stages=1,
                       zero=3, recompute="none", offload="none", precision="bf16", sequence_parallel=False)
    ctx, rows = ev.prepare(plan)
    fwd, bwd = layer_effective_times(rows, ctx.head, ctx.tail, ctx.not_tail)
    blocks = [i for i, layer in enumerate(g.layers) if layer.kind not in ("pre", "post")]
    k = blocks[len(blocks) // 2]                     # a block between two blocks
    mesh = Mesh(dp=32, tp=1, pp=1)
    t = build_layer_tables(ev, styles=[{} for _ in g.layers], signatures=[layer.signature for layer in g.layers],
                           choices=[LayerChoice(zero=3)], mesh=mesh, micro_batch=2, num_microbatches=2,
                           precision="bf16")
    assert t.time_mb_s[k, 0] == pytest.approx(fwd[k] + bwd[k], rel=1e-9)
    # and more than the layer's bare compute: the terms are there
    bare = ev.layer_cost(k, LayerPlan(layer=k, zero=3), mesh, 2, "bf16")
    assert t.time_mb_s[k, 0] > bare.fwd_s + bare.bwd_s


def test_ring_over_nodes_at_its_own_efficiency_and_without_overlap_slowdown():
    """sharded_dp.py items 2 and 6: a sharded ring over nodes on the node's aggregate network reaches
    the calibration's sharded_ring_efficiency of it where the rows priced the profile's all-reduce efficiency, and the
    compute under it is not slowed; within a node (NVLink) the slowdown applies and the bandwidth
    stays; DeepSpeed's per-GPU gathers keep the slowdown and their own share (item 4b)."""
    from autopar.simulator.axes import sharded_dp as S
    from autopar.simulator.device.calibration import Calibration
    from autopar.simulator.step.layer_table import COLUMN_INDEX, COLUMNS

    cal = Calibration(nccl_overlap_slowdown=0.45, sharded_ring_efficiency=0.4)
    # 0.85 priced, 0.5 reached: 1.7 times the wire time (NVIDIA/nccl issue #1218's two figures)
    assert S.gather_bandwidth_scale(S.FSDP2, "inter", 100.0, 12.5, 0.85, ring_efficiency=0.5) == pytest.approx(1.7)
    assert S.gather_bandwidth_scale(S.FSDP1_TORCH_2_2, "inter", 100.0, 12.5, 0.85,
                                    ring_efficiency=0.5) == pytest.approx(1.7)
    # never faster than priced
    assert S.gather_bandwidth_scale(S.FSDP2, "inter", 100.0, 12.5, 0.85, ring_efficiency=0.9) == 1.0
    assert S.overlap_slowdown(S.FSDP2, "inter", cal) == 0.0
    assert S.overlap_slowdown(S.FSDP2, "intra", cal) == 0.45
    assert S.overlap_slowdown(S.DEEPSPEED_ZERO3_2021, "inter", cal) == 0.45

    col = COLUMN_INDEX
    rows = np.zeros((3, len(COLUMNS)))
    for k in range(3):
        rows[k, col["fwd_s"]], rows[k, col["bwd_s"]] = 0.010, 0.020
        # 95 hops of 5 us of ring latency + 0.004 s on the wire, for the gather and the reduce-scatter
        rows[k, col["dp_allgather_s"]] = rows[k, col["dp_reducescatter_s"]] = 95 * 5e-6 + 0.004
        rows[k, col["zero"]] = 3
    terms = S.collective_terms(S.FSDP1_TORCH_2_2, "inter", 96, 100.0, 5e-6, 12.5, 0.85, cal)
    assert terms["slowdown"] == 0.0 and terms["latency_s"] == pytest.approx(95 * 5e-6)
    out = S.with_sharded_dp_costs(rows, col, col["zero"], 1e12, 1.0, **terms)
    wire = 0.004 * 0.85 / 0.4
    assert out[1, col["dp_allgather_s"]] == pytest.approx(95 * 5e-6 + wire)
    assert out[1, col["fwd_s"]] == pytest.approx(0.010)       # FSDP1: no copy-out, no slowdown
    # within a node the same rows keep their wire time and the forward runs under the next gather slower
    terms = S.collective_terms(S.FSDP1_TORCH_2_2, "intra", 8, 300.0, 1e-6, 12.5, 0.85, cal)
    out = S.with_sharded_dp_costs(rows, col, col["zero"], 1e12, 1.0, **terms)
    assert out[1, col["dp_allgather_s"]] == pytest.approx(rows[1, col["dp_allgather_s"]])
    assert out[1, col["fwd_s"]] == pytest.approx(0.010 + 0.45 * rows[2, col["dp_allgather_s"]])
