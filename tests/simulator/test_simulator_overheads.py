"""Framework overheads, measured-table variants, the optimizer's per-tensor cost and shared
compute slots, each against its closed form on a synthetic profile with known figures."""
import math

import numpy as np

import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.core.cluster_file import parse_cluster
from autopar.core.errors import ClusterFileError
from autopar.core.graph import OpNode
from autopar.core.plan import LayerPlan, Mesh
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.simulate import simulate_plan
from autopar.simulator.step.cpu_node import compute_stretch
from sim_graphs import gpt_graph

OVERHEADS = {"op_launch_s": 2e-6, "op_backward_launch_s": 5e-6, "tp_module_fwd_s": 1e-4, "tp_module_bwd_s": 3e-4,
             "fsdp_unit_fwd_s": 2e-4, "fsdp_unit_bwd_s": 4e-4, "optimizer_tensor_s": 3e-5,
             "optimizer_dtensor_tensor_s": 3e-4}
BASE = dict(name="cpu-t", device="cpu", memory_bandwidth_Bps=1e10, peak_flops={"fp32": 1e11, "bf16": 1e11},
            efficiency={"linear": 1.0, "matmul": 1.0, "memory_bound": 1.0},
            collective_efficiency={"intra": 1.0, "inter": 1.0})


def _profile(overheads=None, **extra):
    return {**BASE, **({"framework_overheads": overheads} if overheads is not None else {}), **extra}


def _op(kind, target, fwd_flops=0.0, bytes_moved=0.0):
    return OpNode(name="x", kind=kind, target=target, module_path="m", layer=0, inputs=(), input_shapes=((4,),),
                  output_shape=(4,), dtype="float32", fwd_flops=fwd_flops, bwd_flops=2 * fwd_flops,
                  bytes_moved=bytes_moved)


def _cluster(gpus=4, slots=0):
    g = NodeGroup("n", "cpu-t", 1, gpus, 2**34, Link(1.0, 100.0), 2**36, Link(5.0, 1.0), compute_slots=slots)
    return Cluster("c", (g,), Link(1.0, 100.0))


def test_op_dispatch_floor():
    cm = CostModel.from_profile(_profile(OVERHEADS))
    view = _op("view", "Tensor.view")
    assert cm.op_time(view, "fp32") == pytest.approx(2e-6)                   # no work: one dispatch
    assert cm.op_time(view, "fp32", backward=True) == pytest.approx(5e-6)
    tiny = _op("elementwise", "operator.add", 4.0, 48.0)                     # 4.8 ns of roofline
    assert cm.op_time(tiny, "fp32") == pytest.approx(2e-6)
    big = _op("elementwise", "operator.add", 1e6, 1.2e7)                     # 1.2 ms of roofline
    assert cm.op_time(big, "fp32") == pytest.approx(1.2e7 / 1e10)
    # a GPU profile without measurements: a kernel-launch floor, views free
    gpu = CostModel.from_profile({**BASE, "device": "gpu"})
    assert gpu.op_time(view, "fp32") == 0.0
    assert gpu.op_time(tiny, "fp32") == pytest.approx(5e-6)


def test_memory_bound_rows_by_variant_on_bytes():
    rows = []
    for nbytes in (1e4, 1e5, 1e6):
        # layer norm: 1 s per 1e9 bytes; RMS norm twice as slow; FLOPs deliberately equal
        rows.append(dict(kind="norm", variant="layer_norm", dtype="fp32", shape=[1], flops=1e3, bytes=nbytes,
                         seconds=nbytes * 1e-9))
        rows.append(dict(kind="norm", variant="rms_norm", dtype="fp32", shape=[1], flops=1e3, bytes=nbytes,
                         seconds=nbytes * 2e-9))
    cm = CostModel.from_profile(_profile(op_table=rows))
    ln = _op("norm", "torch.nn.LayerNorm", 1e3, 1e5)
    rms = _op("norm", "torch.nn.RMSNorm", 1e3, 1e5)
    assert cm.op_time_ex(ln, "fp32") == (pytest.approx(1e-4), True)
    assert cm.op_time_ex(rms, "fp32") == (pytest.approx(2e-4), True)
    mid = _op("norm", "F.layer_norm", 1e3, math.sqrt(1e5 * 1e6))             # log-log midpoint
    assert cm.op_time(mid, "fp32") == pytest.approx(math.sqrt(1e5 * 1e6) * 1e-9, rel=1e-9)


def test_masked_fill_rows_and_forced_copies_priced_from_their_rows():
    rows = []
    for nbytes in (1e4, 1e5, 1e6):
        # add 1 s per 1e9 bytes; masked fill 4x; copy 2x (bytes axis: read + write)
        rows += [dict(kind="elementwise", variant="add", dtype="fp32", shape=[1], flops=1.0, bytes=nbytes,
                      seconds=nbytes * 1e-9),
                 dict(kind="elementwise", variant="masked_fill", dtype="fp32", shape=[1], flops=1.0, bytes=nbytes,
                      seconds=nbytes * 4e-9),
                 dict(kind="copy", variant="copy", dtype="fp32", shape=[1], flops=0.0, bytes=nbytes,
                      seconds=nbytes * 2e-9)]
    cm = CostModel.from_profile(_profile(op_table=rows))
    fill = _op("elementwise", "Tensor.masked_fill", 1e3, 1e5)
    assert cm.op_time(fill, "fp32") == pytest.approx(4e-4)
    # a clone of 5e4 bytes first (core/copies.py): read + write = 1e5 bytes of copy rows
    cloned = OpNode(**{**fill.to_dict(), "copy_bytes": 5e4, "inputs": (), "input_shapes": ((4,),),
                       "output_shape": (4,), "params": ()})
    assert cm.op_time(cloned, "fp32") == pytest.approx(4e-4 + 2e-4)
    assert cm.op_time(cloned, "fp32", backward=True) == cm.op_time(fill, "fp32", backward=True)
    # a reshape that could not be a view: the copy alone; half the rows' bytes on 2 shards
    reshape = OpNode(**{**_op("view", "Tensor.reshape").to_dict(), "copy_bytes": 5e4, "inputs": (),
                        "input_shapes": ((4,),), "output_shape": (4,), "params": ()})
    assert cm.op_time_ex(reshape, "fp32") == (pytest.approx(2e-4), True)
    assert cm.op_time(reshape, "fp32", shard=2) == pytest.approx(1e-4)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_wrapper_overhead_per_op(mode):
    per_op = {f"recompute_{mode}_fwd_per_op_s": 3e-5, f"recompute_{mode}_bwd_per_op_s": 7e-5}
    zero_ov = {k: 0.0 for k in OVERHEADS}
    g, plain = _layer_costs(Mesh(dp=1, pp=1, tp=1), LayerPlan(1, (), recompute=mode), zero_ov)
    _, wrapped = _layer_costs(Mesh(dp=1, pp=1, tp=1), LayerPlan(1, (), recompute=mode), {**zero_ov, **per_op})
    kernels = sum(1 for o in g.layer_ops(1) if o.fwd_flops > 0 or o.bytes_moved > 0 or o.copy_bytes > 0)
    views = sum(1 for o in g.layer_ops(1) if o.kind == "view" and o.copy_bytes == 0)
    assert kernels >= 10 and views >= 1                 # the views cost the wrapper nothing
    assert wrapped.fwd_s - plain.fwd_s == pytest.approx(kernels * 3e-5)
    assert wrapped.bwd_s - plain.bwd_s == pytest.approx(kernels * 7e-5)
    assert wrapped.recompute_s == pytest.approx(plain.recompute_s)     # the recomputed forward itself
    _, none = _layer_costs(Mesh(dp=1, pp=1, tp=1), LayerPlan(1, ()), {**zero_ov, **per_op})
    assert none.fwd_s == pytest.approx(_layer_costs(Mesh(dp=1, pp=1, tp=1), LayerPlan(1, ()), zero_ov)[1].fwd_s)


@pytest.mark.parametrize("mode,expected", [("full", ["layer_norm", "linear", "gelu"]),
                                           ("selective", ["layer_norm", "gelu", "add"])])
def test_recompute_probe_subtracts_what_the_simulator_prices_as_rerun(mode, expected):
    """profiling/overheads.py times the wrapper's backward less the rerun the simulator prices
    (axes/recompute.recompute): full, the forward up to the last saved tensor (the projection's
    operands); selective, the ops between the kept matmul outputs -- by the ops each rerun calls."""
    import torch
    from torch.overrides import TorchFunctionMode
    from autopar.profiling.overheads import _ProbeBlock, recompute_rerun

    called = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            called.append(getattr(func, "__name__", str(func)).strip("_"))
            return func(*args, **(kwargs or {}))

    block = _ProbeBlock(8)
    x = torch.randn(2, 3, 8, requires_grad=True)
    rerun = recompute_rerun(block, x, mode)
    with Record():
        rerun()
    assert [c for c in called if c in ("layer_norm", "linear", "gelu", "add")] == expected


def test_autograd_recording_per_op_and_per_kept_byte():
    """A forward with gradients costs, per op autograd records, autograd_fwd_op_s plus
    autograd_fwd_per_byte_s per byte of its output; a fully recomputed layer's forward keeps
    no outputs (only the per-op part), its recompute in backward pays both."""
    a, b = 4e-6, 1e-10
    zero_ov = {k: 0.0 for k in OVERHEADS}
    with_ag = {**zero_ov, "autograd_fwd_op_s": a, "autograd_fwd_per_byte_s": b}
    mesh = Mesh(dp=1, pp=1, tp=1)
    g, plain = _layer_costs(mesh, LayerPlan(1, ()), zero_ov)
    _, rec = _layer_costs(mesh, LayerPlan(1, ()), with_ag)
    recorded = [o for o in g.layer_ops(1) if (o.fwd_flops > 0 or o.bytes_moved > 0 or o.copy_bytes > 0)
                and (o.bwd_flops > 0 or o.saved_bytes > 0)]
    # micro-batch = the graph's batch; an fp32 run of a graph captured in bf16 holds twice its bytes
    out_bytes = sum(o.output_bytes for o in recorded) * 4 / {"bfloat16": 2, "float32": 4}[g.param_dtype]
    assert len(recorded) >= 10 and out_bytes > 0
    assert rec.fwd_s - plain.fwd_s == pytest.approx(len(recorded) * a + out_bytes * b)
    assert rec.bwd_s == pytest.approx(plain.bwd_s)
    _, full_plain = _layer_costs(mesh, LayerPlan(1, (), recompute="full"), zero_ov)
    _, full = _layer_costs(mesh, LayerPlan(1, (), recompute="full"), with_ag)
    assert full.fwd_s - full_plain.fwd_s == pytest.approx(len(recorded) * a)
    # the recompute stops at the block's last saved tensor, the mask of the dropout after the MLP
    # (so the projection before it runs again): the residual add after it does not run again
    # (axes/recompute.recompute) and records nothing; every other recorded op pays both parts again
    ops = g.layer_ops(1)
    assert [o.kind for o in ops[-3:]] == ["linear", "dropout", "elementwise"] and ops[-2].saved_bytes > 0
    skipped = {ops[-1].name}
    rerun = [o for o in recorded if o.name not in skipped]
    assert len(rerun) == len(recorded) - 1
    rerun_bytes = sum(o.output_bytes for o in rerun) * 4 / {"bfloat16": 2, "float32": 4}[g.param_dtype]
    assert full.recompute_s - full_plain.recompute_s == pytest.approx(len(rerun) * a + rerun_bytes * b)


def test_views_cost_a_dispatch_each_pass_on_a_cpu():
    """A CPU profile's layer pays op_launch_s per view in forward and op_backward_launch_s in
    backward (no kernel, but the host dispatches them); a GPU profile's views are free."""
    zero_ov = {k: 0.0 for k in OVERHEADS}
    mesh, lp = Mesh(dp=1, pp=1, tp=1), LayerPlan(1, ())
    g, plain = _layer_costs(mesh, lp, zero_ov)
    _, floors = _layer_costs(mesh, lp, {**zero_ov, "op_launch_s": 1e-7, "op_backward_launch_s": 3e-7})
    views = sum(1 for o in g.layer_ops(1) if o.kind == "view" and not (o.fwd_flops > 0 or o.bytes_moved > 0
                                                                         or o.copy_bytes > 0))
    assert views >= 1
    # the kernels' own times are far above these floors: only the views add
    assert floors.fwd_s - plain.fwd_s == pytest.approx(views * 1e-7)
    assert floors.bwd_s - plain.bwd_s == pytest.approx(views * 3e-7)


def test_send_recv_rows_price_p2p():
    rows = [dict(op="send_recv", bytes=b, group_size=2, level="intra", seconds=1e-4 + b * 1e-9) for b in (1e3, 1e6)]
    cm = CostModel.from_profile(_profile(collective_table=rows))
    t, measured = cm.collective_time_ex("p2p", 1e6, 2, Link(1.0, 1.0))
    assert measured and t == pytest.approx(1e-4 + 1e6 * 1e-9)


def test_optimizer_time_closed_form():
    # rows obeying seconds = n * 2 ns + tensors * 30 us (tensors of at most 2^20 elements)
    rows = [dict(kind="optimizer", variant="adamw", dtype="fp32", shape=[n], flops=12.0 * n, bytes=28.0 * n,
                 seconds=n * 2e-9 + math.ceil(n / 2**20) * 3e-5) for n in (2**18, 2**20, 2**22)]
    cm = CostModel.from_profile(_profile(OVERHEADS, op_table=rows))
    assert cm.optimizer_element_s == pytest.approx(2e-9)
    assert cm.optimizer_time(1e6, 10, 5) == pytest.approx(1e6 * 2e-9 + 10 * 3e-5 + 5 * 3e-4)
    # without rows: 28 bytes per element at the memory bandwidth
    assert CostModel.from_profile(_profile()).optimizer_time(1e6) == pytest.approx(28e6 / 1e10)


def _layer_costs(mesh, lp, overheads, cluster=None, **extra):
    g = gpt_graph(2, 256, 4, 128, 1000, batch=2)
    ev = PlanEvaluator(g, cluster or _cluster(), CostModel.from_profile(_profile(overheads, **extra)))
    return g, ev.layer_cost(1, lp, mesh, 2, "fp32")


def test_tp_and_fsdp_module_overheads_add_per_module():
    zero_ov = {k: 0.0 for k in OVERHEADS}
    only = {**zero_ov, **{k: OVERHEADS[k] for k in ("tp_module_fwd_s", "tp_module_bwd_s", "fsdp_unit_fwd_s",
                                                     "fsdp_unit_bwd_s")}}
    g = gpt_graph(2, 256, 4, 128, 1000, batch=2)
    layer = g.layers[1]
    styles = {}
    for o in g.layer_ops(1):
        if o.kind == "linear":
            styles[o.module_path] = "rowwise" if ("proj" in o.module_path or "fc2" in o.module_path) else "colwise"
    lp = LayerPlan(1, tuple(sorted(styles.items())), zero=3)
    mesh = Mesh(dp=2, pp=1, tp=2)
    _, plain = _layer_costs(mesh, lp, zero_ov)
    _, with_ov = _layer_costs(mesh, lp, only)
    num_linear = sum(1 for o in g.layer_ops(1) if o.kind == "linear" and o.module_path in styles)
    assert num_linear >= 2 and layer.param_numel > 0
    assert with_ov.fwd_s - plain.fwd_s == pytest.approx(num_linear * 1e-4 + 2e-4)
    assert with_ov.bwd_s - plain.bwd_s == pytest.approx(num_linear * 3e-4 + 4e-4)


def test_sequence_parallel_norms_cost_what_sequence_parallel_adds_to_a_norm():
    """Under sequence parallelism each norm of a split block costs sp_norm_fwd_s / sp_norm_bwd_s
    (SequenceParallel on one rank); a profile without them falls back to dtensor_module_*."""
    g = gpt_graph(2, 256, 4, 128, 1000, batch=2)
    styles = {o.module_path: ("rowwise" if ("proj" in o.module_path or "fc2" in o.module_path) else "colwise")
              for o in g.layer_ops(1) if o.kind == "linear"}
    lp = LayerPlan(1, tuple(sorted(styles.items())))
    mesh = Mesh(dp=1, pp=1, tp=2, sequence_parallel=True)
    norms = sum(1 for o in g.layer_ops(1) if o.kind == "norm")
    zero_ov = {k: 0.0 for k in OVERHEADS}
    _, plain = _layer_costs(mesh, lp, zero_ov)
    _, sp = _layer_costs(mesh, lp, {**zero_ov, "sp_norm_fwd_s": 2e-4, "sp_norm_bwd_s": 3e-4,
                                    "dtensor_module_fwd_s": 9e-4, "dtensor_module_bwd_s": 9e-4})
    _, old = _layer_costs(mesh, lp, {**zero_ov, "dtensor_module_fwd_s": 5e-4, "dtensor_module_bwd_s": 7e-4})
    assert norms == 2
    assert sp.fwd_s - plain.fwd_s == pytest.approx(norms * 2e-4)
    assert sp.bwd_s - plain.bwd_s == pytest.approx(norms * 3e-4)
    assert old.fwd_s - plain.fwd_s == pytest.approx(norms * 5e-4)


def test_fsdp_unit_overhead_grows_with_the_units_bytes():
    """``fsdp_unit_*_per_byte_s`` adds per byte of the unit's full parameters (fp32: 4 bytes a
    parameter), on top of the fixed per-unit figure; ZeRO-0 layers pay neither."""
    base = {k: 0.0 for k in OVERHEADS}
    per = {**base, "fsdp_unit_fwd_s": 2e-4, "fsdp_unit_bwd_s": 4e-4, "fsdp_unit_fwd_per_byte_s": 1e-10,
           "fsdp_unit_bwd_per_byte_s": 5e-10}
    mesh = Mesh(dp=2, pp=1, tp=1)
    g, plain = _layer_costs(mesh, LayerPlan(1, (), zero=3), base)
    _, with_ov = _layer_costs(mesh, LayerPlan(1, (), zero=3), per)
    unit_bytes = 4.0 * g.layers[1].param_numel
    assert with_ov.fwd_s - plain.fwd_s == pytest.approx(2e-4 + 1e-10 * unit_bytes)
    assert with_ov.bwd_s - plain.bwd_s == pytest.approx(4e-4 + 5e-10 * unit_bytes)
    _, ddp0 = _layer_costs(mesh, LayerPlan(1, (), zero=0), base)
    _, ddp1 = _layer_costs(mesh, LayerPlan(1, (), zero=0), per)
    assert ddp1.fwd_s == pytest.approx(ddp0.fwd_s) and ddp1.bwd_s == pytest.approx(ddp0.bwd_s)


def test_row_split_embedding_is_a_tensor_parallel_module():
    """The runtime splits a vocabulary table row-wise into a DTensor module: one module's
    overhead in each pass, as a sharded linear."""
    only = {**{k: 0.0 for k in OVERHEADS}, "tp_module_fwd_s": 1e-4, "tp_module_bwd_s": 3e-4}
    g = gpt_graph(2, 256, 4, 128, 1000, batch=2)
    emb = [o for o in g.layer_ops(0) if o.kind == "embedding"]
    assert emb
    lp = LayerPlan(0, ((emb[0].module_path, "rowwise"),), zero=0)
    mesh = Mesh(dp=1, pp=1, tp=2)
    ev0 = PlanEvaluator(g, _cluster(), CostModel.from_profile(_profile({k: 0.0 for k in OVERHEADS})))
    ev1 = PlanEvaluator(g, _cluster(), CostModel.from_profile(_profile(only)))
    plain, with_ov = ev0.layer_cost(0, lp, mesh, 2, "fp32"), ev1.layer_cost(0, lp, mesh, 2, "fp32")
    assert with_ov.fwd_s - plain.fwd_s == pytest.approx(1e-4)
    assert with_ov.bwd_s - plain.bwd_s == pytest.approx(3e-4)

def test_optimizer_counts_plain_and_dtensor_tensors():
    ov = {**{k: 0.0 for k in OVERHEADS}, "optimizer_tensor_s": 3e-5, "optimizer_dtensor_tensor_s": 3e-4}
    g = gpt_graph(2, 256, 4, 128, 1000, batch=2)
    tensors = {p for o in g.layer_ops(1) for p in o.params}
    base = {k: 0.0 for k in OVERHEADS}
    for zero, per_tensor, mesh in ((0, 3e-5, Mesh(2, 1, 1)), (3, 3e-4, Mesh(2, 1, 1)), (1, 3e-5 / 2, Mesh(2, 1, 1))):
        lp = LayerPlan(1, (), zero=zero)
        _, a = _layer_costs(mesh, lp, ov)
        _, b = _layer_costs(mesh, lp, base)
        assert a.optimizer_s - b.optimizer_s == pytest.approx(len(tensors) * per_tensor), zero


def test_compute_slots_stretch_device_work():
    cl = _cluster(gpus=4, slots=2)
    assert compute_stretch(cl, Mesh(dp=2, pp=1, tp=1)) == 1.0
    assert compute_stretch(cl, Mesh(dp=4, pp=1, tp=1)) == 2.0
    assert compute_stretch(_cluster(gpus=4, slots=0), Mesh(dp=4, pp=1, tp=1)) == 1.0
    lp = LayerPlan(1, (), zero=0)
    _, two = _layer_costs(Mesh(dp=2, pp=1, tp=1), lp, OVERHEADS, cl)
    _, four = _layer_costs(Mesh(dp=4, pp=1, tp=1), lp, OVERHEADS, cl)
    assert four.fwd_s == pytest.approx(2 * two.fwd_s)
    assert four.bwd_s == pytest.approx(2 * two.bwd_s)
    assert four.optimizer_s == pytest.approx(2 * two.optimizer_s)


def test_cluster_file_compute_slots():
    text = """
name: t
inter_node: {bandwidth_GBps: 1, latency_us: 100}
groups:
  - {name: cpu, gpu: local-cpu, nodes: 1, gpus_per_node: 4, gpu_memory_GB: 1, host_memory_GB: 8,
     intra_node: {bandwidth_GBps: 1, latency_us: 100}, host_to_device: {bandwidth_GBps: 5, latency_us: 1},
     compute_slots: SLOTS}
"""
    assert parse_cluster(text.replace("SLOTS", "2"), source="t.yaml").groups[0].compute_slots == 2
    for bad in ("0", "5", "1.5"):
        with pytest.raises(ClusterFileError, match="compute_slots"):
            parse_cluster(text.replace("SLOTS", bad), source="t.yaml")


def test_collective_rows_by_busy_processes():
    rows = [dict(op="all_reduce", bytes=b, group_size=2, level="intra", seconds=s * b, processes=p)
            for b in (1e3, 1e6) for p, s in ((2, 1e-9), (4, 3e-9))]
    cm = CostModel.from_profile(_profile(collective_table=rows))
    link = Link(1.0, 1.0)
    assert cm.collective_time("all_reduce", 1e5, 2, link, processes=2) == pytest.approx(1e-4)
    assert cm.collective_time("all_reduce", 1e5, 2, link, processes=4) == pytest.approx(3e-4)
    assert cm.collective_time("all_reduce", 1e5, 2, link) == pytest.approx(1e-4)      # default: the group's own


def test_serial_communication_adds_ddp_allreduce():
    """One process per core: the gradient all-reduces add to compute instead of hiding under it."""
    g = gpt_graph(4, 256, 4, 128, 1000, batch=2)
    cm = CostModel.from_profile(_profile(OVERHEADS))
    plan = config_plan(g, degrees={"dp": 2, "tp": 1, "pp": 1},
                       micro_batch=2, global_batch=4, schedule="1f1b", virtual_stages=1,
                       zero=0, recompute="none", offload="none", precision="fp32", sequence_parallel=False)
    serial_cl, overlap_cl = _cluster(gpus=4, slots=2), _cluster(gpus=4, slots=0)
    ev = PlanEvaluator(g, serial_cl, cm)
    ctx, rows = ev.prepare(plan)
    assert ctx.serial_comm
    total = sum(float(rows.column(k).sum()) for k in ("fwd_s", "bwd_s", "dp_allreduce_s", "optimizer_s"))
    for res in (ev.evaluate(plan), simulate_plan(g, plan, serial_cl, cm)):
        assert res.step_time_s == pytest.approx(total, rel=1e-9)
    assert not PlanEvaluator(g, overlap_cl, cm).prepare(plan)[0].serial_comm
    assert PlanEvaluator(g, overlap_cl, cm).evaluate(plan).step_time_s < total


def test_serial_communication_by_busy_processes_per_core():
    """Communication overlaps compute only while a core is left free for it: fewer busy
    processes than cores overlap, as many or more (oversubscribed) take turns."""
    from autopar.core.plan import Mesh
    from autopar.simulator.step.cpu_node import serial_communication
    cl = _cluster(gpus=8, slots=4)
    assert not serial_communication(cl, Mesh(dp=2, pp=1, tp=1))       # 2 processes, 4 cores
    assert serial_communication(cl, Mesh(dp=4, pp=1, tp=1))           # one per core
    assert serial_communication(cl, Mesh(dp=2, pp=2, tp=2))           # 8 on 4 cores
    assert not serial_communication(_cluster(gpus=8, slots=0), Mesh(dp=8, pp=1, tp=1))   # GPUs


def test_meeting_wait_from_the_measured_points():
    """The wait of one meeting after a stretch of work: the measured extra times made
    non-decreasing, less the shortest burst's, interpolated; beyond the longest burst, the power law
    of the last two points, at most proportional (simulator/cpu_meeting_waits.py); a line-only row, per_compute x gap; one process or an unmeasured
    count, nothing."""
    sync = [{"processes": 2, "per_compute": 0.25, "gaps_s": [1e-3, 4e-3, 2e-3, 1e-2],
             "extra_s": [1e-3, 1.5e-3, 1.6e-3, 3e-3]},          # 2 ms: 1.6 ms, 4 ms: 1.5 -> 1.6 (running max)
            {"processes": 4, "per_compute": 0.5}]
    cm = CostModel.from_profile(_profile(OVERHEADS, sync_wait=sync))
    assert cm.meeting_wait(2, 0.5e-3) == 0.0
    assert cm.meeting_wait(2, 1.5e-3) == pytest.approx(0.3e-3)   # halfway from 0 to 0.6 ms
    assert cm.meeting_wait(2, 3e-3) == pytest.approx(0.6e-3)
    assert cm.meeting_wait(2, 7e-3) == pytest.approx(0.6e-3 + 0.5 * 1.4e-3)
    # beyond the table: the power law of the last two points (0.6 ms at 4 ms, 2 ms at 10 ms: steeper
    # than proportional, so proportional), 2 ms per 10 ms
    assert cm.meeting_wait(2, 4e-2) == pytest.approx(2e-3 * 4)
    assert cm.meeting_wait(4, 4e-3) == pytest.approx(2e-3)       # the line: 0.5 x 4 ms
    assert cm.meeting_wait(1, 4e-3) == cm.meeting_wait(3, 4e-3) == 0.0


@pytest.mark.parametrize("dp,tp,zero", [(2, 1, 0), (4, 1, 0), (2, 1, 3), (1, 2, 0), (2, 2, 0)])
def test_meeting_waits_stretch_each_ranks_work_by_how_often_it_meets(dp, tp, zero):
    """A plan's ranks meet once a step when gradients are all-reduced, at every FSDP all-gather
    and reduce-scatter and at every tensor-parallel collective; each meeting waits
    meeting_wait(work / meetings), stretching the rank's own work by 1 + M wait / W; the
    collectives are not stretched (their in-step rows hold their own wake-up)."""

    sync = [{"processes": p, "per_compute": 0.0, "gaps_s": [1e-4, 1e-3, 1e-1], "extra_s": [0.0, 2e-4, 5e-3]}
            for p in (2, 4)]
    g = gpt_graph(2, 256, 4, 128, 1000, batch=2)
    cl = _cluster(gpus=4, slots=2)
    plan = _ddp_plan(g, dp=dp, tp=tp, zero=zero)
    ctx, plain = PlanEvaluator(g, cl, CostModel.from_profile(_profile(OVERHEADS))).prepare(plan)
    _, waited = PlanEvaluator(g, cl, CostModel.from_profile(_profile(OVERHEADS, sync_wait=sync))).prepare(plan)
    meetings = (1 if zero <= 1 and dp > 1 else 0) + (3 * sum(1 for lay in g.layers if lay.param_numel > 0)
                                                      if zero >= 2 else 0)
    work = float((plain.fwd_s + plain.bwd_s + plain.optimizer_s).sum())
    measured_meetings = float(waited.meetings.sum()) + (1 if zero <= 1 and dp > 1 else 0)
    assert measured_meetings >= 1
    gap = work / measured_meetings
    wait = float(np.interp(gap, [1e-4, 1e-3, 1e-1], [0.0, 2e-4, 5e-3]))
    factor = 1 + measured_meetings * wait / work
    assert factor > 1.0
    for col in ("fwd_s", "bwd_s", "optimizer_s"):
        assert waited.column(col) == pytest.approx(plain.column(col) * factor, rel=1e-9)
    for col in ("dp_allreduce_s", "dp_allgather_s", "dp_reducescatter_s", "tp_comm_fwd_s"):
        assert waited.column(col) == pytest.approx(plain.column(col))
    if tp == 1:                                            # the count, by hand: FSDP 3 a unit, DDP 1
        assert measured_meetings == meetings
    else:   # Megatron's split block: all-reduces f and g in forward, their pair in backward (Shoeybi et al. 2019)
        blocks = [i for i, lay in enumerate(g.layers) if lay.name.startswith("blocks.")]
        assert blocks and all(waited.meetings[i] == 4 for i in blocks)
    one = _ddp_plan(g, dp=1)
    assert (PlanEvaluator(g, cl, CostModel.from_profile(_profile(OVERHEADS, sync_wait=sync))).prepare(one)[1].data
            == PlanEvaluator(g, cl, CostModel.from_profile(_profile(OVERHEADS))).prepare(one)[1].data).all()


def _ddp_plan(g, dp=2, tp=1, zero=0):
    return config_plan(g, degrees={"dp": dp, "tp": tp, "pp": 1},
                       micro_batch=2, global_batch=2 * dp, schedule="1f1b", virtual_stages=1,
                       zero=zero, recompute="none", offload="none", precision="fp32", sequence_parallel=False)


def test_ddp_all_reduces_its_gradients_in_buckets():
    """A plain data-parallel plan all-reduces per DDP bucket (1 MiB first, then 25 MiB, filled from
    the last layer), each on the layer that closes it at the bucket's size; ZeRO-1's per-tensor
    broadcasts are one broadcast of all the parameters; with tensor parallelism (FSDP2's
    replicate: one all-reduce per unit) the per-layer calls stay."""
    from autopar.simulator.evaluator import DDP_FIRST_BUCKET_BYTES, PlanEvaluator as PE
    from autopar.simulator.step.memory import DDP_BUCKET_BYTES

    g = gpt_graph(4, 128, 4, 128, 1000, batch=2)      # ~0.8 MB of fp32 gradients a block: 2 buckets
    cm = CostModel.from_profile(_profile(OVERHEADS))
    cl = _cluster(gpus=4, slots=0)
    ev = PE(g, cl, cm)
    ctx, rows = ev.prepare(_ddp_plan(g))
    grads = rows.dp_grad_bytes
    expected = [0.0] * len(rows)
    cap, filled = DDP_FIRST_BUCKET_BYTES, 0.0
    for k in reversed(range(len(rows))):
        filled += grads[k]
        if filled >= cap or k == 0:
            expected[k] = cm.collective_time("all_reduce", filled, 2, ctx.links.dp.link, ctx.links.dp.level)
            cap, filled = DDP_BUCKET_BYTES, 0.0
    assert rows.dp_allreduce_s.tolist() == pytest.approx(expected)
    assert grads.sum() > DDP_FIRST_BUCKET_BYTES and sum(1 for e in expected if e > 0) == 2
    # dp x tp: per layer, as the layer costs price it
    plan_tp = _ddp_plan(g, tp=2)
    ctx2, rows2 = ev.prepare(plan_tp)
    per_layer = [ev.layer_cost(i, lp, plan_tp.mesh, plan_tp.micro_batch, "fp32").dp_allreduce_s
                 for i, lp in enumerate(plan_tp.layers)]
    assert rows2.dp_allreduce_s.tolist() == pytest.approx(per_layer)


def test_chained_broadcast_rows_price_zero1_parameter_broadcasts():
    """ZeroRedundancyOptimizer's per-tensor broadcasts are priced from the profile's ``chained``
    rows (calls of an asynchronous chain), the in-step rows everywhere else; a profile without
    chained rows prices them as ordinary calls."""
    def rows(seconds, timing):
        return [{"op": "broadcast", "bytes": b, "group_size": 2, "level": "intra", "seconds": seconds,
                 "processes": 2, "timing": timing} for b in (1e3, 1e7)]
    both = CostModel.from_profile(_profile(OVERHEADS, collective_table=rows(1e-3, "in_step") + rows(2e-4, "chained")))
    plain = CostModel.from_profile(_profile(OVERHEADS, collective_table=rows(1e-3, "in_step")))
    link = Link(1.0, 100.0)
    assert both.collective_time("broadcast", 1e5, 2, link, processes=2) == pytest.approx(1e-3)
    assert both.collective_time("broadcast", 1e5, 2, link, processes=2, chained=True) == pytest.approx(2e-4)
    assert plain.collective_time("broadcast", 1e5, 2, link, processes=2, chained=True) == pytest.approx(1e-3)
    g = gpt_graph(2, 256, 4, 128, 1000, batch=2)
    tensors = len({p for o in g.layer_ops(1) for p in o.params})
    lp = LayerPlan(1, (), zero=1)
    for cm, per_call in ((both, 2e-4), (plain, 1e-3)):
        cost = PlanEvaluator(g, _cluster(gpus=2), cm).layer_cost(1, lp, Mesh(dp=2, pp=1, tp=1), 2, "fp32")
        assert cost.dp_allgather_s == pytest.approx(tensors * per_call)
