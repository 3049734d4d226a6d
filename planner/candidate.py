"""A point of the plan space as compact, hashable data, and its conversion to a ``Plan``.

The searches move between ``Candidate`` objects (cheap to copy, hash and compare); only the
one that is priced or returned becomes a ``core.plan.Plan``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.plan import Mesh, ModelRef, Pipeline, Plan, Stage, equal_bounds  # noqa: F401 (re-exported)
from autopar.planner.space import LayerChoice


@dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    micro_batch: int
    num_microbatches: int
    schedule: str                         # "1f1b" | "gpipe" | "interleaved"
    bounds: tuple[int, ...]               # stage boundaries [0, b1, ..., L]; pp * virtual stages
    choices: tuple[LayerChoice, ...]      # one per layer

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.mesh.pp

    @property
    def global_batch(self) -> int:
        return self.mesh.batch_degree * self.micro_batch * self.num_microbatches

    def to_plan(self, *, model: ModelRef, styles: list[dict[str, str]], precision: str, cluster: str) -> Plan:
        stages = tuple(Stage(i, self.bounds[i], self.bounds[i + 1]) for i in range(self.num_stages))
        mesh = self.mesh
        if mesh.tp == 1:
            choices = tuple(replace(c, tp=False) for c in self.choices)
        else:
            choices = self.choices
        layers = tuple(c.to_layer_plan(i, styles[i]) for i, c in enumerate(choices))
        return Plan(model=model, mesh=mesh, global_batch=self.global_batch, micro_batch=self.micro_batch,
                    pipeline=Pipeline(schedule=self.schedule, num_microbatches=self.num_microbatches,
                                      stages=stages),
                    layers=layers, precision=precision, cluster=cluster)


def describe_difference(a: Candidate, b: Candidate) -> str:
    """What separates plan ``b`` from plan ``a``, in a few words."""
    parts = []
    if a.mesh.degrees != b.mesh.degrees:
        parts.append(f"mesh {b.mesh.describe('{name}{size}', ' ')}")
    if a.mesh.sequence_parallel != b.mesh.sequence_parallel:
        parts.append("sequence parallel " + ("on" if b.mesh.sequence_parallel else "off"))
    if a.micro_batch != b.micro_batch:
        parts.append(f"micro-batch {b.micro_batch} x {b.num_microbatches}")
    if a.schedule != b.schedule or a.virtual_stages != b.virtual_stages:
        parts.append(f"schedule {b.schedule}" + (f" v{b.virtual_stages}" if b.schedule == "interleaved" else ""))
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
