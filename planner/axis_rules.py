"""Which degrees each parallel axis may take in the planner's meshes, registered by axis name.

``planner/space.mesh_candidates`` enumerates the factorisations of the world size over the axes
a mesh class declares (core/parallel_dims.py: ``ParallelDims.axes``), asking the rule
registered here under each axis's name which degrees it may take
(core/parallel_dims.factorisations).  A rule is ``rule(left, limits) -> degrees``: ``left`` is
the number of ranks left for this axis and the axes enumerated after it, ``limits`` the
cluster's and the model's limits (``MeshLimits``); a degree that does not divide ``left`` is
skipped, and the axis enumerated last takes exactly the ranks left.

The axes are enumerated in registration order (the first registered varies slowest): the
built-in rules below are registered tp, pp, cp, dp -- the order of the planner's meshes
-- and an axis registered later is enumerated after dp and takes the ranks
left.  A new axis is its ``Axis`` entry and field (core/parallel_dims.py) and one ``register_rule``
call here or in its own module (docs/design.md, "Adding a parallel axis");
tests/planner/test_planner_toy_axis.py registers a toy one alone.

Plain Python: no torch, no simulator.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from autopar.core.rules import dp_admitted, pp_admitted, tp_admitted
from autopar.planner.integers import divisors, powers_of_two_up_to


@dataclass(frozen=True)
class MeshLimits:
    """What the degree rules read: the cluster's node size, the model's layers and batch, the
    user's tp cap (core/rules.tp_cap) and the context-parallel degrees the model takes."""
    gpus_per_node: int
    num_layers: int
    global_batch: int
    max_tp: int | None = None
    tp_inside_node: bool = True
    cp_choices: tuple[int, ...] = (1,)


AxisRule = Callable[[int, MeshLimits], Iterable[int]]

#: axis name -> its degree rule, in enumeration order
_RULES: dict[str, AxisRule] = {}


def register_rule(name: str, rule: AxisRule) -> AxisRule:
    """Register ``rule`` for the axis ``name``, enumerated after the axes registered before it."""
    if name in _RULES:
        raise ValueError(f"a degree rule for the axis {name!r} is registered already")
    _RULES[name] = rule
    return rule


def unregister_rule(name: str) -> None:
    """Remove the rule of axis ``name`` (a test's toy axis)."""
    del _RULES[name]


@contextmanager
def registered_rule(name: str, rule: AxisRule) -> Iterator[AxisRule]:
    """``rule`` registered for the axis ``name`` for the ``with`` block."""
    register_rule(name, rule)
    try:
        yield rule
    finally:
        unregister_rule(name)


def rules_for(axis_names: Iterable[str], limits: MeshLimits) -> dict[str, Callable[[int], Iterable[int]]]:
    """The rules of ``axis_names``, bound to ``limits``, in enumeration (registration) order: the
    ``rules`` argument of core/parallel_dims.factorisations.  Rules registered for axes outside
    ``axis_names`` are left out; an axis without a rule is refused."""
    names = set(axis_names)
    missing = sorted(names - set(_RULES))
    if missing:
        raise ValueError(f"no degree rule is registered for the axes {missing}: register one with "
                         f"autopar.planner.axis_rules.register_rule(name, rule) (docs/design.md, 'Adding a parallel axis')")
    return {n: _bind(rule, limits) for n, rule in _RULES.items() if n in names}


def _bind(rule: AxisRule, limits: MeshLimits) -> Callable[[int], Iterable[int]]:
    return lambda left: rule(left, limits)


# ------------------------------------------------------------------ the built-in axes
def tp_degrees(left: int, lim: MeshLimits) -> list[int]:
    """Powers of two (head and hidden counts are) the tp rule admits (core/rules.tp_admitted: at
    most ``max_tp`` and, with ``tp_inside_node``, a divisor of the GPUs per node)."""
    return [t for t in powers_of_two_up_to(left) if left % t == 0
            and tp_admitted(t, gpus_per_node=lim.gpus_per_node, max_tp=lim.max_tp, tp_inside_node=lim.tp_inside_node)]


def pp_degrees(left: int, lim: MeshLimits) -> list[int]:
    """At most one stage per layer (core/rules.pp_admitted)."""
    return [p for p in divisors(left) if pp_admitted(p, lim.num_layers)]


def cp_rule(left: int, lim: MeshLimits) -> list[int]:
    """The context-parallel degrees the model takes (core/cp_support.cp_degrees)."""
    return [c for c in lim.cp_choices if left % c == 0]


def dp_degrees(left: int, lim: MeshLimits) -> list[int]:
    """Degrees that divide the global batch (core/rules.dp_admitted).  Enumerated last among the
    built-in axes, dp takes the ranks left; before a registered axis it may take any of them."""
    return [d for d in divisors(left) if dp_admitted(d, lim.global_batch)]


for _name, _rule in (("tp", tp_degrees), ("pp", pp_degrees), ("cp", cp_rule), ("dp", dp_degrees)):
    register_rule(_name, _rule)
