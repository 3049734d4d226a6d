"""Named parallel axes (core/parallel_dims.py) against torch's own rank layout.

References the code under test did not produce: ``torch.arange(world).view(shape)`` (the
layout ``init_device_mesh`` documents), torch's ``DeviceMesh`` built on a fake process group
(its coordinates and the ranks of each 1-D sub-mesh), the plan file's mesh object as version 1
wrote it, and brute-force enumerations of the factorisations of a world size.

Adding an axis is local: ``WithContextParallel`` below declares a fourth axis (``cp``, between
``pp`` and ``tp`` as in picotron's ``view(dp, pp, cp, tp)``) with one ``Axis`` entry and one
field, and every generic method -- coordinates, ranks, groups, the plan file's form -- works
for it unchanged.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest
import torch

from autopar.core.errors import PlanFileError
from autopar.core.parallel_dims import (AXES, AXIS_BY_NAME, Axis, ParallelDims, check_declaration,
                                        factorisations)
from autopar.core.plan import Mesh, ModelRef, Plan, uniform_plan
from autopar.planner.space import divisors, mesh_candidates

CP = Axis("cp", "sequence", "context-parallel degree", plan_default=1)


@dataclass(frozen=True)
class WithContextParallel(ParallelDims):
    axes = (AXIS_BY_NAME["dp"], AXIS_BY_NAME["pp"], CP, AXIS_BY_NAME["tp"])
    cp: int = 1


LAYOUTS = [Mesh(dp=2, tp=2, pp=3), Mesh(dp=3, tp=4, pp=1), Mesh(dp=1, tp=1, pp=5),
           WithContextParallel(dp=2, tp=2, pp=2, cp=3), WithContextParallel(dp=3, tp=1, pp=2, cp=2)]


def _torch_layout(dims: ParallelDims) -> torch.Tensor:
    return torch.arange(dims.world_size).view(dims.shape)


def test_the_plan_mesh_is_the_declared_four_axes():
    assert Mesh is ParallelDims
    assert Mesh(dp=2, tp=4, pp=3).axis_names == ("dp", "pp", "cp", "tp") == tuple(a.name for a in AXES)
    assert Mesh(dp=2, tp=4, pp=3).shape == (2, 3, 1, 4)
    assert Mesh(dp=2, tp=4, pp=3, cp=5).shape == WithContextParallel(dp=2, tp=4, pp=3, cp=5).shape
    assert AXIS_BY_NAME["tp"].innermost                    # tp groups are consecutive ranks
    check_declaration(WithContextParallel)
    assert WithContextParallel(dp=2, tp=4, pp=3, cp=5).shape == (2, 3, 5, 4)


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: "x".join(map(str, d.shape)))
def test_coords_ranks_and_groups_match_arange_view(dims):
    ranks = _torch_layout(dims)
    names = dims.axis_names
    assert dims.world_size == ranks.numel()
    for r in range(dims.world_size):
        where = tuple(int(i) for i in (ranks == r).nonzero()[0])
        assert dims.coords(r) == where
        assert dims.rank(*where) == r
        named = dims.coords_by_axis(r)
        assert named == dict(zip(names, where))
        assert dims.rank_at(**named) == r
        for i, axis in enumerate(names):
            assert dims.coord(r, axis) == where[i]
            index = list(where)
            index[i] = slice(None)                         # vary this axis alone
            assert list(dims.group(axis, r)) == ranks[tuple(index)].tolist()
    for i, axis in enumerate(names):
        # every group of the axis, each once: the rows of the layout with this axis last
        rows = ranks.movedim(i, -1).reshape(-1, dims.shape[i]).tolist()
        assert sorted(map(list, dims.groups(axis))) == sorted(rows)
        if i:                                  # groups with the outermost coordinate fixed
            last = dims.shape[0] - 1
            chosen = [g for g in rows if dims.coords(g[0])[0] == last]
            assert sorted(map(list, dims.groups(axis, **{names[0]: last}))) == sorted(chosen)


@pytest.mark.parametrize("dims", [LAYOUTS[0], LAYOUTS[3]], ids=("3-axis", "4-axis"))
def test_coords_and_groups_match_torch_device_mesh(dims):
    """torch's DeviceMesh on a fake world: each rank's coordinate and the ranks of each of its
    1-D sub-meshes (the process group that axis's collectives use)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for r in sorted({0, 1, dims.world_size // 2 + 1, dims.world_size - 1}):
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=dims.world_size)
        try:
            mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=dims.axis_names)
            assert mesh.mesh.tolist() == _torch_layout(dims).tolist()
            assert tuple(mesh.get_coordinate()) == dims.coords(r)
            for axis in dims.axis_names:
                assert mesh[axis].mesh.tolist() == list(dims.group(axis, r))
        finally:
            dist.destroy_process_group()


def test_batch_degree_counts_only_the_axes_that_split_the_batch():
    assert Mesh(dp=4, tp=2, pp=3).batch_degree == 4
    assert WithContextParallel(dp=4, tp=2, pp=3, cp=2).batch_degree == 4     # cp splits tokens, not samples
    assert WithContextParallel(dp=4, tp=2, pp=3, cp=2).degree("sequence") == 2


def test_splits_model_is_any_axis_besides_data_parallel():
    # the runtime's choice of DDP / ZeroRedundancyOptimizer against FSDP2's machinery, and the
    # simulator's price of it, read this one predicate (runtime/apply_dp.data_parallel_kind)
    from autopar.runtime.apply_dp import data_parallel_kind
    assert not Mesh(dp=8).splits_model and not Mesh().splits_model
    assert Mesh(dp=2, tp=2).splits_model and Mesh(pp=2).splits_model
    assert WithContextParallel(dp=4, cp=2).splits_model                    # a new axis counts too
    assert not WithContextParallel(dp=4).splits_model
    assert [data_parallel_kind(z, Mesh(dp=8)) for z in (0, 1, 2, 3)] == ["ddp", "zero1", "fsdp", "fsdp"]
    assert [data_parallel_kind(z, Mesh(dp=4, pp=2)) for z in (0, 1, 2)] == ["replicate", "fsdp", "fsdp"]
    assert [data_parallel_kind(z, WithContextParallel(dp=4, cp=2)) for z in (0, 1)] == ["replicate", "fsdp"]
    assert [data_parallel_kind(z, Mesh(tp=8)) for z in (0, 1, 3)] == ["none", "none", "fsdp"]


def _plan(**mesh) -> Plan:
    return uniform_plan(model=ModelRef("m.py", {}, "m", "f"), num_layers=4, micro_batch=2, **mesh)


def test_plan_file_mesh_keeps_the_version_1_form():
    """The mesh object as plan version 1 has always written it, plus the context-parallel
    degree ``cp`` after the three first axes (docs/design.md, "Adding a parallel axis"); a
    version 1 file without ``cp`` reads as cp = 1 (``test_old_plan_files_load...``)."""
    plan = _plan(dp=2, tp=2, pp=2, sequence_parallel=True)
    mesh = json.loads(plan.to_json())["mesh"]
    assert list(mesh.items()) == [("dp", 2), ("tp", 2), ("pp", 2), ("cp", 1), ("sequence_parallel", True),
                                  ("ep", 1), ("world_size", 8),
                                  ("layout", "ranks = arange(world_size).view(dp, pp, cp, tp)")]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    old = json.loads(plan.to_json())
    del old["mesh"]["cp"], old["mesh"]["ep"]
    assert Plan.from_dict(old) == plan


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: "x".join(map(str, d.shape)))
def test_named_groups_are_the_layout_with_the_other_coordinates_fixed(dims):
    """``get_group(name, r)``: the ranks of the layout tensor that share r's coordinates on every
    axis outside the group, in rank order (the flattened sub-mesh torch builds, below);
    ``group_size`` and ``grad_degree`` their products, worked from the shape."""
    ranks = _torch_layout(dims)
    names = dims.axis_names
    assert dims.GROUPS["grad"] == ("dp", "cp") and dims.GROUPS["batch"] == ("dp",)
    assert dims.grad_degree == dims.dp * dims.cp == dims.group_size("grad")
    assert dims.group_size("world") == dims.world_size and dims.group_size("batch") == dims.batch_degree
    for group, axes in (("grad", ("dp", "cp")), ("world", names), (["pp", "tp"], ("pp", "tp")), ("tp", ("tp",))):
        for r in range(dims.world_size):
            where = (ranks == r).nonzero()[0].tolist()
            index = tuple(slice(None) if n in axes else where[i] for i, n in enumerate(names))
            assert list(dims.get_group(group, r)) == sorted(ranks[index].flatten().tolist())
    assert dims.get_group("tp", 1) == dims.group("tp", 1)


def test_the_gradient_group_is_torchs_flattened_dp_cp_mesh():
    """DeviceMesh's ``mesh["dp", "cp"]._flatten("dp_cp")`` (torchtitan's named mesh) holds the ranks
    ``get_group("grad", r)`` gives, in the same order, on a fake world of dp 2 x pp 2 x cp 2 x tp 2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims(dp=2, pp=2, cp=2, tp=2)
    for r in (0, 5, 15):
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=dims.world_size)
        try:
            mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=dims.axis_names)
            assert mesh["dp", "cp"]._flatten("dp_cp").mesh.tolist() == list(dims.get_group("grad", r))
        finally:
            dist.destroy_process_group()


def test_expert_parallel_groups_borrow_the_data_and_context_ranks():
    """ep groups: ep ranks with the same pp and tp coordinates, consecutive in the flattened
    dp x cp coordinate; worked by hand for dp 4 x cp 2 x tp 2 (ranks = arange(16).view(4, 1, 2, 2))."""
    dims = ParallelDims(dp=4, cp=2, tp=2, ep=4)
    assert dims.world_size == 16
    # tp coordinate 0: flat dp*cp index k sits at rank 2k; the first four are ranks 0, 2, 4, 6
    assert dims.ep_groups() == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert dims.ep_group(13) == (9, 11, 13, 15)
    assert ParallelDims(dp=3, ep=2).problems()[0][0] == "mesh.ep"
    assert ParallelDims(dp=2, cp=2, ep=4).problems() == []


def test_old_plan_files_load_and_a_later_axis_reads_as_one():
    old = {"dp": 2, "tp": 4, "pp": 1, "sequence_parallel": False, "world_size": 8,
           "layout": "ranks = arange(world_size).view(dp, pp, tp)"}

    def read_int(d, key, default):
        return d[key] if default is None else d.get(key, default)

    def read_flag(d, key):
        return d.get(key, False)

    dims = WithContextParallel.from_dict(old, read_int, read_flag)
    assert dims == WithContextParallel(dp=2, tp=4, pp=1, cp=1)
    assert dims.to_dict()["layout"] == "ranks = arange(world_size).view(dp, pp, cp, tp)"
    # an axis plan version 1 always wrote stays required
    d = json.loads(_plan(dp=2).to_json())
    del d["mesh"]["dp"]
    with pytest.raises(PlanFileError, match="'dp'"):
        Plan.from_dict(d)
    d = json.loads(_plan(dp=2).to_json())
    d["mesh"]["tp"] = 0
    with pytest.raises(PlanFileError, match="mesh.tp"):
        Plan.from_dict(d)


def test_a_declaration_that_disagrees_with_its_class_is_refused():
    @dataclass(frozen=True)
    class Undeclared(ParallelDims):           # a field with no axis
        xp: int = 1

    @dataclass(frozen=True)
    class TpNotInnermost(ParallelDims):
        axes = (AXIS_BY_NAME["dp"], AXIS_BY_NAME["tp"], AXIS_BY_NAME["pp"], AXIS_BY_NAME["cp"])

    for cls in (Undeclared, TpNotInnermost):
        with pytest.raises(AssertionError):
            check_declaration(cls)


def test_factorisations_are_every_product_of_the_declared_axes():
    names = ("dp", "pp", "cp", "tp")
    for world in (1, 12, 16, 30):
        got = list(factorisations(world, {n: divisors for n in names}, names))
        want = [dict(zip(names, c)) for c in itertools.product(divisors(world), repeat=4)
                if c[0] * c[1] * c[2] * c[3] == world]
        assert got == want                     # same order too: the first axis varies slowest
    with pytest.raises(ValueError):
        list(factorisations(8, {"dp": divisors, "tp": divisors}))


@pytest.mark.parametrize("world,gpus,layers,batch,max_tp,inside", [
    (32, 8, 10, 64, None, True), (24, 8, 6, 48, 8, True), (16, 4, 32, 8, None, False), (12, 6, 3, 36, 4, True),
    (1024, 8, 96, 1536, 8, True)])
def test_mesh_candidates_equal_the_triple_loop(world, gpus, layers, batch, max_tp, inside):
    """The planner's meshes, in order, against the loop over (tp, pp) with dp taking the rest."""
    limit = max_tp or world
    tps = [t for t in (2 ** k for k in range(world.bit_length())) if t <= min(limit, world) and world % t == 0]
    if inside:
        tps = [t for t in tps if t <= gpus and gpus % t == 0]
    want = []
    for tp in tps:
        for pp in range(1, world // tp + 1):
            if (world // tp) % pp or pp > layers or batch % (world // (tp * pp)):
                continue
            want.append(Mesh(dp=world // (tp * pp), tp=tp, pp=pp))
            if tp > 1:
                want.append(Mesh(dp=world // (tp * pp), tp=tp, pp=pp, sequence_parallel=True))
    got = mesh_candidates(world, gpus_per_node=gpus, num_layers=layers, global_batch=batch, max_tp=max_tp,
                          tp_inside_node=inside)
    assert got == want
