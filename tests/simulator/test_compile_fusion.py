"""The simulator's compile term (simulator/compile_fusion.py) on hand-computed cases.

A block of six ops, bf16, every tensor [4, 8] = 32 elements = 64 bytes:

    fc = linear(x)            gate = linear(x)
    act = gelu(fc)            (keeps fc for backward: 64 B, from outside the region)
    mul = act * gate          (keeps act and gate: 128 B; act is made inside the region)
    proj = linear(mul)
    res = act + proj          (reads act again, after the GEMM proj)

Regions: {act, mul} (epoch 1) and {res} (epoch 2: it waits for proj, which needs mul, so it
cannot join the first region).  {act, mul} reads fc and gate once (128 B) and writes mul (read by
proj), act (read by res, outside the region) and nothing more for mul's saved act (already
written) ... counted as written bytes: mul 64 + act 64 + (mul keeps 128 - 64 from outside = 64)
= 192 B.  {res} reads act and proj (128 B) and writes res (the layer's output, 64 B).
"""
from __future__ import annotations

import pytest

from autopar.core.graph import Layer, OpGraph, OpNode
from autopar.core.plan import Mesh
from autopar.simulator.axes.compile_fusion import compile_saving, fused_regions, graph_consumers

E = 64          # bytes of one [4, 8] bf16 tensor


def _op(name, kind, inputs, saved=0, fwd=32.0, moved=None):
    return OpNode(name=name, kind=kind, target=kind, module_path="blocks.0", layer=1, inputs=tuple(inputs),
                  input_shapes=tuple((4, 8) for _ in inputs), output_shape=(4, 8), dtype="bfloat16",
                  fwd_flops=fwd, bwd_flops=2 * fwd, bytes_moved=float(moved if moved is not None else E * (len(inputs) + 1)),
                  saved_bytes=saved, output_bytes=E)


OPS = [
    _op("fc", "linear", ["input:x"], saved=E, fwd=512.0),
    _op("gate", "linear", ["input:x"], fwd=512.0),
    _op("act", "elementwise", ["fc"], saved=E),
    _op("mul", "elementwise", ["act", "gate"], saved=2 * E),
    _op("proj", "linear", ["mul"], saved=E, fwd=512.0),
    _op("res", "elementwise", ["act", "proj"]),
]


def _graph():
    layer = Layer(index=0, name="blocks.0", kind="Block", module_paths=("blocks.0",), ops=tuple(o.name for o in OPS),
                  param_numel=0, fwd_flops=sum(o.fwd_flops for o in OPS), bwd_flops=sum(o.bwd_flops for o in OPS),
                  saved_bytes=sum(o.saved_bytes for o in OPS), input_bytes=E, output_bytes=E, signature="b")
    return OpGraph(model_name="t", model_file="<t>", model_args={}, batch_size=4, ops=list(OPS), layers=[layer],
                   params_total=0, param_dtype="bfloat16")


def test_regions_read_once_write_once_and_stop_at_a_gemm():
    regions = fused_regions(OPS, graph_consumers(_graph()))
    assert [r.ops for r in regions] == [("act", "mul"), ("res",)]
    first, second = regions
    assert first.read_bytes == 2 * E                # fc and gate, once each
    assert first.write_bytes == 3 * E               # mul (to proj), act (to res), act kept by mul
    assert first.fwd_flops == 64.0 and first.bwd_flops == 128.0
    assert second.read_bytes == 2 * E and second.write_bytes == E
    # eager: act moves 2E, mul 3E = 5E (4E of it by the gelu/mul pair that are fused): the region moves 5E
    # too here, because act must still be written for res -- a fusion saves the launches, not bytes


def test_region_of_views_only_is_no_kernel():
    ops = [_op("fc", "linear", ["input:x"]), _op("v", "view", ["fc"], moved=0), _op("p", "linear", ["v"])]
    assert fused_regions(ops, {"fc": ("v",), "v": ("p",)}) == []


def test_saving_is_eager_minus_one_fused_kernel_per_region():
    regions = fused_regions(OPS, graph_consumers(_graph()))
    eager_f = {"act": 3.0, "mul": 4.0, "res": 2.0, "fc": 10.0}
    eager_b = {"act": 6.0, "mul": 8.0, "res": 4.0, "fc": 20.0}
    # one fused kernel: 1 s forward, 2 s backward; one autograd node per region: 0.5 s
    s = compile_saving(regions, eager_f, eager_b, lambda r, bwd: 2.0 if bwd else 1.0, 0.5)
    assert s.fwd_s == pytest.approx((3 + 4 - 1.5) + (2 - 1.5))     # 6.0
    assert s.bwd_s == pytest.approx((6 + 8 - 2) + (4 - 2))         # 14.0
    assert (s.regions, s.fused_ops) == (2, 3)
    # a fused kernel slower than its eager ops saves nothing (never a loss)
    assert compile_saving(regions, eager_f, eager_b, lambda r, bwd: 100.0, 0.0).fwd_s == 0.0


def _big(op, n):
    """The op on [n, n] tensors (bf16) instead of [4, 8]."""
    from dataclasses import replace

    k = n * n / 32
    return replace(op, input_shapes=tuple((n, n) for _ in op.inputs), output_shape=(n, n), fwd_flops=op.fwd_flops * k,
                   bwd_flops=op.bwd_flops * k, bytes_moved=op.bytes_moved * k, saved_bytes=int(op.saved_bytes * k),
                   output_bytes=int(op.output_bytes * k))


def _layer_costs(ops):
    from autopar.core.cluster import Cluster, Link, NodeGroup
    from autopar.core.plan import LayerPlan, Mesh
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator

    prof = dict(name="t", memory_bandwidth_Bps=1e12, peak_flops={"fp32": 1e13, "bf16": 1e14},
                efficiency={"linear": 0.5, "memory_bound": 0.5}, collective_efficiency={"intra": 1.0, "inter": 1.0})
    cm = CostModel.from_profile(prof)
    cluster = Cluster("c", (NodeGroup("n", "t", 1, 1, 80 * 2**30, Link(100.0, 2.0), 2**40, Link(20.0, 10.0)),),
                      Link(10.0, 8.0))
    layer = Layer(index=0, name="blocks.0", kind="Block", module_paths=("blocks.0",), ops=tuple(o.name for o in ops),
                  param_numel=0, fwd_flops=sum(o.fwd_flops for o in ops), bwd_flops=sum(o.bwd_flops for o in ops),
                  saved_bytes=sum(o.saved_bytes for o in ops), input_bytes=ops[-1].output_bytes,
                  output_bytes=ops[-1].output_bytes, signature="b")
    g = OpGraph(model_name="t", model_file="<t>", model_args={}, batch_size=4, ops=list(ops), layers=[layer],
                params_total=0, param_dtype="bfloat16")
    ev = PlanEvaluator(g, cluster, cm)
    lp, mesh = LayerPlan(layer=0), Mesh(dp=1, pp=1, tp=1)
    return cm, ev.layer_cost(0, lp, mesh, 4, "bf16", cm, False), ev.layer_cost(0, lp, mesh, 4, "bf16", cm, True)


def test_layer_cost_launch_bound_saves_one_launch_per_fused_op():
    """Tiny tensors: every op costs the launch floor L (plus the autograd node A of an op with a
    backward).  {act, mul} becomes one kernel and one autograd node: compile saves one L + A in the
    forward and one backward launch in the backward; {res} is one op either way."""
    cm, eager, compiled = _layer_costs(OPS)
    launch, back, node = (cm.overhead(k) for k in ("op_launch_s", "op_backward_launch_s", "autograd_fwd_op_s"))
    assert launch > 0 and back > 0
    assert eager.fwd_s - compiled.fwd_s == pytest.approx(launch + node, rel=1e-9)
    assert eager.bwd_s - compiled.bwd_s == pytest.approx(back, rel=1e-9)


def test_layer_cost_bandwidth_bound_saves_the_fused_away_traffic():
    """[4096, 4096] tensors (E = 32 MiB, E / B = 67 us at B = 1e12 x 0.5 B/s, far above the launch
    floor) and res reading x instead of act: eager act moves 2E and mul 3E; fused {act, mul} reads
    fc and gate (2E) and writes mul and the act mul keeps (2E) = 4E: the forward saves E, the
    backward (twice the bytes) 2E, each x 2: bf16 without FSDP runs under autocast with fp32
    master weights, where these ops (target "elementwise", priced as adds) read and write fp32
    (simulator/autocast.py), the fused kernel too; the GEMMs and the kept activations are unchanged."""
    n = 4096
    ops = [_big(o, n) for o in OPS[:5] + [_op("res", "elementwise", ["input:x", "proj"])]]
    big_e = n * n * 2
    cm, eager, compiled = _layer_costs(ops)
    node = cm.overhead("autograd_fwd_op_s")
    bw = 1e12 * 0.5
    from autopar.simulator.device import autocast

    from autopar.simulator.device.cost_model import op_variant

    fp32 = autocast.bytes_factor("elementwise", op_variant("elementwise", "elementwise"), autocast.autocast_mode(0, Mesh(dp=1, pp=1, tp=1), "bf16",
                                                                             cm.code.autocast))
    assert fp32 == 2.0
    assert eager.fwd_s - compiled.fwd_s == pytest.approx(fp32 * big_e / bw + node, rel=1e-9)
    assert eager.bwd_s - compiled.bwd_s == pytest.approx(fp32 * 2 * big_e / bw, rel=1e-9)
    assert compiled.hw_flops == eager.hw_flops and compiled.activation_bytes == eager.activation_bytes


def test_simulate_cli_compile_flag(capsys):
    """``autopar simulate --compile`` prices the configuration compiled: GPT-2 small's unfused
    attention (scale, mask, softmax, dropout between its two batched GEMMs) and its GELU chains
    fuse, so the step is shorter, and the JSON says compile."""
    import json
    from pathlib import Path

    from autopar.cli import main

    gpt = str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
    base = ["simulate", gpt, "--model-arg", "size=gpt2-small", "--model-arg", "layers=2",
            "--cluster", "h100-16x8", "--nodes", "1", "--dp", "8", "--micro-batch", "4", "--json"]
    out = {}
    for extra in ((), ("--compile",)):
        assert main(base + list(extra)) == 0
        out[bool(extra)] = json.loads(capsys.readouterr().out)
    assert out[True]["plan"]["compile"] is True and out[False]["plan"]["compile"] is False
    assert out[True]["step_time_s"] < out[False]["step_time_s"]
    assert out[True]["max_memory_bytes"] == out[False]["max_memory_bytes"]    # activations kept as eager
