"""The Chrome trace of a simulated step (simulator/step_trace.py): it ends where the step model
ends, and it is a possible picture of the schedule.

* the trace's last event ends at the step time and each pipeline rank's at the step model's
  time for that rank (SimResult.stage_step_s), to 1e-9, over schedules, ZeRO stages, offload,
  recompute, tensor/pipeline parallelism, accumulation, and a CPU node whose communication
  takes turns with compute;
* on every rank no two events overlap on one stream; a forward of micro-batch i on a stage
  starts after the previous stage's forward of i and its send, a backward after the next
  stage's backward and its send (the last stage's after its own forward); a DDP all-reduce
  starts after its layer's last backward;
* the pipelines drawn against hand-derived schedules, each task as soon as it can run (nothing
  ties the drawing to the formula there): where the pipeline formula is met (equal stages
  without sends, GPipe with sends, interleaved with sends up to a chunk's pass) the drawn
  pipeline ends at it; under 1F1B with a send as long as a stage the schedule cannot, and the
  trace says by how much; with unequal stages it ends before the formula, and draw_step's
  placement of each rank's last backward at the step model's end moves it there;
* the same plans under Megatron-LM 2021's blocking exchange (simulator/pipeline_p2p.py), each
  send the last part of its task, against a hand-worked 1F1B schedule, and its scatter/gather
  exchange against the cost model's closed forms.
"""
import json
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.axes import pp_p2p as pipeline_p2p
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.simulate import simulate_plan
from autopar.simulator.axes.pp import pipeline_time, rank_ends
from autopar.simulator.step.trace import _pipeline_starts, _Terms, draw_step, schedule_tasks
from autopar.simulator.step.timeline import write_chrome_trace
from autopar.simulator.device.training_code import AUTOPAR
from sim_graphs import gpt_graph

PROFILE = dict(name="t", memory_bandwidth_Bps=2e12, peak_flops={"fp32": 20e12, "bf16": 250e12},
               efficiency={"linear": 0.8, "matmul": 0.8, "memory_bound": 0.8},
               collective_efficiency={"intra": 0.7, "inter": 0.9})
#: a CPU node: 4 devices on 2 compute slots, so communication takes turns with compute (cpu_node.py)
CPU_PROFILE = dict(name="cpu-t", device="cpu", memory_bandwidth_Bps=1e10, peak_flops={"fp32": 1e11, "bf16": 1e11},
                   efficiency={"linear": 1.0, "matmul": 1.0, "memory_bound": 1.0},
                   collective_efficiency={"intra": 1.0, "inter": 1.0})


def _gpu_cluster():
    return Cluster("c", (NodeGroup("n", "t", 2, 4, 80 * 2**30, Link(300.0, 3.0), 2**40, Link(25.0, 10.0)),),
                   Link(25.0, 5.0))


def _cpu_cluster():
    return Cluster("c", (NodeGroup("n", "cpu-t", 1, 4, 2**34, Link(1.0, 100.0), 2**36, Link(5.0, 1.0),
                                   compute_slots=2),), Link(1.0, 100.0))


GRAPH = gpt_graph(8, 512, 8, 256, 1000)
CPU_GRAPH = gpt_graph(6, 512, 8, 256, 1000)

# plans whose pipeline formula the drawn schedule meets (see test_hand_schedules for one it cannot)
EXACT = [
    dict(dp=8, tp=1, pp=1, schedule="1f1b", zero=0, recompute="none", offload="none", m=1),
    dict(dp=8, tp=1, pp=1, schedule="1f1b", zero=1, recompute="selective", offload="none", m=4),
    dict(dp=4, tp=2, pp=1, schedule="1f1b", zero=2, recompute="full", offload="cpu", m=2),
    dict(dp=4, tp=2, pp=1, schedule="1f1b", zero=3, recompute="none", offload="cpu", m=4),
    dict(dp=2, tp=4, pp=1, schedule="1f1b", zero=3, recompute="selective", offload="none", m=2, sp=True),
    dict(dp=2, tp=2, pp=2, schedule="gpipe", zero=3, recompute="full", offload="cpu", m=4),
    dict(dp=2, tp=1, pp=4, schedule="1f1b", zero=2, recompute="none", offload="none", m=16),
    dict(dp=2, tp=2, pp=2, schedule="1f1b", zero=3, recompute="selective", offload="cpu", m=8),
    dict(dp=2, tp=2, pp=2, schedule="interleaved", zero=3, recompute="full", offload="none", m=2),
    # unequal model chunks (embedding and head on the end chunks), sends crossing every chunk boundary
    dict(dp=1, tp=2, pp=4, schedule="interleaved", zero=0, recompute="none", offload="none", m=4),
]
CPU_PLANS = [
    dict(dp=4, tp=1, pp=1, schedule="1f1b", zero=0, recompute="none", offload="none", m=2),
    dict(dp=2, tp=2, pp=1, schedule="1f1b", zero=3, recompute="full", offload="cpu", m=1),
    dict(dp=2, tp=1, pp=2, schedule="1f1b", zero=1, recompute="none", offload="none", m=4),
    dict(dp=2, tp=1, pp=2, schedule="1f1b", zero=3, recompute="full", offload="cpu", m=4),
    dict(dp=2, tp=1, pp=2, schedule="gpipe", zero=2, recompute="none", offload="cpu", m=2),
    dict(dp=1, tp=2, pp=2, schedule="gpipe", zero=0, recompute="selective", offload="none", m=4),
]
# plans whose formula the schedule cannot meet: sends under 1F1B, unequal chunks interleaved on a CPU node
LATE = [
    dict(dp=1, tp=2, pp=4, schedule="1f1b", zero=0, recompute="none", offload="none", m=16),
    # ZeRO-1 under a pipeline runs as ZeRO-2, whose gathers and reduce-scatters are per step
    # (simulator/pipeline_fsdp.py): the stages are compute-bound and unequal -- the slowest forward
    # on the last rank, the slowest backward on the first -- which the formula's (m - 1) max_r T_r
    # takes as one rank's (GPipe: 7.9 us short of the drawn 4.21 ms)
    dict(dp=2, tp=1, pp=4, schedule="gpipe", zero=1, recompute="none", offload="none", m=8),
    dict(dp=2, tp=2, pp=2, schedule="1f1b", zero=1, recompute="full", offload="none", m=4),
    dict(dp=2, tp=2, pp=2, schedule="interleaved", zero=1, recompute="none", offload="none", m=4),
]
# the split-backward schedules in torch's own order (torch_pipeline_order.py): their formulas are
# those of equal chunks (pipeline_zero_bubble.py), so the drawn schedule may end after them
SPLIT = [
    dict(dp=2, tp=1, pp=2, schedule="zbv", zero=2, recompute="none", offload="none", m=4),
    dict(dp=2, tp=1, pp=2, schedule="interleaved-zb", zero=0, recompute="full", offload="none", m=4),
    dict(dp=1, tp=2, pp=4, schedule="dualpipev", zero=0, recompute="none", offload="none", m=8),
]
CPU_LATE = [
    dict(dp=1, tp=1, pp=2, schedule="interleaved", zero=3, recompute="none", offload="cpu", m=4, v=3),
    dict(dp=1, tp=1, pp=2, schedule="interleaved", zero=2, recompute="none", offload="cpu", m=4, v=3),
]


def _plan(graph, kw, precision="bf16"):
    return config_plan(graph, degrees={"dp": kw["dp"], "tp": kw["tp"], "pp": kw["pp"]}, micro_batch=1,
                       global_batch=kw["dp"] * kw["m"], schedule=kw["schedule"], virtual_stages=kw.get("v", 2),
                       zero=kw["zero"], recompute=kw["recompute"], offload=kw["offload"], precision=precision,
                       sequence_parallel=kw.get("sp", False))


def _cases():
    gpu = CostModel.from_profile(PROFILE)
    cpu = CostModel.from_profile(CPU_PROFILE)
    # the same GPU priced as Megatron-LM 2021 ran its pipeline exchange (simulator/training_code.py)
    megatron = replace(gpu, code=replace(AUTOPAR, p2p=pipeline_p2p.MEGATRON_2021))
    for kw in EXACT:
        yield pytest.param(GRAPH, _plan(GRAPH, kw), _gpu_cluster(), gpu, True, id="gpu-" + _name(kw))
    for kw in CPU_PLANS:
        yield pytest.param(CPU_GRAPH, _plan(CPU_GRAPH, kw, "fp32"), _cpu_cluster(), cpu, True,
                           id="cpu-" + _name(kw))
    for kw in LATE:
        yield pytest.param(GRAPH, _plan(GRAPH, kw), _gpu_cluster(), gpu, False, id="late-gpu-" + _name(kw))
    for kw in SPLIT:
        yield pytest.param(GRAPH, _plan(GRAPH, kw), _gpu_cluster(), gpu, None, id="split-gpu-" + _name(kw))
    for kw in CPU_LATE:
        yield pytest.param(CPU_GRAPH, _plan(CPU_GRAPH, kw, "fp32"), _cpu_cluster(), cpu, False,
                           id="late-cpu-" + _name(kw) + f"-v{kw['v']}")
    # priced as clipped runs (TrainingCode.grad_clip): the norm's all-reduce after the sync, on a
    # GPU and on a CPU node whose communication takes turns with compute
    clip = lambda c: replace(c, code=replace(c.code, grad_clip=True))          # noqa: E731
    for kw in (EXACT[1], EXACT[7]):
        yield pytest.param(GRAPH, _plan(GRAPH, kw), _gpu_cluster(), clip(gpu), True, id="clip-gpu-" + _name(kw))
    for kw in (CPU_PLANS[0], CPU_PLANS[2]):
        yield pytest.param(CPU_GRAPH, _plan(CPU_GRAPH, kw, "fp32"), _cpu_cluster(), clip(cpu), True,
                           id="clip-cpu-" + _name(kw))
    # Megatron-LM 2021's blocking exchange: each send is the last part of its task, so 1F1B meets
    # the formula; interleaved with unequal chunks does not, nor interleaved where the layers'
    # FSDP gathers outlast their compute (ZeRO-1 with tp runs as ZeRO-2, axes/sharded_dp.effective_zero;
    # over the two nodes its gathers take 167 us against an 80 us forward, sharded_dp.py item 6:
    # the trace ends 0.7 us after the formula)
    for kw in [k for k in EXACT + LATE if k["pp"] > 1]:
        late = kw["schedule"] == "interleaved" and (kw["pp"] == 4 or kw["zero"] == 1)
        yield pytest.param(GRAPH, _plan(GRAPH, kw), _gpu_cluster(), megatron, not late,
                           id=("late-" if late else "") + "megatron-" + _name(kw))


def _name(kw):
    return "{dp}x{tp}x{pp}-{schedule}-z{zero}-{recompute}-{offload}-m{m}".format(**kw)


def _draw(graph, plan, cluster, cm):
    ctx, rows = PlanEvaluator(graph, cluster, cm).prepare(plan)
    devices = [plan.mesh.rank_at(pp=r) for r in range(plan.mesh.pp)]
    return ctx, rows, draw_step(ctx, rows, devices), devices


def _end(e):
    return e["start_s"] + e["dur_s"]


@pytest.mark.parametrize("graph,plan,cluster,cm,exact", list(_cases()))
def test_trace_ends_at_the_step_model(graph, plan, cluster, cm, exact):
    res = simulate_plan(graph, plan, cluster, cm, timeline=True)
    ctx, rows, trace, devices = _draw(graph, plan, cluster, cm)
    assert ctx.serial_comm == (cluster.groups[0].compute_slots > 0)
    ends = [max(_end(e) for e in trace.events if e["device"] == d) for d in devices]
    assert trace.rank_end_s.tolist() == pytest.approx(ends, rel=1e-12, abs=0)
    if exact is None:            # met or late
        assert (trace.late_s >= 0).all()
        assert ends == pytest.approx(np.asarray(res.stage_step_s) + trace.late_s, rel=1e-9, abs=0)
    elif exact:
        assert not trace.late_s.any()
        assert max(_end(e) for e in res.timeline) == pytest.approx(res.step_time_s, rel=1e-9, abs=0)
        assert ends == pytest.approx(res.stage_step_s, rel=1e-9, abs=0)
    else:
        # the drawn pipeline honours every send, so each rank ends that much after the model
        assert (trace.late_s > 0).any() and (trace.late_s >= 0).all()
        assert ends == pytest.approx(np.asarray(res.stage_step_s) + trace.late_s, rel=1e-9, abs=0)


@pytest.mark.parametrize("graph,plan,cluster,cm,exact", list(_cases()))
def test_trace_is_a_possible_schedule(graph, plan, cluster, cm, exact):
    ctx, rows, trace, devices = _draw(graph, plan, cluster, cm)
    events = trace.events
    tol = 1e-12 * max(_end(e) for e in events)
    # one stream runs one thing at a time
    tracks = defaultdict(list)
    for e in events:
        tracks[(e["device"], e["stream"])].append((e["start_s"], _end(e), e["name"]))
    for track, spans in tracks.items():
        spans.sort()
        for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
            assert s1 >= e0 - tol, f"{n0} and {n1} overlap on {track}"
    # every task's work is drawn: forward, recompute, backward of every layer and micro-batch
    m = ctx.num_microbatches
    for prefix in ("fwd L", "bwd L"):
        drawn = defaultdict(int)
        for e in events:
            if e["stream"] == "compute" and e["name"].startswith(prefix):
                drawn[int(e["name"][len(prefix):])] += 1
        assert drawn == {k: m for k in range(len(rows))}
    # a task starts after its input arrived
    p, G = ctx.p, len(ctx.starts)
    dev_of_stage = {int(g): devices[r] for row in ctx.grid for r, g in enumerate(row)}
    span = {}        # (pass, micro-batch, stage) -> (first start, last end) on compute and tp
    for e in events:
        a = e.get("args") or {}
        if e["stream"] in ("compute", "tp") and "stage" in a:
            # (a split backward's weight gradients, "bwd weights", run apart: after its input gradient)
            kind = "W" if e["name"].startswith("bwd weights") else \
                "B" if e["name"].startswith(("bwd", "recompute", "tp bwd")) else "F"
            key = (kind, a["micro_batch"], a["stage"])
            lo, hi = span.get(key, (np.inf, -np.inf))
            span[key] = (min(lo, e["start_s"]), max(hi, _end(e)))
            assert e["device"] == dev_of_stage[a["stage"]]
    sends = {("F" if e["name"].startswith("send act") else "B", e["args"]["micro_batch"], e["args"]["stage"]): e
             for e in events if e["stream"] == "pp"}
    crossing = [g for g in range(G - 1) if dev_of_stage[g] != dev_of_stage[g + 1]]   # (the V's turn is not)
    assert len(sends) == 2 * len(crossing) * m if G > 1 else not sends
    for (kind, i, g), (start, _) in span.items():
        if kind == "W":
            assert start >= span[("B", i, g)][1] - tol, f"weight gradient of micro-batch {i} on {g} before its input's"
            continue
        if g - 1 not in crossing and kind == "F" or g not in crossing and kind == "B" and g < G - 1:
            continue
        if kind == "F" and g > 0:
            src = sends[("F", i, g - 1)]
            assert src["start_s"] >= span[("F", i, g - 1)][1] - tol
            assert start >= _end(src) - tol, f"forward of micro-batch {i} on stage {g} before its input"
        if kind == "B" and g < G - 1:
            src = sends[("B", i, g + 1)]
            assert src["start_s"] >= span[("B", i, g + 1)][1] - tol
            assert start >= _end(src) - tol, f"backward of micro-batch {i} on stage {g} before its gradient"
        if kind == "B" and g == G - 1:
            assert start >= span[("F", i, g)][1] - tol
    # a gradient is all-reduced after its layer's last backward
    last_bwd = {}
    for e in events:
        if e["stream"] == "compute" and e["name"].startswith("bwd L"):
            k = int(e["name"][5:])
            last_bwd[k] = max(last_bwd.get(k, -np.inf), _end(e))
    for e in events:
        if e["name"].startswith("all_reduce L"):
            assert e["start_s"] >= last_bwd[int(e["name"][12:])] - tol


def test_chrome_trace(tmp_path):
    g = GRAPH
    cl = _gpu_cluster()
    plan = config_plan(g, degrees={"dp": 2, "tp": 2, "pp": 2},
                       micro_batch=1, global_batch=8, schedule="1f1b", virtual_stages=1,
                       zero=3, recompute="full", offload="none", precision="bf16", sequence_parallel=False)
    r = simulate_plan(g, plan, cl, CostModel.from_profile(PROFILE), timeline=True)
    path = tmp_path / "trace.json"
    write_chrome_trace(path, r.timeline)
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {plan.mesh.rank_at(pp=p) for p in range(plan.mesh.pp)}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "tp", "fsdp", "pp"} <= {names[(e["pid"], e["tid"])] for e in events}
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(r.step_time_s * 1e6, rel=1e-9)


def _hand(p, m, f, b, c, schedule, v=1, placed=False):
    """The drawn pipeline of p stages (forward f, backward b per chunk: one number for equal chunks
    or one per chunk, send c), every task as soon as it can run; ``placed``: each rank's last
    backward placed at the step model's end for the rank where it can end there (what draw_step
    does), else nothing ties the drawing to the formula (no rank end to meet: zeros)."""
    G = p * v
    f_g, b_g = np.broadcast_to(np.asarray(f, float), (G,)), np.broadcast_to(np.asarray(b, float), (G,))
    pipe, _ = pipeline_time((f_g + b_g).reshape(v, p).sum(axis=0), m, p, v, c)
    terms = _Terms(serial=False, fwd=f_g, bwd=b_g, f_g=f_g, b_g=b_g, pipe=pipe,
                   end_r=rank_ends(pipe, b_g[:p], c) if placed else np.zeros(p), send_s=float(c))
    starts, end = _pipeline_starts(SimpleNamespace(p=p, v=v, num_microbatches=m, schedule=schedule), terms)
    return pipe, end, starts


def test_hand_schedules():
    # equal stages, no send: (m + p - 1)(f + b) (Huang et al. 2019; Narayanan et al. 2021 Sec. 2.2.1),
    # interleaved (m + (p - 1) / v) v (f + b) (Sec. 2.2.2): the formula, and the drawn pipeline ends there
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
        pipe, end, _ = _hand(4, 8, 1.0, 2.0, 0.0, schedule, v)
        assert pipe == pytest.approx((8 + 3 / v) * v * 3.0)
        assert end.tolist() == pytest.approx([pipe - 2.0 * r for r in range(4)])
    # GPipe, p = 2, m = 4, f = b = c = 1: stage 1 gets micro-batch 0 at 2, runs 4 forwards and 4
    # backwards to 10, the last gradient reaches stage 0 at 11: the formula's (4 + 1) 2 + 2 = 12
    pipe, end, starts = _hand(2, 4, 1, 1, 1, "gpipe")
    assert pipe == 12 and end.tolist() == [12, 10]
    # 1F1B, same stages (stage 0: F0 F1 B0 F2 B1 F3 B2 B3; stage 1: F0 B0 F1 B1 ...), each task as
    # soon as its input is in: stage 0 F0 [0, 1] F1 [1, 2]; stage 1 F0 [2, 3] B0 [3, 4] F1 [4, 5]
    # B1 [5, 6]; stage 0 B0 [5, 6] F2 [6, 7] B1 [7, 8] F3 [8, 9]; stage 1 F2 [8, 9] B2 [9, 10]
    # F3 [10, 11] B3 [11, 12]; stage 0 B2 [11, 12] B3 [13, 14].  The formula charges the sends only
    # in the fill and the drain (12): the drawn pipeline ends 2 later on both stages
    pipe, end, starts = _hand(2, 4, 1, 1, 1, "1f1b")
    assert pipe == 12 and end.tolist() == [14, 12]
    assert [(k, i, t) for k, i, _, t, _ in starts[0]] == [("F", 0, 0), ("F", 1, 1), ("B", 0, 5), ("F", 2, 6),
                                                         ("B", 1, 7), ("F", 3, 8), ("B", 2, 11), ("B", 3, 13)]
    # interleaved, p = 2, v = 2 (virtual stages g0 g2 on rank 0, g1 g3 on rank 1), m = 2, f = b = c = 1.
    # Rank 0 warms up with all 4 forwards, rank 1 with 2 (Narayanan et al. 2021 Sec. 2.2.2).
    # Forward: g0 F0 [0, 1] F1 [1, 2]; g1 F0 [2, 3] F1 [3, 4]; g2 F0 [4, 5] F1 [5, 6]; g3 F0 [6, 7]
    # B0 [7, 8] F1 [8, 9] B1 [9, 10]; backward: g2 B0 [9, 10] B1 [11, 12]; g1 B0 [11, 12] B1 [13, 14];
    # g0 B0 [13, 14] B1 [15, 16].  The first micro-batch crosses 3 boundaries each way: the formula
    # m T + (p - 1) T / v + 2 (p v - 1) c = 2 * 4 + 4 / 2 + 6 = 16, rank 1 one backward and a send before
    pipe, end, starts = _hand(2, 2, 1, 1, 1, "interleaved", 2)
    assert pipe == 16 and end.tolist() == [16, 14]
    assert [(k, i, c, t) for k, i, c, t, _ in starts[1]] == [("F", 0, 0, 2), ("F", 1, 0, 3), ("F", 0, 1, 6),
                                                            ("B", 0, 1, 7), ("F", 1, 1, 8), ("B", 1, 1, 9),
                                                            ("B", 0, 0, 11), ("B", 1, 0, 13)]
    # the step model's end placed: 1F1B, p = 2, m = 2, no send, stage 0 twice as long (f = b = 2)
    # as stage 1 (f = b = 1).  As soon as it can: stage 0 F0 [0, 2] F1 [2, 4]; stage 1 F0 [2, 3]
    # B0 [3, 4] F1 [4, 5] B1 [5, 6]; stage 0 B0 [4, 6] B1 [6, 8].  The formula charges
    # sum T + (m - 1) max T = 6 + 4 = 10 for rank 0 and, one backward of rank 0 (2) earlier, 8 for
    # rank 1 (pp.rank_ends): draw_step waits on each rank before its last backward, so
    # rank 1's B1 runs [7, 8] and rank 0's [8, 10]
    for placed, want in ((False, [8, 6]), (True, [10, 8])):
        pipe, end, starts = _hand(2, 2, [2, 1], [2, 1], 0, "1f1b", placed=placed)
        assert pipe == 10 and end.tolist() == want
    assert [(k, i, t) for k, i, _, t, _ in starts[1]] == [("F", 0, 2), ("B", 0, 3), ("F", 1, 4), ("B", 1, 7)]
    assert [(k, i, t) for k, i, _, t, _ in starts[0]] == [("F", 0, 0), ("F", 1, 2), ("B", 0, 4), ("B", 1, 8)]


def test_blocking_exchange_hand_schedule():
    # Megatron-LM 2021 (pipeline_p2p.MEGATRON_2021): the exchange holds the rank, so each send is the
    # last part of the task that sends.  1F1B, p = 2, m = 4, f = b = c = 1: stage 0's forwards and
    # stage 1's backwards last 2.  Stage 0 F0 [0, 2] F1 [2, 4]; stage 1 F0 [2, 3] B0 [3, 5] F1 [5, 6]
    # B1 [6, 8]; stage 0 B0 [5, 6] F2 [6, 8] B1 [8, 9] F3 [9, 11]; stage 1 F2 [8, 9] B2 [9, 11] F3
    # [11, 12] B3 [12, 14]; stage 0 B2 [11, 12] B3 [14, 15]: T_0 = T_1 = 3, sum T + (m - 1) max T = 15
    f_g, b_g, c = pipeline_p2p.task_lengths(np.ones(2), np.ones(2), 1.0, pipeline_p2p.MEGATRON_2021.blocking)
    assert f_g.tolist() == [2, 1] and b_g.tolist() == [1, 2] and c == 0.0
    pipe, _ = pipeline_time(f_g + b_g, 4, 2, 1, c)
    terms = _Terms(serial=False, fwd=f_g, bwd=b_g, f_g=f_g, b_g=b_g, pipe=pipe, end_r=rank_ends(pipe, b_g[:2], c),
                   send_s=1.0, sends_in_task=True)
    starts, end = _pipeline_starts(SimpleNamespace(p=2, v=1, num_microbatches=4, schedule="1f1b"), terms)
    assert pipe == 15 and end.tolist() == [15, 14]
    assert [(k, i, t) for k, i, _, t, _ in starts[0]] == [("F", 0, 0), ("F", 1, 2), ("B", 0, 5), ("F", 2, 6),
                                                         ("B", 1, 8), ("F", 3, 9), ("B", 2, 11), ("B", 3, 14)]


def test_scatter_gather_exchange():
    # Narayanan et al. 2021 Sec. 4.1: each of t ranks sends 1/t of the activation, then the t pieces
    # are all-gathered: alpha_pp + (M / t) / B_pp plus the ring all-gather (t - 1) (alpha_tp + (M / t) / B_tp)
    # (the cost model's closed forms, no measured rows in PROFILE)
    cm = CostModel.from_profile(PROFILE)
    pp_link, tp_link = Link(25.0, 5.0), Link(300.0, 3.0)
    M, t = 64e6, 8
    whole, _ = pipeline_p2p.exchange_time(cm, M, t, pp_link, "inter", tp_link, "intra", None)
    assert whole == pytest.approx(5e-6 + M / (25e9 * 0.9))
    megatron = replace(cm, code=replace(AUTOPAR, p2p=pipeline_p2p.MEGATRON_2021))
    split, _ = pipeline_p2p.exchange_time(megatron, M, t, pp_link, "inter", tp_link, "intra", None)
    gather, _ = cm.collective_time_ex("all_gather", M, t, tp_link, "intra")
    assert gather == pytest.approx((t - 1) * (3e-6 + M / t / (300e9 * 0.7)))
    assert split == pytest.approx(5e-6 + M / t / (25e9 * 0.9) + gather)


def test_interleaved_fill_and_drain_is_exact():
    # equal chunks, any send up to the shorter of a chunk's forward and backward: the interleaved
    # warm-up hides every steady-state send, so the schedule played with all of them ends exactly
    # at the formula on every rank (the drawn pipeline starts each task as soon as it can)
    for p, v, m, f, b in ((2, 2, 4, 1.0, 2.0), (4, 2, 8, 2.0, 1.0), (3, 3, 6, 1.0, 3.0), (8, 2, 16, 1.0, 2.0)):
        for c in (0.0, 0.25 * min(f, b), min(f, b)):
            G = p * v
            f_g, b_g = np.full(G, f), np.full(G, b)
            free = _Terms(serial=False, fwd=f_g, bwd=b_g, f_g=f_g, b_g=b_g, pipe=0.0, end_r=np.zeros(p), send_s=c)
            _, end = _pipeline_starts(SimpleNamespace(p=p, v=v, num_microbatches=m, schedule="interleaved"), free)
            pipe, _ = pipeline_time(np.full(p, v * (f + b)), m, p, v, c)
            assert pipe == pytest.approx((m + (p - 1) / v) * v * (f + b) + 2 * (G - 1) * c)
            assert end.tolist() == pytest.approx(rank_ends(pipe, b_g[:p], c).tolist(), rel=1e-12)

def test_schedule_orders():
    # 1F1B: p - r - 1 warm-up forwards (Narayanan et al. 2021 Sec. 2.2.1)
    assert schedule_tasks("1f1b", 3, 0, 4, 1) == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("F", 3, 0),
                                                  ("B", 1, 0), ("B", 2, 0), ("B", 3, 0)]
    # interleaved, p = 2, v = 2: 2(p - r - 1) + (v - 1) p warm-up steps, groups of p per chunk
    assert schedule_tasks("interleaved", 2, 1, 2, 2) == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1),
                                                         ("F", 1, 1), ("B", 1, 1), ("B", 0, 0), ("B", 1, 0)]
