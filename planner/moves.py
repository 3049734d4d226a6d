"""Random local moves over ``Candidate`` plans: the MCMC proposal (FlexFlow, Jia et al. 2019, Sec. 5.2).

FlexFlow proposes by changing the configuration of one randomly chosen operator.  Here a
move is one of: change one layer's choice (its tensor-parallel split, ZeRO stage within the
family, recompute or offload), apply one knob to every layer of a stage, move a stage boundary,
switch the ZeRO family of the whole model, change the micro-batch size, the schedule or the
number of virtual stages, toggle sequence parallelism, or change the mesh (trade a factor of
two between two declared axes -- dp, tp, pp, cp and any axis registered in planner/axis_rules.py
-- or double or halve ep), re-deriving what the new mesh forces (micro-batch count, equal
stages).  Every move returns a candidate that satisfies the plan rules (Plan.validate());
memory is left to the cost function, which returns ``inf`` for a plan that does not fit.
The moves are symmetric in kind (each has its inverse), as Metropolis-Hastings assumes.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from autopar.core.plan import Mesh, equal_bounds
from autopar.planner.candidate import Candidate
from autopar.core.rules import ZERO_FAMILIES, offload_allowed, zero1_shards, zero_family_of
from autopar.core.rules import MULTI_CHUNK_SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from autopar.planner.space import RECOMPUTE_CHOICES, LayerChoice, microbatch_candidates, schedule_candidates


@dataclass(frozen=True)
class MoveSpace:
    meshes: tuple[Mesh, ...]              # meshes the search admits
    can_split: tuple[bool, ...]           # per layer: has a tensor-parallel split
    num_layers: int
    global_batch: int
    max_micro_batch: int | None = None
    refused_micro_batches: frozenset[int] = frozenset()   # sizes the model cannot take
    max_virtual_stages: int = 4
    allow_offload: bool = True
    offload_tier: str = "cpu"             # what an offloaded layer uses: "cpu" or "nvme" (PlanOptions)
    recompute_choices: tuple[str, ...] = RECOMPUTE_CHOICES
    zero_families: tuple[str, ...] = ("ddp", "zero1", "fsdp")
    #: per mesh (by value): its neighbours among ``meshes`` and the other meshes (``mesh_pools``)
    _pools: dict = field(default_factory=dict, compare=False, repr=False)

    def mesh_pools(self, cur: Mesh) -> tuple[list[Mesh], list[Mesh]]:
        """(the admitted meshes next to ``cur`` (``_is_neighbour``), every admitted mesh but
        ``cur``), in ``meshes``' order; worked out once per mesh."""
        pools = self._pools.get(cur)
        if pools is None:
            others = [m for m in self.meshes if m != cur]
            pools = self._pools[cur] = ([m for m in others if _is_neighbour(m, cur)], others)
        return pools


def _cumulative(weights: list[float]) -> list[float]:
    """The normalised cumulative weights, computed as numpy's ``Generator.choice(n, p=...)`` does."""
    p = np.asarray(weights, dtype=float)
    cdf = (p / p.sum()).cumsum()
    cdf /= cdf[-1]
    return cdf.tolist()


#: relative frequency of each kind of move (propose's order)
_MOVE_CDF = _cumulative([4, 2, 2, 1, 1, 1, 1, 1])


def propose(c: Candidate, rng: np.random.Generator, space: MoveSpace) -> Candidate:
    """One random local move; falls back to another kind when a kind does not apply."""
    kinds = [_layer_move, _stage_knob_move, _boundary_move, _zero_family_move, _microbatch_move,
             _schedule_move, _sequence_parallel_move, _mesh_move]
    for _ in range(8):
        # one uniform draw against the cumulative weights: what Generator.choice(n, p=...) does,
        # without its checks of p (the same kind for the same draw)
        move = kinds[bisect.bisect_right(_MOVE_CDF, rng.random())]
        out = move(c, rng, space)
        if out is not None and out != c:
            return out
    return c


# ------------------------------------------------------------------------ per layer
@lru_cache(maxsize=None, typed=True)
def _interned(tp: bool, zero: int, recompute: str, offload: str) -> LayerChoice:
    return LayerChoice(tp=tp, zero=zero, recompute=recompute, offload=offload)


def _with(ch: LayerChoice, **changes) -> LayerChoice:
    """``dataclasses.replace(ch, **changes)``, one shared object per value (moves build many,
    and equal plans then compare and hash their choices faster)."""
    return _interned(changes.get("tp", ch.tp), changes.get("zero", ch.zero), changes.get("recompute", ch.recompute),
                     changes.get("offload", ch.offload))


def _choice_options(c: Candidate, layer: int, space: MoveSpace) -> list[LayerChoice]:
    family = zero_family_of(c.choices[layer].zero)
    out = []
    splits = (True, False) if c.mesh.tp > 1 and space.can_split[layer] else (False,)
    for split in splits:
        for zero in ZERO_FAMILIES[family]:
            for rc in space.recompute_choices:
                for off in ("none", space.offload_tier) if (space.allow_offload and offload_allowed(zero)) else ("none",):
                    out.append(_interned(split, zero, rc, off))
    return out


def _layer_move(c: Candidate, rng, space: MoveSpace) -> Candidate | None:
    layer = int(rng.integers(space.num_layers))
    options = [o for o in _choice_options(c, layer, space) if o != c.choices[layer]]
    if not options:
        return None
    new = options[int(rng.integers(len(options)))]
    choices = list(c.choices)
    choices[layer] = new
    return replace(c, choices=tuple(choices))


def _stage_knob_move(c: Candidate, rng, space: MoveSpace) -> Candidate | None:
    """Set one knob (recompute / offload / zero / tp split) on every layer of a stage."""
    s = int(rng.integers(c.num_stages))
    lo, hi = c.bounds[s], c.bounds[s + 1]
    knob = ["recompute", "offload", "zero", "tp"][int(rng.integers(4))]
    family = zero_family_of(c.choices[lo].zero)
    if knob == "recompute":
        value = space.recompute_choices[int(rng.integers(len(space.recompute_choices)))]
    elif knob == "offload":
        if family != "fsdp" or not space.allow_offload:
            return None
        value = ["none", space.offload_tier][int(rng.integers(2))]
    elif knob == "zero":
        if family != "fsdp":
            return None
        value = [2, 3][int(rng.integers(2))]
    else:
        if c.mesh.tp == 1:
            return None
        value = bool(rng.integers(2))
    choices = list(c.choices)
    for i in range(lo, hi):
        if knob == "tp" and not space.can_split[i]:
            continue
        choices[i] = _with(choices[i], **{knob: value})
    return replace(c, choices=tuple(choices))


def _zero_family_move(c: Candidate, rng, space: MoveSpace) -> Candidate | None:
    current = zero_family_of(c.choices[0].zero)
    families = [f for f in space.zero_families if f != current and not (f == "zero1" and not zero1_shards(c.mesh.dp))]
    if not families:
        return None
    family = families[int(rng.integers(len(families)))]
    return replace(c, choices=tuple(_to_family(ch, family) for ch in c.choices))


def _to_family(ch: LayerChoice, family: str) -> LayerChoice:
    if family == "fsdp":
        return _with(ch, zero=ch.zero if ch.zero >= 2 else 3)
    return _with(ch, zero=ZERO_FAMILIES[family][0], offload="none")


# ------------------------------------------------------------------------ pipeline
def _boundary_move(c: Candidate, rng, space: MoveSpace) -> Candidate | None:
    if c.num_stages == 1 or c.schedule in MULTI_CHUNK_SCHEDULES:   # their chunks stay equal (space.schedule_candidates)
        return None
    k = 1 + int(rng.integers(c.num_stages - 1))          # an inner boundary
    step = int(rng.choice([-2, -1, 1, 2]))
    b = list(c.bounds)
    b[k] += step
    if not b[k - 1] < b[k] < b[k + 1]:
        return None
    return replace(c, bounds=tuple(b))


def _microbatch_move(c: Candidate, rng, space: MoveSpace) -> Candidate | None:
    options = microbatch_candidates(space.global_batch, c.mesh.batch_degree, max_micro_batch=space.max_micro_batch,
                                    refused=space.refused_micro_batches)
    idx = [mb for mb, _ in options].index(c.micro_batch) if c.micro_batch in [mb for mb, _ in options] else 0
    j = idx + int(rng.choice([-1, 1]))
    if not 0 <= j < len(options):
        return None
    mb, m = options[j]
    return _fix_schedule(replace(c, micro_batch=mb, num_microbatches=m), space, rng)


def _schedule_move(c: Candidate, rng, space: MoveSpace) -> Candidate | None:
    # a chain keeps to the whole- or the split-backward schedules it started in (planner/search.py,
    # split_backward_twins: the split ones enter as twins of the structured plans)
    options = schedule_candidates(c.mesh.pp, space.num_layers, c.num_microbatches,
                                  max_virtual_stages=space.max_virtual_stages,
                                  split_backward=c.schedule in SPLIT_BACKWARD_SCHEDULES)
    options = [o for o in options if o != (c.schedule, c.virtual_stages)]
    if not options:
        return None
    schedule, v = options[int(rng.integers(len(options)))]
    bounds = c.bounds if v == c.virtual_stages else equal_bounds(space.num_layers, c.mesh.pp * v)
    return replace(c, schedule=schedule, bounds=bounds)


def _fix_schedule(c: Candidate, space: MoveSpace, rng) -> Candidate:
    """Keep the schedule if still valid for the micro-batch count, else fall back to 1F1B."""
    options = schedule_candidates(c.mesh.pp, space.num_layers, c.num_microbatches,
                                  max_virtual_stages=space.max_virtual_stages,
                                  split_backward=c.schedule in SPLIT_BACKWARD_SCHEDULES)
    if (c.schedule, c.virtual_stages) in options:
        return c
    return replace(c, schedule="1f1b", bounds=equal_bounds(space.num_layers, c.mesh.pp))


# ------------------------------------------------------------------------ mesh
def _sequence_parallel_move(c: Candidate, rng, space: MoveSpace) -> Candidate | None:
    mesh = replace(c.mesh, sequence_parallel=not c.mesh.sequence_parallel)
    if mesh not in space.meshes:
        return None
    # the admitted mesh object itself: plans on one mesh then share it (the evaluator finds
    # their context by identity)
    return replace(c, mesh=space.meshes[space.meshes.index(mesh)])


#: the chance that a mesh move goes to a neighbouring mesh (one axis doubled, another halved)
#: rather than to any admitted mesh.  Set by hand, not fitted: mostly local proposals keep the
#: chain's acceptance rate up near a good plan (a neighbour shares most of the plan's costs), and
#: one proposal in five jumps anywhere so that a chain is not confined to the meshes next to its
#: start (FlexFlow's search, Jia et al. 2019, likewise proposes one random change at a time).  It
#: changes which plans MCMC visits, so the recorded plans depend on it (planner_vs_grid.py
#: re-measures a change).
NEAR_MESH_PROBABILITY = 0.8


def _is_neighbour(m: Mesh, cur: Mesh) -> bool:
    """One declared axis doubled and another halved with ep kept, or ep alone doubled or halved
    (ep borrows dp x cp ranks: core/parallel_dims.py)."""
    if m.sequence_parallel != (cur.sequence_parallel and m.tp > 1):
        return False
    up = down = 0
    for a, b in zip(m.shape, cur.shape):
        if a == b:
            continue
        if a == 2 * b:
            up += 1
        elif 2 * a == b:
            down += 1
        else:
            return False
    if m.ep == cur.ep:
        return up == 1 and down == 1
    return up == down == 0 and (m.ep == 2 * cur.ep or 2 * m.ep == cur.ep)


def _mesh_move(c: Candidate, rng, space: MoveSpace) -> Candidate | None:
    """Another admitted mesh, preferring neighbours (one axis doubled, another halved; ep doubled
    or halved)."""
    near, others = space.mesh_pools(c.mesh)
    pool = near if near and rng.random() < NEAR_MESH_PROBABILITY else others
    if not pool:
        return None
    mesh = pool[int(rng.integers(len(pool)))]
    return rebase(c, mesh, space, rng)


def rebase(c: Candidate, mesh: Mesh, space: MoveSpace, rng=None) -> Candidate | None:
    """``c`` moved onto another mesh: keep the micro-batch if it divides, split stages equally."""
    options = microbatch_candidates(space.global_batch, mesh.batch_degree, max_micro_batch=space.max_micro_batch,
                                    refused=space.refused_micro_batches)
    if not options:
        return None
    mb, m = min(options, key=lambda o: (abs(np.log2(o[0] / c.micro_batch)), -o[0]))
    schedule, v = c.schedule, c.virtual_stages
    valid = schedule_candidates(mesh.pp, space.num_layers, m, max_virtual_stages=space.max_virtual_stages)
    if (schedule, v) not in valid:
        schedule, v = valid[0]
    if mesh.pp == c.mesh.pp and v == c.virtual_stages:
        bounds = c.bounds
    else:
        bounds = equal_bounds(space.num_layers, mesh.pp * v)
    choices = c.choices
    if not zero1_shards(mesh.dp) and choices[0].zero == 1:
        choices = tuple(_to_family(ch, "ddp") for ch in choices)
    if mesh.tp > 1 and c.mesh.tp == 1:
        choices = tuple(_with(ch, tp=space.can_split[i]) for i, ch in enumerate(choices))
    return Candidate(mesh=mesh, micro_batch=mb, num_microbatches=m, schedule=schedule, bounds=bounds,
                     choices=choices)
