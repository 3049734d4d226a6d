"""A toy parallel axis declared through the registration alone reaches the planner's space, its
mesh move, its settings, folded layer tables and screening bound.

The toy axis ``xp`` splits the batch.  It is declared in a ``ParallelDims`` subclass (an ``Axis``
entry and an int field: core/parallel_dims.py) and its degree rule ("1 or 2") is registered by
name (planner/axis_rules.register_rule); nothing in the planner is edited.  The independent
references are built by hand here: the factorisations of the world over (dp, xp, tp, pp) that
the written-out rules admit, the neighbours of a mesh (one axis doubled, another halved), and
and, where xp joins the gradient group (``SyncedDims``), the ring all-reduce of its gradient sync
in closed form.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import pytest

from autopar.core.parallel_dims import AXES, Axis, ParallelDims
from autopar.core.plan import Mesh, ModelRef, equal_bounds
from autopar.planner import axis_rules
from autopar.planner.candidate import Candidate
from autopar.planner.moves import MoveSpace, _is_neighbour, _mesh_move, propose
from autopar.planner.space import LayerChoice, mesh_candidates


@dataclass(frozen=True)
class ToyDims(ParallelDims):
    axes: ClassVar = AXES[:1] + (Axis("xp", "batch", "toy data-parallel axis", plan_default=1),) + AXES[1:]
    xp: int = 1


@dataclass(frozen=True)
class SyncedDims(ToyDims):
    """The toy axis with a cost: it splits the batch and its ranks average their gradients
    with the dp and cp ranks' (it joins the "batch" and "grad" groups)."""
    GROUPS: ClassVar = {"batch": ("dp", "xp"), "grad": ("dp", "xp", "cp"), "world": tuple(a.name for a in ToyDims.axes)}


def toy_rule(left: int, limits: axis_rules.MeshLimits) -> tuple[int, ...]:
    return (1, 2)


WORLD, GPUS, L, GB = 16, 8, 8, 32


def _meshes(mesh_class=Mesh):
    return mesh_candidates(WORLD, gpus_per_node=GPUS, num_layers=L, global_batch=GB, sequence_parallel=False,
                           mesh_class=mesh_class)


def test_the_space_enumerates_the_toy_axis():
    with axis_rules.registered_rule("xp", toy_rule):
        toy = _meshes(ToyDims)
        plain = _meshes()
    # by hand: tp a power of two dividing the node's 8 GPUs, pp at most L, xp 1 or 2, and the
    # batch split dp x xp ways evenly
    want = {(dp, xp, tp, pp) for dp, xp, tp, pp in itertools.product(range(1, WORLD + 1), (1, 2), (1, 2, 4, 8),
                                                                       range(1, L + 1))
            if dp * xp * tp * pp == WORLD and GB % (dp * xp) == 0}
    got = [(m.dp, m.xp, m.tp, m.pp) for m in toy]
    assert len(got) == len(set(got)) and set(got) == want
    assert {x for x in want if x[1] == 2} and all(type(m) is ToyDims and m.cp == 1 for m in toy)
    assert all(GB % m.batch_degree == 0 for m in toy)
    # a registered rule of an axis the mesh class does not declare changes nothing
    assert plain == _meshes()
    # without its rule the toy axis is refused, saying where to register one
    with pytest.raises(ValueError, match="axis_rules.register_rule"):
        _meshes(ToyDims)


def test_the_mesh_move_reaches_the_toy_axis():
    with axis_rules.registered_rule("xp", toy_rule):
        meshes = tuple(_meshes(ToyDims))
    space = MoveSpace(meshes=meshes, can_split=(True,) * L, num_layers=L, global_batch=GB)
    cur = ToyDims(dp=16)
    # by hand: the neighbours of dp 16 are dp 8 with one other axis at 2
    assert {m for m in meshes if _is_neighbour(m, cur)} == {ToyDims(dp=8, xp=2), ToyDims(dp=8, tp=2),
                                                             ToyDims(dp=8, pp=2)}
    assert _is_neighbour(ToyDims(dp=4, xp=2, tp=2), ToyDims(dp=4, xp=1, tp=4))
    assert not _is_neighbour(ToyDims(dp=2, xp=2, tp=4), ToyDims(dp=8, xp=1, tp=2))   # dp / 4
    c = Candidate(cur, 2, 1, "1f1b", equal_bounds(L, 1), tuple(LayerChoice() for _ in range(L)))
    rng = np.random.default_rng(0)
    moved = [_mesh_move(c, rng, space) for _ in range(200)]
    reached = {m.mesh for m in moved if m is not None}
    assert ToyDims(dp=8, xp=2) in reached
    # each keeps the global batch: the micro-batches follow the batch degree dp x xp
    assert all(m.global_batch == GB for m in moved if m is not None)

    # the chain's proposals reach meshes with xp = 2, each a valid plan of the same batch
    styles = [{f"l{i}.a": "colwise", f"l{i}.b": "rowwise"} for i in range(L)]
    model = ModelRef("m.py", {}, "m", "0" * 16)
    seen = set()
    for _ in range(2000):
        c = propose(c, rng, space)
        plan = c.to_plan(model=model, styles=styles, precision="bf16", cluster="x")
        plan.validate(L)
        assert plan.global_batch == GB and type(plan.mesh) is ToyDims
        seen.add(c.mesh.xp)
    assert seen == {1, 2}


def test_the_toy_axis_gradient_sync_is_priced_in_closed_form():
    """xp joins the gradient group (``GROUPS["grad"]``), so its ranks all-reduce their gradients
    with the dp ranks'.  On dp 4 x xp 2 (8 ranks of one 8-GPU A100 node, ZeRO-0: DDP), the
    gradient sync is a ring all-reduce over n = 8 ranks of the model's gradients, G bytes
    (G: the parameters of the torch model, counted here, in fp32): each call costs
    2 (n - 1) alpha + 2 (n - 1) / n M beta (Patarasuk & Yuan 2009; alpha, beta: the node link's
    latency and 1 / (bandwidth x the profile's intra-node efficiency) from the cluster file and
    the profile), so the k calls of DDP's buckets cost 2 (n - 1) k alpha + 2 (n - 1) / n G beta
    in all, and every rank sends 2 (n - 1) / n G bytes.  Checked in the step's price (the
    layer table the step is composed from), the plan's prediction (its ``comm_bytes``) and the
    trace (its all-reduce events).  The planner's tables on the toy mesh equal those of the
    plain dp 8 mesh of the same global batch: xp syncs as dp does.

    The files the axis needed: the ParallelDims declaration (an ``Axis`` entry, a field and the
    groups it joins: core/parallel_dims.py for a real axis) and its degree rule
    (``axis_rules.register_rule``): 2, and no package module names ``xp``."""
    import importlib.util
    import pathlib

    import torch

    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.planner.search import PlanOptions, Planner
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.step.trace import draw_step

    args = {"layers": 4, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024}
    graph = capture_model_file("examples/gpt.py", args, 2)
    cluster = load_cluster("dgx-a100-1x8")
    cm = CostModel.from_profile("a100-80gb-sxm")
    cms = {g.gpu: cm for g in cluster.groups}
    with axis_rules.registered_rule("xp", toy_rule):
        toy = Planner(graph, cluster, cms, PlanOptions(global_batch=64, precision="fp32", mesh_class=SyncedDims))
        settings = toy.settings()
        assert any(s.mesh.xp == 2 for s in settings) and all(type(s.mesh) is SyncedDims for s in settings)
        mesh = SyncedDims(dp=4, xp=2)
        assert mesh.grad_degree == 8 and mesh.batch_degree == 8
        c = Candidate(mesh, 2, 4, "1f1b", equal_bounds(len(graph.layers), 1),
                      tuple(LayerChoice() for _ in graph.layers))
        priced = toy.price(c)
    assert priced is not None and priced.plan.mesh == mesh and priced.plan.global_batch == 64

    # the closed form
    spec = importlib.util.spec_from_file_location("toy_axis_gpt", "examples/gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    with torch.device("meta"):
        model = gpt.build_model(**args)
    grad_bytes = 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    n = 8
    link = cluster.groups[0].intra_node
    alpha, beta = link.latency_s, 1.0 / (link.bandwidth_Bps * cm.collective_efficiency["intra"])

    # the step's price: the layer table the step is composed from
    ctx, rows = toy.evaluator.prepare(priced.plan)
    assert rows.dp_grad_bytes.sum() == pytest.approx(grad_bytes, rel=1e-12)
    calls = int((rows.dp_allreduce_s > 0).sum())
    want = 2 * (n - 1) * calls * alpha + 2 * (n - 1) / n * grad_bytes * beta
    assert calls >= 1 and rows.dp_allreduce_s.sum() == pytest.approx(want, rel=1e-9)
    # the plan's prediction (the block search._finish writes into plan.json's "predicted"): every
    # rank sends 2 (n - 1) / n G bytes per step
    predicted = priced.result.predicted_dict()["comm_bytes"]
    assert predicted["intra"] == pytest.approx(n * 2 * (n - 1) / n * grad_bytes, rel=1e-12) and predicted["inter"] == 0
    # the trace: one all-reduce event per call, on the data-parallel stream, summing to the closed form
    events = [e for e in draw_step(ctx, rows, [0]).events if e["name"].startswith("all_reduce")]
    assert len(events) == calls and {e["stream"] for e in events} == {"dp"}
    assert sum(e["dur_s"] for e in events) == pytest.approx(want, rel=1e-9)

    # xp syncs as dp: the toy mesh's tables are the plain dp 8 mesh's
    plain = Planner(graph, cluster, cms, PlanOptions(global_batch=64, precision="fp32"))
    s = next(s for s in settings if s.mesh == mesh)
    p = replace(s, mesh=Mesh(dp=8))
    assert toy.bound(s) == plain.bound(p)
    (t,), _ = toy.tables(s)
    (u,), _ = plain.tables(p)
    assert t.valid.any() and np.array_equal(t.valid, u.valid)
    assert np.array_equal(t.time_mb_s[t.valid], u.time_mb_s[u.valid])

    # no package module names the toy axis
    root = pathlib.Path(__file__).resolve().parents[2]
    named = [f for d in ("core", "planner", "simulator", "runtime") for f in (root / d).rglob("*.py")
             if '"xp"' in f.read_text() or ".xp" in f.read_text()]
    assert named == []
