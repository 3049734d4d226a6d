"""A point of the plan space as compact, hashable data, and its conversion to a ``Plan``.

The searches move between ``Candidate`` objects (cheap to copy, hash and compare); only the
one that is priced or returned becomes a ``core.plan.Plan``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.plan import LayerPlan, Mesh, ModelRef, Pipeline, Plan, Stage
from autopar.planner.space import LayerChoice


class Choices(tuple):
    """One ``LayerChoice`` per layer: a tuple that keeps its hash once worked out (tuple's own
    hash, so equal to that of an equal plain tuple).  Moves that keep a candidate's choices keep
    this object, so hashing a candidate, or a memo keyed by its choices, reads the hash kept."""

    def __hash__(self) -> int:
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h

    def __reduce__(self):
        return Choices, (tuple(self),)          # a copy works its hash out again (str hashes are per process)


@dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    micro_batch: int
    num_microbatches: int
    schedule: str                         # one of core.plan.SCHEDULES
    bounds: tuple[int, ...]               # stage boundaries [0, b1, ..., L]; pp * virtual stages
    choices: tuple[LayerChoice, ...]      # one per layer, held as ``Choices``

    def __post_init__(self):
        if type(self.choices) is not Choices:
            object.__setattr__(self, "choices", Choices(self.choices))

    def __hash__(self) -> int:
        # a hash of the fields, kept once computed: a search hashes a candidate several times
        # (its memo of priced plans); the choices keep their own (``Choices``)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.mesh, self.micro_batch, self.num_microbatches, self.schedule, self.bounds, self.choices))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.mesh.pp

    @property
    def global_batch(self) -> int:
        return self.mesh.batch_degree * self.micro_batch * self.num_microbatches

    def to_plan(self, *, model: ModelRef, styles: list[dict[str, str]], precision: str, cluster: str,
                memo: dict | None = None) -> Plan:
        """The plan; ``memo`` (a dict kept by the caller across calls with the same ``styles``)
        hands out one Pipeline per (schedule, micro-batches, bounds) and one LayerPlan per
        (layer, choice), so that plans of one search share their unchanged parts as the same
        objects (the evaluator then tells them apart by identity, and nothing is rebuilt)."""
        memo = {} if memo is None else memo
        pkey = ("pipeline", self.schedule, self.num_microbatches, self.bounds)
        pipeline = memo.get(pkey)
        if pipeline is None:
            stages = tuple(Stage(i, self.bounds[i], self.bounds[i + 1]) for i in range(self.num_stages))
            pipeline = memo[pkey] = Pipeline(schedule=self.schedule, num_microbatches=self.num_microbatches,
                                             stages=stages)
        mesh = self.mesh
        no_tp = mesh.tp == 1                         # a choice's split means nothing then
        key = ("layers", self.choices, no_tp)        # moves that keep the choices keep their hash
        layers = memo.get(key)
        if layers is None:
            layers = memo[key] = self._layer_plans(styles, no_tp, memo)
        return Plan(model=model, mesh=mesh, global_batch=self.global_batch, micro_batch=self.micro_batch,
                    pipeline=pipeline, layers=layers, precision=precision, cluster=cluster)

    def _layer_plans(self, styles: list[dict[str, str]], no_tp: bool, memo: dict) -> tuple[LayerPlan, ...]:
        layers = []
        for i, c in enumerate(self.choices):
            eff = replace(c, tp=False) if no_tp and c.tp else c
            lp = memo.get(("layer", i, eff))
            if lp is None:
                lp = memo[("layer", i, eff)] = eff.to_layer_plan(i, styles[i])
            layers.append(lp)
        return tuple(layers)


def describe_difference(a: Candidate, b: Candidate) -> str:
    """What separates plan ``b`` from plan ``a``, in a few words."""
    parts = []
    if a.mesh.degrees != b.mesh.degrees:
        parts.append(f"mesh {b.mesh.describe('{name}{size}', ' ')}")
    if a.mesh.sequence_parallel != b.mesh.sequence_parallel:
        parts.append("sequence parallel " + ("on" if b.mesh.sequence_parallel else "off"))
    if a.mesh.ep != b.mesh.ep:
        parts.append(f"ep {b.mesh.ep}")
    if a.micro_batch != b.micro_batch:
        parts.append(f"micro-batch {b.micro_batch} x {b.num_microbatches}")
    if a.schedule != b.schedule or a.virtual_stages != b.virtual_stages:
        looped = b.schedule in ("interleaved", "interleaved-zb")
        parts.append(f"schedule {b.schedule}" + (f" v{b.virtual_stages}" if looped else ""))
    if a.bounds != b.bounds and a.num_stages == b.num_stages:
        parts.append("stage boundaries " + ",".join(map(str, b.bounds[1:-1])))
    if len(a.choices) == len(b.choices):
        diff = [i for i, (x, y) in enumerate(zip(a.choices, b.choices)) if x != y]
        if diff:
            for attr, name in (("zero", "ZeRO"), ("recompute", "recompute"), ("offload", "offload"), ("tp", "tp split")):
                vals_a = sorted({str(getattr(a.choices[i], attr)) for i in diff})
                vals_b = sorted({str(getattr(b.choices[i], attr)) for i in diff})
                if vals_a != vals_b:
                    parts.append(f"{name} {'/'.join(vals_b)} on {len(diff)} layer{'s' if len(diff) > 1 else ''}"
                                 f" (winner: {'/'.join(vals_a)})")
    return "; ".join(parts) if parts else "same configuration"
