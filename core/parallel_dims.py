"""The parallel axes of a plan, by name: what each splits, how ranks are laid out over them.

``AXES`` declares the axes outermost to innermost; ``ParallelDims`` holds one degree per axis
(plus sequence parallelism, which rides on the tensor-parallel axis) and answers every
question about the rank layout from that declaration: world size, shape, a rank's
coordinates, the rank at given coordinates, the groups of ranks along an axis, and how many
ways the batch is split.  The layout is ``arange(world).view(*shape)`` -- the layout of
``torch.distributed.device_mesh.init_device_mesh(device, shape, mesh_dim_names=axis_names)``
-- so the innermost axis's groups are runs of consecutive ranks, which keeps them inside a
node when the node's device count is a multiple of the axis size.

A new axis (context parallelism ``cp``, say) is one ``Axis`` entry in ``AXES`` and one field
of ``ParallelDims`` with default 1 (docs/design.md, "Adding a parallel axis"); the checks at
the end of this module refuse a declaration and a class that disagree.

Nothing here imports torch: the planner and the simulator price plans without it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Mapping

SPLITS = ("batch", "layers", "tensors")


@dataclass(frozen=True)
class Axis:
    """One parallel axis of the device mesh.

    ``splits``: what the ranks along the axis divide between them -- ``"batch"`` (samples:
    data parallelism), ``"layers"`` (pipeline stages) or ``"tensors"`` (weights and
    activations of one layer: tensor parallelism, Shoeybi et al. 2019).
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


#: outermost to innermost: ranks = arange(world).view(dp, pp, tp)
AXES: tuple[Axis, ...] = (
    Axis("dp", "batch", "data-parallel degree"),
    Axis("pp", "layers", "pipeline-parallel degree (ranks)"),
    Axis("tp", "tensors", "tensor-parallel degree (Megatron column/row pairs)", innermost=True),
)
AXIS_NAMES: tuple[str, ...] = tuple(a.name for a in AXES)
AXIS_BY_NAME: dict[str, Axis] = {a.name: a for a in AXES}


@dataclass(frozen=True)
class ParallelDims:
    """One degree per axis of ``AXES``; ``sequence_parallel`` also shards the activations between
    tensor-parallel regions on the sequence dim over the tp axis (Korthikanti et al. 2022).

    The fields are plain ints, read directly by the simulator's hot path (``dims.tp``); the
    generic methods below are for everything that need not know which axes exist.  Field order
    is the order of the plan file's keys and of the ``dp x tp x pp`` displays; the rank layout
    follows ``AXES``.
    """
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False

    # ------------------------------------------------------------ shape
    @property
    def axes(self) -> tuple[Axis, ...]:
        return AXES

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names outermost to innermost (``mesh_dim_names`` of the DeviceMesh)."""
        return AXIS_NAMES

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """Degrees outermost to innermost (the DeviceMesh's shape)."""
        return tuple(getattr(self, n) for n in AXIS_NAMES)

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
        return getattr(self, AXIS_BY_NAME[axis].name)

    @property
    def degrees(self) -> dict[str, int]:
        """Axis name -> degree, in field order (the plan file's keys)."""
        return {n: getattr(self, n) for n in DEGREE_NAMES}

    def degree(self, splits: str) -> int:
        """How many ways the axes that split ``splits`` (``"batch"``, ...) divide it together."""
        return _product(getattr(self, a.name) for a in AXES if a.splits == splits)

    @cached_property
    def batch_degree(self) -> int:
        """Data-parallel replicas: each takes ``global_batch / batch_degree`` samples."""
        return self.degree("batch")

    def describe(self, fmt: str = "{name} {size}", sep: str = " x ", layout_order: bool = False,
                 splits: str | None = None) -> str:
        """``dp 2 x tp 4 x pp 1``: the degrees in field order (``layout_order``: outermost axis
        first), of every axis or of those that split ``splits``."""
        names = AXIS_NAMES if layout_order else DEGREE_NAMES
        return sep.join(fmt.format(name=n, size=getattr(self, n)) for n in names
                        if splits is None or AXIS_BY_NAME[n].splits == splits)

    @property
    def layout(self) -> str:
        return f"ranks = arange(world_size).view({', '.join(AXIS_NAMES)})"

    # ------------------------------------------------------ coordinates
    def coords(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinate on each axis, outermost to innermost."""
        out = []
        for stride, size in zip(self._strides, self.shape):
            out.append(rank // stride % size)
        return tuple(out)

    def coords_by_axis(self, rank: int) -> dict[str, int]:
        """Axis name -> the rank's coordinate on it."""
        return dict(zip(AXIS_NAMES, self.coords(rank)))

    def coord(self, rank, axis: str):
        """The rank's coordinate on ``axis`` (``rank`` may be a numpy array of ranks)."""
        i = AXIS_NAMES.index(axis)
        return rank // self._strides[i] % self.shape[i]

    def rank(self, *coords: int) -> int:
        """The global rank at ``coords`` (one per axis, outermost to innermost)."""
        assert len(coords) == len(AXES), f"{len(coords)} coordinates for the {len(AXES)} axes {AXIS_NAMES}"
        return sum(c * s for c, s in zip(coords, self._strides))

    def rank_at(self, **coords: int) -> int:
        """The global rank at the named coordinates; an axis not named is at coordinate 0."""
        unknown = set(coords) - set(AXIS_NAMES)
        assert not unknown, f"unknown axes {sorted(unknown)}; the axes are {AXIS_NAMES}"
        return sum(coords.get(n, 0) * s for n, s in zip(AXIS_NAMES, self._strides))

    def group(self, axis: str, rank: int = 0) -> tuple[int, ...]:
        """The ranks along ``axis`` through ``rank``: every rank that differs from it on that
        axis alone (the process group of the axis that ``rank`` belongs to)."""
        assert 0 <= rank < self.world_size, f"rank {rank} outside a world of {self.world_size}"
        i = AXIS_NAMES.index(axis)
        stride = self._strides[i]
        first = rank - self.coord(rank, axis) * stride
        return tuple(first + k * stride for k in range(self.shape[i]))

    def ranks_where(self, **fixed: int) -> list[int]:
        """Every rank whose coordinates match ``fixed`` (the others range over their degrees),
        in rank order."""
        ranges = [[fixed[n]] if n in fixed else range(self.size(n)) for n in AXIS_NAMES]
        return [self.rank(*point) for point in _grid(ranges)]

    def groups(self, axis: str, **fixed: int) -> list[tuple[int, ...]]:
        """Every group along ``axis`` whose other coordinates match ``fixed``, in the order of
        their first ranks."""
        return [self.group(axis, r) for r in self.ranks_where(**{axis: 0}, **fixed)]

    # ---------------------------------------------------------- checks
    def problems(self) -> list[tuple[str, Any, str]]:
        """(field, value, what it must be) for each degree below 1 and for sequence parallelism
        without a tensor-parallel axis to ride on."""
        out: list[tuple[str, Any, str]] = []
        for n in DEGREE_NAMES:
            if getattr(self, n) < 1:
                out.append((f"mesh.{n}", getattr(self, n), "a positive integer"))
        if self.sequence_parallel and self.tp == 1:
            out.append(("mesh.sequence_parallel", True,
                        "false when mesh.tp is 1 (sequence parallelism splits over the tp axis)"))
        return out

    # ------------------------------------------------------- JSON form
    def to_dict(self) -> dict[str, Any]:
        return {**self.degrees, "sequence_parallel": self.sequence_parallel, "world_size": self.world_size,
                "layout": self.layout}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], read_int: Callable[[Mapping, str, int | None], int],
                  read_flag: Callable[[Mapping, str], bool]) -> "ParallelDims":
        """The dims in a plan file's ``mesh`` object; ``read_int(d, key, default)`` and
        ``read_flag(d, key)`` check the types and name the field they refuse.  ``world_size``
        and ``layout`` are written for the reader and recomputed, not read."""
        degrees = {n: read_int(d, n, AXIS_BY_NAME[n].plan_default) for n in DEGREE_NAMES}
        return cls(**degrees, sequence_parallel=read_flag(d, "sequence_parallel"))


def factorisations(world_size: int, rules: Mapping[str, Callable[[int], Iterable[int]]]) -> Iterator[dict[str, int]]:
    """Every assignment of a degree to each declared axis whose product is ``world_size``.

    ``rules`` names every axis once, in the order to enumerate them (the first varies slowest);
    ``rules[name](n)`` gives the degrees that axis may take when ``n`` ranks are left for it and
    the axes after it.  A degree that does not divide ``n`` is skipped, and the last axis takes
    exactly the ranks left (when its rule admits that many).
    """
    if set(rules) != set(AXIS_NAMES) or len(rules) != len(AXIS_NAMES):
        raise ValueError(f"factorisations needs one rule per axis {AXIS_NAMES}; got {tuple(rules)}")
    order = list(rules)

    def walk(i: int, left: int, chosen: dict[str, int]) -> Iterator[dict[str, int]]:
        name = order[i]
        for d in rules[name](left):
            if d < 1 or left % d or (i == len(order) - 1 and d != left):
                continue
            if i == len(order) - 1:
                yield {**chosen, name: d}
            else:
                yield from walk(i + 1, left // d, {**chosen, name: d})

    return walk(0, world_size, {})


def _product(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _grid(ranges: list) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for rest in _grid(ranges[1:]):
            yield (head, *rest)


#: the axis names in ParallelDims' field order (plan file keys, CLI flags, ``dp x tp x pp`` displays)
DEGREE_NAMES: tuple[str, ...] = tuple(f.name for f in fields(ParallelDims) if f.name != "sequence_parallel")

# The declaration and the class must agree: one int field per declared axis, each splitting a
# known thing, at most one innermost axis and it last.
assert set(DEGREE_NAMES) == set(AXIS_NAMES), f"ParallelDims fields {DEGREE_NAMES} != declared axes {AXIS_NAMES}"
assert all(a.splits in SPLITS for a in AXES), f"an axis splits something outside {SPLITS}"
assert all(not a.innermost for a in AXES[:-1]), "only the last declared axis may be innermost"
