"""Chrome trace of a simulated step: valid JSON, tracks per device and stream, no overlap on a stream."""
import json
from collections import defaultdict

import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.simulator.configure import config_plan
from autopar.simulator.cost_model import CostModel
from autopar.simulator.simulate import simulate
from autopar.simulator.timeline import write_chrome_trace
from sim_graphs import engine_step_s, gpt_graph

PROFILE = dict(name="t", memory_bandwidth_Bps=2e12, peak_flops={"fp32": 20e12, "bf16": 250e12},
               efficiency={"linear": 0.8, "matmul": 0.8, "memory_bound": 0.8},
               collective_efficiency={"intra": 0.7, "inter": 0.9})


def test_chrome_trace(tmp_path):
    g = gpt_graph(8, 512, 8, 256, 1000)
    cl = Cluster("c", (NodeGroup("n", "t", 2, 4, 80 * 2**30, Link(300.0, 3.0), 2**40, Link(25.0, 10.0)),), Link(25.0, 5.0))
    plan = config_plan(g, dp=2, tp=2, pp=2, micro_batch=1, global_batch=8, schedule="1f1b", virtual_stages=1,
                       zero=3, recompute="full", offload="none", precision="bf16", sequence_parallel=False)
    r = simulate(g, plan, cl, CostModel.from_profile(PROFILE), timeline=True)
    path = tmp_path / "trace.json"
    write_chrome_trace(path, r.timeline)
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    devices = {e["pid"] for e in events}
    assert devices == {plan.mesh.rank(0, p, 0) for p in range(plan.mesh.pp)}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    per_track = defaultdict(list)
    for e in events:
        per_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    streams = {names[k] for k in per_track}
    assert {"compute", "tp", "dp", "pp"} <= streams
    for track, spans in per_track.items():
        spans.sort()
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-6, f"overlapping events on {track}"
    # the last event ends when the engine's step ends, within 5% of the step model's
    end_us = max(e for spans in per_track.values() for _, e in spans)
    assert end_us == pytest.approx(engine_step_s(g, plan, cl, CostModel.from_profile(PROFILE)) * 1e6)
    assert end_us == pytest.approx(r.step_time_s * 1e6, rel=0.05)
