"""A toy parallel axis declared through the registration alone reaches the planner's space, its
mesh move, its settings, folded layer tables and screening bound.

The toy axis ``xp`` splits the batch.  It is declared in a ``ParallelDims`` subclass (an ``Axis``
entry and an int field: core/parallel_dims.py) and its degree rule ("1 or 2") is registered by
name (planner/axis_rules.register); nothing in the planner is edited.  The independent
references are built by hand here: the factorisations of the world over (dp, xp, tp, pp) that
the written-out rules admit, the neighbours of a mesh (one axis doubled, another halved), and
the plain mesh's tables and bound (xp replicas each do the work of one).
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


def toy_rule(left: int, limits: axis_rules.MeshLimits) -> tuple[int, ...]:
    return (1, 2)


WORLD, GPUS, L, GB = 16, 8, 8, 32


def _meshes(mesh_class=Mesh):
    return mesh_candidates(WORLD, gpus_per_node=GPUS, num_layers=L, global_batch=GB, sequence_parallel=False,
                           mesh_class=mesh_class)


def test_the_space_enumerates_the_toy_axis():
    with axis_rules.registered("xp", toy_rule):
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
    with pytest.raises(ValueError, match="axis_rules.register"):
        _meshes(ToyDims)


def test_the_mesh_move_reaches_the_toy_axis():
    with axis_rules.registered("xp", toy_rule):
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


def test_the_planner_prices_the_toy_axis_as_replicas():
    """The whole search handed the toy mesh class (``PlanOptions.mesh_class``) screens settings with
    xp = 2, and its folded layer tables and screening bound on dp 2 x xp 2 x tp 2 are those of the
    plain dp 2 x tp 2 mesh with half the global batch: xp adds replicas that each do the same work
    and no cost term reads it (the reference the simulator's toy-axis test uses,
    tests/simulator/test_simulator_terms.py)."""
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.planner.search import PlanOptions, Planner
    from autopar.simulator.device.cost_model import CostModel

    graph = capture_model_file("examples/gpt.py", {"layers": 4, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024},
                               2)
    cluster = load_cluster("dgx-a100-1x8")
    cms = {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}
    with axis_rules.registered("xp", toy_rule):
        toy = Planner(graph, cluster, cms, PlanOptions(global_batch=64, mesh_class=ToyDims))
        settings = toy.settings()
    plain = Planner(graph, cluster, cms, PlanOptions(global_batch=32))
    assert {s.mesh.xp for s in settings} == {1, 2} and all(type(s.mesh) is ToyDims for s in settings)
    assert any(m.xp == 2 for m in toy.moves.meshes)
    # each setting splits the global batch over dp x xp replicas
    assert all(s.mesh.dp * s.mesh.xp * s.micro_batch * s.num_microbatches == 64 for s in settings)
    # the same setting on the plain mesh (4 of the 8 ranks: the evaluator prices a mesh smaller
    # than the cluster, as the simulator's toy-axis test does)
    pairs = [(s, replace(s, mesh=Mesh(dp=2, tp=2, sequence_parallel=s.mesh.sequence_parallel)))
             for s in settings if (s.mesh.dp, s.mesh.xp, s.mesh.tp, s.mesh.pp) == (2, 2, 2, 1)]
    assert {s.zero_family for s, _ in pairs} == {"ddp", "zero1", "fsdp"}
    for s, p in pairs:
        assert toy.bound(s) == plain.bound(p), s
        (t,), _ = toy.tables(s)
        (u,), _ = plain.tables(p)
        assert t.valid.any() and np.array_equal(t.valid, u.valid), s
        assert np.array_equal(t.time_mb_s[t.valid], u.time_mb_s[u.valid]), s
