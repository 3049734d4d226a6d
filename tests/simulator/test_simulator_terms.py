"""The registry of the step's cost terms (simulator/term_registry.py): a toy term registered alone
reaches every reader of the step.

The toy term adds a constant ``TOY_S`` seconds to every layer's forward, on the critical path, in
a column of its own -- declared in this file and registered, nothing else edited.  The
independent reference is the closed form of a single pipeline rank, ``m (sum_k fwd_k + bwd_k)``
(Narayanan et al. 2021, Sec. 2.2.1 with p = 1), which grows by exactly ``m L TOY_S`` when every
one of the L layers' forwards grows by TOY_S and nothing else moves (compute, not the FSDP traffic,
sets each layer's pace here: no ZeRO-2/3).  So:

* the step model, on the fast path (evaluate, its _LayerMemo serving a changed plan) and the full
  one (simulate), in both step forms (a GPU's overlapped, a CPU node's serial): the step moves by
  m L TOY_S;
* the trace: one "toy L<k>" event per layer and micro-batch on the term's stream, each TOY_S
  long, drawn on the critical path (the passes run back to back and end m L TOY_S later);
* the planner's folded tables: every entry of the DDP family moves by TOY_S per micro-batch;
* the screening bound of a one-rank setting moves by m L TOY_S.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopar.core.capture import capture_model_file
from autopar.core.cluster import load_cluster
from autopar.simulator.step import layer_table
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.simulate import simulate_plan
from autopar.simulator.step.trace import draw_step
from autopar.simulator.step.timeline import to_chrome_trace
from autopar.simulator.step.term_registry import ENTRIES, Column, Term, registered, terms

GPT = "examples/gpt.py"
TOY_S = 1e-3

#: the toy term: one column, filled with TOY_S for every layer, added to each layer's forward
TOY = Term("toy", "compute", columns=(Column("toy_s", lambda lc, lp, mesh: TOY_S),), fwd="toy_s",
           stream="toy", fwd_label="toy", source="tests/simulator/test_simulator_terms.py")


@pytest.fixture(scope="module")
def gpt4():
    # 6 layers: embeddings, 4 blocks, head
    return capture_model_file(GPT, {"layers": 4, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024}, 2)


def _cms(cluster):
    return {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}


def _plan(graph, dp, tp, m, zero=0, recompute="none"):
    return config_plan(graph, degrees={"dp": dp, "tp": tp, "pp": 1},
                       micro_batch=2, global_batch=2 * dp * m, schedule="1f1b",
                       virtual_stages=1, zero=zero, recompute=recompute, offload="none", precision="bf16",
                       sequence_parallel=False)


def test_builtin_terms_are_declared_over_existing_columns():
    """Every built-in term says how it enters the step, and reads columns the table has."""
    names = [t.name for t in terms()]
    assert {"compute", "tp", "recompute", "ddp_buckets", "sharded_dp", "offload", "pipeline", "cpu_waits"} <= set(names)
    for t in terms():
        assert t.enters in ENTRIES
        assert set(t.reads) <= set(layer_table.COLUMNS), t.name
    assert "toy_s" not in layer_table.COLUMNS


@pytest.mark.parametrize("cluster_name,dp,tp", [("dgx-a100-1x8", 4, 2),     # GPU: overlapped form, fast path
                                                ("local-cpu", 2, 1)])       # CPU node: the serial form
def test_toy_term_moves_the_step_by_its_layers_and_appears_in_the_trace(gpt4, cluster_name, dp, tp):
    cluster = load_cluster(cluster_name)
    L, m = len(gpt4.layers), 3
    plan = _plan(gpt4, dp, tp, m)
    changed = replace(plan, layers=tuple(replace(lp, recompute="full") if i == 2 else lp
                                         for i, lp in enumerate(plan.layers)))
    before = [PlanEvaluator(gpt4, cluster, _cms(cluster)).evaluate(p).step_time_s for p in (plan, changed)]
    trace0 = draw_step(*PlanEvaluator(gpt4, cluster, _cms(cluster)).prepare(changed), [0])
    with registered(TOY):
        assert layer_table.COLUMNS[-1] == "toy_s"
        ev = PlanEvaluator(gpt4, cluster, _cms(cluster))
        fast = [ev.evaluate(p).step_time_s for p in (plan, changed)]     # the second from the memo
        full = simulate_plan(gpt4, changed, cluster, _cms(cluster))
        ctx, rows = ev.prepare(changed)
        assert ctx.memo_ok == (cluster_name != "local-cpu")
        assert np.all(rows.toy_s == TOY_S)
        trace = draw_step(ctx, rows, [0])
    assert "toy_s" not in layer_table.COLUMNS                              # unregistered again
    for b, f in zip(before, fast):
        assert f - b == pytest.approx(m * L * TOY_S, rel=1e-9)
    assert full.step_time_s == pytest.approx(fast[1], rel=1e-12)
    toy = [e for e in trace.events if e["name"].startswith("toy L")]
    assert len(toy) == m * L and {e["stream"] for e in toy} == {"toy"}
    assert all(e["dur_s"] == pytest.approx(TOY_S, rel=1e-12) for e in toy)
    chrome = to_chrome_trace(trace.events)["traceEvents"]
    assert sum(1 for e in chrome if e.get("cat") == "toy") == m * L
    # the passes drawn run back to back, each event where the one before it ends (the toy's slot
    # holds it, and no wait is drawn before the last backward), and they end m L TOY_S later than
    # without the term: the closed form, not the step model's end, which draw_step places each
    # rank's last backward at where it can (so an end equal to it would hold by construction)
    ends = [_passes_end(t) for t in (trace0, trace)]
    assert ends[1] - ends[0] == pytest.approx(m * L * TOY_S, rel=1e-9)


def _passes_end(trace) -> float:
    """When the forward and backward passes of the drawn rank end, checking that they run back to
    back from 0: each event on the compute-term streams starts where the one before it ends."""
    passes = sorted(((e["start_s"], e["start_s"] + e["dur_s"]) for e in trace.events
                     if "micro_batch" in (e.get("args") or {}) and e["stream"] != "fsdp"))
    t = 0.0
    for start, end in passes:
        assert start == pytest.approx(t, rel=1e-12, abs=1e-15)
        t = end
    return t


def test_toy_term_reaches_the_planner_tables_and_the_bound(gpt4):
    from autopar.planner.search import PlanOptions, Planner

    cluster = load_cluster("dgx-a100-1x8")
    L = len(gpt4.layers)

    def planner():
        return Planner(gpt4, cluster, _cms(cluster), PlanOptions(global_batch=32, sequence_parallel=False))

    P0 = planner()
    settings = [s for s in P0.settings() if s.mesh.pp == 1 and s.zero_family == "ddp"]
    assert settings
    before = {s: (P0.bound(s), P0.tables(s)[0][0]) for s in settings}
    with registered(TOY):
        P1 = planner()
        after = {s: (P1.bound(s), P1.tables(s)[0][0]) for s in settings}
    for s in settings:
        (b0, t0), (b1, t1) = before[s], after[s]
        assert b1 - b0 == pytest.approx(s.num_microbatches * L * TOY_S, rel=1e-9), s
        ok = t0.valid
        assert np.allclose((t1.time_mb_s - t0.time_mb_s)[ok], TOY_S, rtol=1e-9, atol=0), s


# ------------------------------------------------------------------ a toy axis
def test_toy_axis_is_seen_by_the_plan_builder_the_links_and_the_step_model(gpt4):
    """A toy axis ``xp`` that splits the batch, declared in a ParallelDims subclass alone
    (core/parallel_dims.py): the plan builder takes its degree by name and counts it in the
    global batch, the mesh's links carry its group by name, and the evaluator prices each
    replica as the plain mesh's (same step time) while the samples per second and the bytes
    sent per step, summed over devices, double with xp = 2 (twice the replicas, each doing the
    same work: the closed-form reference is the plain dp 2 x tp 2 plan's figures)."""
    from dataclasses import dataclass
    from typing import ClassVar

    from autopar.core.parallel_dims import AXES, Axis, ParallelDims
    from autopar.core.plan import ModelRef, uniform_plan
    from autopar.core.sharding import megatron_styles

    @dataclass(frozen=True)
    class ToyDims(ParallelDims):
        axes: ClassVar = AXES[:1] + (Axis("xp", "batch", "toy data-parallel axis", plan_default=1),) + AXES[1:]
        xp: int = 1

    cluster = load_cluster("dgx-a100-1x8")
    ref = ModelRef(gpt4.model_file, dict(gpt4.model_args), gpt4.model_name, gpt4.fingerprint)
    kw = dict(model=ref, num_layers=len(gpt4.layers), micro_batch=2, num_microbatches=3, precision="bf16",
              tp_styles_per_layer={i: megatron_styles(gpt4, i) for i in range(len(gpt4.layers))})
    toy = uniform_plan(mesh_class=ToyDims, dp=2, xp=2, tp=2, **kw)
    plain = uniform_plan(dp=2, tp=2, **kw)
    assert toy.mesh.world_size == 8 and toy.global_batch == 2 * plain.global_batch
    with pytest.raises(TypeError):
        uniform_plan(xp=2, **kw)                             # the plain mesh has no such axis
    ev = PlanEvaluator(gpt4, cluster, _cms(cluster))
    links = ev.links(toy.mesh)
    assert list(links.axes) == list(toy.mesh.axis_names) and links.xp.size == 2 and links.axis("xp") is links.xp
    a, b = ev.evaluate(toy), PlanEvaluator(gpt4, cluster, _cms(cluster)).evaluate(plain)
    assert a.step_time_s == b.step_time_s
    assert a.samples_per_s == pytest.approx(2 * b.samples_per_s, rel=1e-12)
    assert sum(a.work.comm_bytes.values()) == pytest.approx(2 * sum(b.work.comm_bytes.values()), rel=1e-12)
    assert simulate_plan(gpt4, toy, cluster, _cms(cluster)).step_time_s == a.step_time_s


# ------------------------------------------------------------------ a toy traffic term
TOY_COPY_S = 1e-7

#: a toy transfer before each layer's forward on a stream of its own, beside compute
TOY_COPY = Term("toy_copy", "traffic", columns=(Column("toy_copy_s", lambda lc, lp, mesh: TOY_COPY_S),),
                traffic=lambda src, zero, offload, pipeline_m=None: (src.toy_copy_s, 0.0 * src.toy_copy_s, 0.0 * src.toy_copy_s),
                stream="toy", gather_label="toy copy", scatter_label="toy copy back",
                source="tests/simulator/test_simulator_terms.py")


@pytest.mark.parametrize("cluster_name,dp,tp", [("dgx-a100-1x8", 4, 2), ("local-cpu", 2, 1)])
def test_toy_traffic_enters_beside_compute(gpt4, cluster_name, dp, tp):
    """A transfer before each layer's forward, shorter than any layer's compute, hides behind the
    previous layer's compute where communication overlaps (a GPU: FSDP's prefetch rule, Zhao et
    al. 2023, Sec. 3.3): only the first layer of the chunk waits for its own, so the step moves by
    m TOY_COPY_S; where communication takes turns with compute (a CPU node) every transfer adds:
    m L TOY_COPY_S.  The trace draws one per layer and micro-batch, and more on the GPU (the
    prefetches of the next layer)."""
    cluster = load_cluster(cluster_name)
    L, m = len(gpt4.layers), 3
    plan = _plan(gpt4, dp, tp, m)
    before = PlanEvaluator(gpt4, cluster, _cms(cluster)).evaluate(plan).step_time_s
    with registered(TOY_COPY):
        ev = PlanEvaluator(gpt4, cluster, _cms(cluster))
        after = ev.evaluate(plan).step_time_s
        ctx, rows = ev.prepare(plan)
        assert TOY_COPY_S < rows.fwd_s.min()
        trace = draw_step(ctx, rows, [0])
    serial = cluster_name == "local-cpu"
    assert after - before == pytest.approx(m * (L if serial else 1) * TOY_COPY_S, rel=1e-6)
    copies = [e for e in trace.events if e["name"].startswith("toy copy L")]
    assert {e["stream"] for e in copies} == {"toy"}
    assert len(copies) == m * L if serial else len(copies) >= m * L
