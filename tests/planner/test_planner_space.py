"""The plan space: enumeration against hand counts, and every MCMC move yields a valid plan."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.core.plan import ModelRef, equal_bounds
from autopar.planner.candidate import Candidate
from autopar.planner.moves import MoveSpace, propose
from autopar.planner.space import (LayerChoice, layer_choices, mesh_candidates, microbatch_candidates,
                                   schedule_candidates)


def test_mesh_candidates_match_a_hand_enumeration():
    meshes = mesh_candidates(32, gpus_per_node=8, num_layers=10, global_batch=64, sequence_parallel=False)
    want = {(dp, tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8, 16, 32) for dp in (1, 2, 4, 8, 16, 32)
            if dp * tp * pp == 32 and pp <= 10 and 64 % dp == 0}
    assert {(m.dp, m.tp, m.pp) for m in meshes} == want
    with_sp = mesh_candidates(32, gpus_per_node=8, num_layers=10, global_batch=64)
    assert len(with_sp) == len(meshes) + sum(1 for m in meshes if m.tp > 1)
    # tp never crosses a node of 4 GPUs
    assert max(m.tp for m in mesh_candidates(16, gpus_per_node=4, num_layers=8, global_batch=16)) == 4


def test_microbatches_and_schedules():
    assert microbatch_candidates(24, 4) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert microbatch_candidates(24, 5) == []
    assert schedule_candidates(1, 10, 8) == [("1f1b", 1)]
    assert all(s != "interleaved" for s, _ in schedule_candidates(4, 10, 6))   # m not a multiple of p
    assert ("interleaved", 3) not in schedule_candidates(4, 10, 8)            # 12 > 10 layers
    # interleaved only where the layers split into p * v equal chunks
    assert ("interleaved", 2) in schedule_candidates(4, 16, 8)
    assert ("interleaved", 2) not in schedule_candidates(4, 10, 8)            # 10 layers, 8 chunks
    assert [v for s, v in schedule_candidates(2, 24, 4, max_virtual_stages=4) if s == "interleaved"] == [2, 3, 4]
    assert [v for s, v in schedule_candidates(3, 24, 6, max_virtual_stages=4) if s == "interleaved"] == [2, 4]


def test_layer_choices_respect_the_plan_rules():
    ch = layer_choices(tp=2, dp=4, zero_family="fsdp", can_split=True)
    assert len(ch) == 2 * 2 * 3 * 2                     # split x zero{2,3} x recompute x offload
    assert all(c.offload == "none" or c.zero >= 2 for c in ch)
    assert {c.zero for c in layer_choices(tp=1, dp=4, zero_family="zero1", can_split=True)} == {1}
    assert layer_choices(tp=1, dp=1, zero_family="zero1", can_split=True) == []


def test_every_move_gives_a_valid_plan():
    from autopar.core.plan import Mesh

    L = 8
    meshes = tuple(mesh_candidates(16, gpus_per_node=8, num_layers=L, global_batch=32))
    space = MoveSpace(meshes=meshes, can_split=(True,) * L, num_layers=L, global_batch=32)
    styles = [{f"l{i}.a": "colwise", f"l{i}.b": "rowwise"} for i in range(L)]
    model = ModelRef("m.py", {}, "m", "0" * 16)
    c = Candidate(Mesh(dp=16), 2, 1, "1f1b", equal_bounds(L, 1), tuple(LayerChoice() for _ in range(L)))
    rng = np.random.default_rng(0)
    kinds = set()
    for _ in range(3000):
        c = propose(c, rng, space)
        c.to_plan(model=model, styles=styles, precision="bf16", cluster="x").validate(L)
        kinds.add((c.mesh.pp > 1, c.schedule, c.choices[0].zero))
        if c.schedule == "interleaved":                   # equal model chunks only
            assert len({b - a for a, b in zip(c.bounds, c.bounds[1:])}) == 1, c.bounds
    assert len(kinds) > 6                                 # the chain moves across the space


def test_candidate_memos_key_by_the_choices_values():
    """A candidate's choices keep tuple's own hash, and Candidate.to_plan's memo serves equal
    choices held in two distinct tuples with one tuple of layer plans (a memo keyed by the
    tuple's identity would build a second)."""
    from autopar.core.plan import Mesh

    L = 4
    styles = [{f"l{i}.a": "colwise"} for i in range(L)]
    model = ModelRef("m.py", {}, "m", "0" * 16)
    make = lambda: tuple(LayerChoice(tp=True, zero=i % 2) for i in range(L))   # noqa: E731
    a = Candidate(Mesh(dp=2, tp=2), 2, 1, "1f1b", equal_bounds(L, 1), make())
    b = Candidate(Mesh(dp=2, tp=2), 2, 1, "1f1b", equal_bounds(L, 1), make())
    assert a.choices is not b.choices and a == b and hash(a) == hash(b)
    assert hash(a.choices) == hash(tuple(a.choices)) and a.choices == tuple(b.choices)
    memo: dict = {}
    pa = a.to_plan(model=model, styles=styles, precision="bf16", cluster="x", memo=memo)
    pb = b.to_plan(model=model, styles=styles, precision="bf16", cluster="x", memo=memo)
    assert pa.layers is pb.layers and [lp.zero for lp in pa.layers] == [0, 1, 0, 1]


def test_move_kinds_are_drawn_as_numpy_draws_with_the_weights():
    """propose's draw of a kind equals numpy's Generator.choice over the kinds with the weights
    (4 for a layer move, 2 for a stage knob or a boundary, 1 for the others), on the same stream."""
    import bisect

    from autopar.planner.moves import _MOVE_CDF

    weights = np.array([4, 2, 2, 1, 1, 1, 1, 1], dtype=float)
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    want = [int(a.choice(8, p=weights / weights.sum())) for _ in range(20000)]
    got = [bisect.bisect_right(_MOVE_CDF, b.random()) for _ in range(20000)]
    assert got == want
    assert np.bincount(got, minlength=8) / len(got) == pytest.approx(weights / weights.sum(), abs=0.01)
