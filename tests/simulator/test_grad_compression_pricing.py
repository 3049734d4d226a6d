"""Gradient compression's price (simulator/grad_compression.py) against closed forms written here
from the profile's and the cluster's own numbers:

* a bf16 / fp16 cast halves the bytes of FSDP2's reduce-scatter (reduced in fp32 otherwise) and
  prices each DDP bucket's ring all-reduce at 2 bytes an element (Thakur et al. 2005: 2 (n - 1)
  latencies and 2 (n - 1) / n M over the link's bandwidth);
* PowerSGD (Vogels et al. 2019, Algorithm 1, as torch's powerSGD_hook runs it) prices a bucket as
  the all-reduces of its whole tensors, of P (n r per matrix) and of Q (m r), plus the larger of
  its FLOPs (3 x 2 n m r, and 2 n r^2 + 2 m r^2 of Gram-Schmidt at r <= 2) at the fp32 peak, 12
  passes over its bytes at the memory bandwidth, and its kernel launches;
* the matrices read from a captured model are its weights' shapes."""
from dataclasses import replace

import pytest

from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.simulate import plan_cost_models
from sim_graphs import REDUCE_PROFILE, gpt_graph, toy_cluster

PROFILE = REDUCE_PROFILE
NODE_LINK = toy_cluster().groups[0].intra_node       # one node of 8 devices: every group on this link
GRAPH = gpt_graph(4, 256, 4, 128, 1000)


def _rows(dp, zero, precision, compression):
    plan = config_plan(GRAPH, degrees={"dp": dp, "tp": 1, "pp": 1}, micro_batch=1, global_batch=dp, schedule="1f1b", virtual_stages=1,
                       zero=zero, recompute="none", offload="none", precision=precision, sequence_parallel=False)
    plan = replace(plan, grad_compression=compression)
    cm = CostModel.from_profile(PROFILE)
    return PlanEvaluator(GRAPH, toy_cluster(), plan_cost_models(plan, cm)).prepare(plan)[1], cm


def _ring_all_reduce(n, nbytes):
    bw = NODE_LINK.bandwidth_Bps * PROFILE["collective_efficiency"]["intra"]
    return 2 * (n - 1) * NODE_LINK.latency_s + 2 * (n - 1) / n * nbytes / bw if nbytes > 0 else 0.0


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("cast", ["bf16", "fp16"])
def test_cast_halves_the_fsdp_reduce_scatter(precision, cast):
    plain, _ = _rows(8, 2, precision, "none")
    cast_rows, _ = _rows(8, 2, precision, cast)
    assert plain.dp_reducescatter_s.sum() > 0
    assert cast_rows.dp_reducescatter_s == pytest.approx(plain.dp_reducescatter_s / 2, rel=1e-12)
    assert cast_rows.dp_allgather_s == pytest.approx(plain.dp_allgather_s, rel=1e-12)


def test_cast_prices_each_ddp_bucket_at_two_bytes():
    from autopar.simulator.axes.dp_buckets import buckets

    plain, _ = _rows(8, 0, "fp32", "none")
    rows, _ = _rows(8, 0, "fp32", "bf16")
    want = [0.0] * len(rows)
    for closing, _top, filled in buckets(plain.dp_grad_bytes):
        want[closing] = _ring_all_reduce(8, filled / 2)         # fp32 rows: 4 bytes -> 2
    assert list(rows.dp_allreduce_s) == pytest.approx(want, rel=1e-12)
    assert sum(want) > 0 and sum(want) < plain.dp_allreduce_s.sum()
    # the bytes a rank sends: the ring all-reduce's 2 (n - 1) / n M, at 2 bytes instead of 4
    assert rows.dp_wire_bytes_per_step == pytest.approx(plain.dp_wire_bytes_per_step / 2, rel=1e-12)


def test_powersgd_bucket_by_hand():
    from autopar.simulator.axes.dp_buckets import buckets
    from autopar.simulator.axes.grad_compression import layer_matrices

    rank = 2
    plain, cm = _rows(8, 0, "fp32", "none")
    rows, _ = _rows(8, 0, "fp32", f"powersgd:{rank}")
    launch = cm.overhead("op_launch_s")
    for closing, top, filled in buckets(plain.dp_grad_bytes):
        whole = p = q = flops = kernels = 0
        for k in range(closing, top + 1):
            mats, vec = layer_matrices(GRAPH, k)
            whole += vec
            for n, m in mats:
                r = min(n, m, rank)
                if (n + m) * r * 2 >= n * m:                      # torch's _should_compress
                    whole += n * m
                    continue
                p, q = p + n * r, q + m * r
                flops += 6 * n * m * r + 2 * n * r * r + 2 * m * r * r
                kernels += 3 + 2 * (2 * r + 4 * (r - 1))          # bmm x 3, Gram-Schmidt of P and Q
        work = max(flops / (PROFILE["peak_flops"]["fp32"] * PROFILE["efficiency"]["matmul"]),
                   12 * filled / (PROFILE["memory_bandwidth_Bps"] * PROFILE["efficiency"]["memory_bound"]),
                   kernels * launch)
        want = _ring_all_reduce(8, 4 * whole) + _ring_all_reduce(8, 4 * p) + _ring_all_reduce(8, 4 * q) + work
        assert p > 0 and rows.dp_allreduce_s[closing] == pytest.approx(want, rel=1e-12)
    # each layer sends its whole tensors, P and Q: 2 (n - 1) / n of them at 4 bytes
    sent = []
    for k in range(len(rows)):
        mats, vec = layer_matrices(GRAPH, k)
        total = vec + sum(n * m if (n + m) * min(n, m, rank) * 2 >= n * m else (n + m) * min(n, m, rank)
                          for n, m in mats)
        sent.append(2 * 7 / 8 * 4 * total)
    assert list(rows.dp_wire_bytes_per_step) == pytest.approx(sent, rel=1e-12)
    # error feedback keeps one more copy of the gradients
    assert rows.grad_bytes == pytest.approx(plain.grad_bytes + plain.dp_grad_bytes, rel=1e-12)


def test_powersgd_sends_a_small_fraction_and_casts_half():
    from autopar.simulator.axes.grad_compression import compressed_fraction

    assert compressed_fraction(GRAPH, "bf16") == 0.5 and compressed_fraction(GRAPH, "none") == 1.0
    f1, f4 = compressed_fraction(GRAPH, "powersgd:1"), compressed_fraction(GRAPH, "powersgd:4")
    assert 0 < f1 < f4 < 0.1


@pytest.mark.slow
def test_layer_matrices_are_the_weights_shapes():
    """From the captured small GPT: each block's weights (qkv 96 x 32, proj 32 x 32, fc 128 x 32,
    proj 32 x 128, as {n, m} pairs) and its vectors (norms and biases) -- the model's own
    named_parameters say so."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from runtime_support import graph
    from autopar.simulator.axes.grad_compression import layer_matrices

    g = graph()
    block = next(i for i, l in enumerate(g.layers) if l.name == "blocks.0")
    mats, vec = layer_matrices(g, block)
    assert sorted(tuple(sorted(m)) for m in mats) == sorted([(32, 96), (32, 32), (32, 128), (32, 128)])
    assert vec == 4 * 32 + 96 + 32 + 128 + 32        # ln1, ln2 (weight + bias); the four biases


def test_layer_matrices_of_a_cnn_are_out_channels_by_the_rest():
    """examples/cnn.py at 8 channels: each block's 3x3 convolution (no bias) is the matrix torch's
    hook compresses, weight.view(out_channels, -1) = 8 x 72, and its BatchNorm's weight and bias
    are two vectors of 8 -- not matrices cut along the image's width (its last dimension, 16)."""
    from autopar.core.capture import capture_model_file
    from autopar.simulator.axes.grad_compression import layer_matrices

    g = capture_model_file(str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "cnn.py"),
                           {"blocks": 2, "channels": 8}, 2)
    block = next(i for i, l in enumerate(g.layers) if l.name == "blocks.0")
    assert layer_matrices(g, block) == (((8, 72),), 2 * 8)
