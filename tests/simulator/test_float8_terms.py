"""simulator/float8.py on hand-computed cases (a roofline device: bf16 peak 1e14 FLOP/s, linear
efficiency 0.5, memory 1e12 B/s x 0.5, launch floor 5 us)."""
from __future__ import annotations

import pytest

from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.axes.float8 import float8_linear_cost

PROFILE = dict(name="t", memory_bandwidth_Bps=1e12, peak_flops={"fp32": 1e13, "bf16": 1e14},
               efficiency={"linear": 0.5, "memory_bound": 0.5}, collective_efficiency={"intra": 1.0, "inter": 1.0})


def test_square_linear_tensorwise_and_rowwise():
    cm = CostModel.from_profile(PROFILE)
    n = 4096
    t = float8_linear_cost(n, n, n, cm, "tensorwise")
    # three GEMMs of 2 n^3 = 4.123e11 FLOPs: bf16 at 0.5e14 -> 8.246 ms; fp8 at twice the rate -> 4.123 ms
    assert t.bf16_gemm_s == pytest.approx(6 * n**3 / 0.5e14)
    assert t.gemm_s == pytest.approx(6 * n**3 / 1.0e14)
    # six casts of n^2 elements, 5 bytes each (amax read 2 + cast read 2, write 1) at 5e11 B/s: 1.007 ms
    assert t.cast_s == pytest.approx(6 * n * n * 5 / 5e11)
    assert t.speedup == pytest.approx((6 * n**3 / 0.5e14) / (6 * n**3 / 1e14 + 6 * n * n * 5 / 5e11))   # 1.61
    assert (t.allgather_bytes_per_weight, t.transient_weight_bytes) == (1, 2 * n * n)
    r = float8_linear_cost(n, n, n, cm, "rowwise")
    assert r.cast_s == pytest.approx(6 * n * n * 3 / 5e11) and r.gemm_s == t.gemm_s
    assert r.allgather_bytes_per_weight == 2          # rowwise all-gathers bf16


def test_few_tokens_are_launch_bound():
    """16 tokens: each cast of x or dy moves under 1 us of bytes, so it costs its kernels' launch
    floors (tensorwise: 2 x 5 us); the weight casts (4096 x 4096) stay bandwidth-bound."""
    cm = CostModel.from_profile(PROFILE)
    t = float8_linear_cost(16, 4096, 4096, cm, "tensorwise")
    small = 4 * 2 * 5e-6                                    # x, dy, dy^T, x^T
    weights = 2 * 4096 * 4096 * 5 / 5e11                    # W, W^T
    assert t.cast_s == pytest.approx(small + weights)
    assert t.speedup < 1.0                                  # float8 does not pay on a skinny GEMM


def test_profile_fp8_peak_wins_over_the_datasheet_ratio():
    cm = CostModel.from_profile({**PROFILE, "peak_flops": {**PROFILE["peak_flops"], "fp8": 3e14}})
    t = float8_linear_cost(1024, 1024, 1024, cm)
    assert t.gemm_s == pytest.approx(6 * 1024**3 / (3e14 * 0.5))
    with pytest.raises(ValueError):
        float8_linear_cost(8, 8, 8, cm, "blockwise")


def test_layer_cost_prices_an_fp8_layers_linears_by_these_terms():
    """A layer of one 4096 x 4096 linear on 4096 tokens: with precision fp8 its forward costs the
    fp8 GEMM and the casts of x and W, its backward the other two GEMMs and four casts, in place
    of the bf16 op's time (roofline: no autograd overheads on this profile)."""
    from autopar.core.cluster import Cluster, Link, NodeGroup
    from autopar.core.graph import Layer, OpGraph, OpNode
    from autopar.core.plan import LayerPlan, Mesh
    from autopar.simulator.evaluator import PlanEvaluator

    cm = CostModel.from_profile(PROFILE)
    m = n = k = 4096
    op = OpNode(name="fc", kind="linear", target="torch.nn.Linear", module_path="blocks.0.fc", layer=0,
                inputs=("input:x",), input_shapes=((m, k),), output_shape=(m, n), dtype="bfloat16",
                fwd_flops=2.0 * m * n * k, bwd_flops=4.0 * m * n * k, bytes_moved=2.0 * (m * k + k * n + m * n),
                params=("blocks.0.fc.weight",), param_numel=n * k, saved_bytes=2 * m * k, output_bytes=2 * m * n)
    layer = Layer(index=0, name="blocks.0", kind="Block", module_paths=("blocks.0",), ops=("fc",), param_numel=n * k,
                  fwd_flops=op.fwd_flops, bwd_flops=op.bwd_flops, saved_bytes=op.saved_bytes, input_bytes=2 * m * k,
                  output_bytes=2 * m * n, signature="b")
    g = OpGraph(model_name="t", model_file="<t>", model_args={}, batch_size=1, ops=[op], layers=[layer],
                params_total=n * k, param_dtype="bfloat16")
    cluster = Cluster("c", (NodeGroup("n", "t", 1, 1, 80 * 2**30, Link(100.0, 2.0), 2**40, Link(20.0, 10.0)),),
                      Link(10.0, 8.0))
    ev = PlanEvaluator(g, cluster, cm)
    mesh = Mesh(dp=1, pp=1, tp=1)
    bf16 = ev.layer_cost(0, LayerPlan(layer=0), mesh, 1, "bf16", cm)
    fp8 = ev.layer_cost(0, LayerPlan(layer=0, precision="fp8"), mesh, 1, "bf16", cm)
    c = float8_linear_cost(m, k, n, cm)
    eager_f, _ = cm.op_time_ex(op, "bf16")
    eager_b, _ = cm.op_time_ex(op, "bf16", backward=True)
    assert fp8.fwd_s - bf16.fwd_s == pytest.approx(c.fwd_s - eager_f, rel=1e-9)
    assert fp8.bwd_s - bf16.bwd_s == pytest.approx((c.total_s - c.fwd_s) - eager_b, rel=1e-9)
    assert fp8.fwd_s < bf16.fwd_s and fp8.bwd_s < bf16.bwd_s


def _one_linear_graph(m: int, k: int, n: int):
    """A model of one block holding one bf16 linear [k -> n] on m tokens (as above)."""
    from autopar.core.graph import Layer, OpGraph, OpNode

    op = OpNode(name="fc", kind="linear", target="torch.nn.Linear", module_path="blocks.0.fc", layer=0,
                inputs=("input:x",), input_shapes=((m, k),), output_shape=(m, n), dtype="bfloat16",
                fwd_flops=2.0 * m * n * k, bwd_flops=4.0 * m * n * k, bytes_moved=2.0 * (m * k + k * n + m * n),
                params=("blocks.0.fc.weight",), param_numel=n * k, saved_bytes=2 * m * k, output_bytes=2 * m * n)
    layer = Layer(index=0, name="blocks.0", kind="Block", module_paths=("blocks.0",), ops=("fc",), param_numel=n * k,
                  fwd_flops=op.fwd_flops, bwd_flops=op.bwd_flops, saved_bytes=op.saved_bytes, input_bytes=2 * m * k,
                  output_bytes=2 * m * n, signature="b")
    return OpGraph(model_name="t", model_file="<t>", model_args={}, batch_size=1, ops=[op], layers=[layer],
                   params_total=n * k, param_dtype="bfloat16")


def _evaluator(graph, devices: int = 2):
    from autopar.core.cluster import Cluster, Link, NodeGroup
    from autopar.simulator.evaluator import PlanEvaluator

    cluster = Cluster("c", (NodeGroup("n", "t", 1, devices, 80 * 2**30, Link(100.0, 2.0), 2**40, Link(20.0, 10.0)),),
                      Link(10.0, 8.0))
    return PlanEvaluator(graph, cluster, CostModel.from_profile(PROFILE))


def test_fp8_transient_copies():
    """torchao keeps the bf16 input and weight for backward and casts again there: the fp8
    copies alive at once are the backward's dy, W^T (dx) and dy^T, x^T (dW): 2mn + nk + mk bytes
    (m = 512 tokens, k = 1024, n = 4096: 4 MiB + 4 MiB + 0.5 MiB = 8.5 MiB)."""
    cm = CostModel.from_profile(PROFILE)
    c = float8_linear_cost(512, 1024, 4096, cm)
    assert c.transient_bytes == 2 * 512 * 4096 + 4096 * 1024 + 512 * 1024 == 8.5 * 2**20
    assert c.transient_weight_bytes == 2 * 4096 * 1024


def test_layer_memory_and_fsdp_all_gather_of_an_fp8_layer():
    """ZeRO-3 over dp = 2, bf16: the 4096 x 4096 weight all-gathers in fp8 under tensorwise
    (16 MiB in the unsharded buffer instead of 32 MiB; (2-1)/2 of it on the wire, twice per
    micro-batch -- forward and backward), in bf16 under rowwise; the gradient reduce-scatter
    stays bf16 (32 MiB, half on the wire); the fp8 copies add to the layer's transient bytes."""
    from autopar.core.plan import LayerPlan, Mesh
    from autopar.simulator.axes.float8 import float8_linear_cost

    m = n = k = 4096
    ev = _evaluator(_one_linear_graph(m, k, n))
    cm = CostModel.from_profile(PROFILE)
    mesh = Mesh(dp=2)
    bf16 = ev.layer_cost(0, LayerPlan(layer=0, zero=3), mesh, 1, "bf16", cm)
    tw = ev.layer_cost(0, LayerPlan(layer=0, zero=3, precision="fp8"), mesh, 1, "bf16", cm, fp8_recipe="tensorwise")
    rw = ev.layer_cost(0, LayerPlan(layer=0, zero=3, precision="fp8"), mesh, 1, "bf16", cm, fp8_recipe="rowwise")
    assert bf16.fsdp_param_buffer_bytes == rw.fsdp_param_buffer_bytes == 2 * n * k
    assert tw.fsdp_param_buffer_bytes == n * k
    # over a tensor-parallel mesh the runtime all-gathers bf16 (runtime/apply_fp8.py)
    ev2 = _evaluator(_one_linear_graph(m, k, n), devices=4)
    split = LayerPlan(layer=0, zero=3, precision="fp8", tp=(("blocks.0.fc", "colwise"),))
    assert ev2.layer_cost(0, split, Mesh(dp=2, tp=2), 1, "bf16", cm).fsdp_param_buffer_bytes == 2 * n * k / 2
    grad_wire = 0.5 * 2 * n * k
    assert bf16.dp_wire_bytes_per_mb == 2 * 0.5 * 2 * n * k + grad_wire
    assert tw.dp_wire_bytes_per_mb == 2 * 0.5 * n * k + grad_wire
    assert tw.dp_allgather_s < bf16.dp_allgather_s == rw.dp_allgather_s
    c = float8_linear_cost(m, k, n, cm)
    assert tw.transient_bytes - bf16.transient_bytes == c.transient_bytes == (2 + 1 + 1) * m * n
    # the recipe reaches the layer's cost: rowwise's casts move 3 bytes per element, tensorwise's 5
    assert rw.fwd_s + rw.bwd_s < tw.fwd_s + tw.bwd_s
    # state bytes are bf16's: torchao keeps the bf16 parameter (and fp32 master weights)
    assert (tw.param_bytes, tw.grad_bytes, tw.optimizer_bytes) == (bf16.param_bytes, bf16.grad_bytes,
                                                                   bf16.optimizer_bytes)


def test_linear_with_a_dim_not_divisible_by_16_stays_bf16():
    """The runtime leaves a linear of 1000 out features in bf16 (torch._scaled_mm's 16-element
    alignment): an fp8 layer of it costs what the bf16 layer costs."""
    from autopar.core.plan import LayerPlan, Mesh

    ev = _evaluator(_one_linear_graph(4096, 4096, 1000))
    cm = CostModel.from_profile(PROFILE)
    bf16 = ev.layer_cost(0, LayerPlan(layer=0), Mesh(), 1, "bf16", cm)
    fp8 = ev.layer_cost(0, LayerPlan(layer=0, precision="fp8"), Mesh(), 1, "bf16", cm)
    assert (fp8.fwd_s, fp8.bwd_s, fp8.transient_bytes) == (bf16.fwd_s, bf16.bwd_s, bf16.transient_bytes)


def test_what_the_runtime_converts():
    """Both dims divisible by 16, by 16 x tp when tensor parallelism splits the linear
    (runtime/apply_fp8.py: the shard's GEMM needs 16-aligned dims whichever dim is split)."""
    from autopar.simulator.axes.float8 import converts

    assert converts(4096, 14336) and not converts(4096, 50257)
    assert converts(32, 96, tp=2) and not converts(48, 64, tp=2) and converts(48, 64)


def test_fsdp_float8_all_gather_moves_the_weight_casts():
    """Under the FSDP2 fp8 all-gather the layer casts neither W nor W^T (they arrive in fp8);
    each all-gather first casts this rank's fp32 shard (4 + 1 bytes per element, one kernel)
    and the scales' precompute reads the shard (4 bytes) once per step.  dp = 2, a 4096 x 4096
    weight: the shard holds 8 Mi elements."""
    from autopar.core.plan import LayerPlan, Mesh

    cm = CostModel.from_profile(PROFILE)
    m = n = k = 4096
    shard = n * k / 2
    plain = float8_linear_cost(m, k, n, cm)
    gathered = float8_linear_cost(m, k, n, cm, gathered_shard=shard)
    weight_cast = n * k * 5 / 5e11                       # tensorwise: amax read 2 + cast read 2, write 1
    assert plain.cast_s - gathered.cast_s == pytest.approx(2 * weight_cast)
    assert gathered.shard_cast_s == pytest.approx(shard * 5 / 5e11)
    ev = _evaluator(_one_linear_graph(m, k, n))
    for zero, gathers in ((3, 2), (2, 1)):
        bf = ev.layer_cost(0, LayerPlan(layer=0, zero=zero, precision="fp8"), Mesh(dp=2), 1, "bf16", cm,
                           fp8_recipe="rowwise")     # rowwise: no fp8 all-gather, six casts of its own
        tw = ev.layer_cost(0, LayerPlan(layer=0, zero=zero, precision="fp8"), Mesh(dp=2), 1, "bf16", cm)
        rw = float8_linear_cost(m, k, n, cm, "rowwise")
        # the layer's compute: tensorwise's casts less W and W^T, plus the shard's cast per all-gather
        assert (tw.fwd_s + tw.bwd_s) - (bf.fwd_s + bf.bwd_s) == pytest.approx(
            gathered.cast_s - rw.cast_s + gathers * gathered.shard_cast_s, rel=1e-9)
        assert tw.optimizer_s - bf.optimizer_s == pytest.approx(shard * 4 / 5e11)
