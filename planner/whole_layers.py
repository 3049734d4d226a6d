"""The layers a tensor-parallel plan leaves whole, and why.

A plan with tp > 1 need not split every layer: the search splits a layer only where that pays
(a small layer's all-reduces can cost more than the compute they divide), and some layers have
nothing to split or a split the runtime cannot run.  Every tp rank then computes such a layer
in full and holds all of its weights, which a user who asked for ``--tp`` to save memory
would not guess.  ``whole_layers`` lists them with the reason: for a layer that has a split
the runtime runs, the simulator's price of the plan with that layer split too (the step-time
change and the change of the fullest device's memory; structurally identical layers are
priced together), and the layer's parameter bytes that each tp rank holds whole.  The plan
summary prints it (``lines``) and plan.json keeps it under ``provenance.whole_layers``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.dtypes import precision_bytes
from autopar.core.errors import InfeasibleError, UserError
from autopar.core.graph import OpGraph
from autopar.core.units import fmt_bytes, fmt_seconds


@dataclass(frozen=True)
class WholeLayer:
    layer: int
    name: str
    param_bytes: float                        # its parameters in the plan's precision, held whole by every tp rank
    reason: str                               # why it stays whole
    split_step_delta_s: float | None = None   # the plan's step with this layer's kind split too, less its own
    split_memory_delta_bytes: float | None = None   # the same for the fullest device's memory

    def to_dict(self) -> dict:
        return {"layer": self.layer, "name": self.name, "param_bytes": self.param_bytes, "reason": self.reason,
                "split_step_delta_s": self.split_step_delta_s,
                "split_memory_delta_bytes": self.split_memory_delta_bytes}


def whole_layers(plan, graph: OpGraph, cluster, cost_models, executable=None, left_out=(),
                 fixed: bool = False) -> list[WholeLayer]:
    """The layers of ``plan`` (tp > 1) that tensor parallelism leaves whole, each with its reason;
    [] for a plan without tp or one that splits every layer."""
    from autopar.core.sharding import megatron_styles
    from autopar.simulator.api import price_plan

    if plan.mesh.tp == 1:
        return []
    whole = [lp.layer for lp in plan.layers if not lp.tp]
    if not whole:
        return []
    refused = {x.kind.removeprefix("tp split of "): x.reason for x in left_out if x.kind.startswith("tp split of ")}
    base = price_plan(plan, cluster, cost_models, graph=graph)
    width = precision_bytes(plan.precision)    # the parameters in the plan's precision
    asked = f"--tp {plan.mesh.tp}" if fixed else f"tp {plan.mesh.tp}"
    out: dict[int, WholeLayer] = {}
    by_kind: dict[str, list[int]] = {}
    for i in whole:
        layer = graph.layers[i]
        styles = executable.styles(graph, i) if executable is not None else megatron_styles(graph, i)
        params = float(layer.param_numel * width)
        if styles:
            by_kind.setdefault(f"{layer.signature}|{sorted(styles.values())}", []).append(i)
            continue
        if layer.name in refused:
            why = f"its split does not run here (the runtime check left it out: {refused[layer.name]})"
        elif megatron_styles(graph, i):
            why = "its split does not run here (the runtime check left it out)"
        else:
            why = ("tensor parallelism has nothing to split in it (no column/row pair of Linear or Conv1D modules, "
                   "no vocabulary embedding, no Linear head feeding the loss)")
        out[i] = WholeLayer(i, layer.name, params, why)
    for members in by_kind.values():
        split = list(plan.layers)
        for i in members:
            styles = executable.styles(graph, i) if executable is not None else megatron_styles(graph, i)
            split[i] = replace(split[i], tp=tuple(sorted(styles.items())))
        try:
            res = price_plan(replace(plan, layers=tuple(split)), cluster, cost_models, graph=graph)
        except (InfeasibleError, UserError) as e:
            for i in members:
                out[i] = WholeLayer(i, graph.layers[i].name, float(graph.layers[i].param_numel * width),
                                    f"the simulator cannot price the plan with it split ({e})")
            continue
        step = res.step_time_s - base.step_time_s
        memory = res.max_memory_bytes - base.max_memory_bytes
        them = f"the {len(members)} of them" if len(members) > 1 else "it"
        why = (f"the search kept {'them' if len(members) > 1 else 'it'} whole under {asked}: splitting {them} is "
               f"predicted to make the step {fmt_seconds(abs(step))} {'slower' if step > 0 else 'faster'} "
               f"({100 * step / base.step_time_s:+.1f}%) and to {'save' if memory < 0 else 'add'} "
               f"{fmt_bytes(abs(memory))} on the fullest device"
               + ("" if step > 0 else "; the plan was kept for another reason (validation, the runtime check or "
                                      "memory)"))
        for i in members:
            layer = graph.layers[i]
            out[i] = WholeLayer(i, layer.name, float(layer.param_numel * width), why, step, memory)
    return [out[i] for i in sorted(out)]


def lines(whole: list[WholeLayer], plan) -> list[str]:
    """The summary's lines: one per reason, naming its layers and their parameter bytes."""
    if not whole:
        return []
    groups: dict[str, list[WholeLayer]] = {}
    for w in whole:
        groups.setdefault(w.reason, []).append(w)
    out = [f"whole under tp {plan.mesh.tp}: {len(whole)} of {len(plan.layers)} layers run in full on every tp rank, "
           f"each rank holding all of their weights"]
    for reason, members in groups.items():
        names = ", ".join(w.name for w in members)
        params = fmt_bytes(sum(w.param_bytes for w in members))
        out.append(f"  - {names} ({params} of parameters): {reason}")
    return out
