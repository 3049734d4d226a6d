"""The plan's float8 knob: bf16 or fp8 per kind of repeated block, priced by the simulator.

After the search (which ranks plans in the plan's precision, bf16) and the compile choice,
each kept plan is priced again with the linears of one kind of layer at a time in float8
(``precision: fp8`` on every layer of that kind -- layers of one kind share their shapes, so
they gain or lose alike; the terms are simulator/float8.py's at the plan's ``fp8_recipe``,
tensorwise) and keeps each kind's fp8 where it makes the step faster by more than the search's
tidy tolerance and still fits the devices' memory.  The summary says what it bought.

Offered only where it can run (runtime/fp8_check.py refuses the rest before launch):

* a bf16 plan (float8 trains on top of bf16's master weights and outputs);
* every device of the cluster has fp8 tensor cores: its profile has ``peak_flops["fp8"]``
  (datasheet figures of Ada / Hopper and later, compute capability 8.9+); never on a gloo (CPU)
  cluster;
* torchao is importable (the ``autopar[fp8]`` extra; runtime/apply_fp8.py);
* a layer with at least one linear whose dims divide by 16 (the runtime converts only those; by
  16 x tp where tensor parallelism splits it);
* the runtime check (fake ranks) ran a float8 plan of the model (``Executable.float8``).

``--precision bf16`` forbids it, ``--precision fp8`` puts every kind that can in fp8.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.plan import Plan
from autopar.planner.search import TIDY_TOLERANCE, Evaluated, SearchResult, keep_best_unless_beaten


@dataclass(frozen=True)
class Float8Choice:
    layers: tuple[int, ...]        # the layers chosen fp8
    why: str
    bf16_step_s: float = 0.0       # the plan with every layer bf16
    fp8_step_s: float = 0.0        # the plan with the chosen layers fp8 (= bf16_step_s when none)
    recipe: str = "tensorwise"

    @property
    def on(self) -> bool:
        return bool(self.layers)

    def summary(self) -> str:
        if not self.on:
            return f"float8 off ({self.why})"
        gain = self.bf16_step_s / self.fp8_step_s - 1.0 if self.fp8_step_s > 0 else 0.0
        return (f"float8 on {len(self.layers)} layer(s), {self.recipe} ({self.why}): predicted step "
                f"{self.fp8_step_s:.4g} s with float8 vs {self.bf16_step_s:.4g} s in bf16 ({gain:+.1%} throughput)")

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "why": self.why, "bf16_step_s": self.bf16_step_s,
                "fp8_step_s": self.fp8_step_s, "recipe": self.recipe}


def fp8_unavailable(cluster, cost_models, precision: str, executable=None) -> str | None:
    """Why no plan on this cluster may train float8, or None when it may."""
    if precision != "bf16":
        return f"the plan's precision is {precision}; float8 trains on top of bf16"
    if cluster.backend == "gloo":
        return "gloo (CPU) cluster: the CPU has no fp8 matrix units"
    for g in cluster.groups:
        cm = cost_models[g.gpu]
        if "fp8" not in cm.peak_flops:
            return (f"profile {cm.name} has no fp8 peak: fp8 tensor cores need compute capability 8.9 or later "
                    f"(Ada, Hopper)")
    from autopar.runtime import apply_fp8
    from autopar.runtime.meta_apply import FP8_INSTALL_HINT as INSTALL_HINT

    if not apply_fp8.torchao_available():
        return f"torchao is not installed ('{INSTALL_HINT}')"
    if executable is not None and not executable.float8:
        why = next((x.reason for x in executable.left_out if x.kind == "float8"), "refused by the runtime check")
        return f"the runtime check could not run it: {why}"
    return None


def convertible_layers(graph) -> list[int]:
    """Layers holding at least one linear the runtime converts (simulator/float8.converts)."""
    from autopar.simulator.api import float8_converts as converts

    out = []
    for i in range(len(graph.layers)):
        for op in graph.layer_ops(i):
            if op.kind == "linear" and op.params and op.input_shapes and \
                    converts(op.input_shapes[0][-1], op.output_shape[-1]):
                out.append(i)
                break
    return out


def with_fp8(plan: Plan, layers, recipe: str | None = None) -> Plan:
    """``plan`` with exactly ``layers`` in fp8 (the others in the plan's precision)."""
    chosen = set(layers)
    return replace(plan, layers=tuple(replace(lp, precision="fp8" if lp.layer in chosen else "")
                                      for lp in plan.layers), fp8_recipe=recipe or plan.fp8_recipe)


def choose_float8(result: SearchResult, graph, cluster, cost_models, flag: str | None, precision: str,
                  executable=None, memory_headroom: float = 0.0,
                  recipe: str = "tensorwise") -> tuple[SearchResult, Float8Choice]:
    """The result with every kept plan's per-layer precision decided (``flag``: 'bf16' or 'fp8'
    from --precision, None: the planner's choice) and re-priced; the best plan re-picked if
    float8 reorders them (as planner/compile_choice.py)."""
    if flag == "bf16":
        return result, Float8Choice((), "--precision bf16", recipe=recipe)
    why_not = fp8_unavailable(cluster, cost_models, precision, executable)
    if why_not is not None:
        if flag == "fp8":
            from autopar.core.errors import UserError

            raise UserError(f"--precision fp8 asks for float8 linears, but {why_not}. Plan with --precision bf16, "
                            f"or on a cluster of Hopper-class GPUs with torchao installed.")
        return result, Float8Choice((), why_not, recipe=recipe)
    from autopar.planner.headroom import with_headroom
    from autopar.simulator.api import PlanEvaluator

    ev = PlanEvaluator(graph, with_headroom(cluster, memory_headroom), cost_models)
    candidates = convertible_layers(graph)
    kinds: dict[str, list[int]] = {}
    for i in candidates:
        kinds.setdefault(graph.layers[i].signature, []).append(i)
    choices: list[tuple[Evaluated, Float8Choice]] = []
    for item in [result.best] + list(result.runner_ups):
        base_plan = with_fp8(item.plan, (), recipe)
        base = ev.evaluate(base_plan)
        chosen: list[int] = []
        best_res = base
        for layers in kinds.values():
            trial = ev.evaluate(with_fp8(item.plan, chosen + layers, recipe))
            faster = trial.step_time_s < best_res.step_time_s * (1.0 - TIDY_TOLERANCE)
            if trial.fits and (flag == "fp8" or faster):
                chosen, best_res = chosen + layers, trial
        if not candidates:
            why = "no linear with both dims divisible by 16"
        elif flag == "fp8":
            why = "--precision fp8" if chosen else "--precision fp8, but no float8 layer fits the memory"
        else:
            why = "faster" if chosen else "saves less than 0.2%"
        if chosen:
            plan = with_fp8(item.plan, sorted(chosen), recipe)
            plan = plan.with_predicted(best_res.predicted_dict()) if item.plan.predicted else plan
            item = Evaluated(item.candidate, plan, best_res)
        choices.append((item, Float8Choice(tuple(sorted(chosen)), why, base.step_time_s, best_res.step_time_s,
                                           recipe)))
    return keep_best_unless_beaten(result, choices)
