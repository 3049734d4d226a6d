"""The parallel axes of a plan, by name: what each splits, how ranks are laid out over them.

``AXES`` declares the axes outermost to innermost; ``ParallelDims`` holds one degree per axis
(plus sequence parallelism, which rides on the tensor-parallel axis) and answers every
question about the rank layout from that declaration: world size, shape, a rank's
coordinates, the rank at given coordinates, the groups of ranks along an axis, and how many
ways the batch is split.  The layout is ``arange(world).view(*shape)`` -- the layout of
``torch.distributed.device_mesh.init_device_mesh(device, shape, mesh_dim_names=axis_names)``
-- so the innermost axis's groups are runs of consecutive ranks, which keeps them inside a
node when the node's device count is a multiple of the axis size.

A new axis (context parallelism ``cp``, say) is one ``Axis`` entry in ``AXES`` and one int
field of ``ParallelDims`` with default 1 (docs/design.md, "Adding a parallel axis");
``check_declaration`` refuses a declaration and a class that disagree.  The generic methods
read the axes from the class (``axes``), so a subclass that declares one more axis gets all
of them unchanged (tests/core/test_parallel_dims.py builds one with ``cp``).

Nothing here imports torch: the planner and the simulator price plans without it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping

SPLITS = ("batch", "layers", "tensors", "sequence")


@dataclass(frozen=True)
class Axis:
    """One parallel axis of the device mesh.

    ``splits``: what the ranks along the axis divide between them -- ``"batch"`` (samples:
    data parallelism), ``"layers"`` (pipeline stages), ``"tensors"`` (the weights and
    activations of one layer: tensor parallelism, Shoeybi et al. 2019) or ``"sequence"`` (the
    tokens of one sample: context parallelism, Liu et al. 2023 ring attention).
    ``innermost``: the axis must be the innermost of the layout, so its groups are consecutive
    ranks and stay inside a node (tensor parallelism communicates inside every layer).
    ``plan_default``: the degree a plan file that lacks the axis's key is read with -- ``None``
    for the axes every plan file has written since version 1 (the key is then required), 1 for
    an axis added later, so plan files written before it still load.
    ``help``: what the ``--<name> N`` flag of ``autopar plan`` and ``autopar simulate`` sets.
    """
    name: str
    splits: str
    help: str
    innermost: bool = False
    plan_default: int | None = None


#: outermost to innermost: ranks = arange(world).view(dp, pp, cp, tp) -- cp between pp and tp as
#: picotron's ``view(dp, pp, cp, tp)``: it talks in every attention layer, but less than tp
AXES: tuple[Axis, ...] = (
    Axis("dp", "batch", "data-parallel degree"),
    Axis("pp", "layers", "pipeline-parallel degree (ranks)"),
    Axis("cp", "sequence", "context-parallel degree (each rank holds 1/cp of every sequence's tokens)",
         plan_default=1),
    Axis("tp", "tensors", "tensor-parallel degree (Megatron column/row pairs)", innermost=True),
)
AXIS_NAMES: tuple[str, ...] = tuple(a.name for a in AXES)
AXIS_BY_NAME: dict[str, Axis] = {a.name: a for a in AXES}


@dataclass(frozen=True)
class ParallelDims:
    """One degree per axis of ``axes``; ``sequence_parallel`` also shards the activations between
    tensor-parallel regions on the sequence dim over the tp axis (Korthikanti et al. 2022).

    The fields are plain ints, read directly by the simulator's hot path (``dims.tp``); the
    generic methods below serve everything that need not know which axes exist.  Field order
    is the order of the plan file's keys, of the CLI flags and of the ``dp x tp x pp`` displays;
    the rank layout follows ``axes``.
    """
    axes: ClassVar[tuple[Axis, ...]] = AXES
    #: named groups of axes, asked for by name (``group_size``, ``get_group``; the runtime's
    #: ``RankContext.get_mesh``), as torchtitan names its flattened meshes ("dp_cp",
    #: torchtitan/distributed/parallel_dims.py): ``"batch"`` the axes that split the global batch,
    #: ``"grad"`` the ranks that hold replicas of the same parameter shard and average its
    #: gradients (the cp ranks hold the same weights: torchtitan's ``dp_shard_cp``), ``"world"`` all
    #: axes.  A subclass that declares an axis names the groups it joins here.
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {"batch": ("dp",), "grad": ("dp", "cp"), "world": AXIS_NAMES}

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    #: expert parallelism: a degree borrowed from the data and context ranks (dp x cp), not an
    #: axis of its own -- the world is still dp x pp x cp x tp.  The routed experts of an MoE layer
    #: are split ``ep`` ways along the expert dimension over groups of ``ep`` consecutive ranks of
    #: the flattened dp x cp coordinate, and tokens reach their expert by all-to-all inside the
    #: group; the dense weights keep their dp x cp sharding.  This is how torchtitan borrows ep from
    #: ``dp_shard x cp`` (its ParallelDims, 2025) and DeepSpeed-MoE from its data ranks
    #: (Rajbhandari et al. 2022, section 4.1).
    ep: int = 1

    # ------------------------------------------------------------ shape
    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names outermost to innermost (``mesh_dim_names`` of the DeviceMesh)."""
        return tuple(a.name for a in self.axes)

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """Degrees outermost to innermost (the DeviceMesh's shape)."""
        return tuple(getattr(self, a.name) for a in self.axes)

    @cached_property
    def world_size(self) -> int:
        return _product(self.shape)

    @cached_property
    def _strides(self) -> tuple[int, ...]:
        out, stride = [], 1
        for size in reversed(self.shape):
            out.append(stride)
            stride *= size
        return tuple(reversed(out))

    def size(self, axis: str) -> int:
        return self.shape[self.axis_names.index(axis)]

    @classmethod
    def degree_names(cls) -> tuple[str, ...]:
        """The axis names in field order (plan file keys, CLI flags, ``dp x tp x pp`` displays)."""
        declared = {a.name for a in cls.axes}
        return tuple(f.name for f in fields(cls) if f.name in declared)

    @property
    def degrees(self) -> dict[str, int]:
        """Axis name -> degree, in field order."""
        return {n: getattr(self, n) for n in self.degree_names()}

    def degree(self, splits: str) -> int:
        """How many ways the axes that split ``splits`` (``"batch"``, ...) divide it together."""
        return _product(getattr(self, a.name) for a in self.axes if a.splits == splits)

    @cached_property
    def batch_degree(self) -> int:
        """Data-parallel replicas: each takes ``global_batch / batch_degree`` samples."""
        return self.degree("batch")

    def group_size(self, name: str) -> int:
        """The product of the degrees of the axes of group ``name`` (``"grad"`` -> dp x cp)."""
        return _product(getattr(self, a) for a in self.GROUPS[name])

    @cached_property
    def grad_degree(self) -> int:
        """The ranks that hold the same parameter shard's replicas and average its gradients
        (dp x cp): the size of the gradient all-reduce, of FSDP's shard group and of the group
        expert parallelism borrows its ranks from."""
        return self.group_size("grad")

    def group_axes(self, names: str | Iterable[str]) -> tuple[str, ...]:
        """The axes of ``names``: a group name of ``GROUPS`` or axis names, in layout order."""
        axes = self.GROUPS[names] if isinstance(names, str) and names in self.GROUPS else (
            (names,) if isinstance(names, str) else tuple(names))
        unknown = [a for a in axes if a not in self.axis_names]
        assert not unknown, f"unknown axes {unknown}; the axes are {self.axis_names}"
        return tuple(a for a in self.axis_names if a in axes)

    def get_group(self, names: str | Iterable[str], rank: int = 0) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` outside the axes ``names`` (a group
        name of ``GROUPS`` or axis names), in rank order -- the ranks of torchtitan's
        ``get_mesh(["dp", "cp"])`` through ``rank``; the flattened coordinate of a rank in the
        group is its index here."""
        assert 0 <= rank < self.world_size, f"rank {rank} outside a world of {self.world_size}"
        inside = set(self.group_axes(names))
        c = self.coords_by_axis(rank)
        return tuple(self.ranks_where(**{a: v for a, v in c.items() if a not in inside}))

    @cached_property
    def splits_model(self) -> bool:
        """Whether an axis other than data parallelism has more than one rank, i.e. each rank holds
        part of the model (its layers, its tensors) or of a sample's tokens.  The runtime then runs
        data parallelism on FSDP2's machinery rather than ``DistributedDataParallel`` /
        ``ZeroRedundancyOptimizer`` (runtime/apply_dp.data_parallel_kind), and the simulator
        prices what runs (simulator/layer_cost.effective_zero, simulator/autocast.autocast_mode)."""
        return any(getattr(self, a.name) > 1 for a in self.axes if a.splits != "batch")

    def describe(self, fmt: str = "{name} {size}", sep: str = " x ", layout_order: bool = False,
                 splits: str | None = None) -> str:
        """``dp 2 x tp 4 x pp 1``: the degrees in field order (``layout_order``: outermost axis
        first), of every axis or of those that split ``splits``."""
        names = self.axis_names if layout_order else self.degree_names()
        kinds = {a.name: a.splits for a in self.axes}
        return sep.join(fmt.format(name=n, size=getattr(self, n)) for n in names
                        if splits is None or kinds[n] == splits)

    @property
    def layout(self) -> str:
        return f"ranks = arange(world_size).view({', '.join(self.axis_names)})"

    # ------------------------------------------------------ coordinates
    def coords(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinate on each axis, outermost to innermost."""
        return tuple(rank // stride % size for stride, size in zip(self._strides, self.shape))

    def coords_by_axis(self, rank: int) -> dict[str, int]:
        """Axis name -> the rank's coordinate on it."""
        return dict(zip(self.axis_names, self.coords(rank)))

    def coord(self, rank, axis: str):
        """The rank's coordinate on ``axis`` (``rank`` may be a numpy array of ranks)."""
        i = self.axis_names.index(axis)
        return rank // self._strides[i] % self.shape[i]

    def rank(self, *coords: int) -> int:
        """The global rank at ``coords`` (one per axis, outermost to innermost)."""
        assert len(coords) == len(self.axes), f"{len(coords)} coordinates for the axes {self.axis_names}"
        return sum(c * s for c, s in zip(coords, self._strides))

    def rank_at(self, **coords: int) -> int:
        """The global rank at the named coordinates; an axis not named is at coordinate 0."""
        names = self.axis_names
        assert set(coords) <= set(names), f"unknown axes {sorted(set(coords) - set(names))}; the axes are {names}"
        return sum(coords.get(n, 0) * s for n, s in zip(names, self._strides))

    def group(self, axis: str, rank: int = 0) -> tuple[int, ...]:
        """The ranks along ``axis`` through ``rank``: every rank that differs from it on that
        axis alone (the process group of the axis that ``rank`` belongs to)."""
        assert 0 <= rank < self.world_size, f"rank {rank} outside a world of {self.world_size}"
        i = self.axis_names.index(axis)
        stride = self._strides[i]
        first = rank - self.coord(rank, axis) * stride
        return tuple(first + k * stride for k in range(self.shape[i]))

    def ranks_where(self, **fixed: int) -> list[int]:
        """Every rank whose coordinates match ``fixed`` (the others range over their degrees),
        in rank order."""
        out = [0]
        for n, size, stride in zip(self.axis_names, self.shape, self._strides):
            # outermost first, so the innermost axis varies fastest: rank order
            values = (fixed[n],) if n in fixed else range(size)
            out = [o + v * stride for o in out for v in values]
        return out

    def groups(self, axis: str, **fixed: int) -> list[tuple[int, ...]]:
        """Every group along ``axis`` whose other coordinates match ``fixed``, in the order of
        their first ranks."""
        return [self.group(axis, r) for r in self.ranks_where(**{axis: 0}, **fixed)]

    # ---------------------------------------------------------- checks
    def problems(self) -> list[tuple[str, Any, str]]:
        """(field, value, what it must be) for each degree below 1 and for sequence parallelism
        without a tensor-parallel axis to ride on."""
        out: list[tuple[str, Any, str]] = []
        for n, size in self.degrees.items():
            if size < 1:
                out.append((f"mesh.{n}", size, "a positive integer"))
        if self.sequence_parallel and self.tp == 1:
            out.append(("mesh.sequence_parallel", True,
                        "false when mesh.tp is 1 (sequence parallelism splits over the tp axis)"))
        if self.ep < 1:
            out.append(("mesh.ep", self.ep, "a positive integer"))
        elif all(getattr(self, a) >= 1 for a in self.GROUPS["grad"]) and self.grad_degree % self.ep:
            grad = " x ".join(f"mesh.{a}" for a in self.GROUPS["grad"])
            out.append(("mesh.ep", self.ep, f"a divisor of {grad} = {self.grad_degree} "
                        "(expert parallelism borrows the data and context ranks)"))
        return out

    # ------------------------------------------------ expert parallelism
    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that split ``rank``'s experts between them: ``ep`` ranks of its gradient group
        (``get_group("grad")``) whose flattened coordinate in it (``dp_coord * cp + cp_coord``)
        lies in the same run of ``ep`` consecutive values; by stride arithmetic (O(ep))."""
        axes = self.group_axes("grad")
        where = [self.axis_names.index(a) for a in axes]
        sizes, strides = [self.shape[i] for i in where], [self._strides[i] for i in where]
        coords = [self.coord(rank, a) for a in axes]
        base = rank - sum(c * st for c, st in zip(coords, strides))   # the group's first rank
        flat = 0
        for c, size in zip(coords, sizes):
            flat = flat * size + c
        first = flat - flat % self.ep
        out = []
        for f in range(first, first + self.ep):
            r = base
            for size, st in zip(reversed(sizes), reversed(strides)):
                r, f = r + f % size * st, f // size
            out.append(r)
        return tuple(out)

    def ep_groups(self) -> list[tuple[int, ...]]:
        """Every expert-parallel group, in the order of their first ranks."""
        seen, out = set(), []
        for r in range(self.world_size):
            g = self.ep_group(r)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return out

    # ------------------------------------------------------- JSON form
    def to_dict(self) -> dict[str, Any]:
        return {**self.degrees, "sequence_parallel": self.sequence_parallel, "ep": self.ep,
                "world_size": self.world_size, "layout": self.layout}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], read_int: Callable[[Mapping, str, int | None], int],
                  read_flag: Callable[[Mapping, str], bool]) -> "ParallelDims":
        """The dims in a plan file's ``mesh`` object; ``read_int(d, key, default)`` and
        ``read_flag(d, key)`` check the types and name the field they refuse.  ``world_size``
        and ``layout`` are written for the reader and recomputed, not read."""
        default = {a.name: a.plan_default for a in cls.axes}
        degrees = {n: read_int(d, n, default[n]) for n in cls.degree_names()}
        # ``ep`` came after version 1's keys: a file without it has no expert parallelism
        return cls(**degrees, sequence_parallel=read_flag(d, "sequence_parallel"), ep=read_int(d, "ep", 1))


def check_declaration(cls: type[ParallelDims]) -> None:
    """The axes and the class agree: one int field per declared axis, each splitting a known
    thing, at most one innermost axis and it last (an internal invariant of the declaration)."""
    names = [a.name for a in cls.axes]
    ints = [f.name for f in fields(cls) if f.name not in ("sequence_parallel", "ep")]
    assert len(set(names)) == len(names), f"an axis is declared twice in {names}"
    assert set(ints) == set(names), f"{cls.__name__} fields {ints} != declared axes {names}"
    assert all(a.splits in SPLITS for a in cls.axes), f"an axis splits something outside {SPLITS}"
    assert all(not a.innermost for a in cls.axes[:-1]), "only the last declared axis may be innermost"


def factorisations(world_size: int, rules: Mapping[str, Callable[[int], Iterable[int]]],
                   axis_names: Iterable[str] = AXIS_NAMES) -> Iterator[dict[str, int]]:
    """Every assignment of a degree to each declared axis whose product is ``world_size``.

    ``rules`` names every axis once, in the order to enumerate them (the first varies slowest);
    ``rules[name](n)`` gives the degrees that axis may take when ``n`` ranks are left for it and
    the axes after it.  A degree that does not divide ``n`` is skipped, and the last axis takes
    exactly the ranks left (when its rule admits that many).
    """
    names = tuple(axis_names)
    if sorted(rules) != sorted(names):
        raise ValueError(f"factorisations needs one rule per axis {names}; got {tuple(rules)}")
    order = list(rules)

    def walk(i: int, left: int, chosen: dict[str, int]) -> Iterator[dict[str, int]]:
        name, last = order[i], i == len(order) - 1
        for d in rules[name](left):
            if d < 1 or left % d or (last and d != left):
                continue
            if last:
                yield {**chosen, name: d}
            else:
                yield from walk(i + 1, left // d, {**chosen, name: d})

    return walk(0, world_size, {})


def _product(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


check_declaration(ParallelDims)
#: the axis names in field order (plan file keys, CLI flags, ``dp x tp x pp`` displays)
DEGREE_NAMES: tuple[str, ...] = ParallelDims.degree_names()
