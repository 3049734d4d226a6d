"""The plan's compile knob: price the search's plans with regional ``torch.compile`` on and off.

The search ranks plans eager; this step then prices each kept plan (best and runner-ups) both
ways with the same simulator (the compile term is simulator/compile_fusion.py) and keeps, per
plan, the faster.  Compile shortens only the blocks' memory-bound work and keeps their memory,
so it cannot make a plan infeasible; it rarely reorders plans, and where a runner-up becomes
faster than the best by more than the search's tidy tolerance it becomes the best.

What is not priced into the step, and decides the default where the search is free:

* **Compile time.**  Inductor compiles each distinct block once when the run starts (the
  summary says so).  On a CPU (gloo) cluster that is C++ code generation and a gcc build per
  block setting -- measured here, a first step of 3 minutes for a 4-block GPT whose steps take
  50 ms (tests/integration/test_runtime_compile.py's cases) -- longer than any CPU run autopar plans, so on
  gloo clusters compile stays off unless ``--compile`` asks for it.  On GPU clusters it is on
  where it saves more than the simulator can tell apart (``TIDY_TOLERANCE``, 0.2%).

``--compile`` / ``--no-compile`` fix it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.rules import split_backward_problem
from autopar.core.units import fmt_seconds
from autopar.planner.search import TIDY_TOLERANCE, Evaluated, SearchResult, keep_best_unless_beaten


@dataclass(frozen=True)
class CompileChoice:
    compile: bool
    why: str
    eager_step_s: float
    compiled_step_s: float
    distinct_blocks: int = 0       # block graphs inductor compiles at the start (one per block signature)

    def summary(self) -> str:
        gain = self.eager_step_s / self.compiled_step_s - 1.0 if self.compiled_step_s > 0 else 0.0
        state = "on" if self.compile else "off"
        return (f"compile {state} ({self.why}): predicted step {fmt_seconds(self.compiled_step_s)} compiled vs "
                f"{fmt_seconds(self.eager_step_s)} eager ({gain:+.1%} throughput); compile time is not in the step: "
                f"inductor compiles {self.distinct_blocks} distinct block graph(s) (forward and backward) once "
                f"at the start of the run")

    def to_dict(self) -> dict:
        return {"compile": self.compile, "why": self.why, "eager_step_s": self.eager_step_s,
                "compiled_step_s": self.compiled_step_s, "distinct_blocks": self.distinct_blocks}


def choose_compile(result: SearchResult, graph, cluster, cost_models, flag: bool | None,
                   memory_headroom: float = 0.0) -> tuple[SearchResult, CompileChoice]:
    """The result with every kept plan's ``compile`` decided (``flag``: fixed by the user) and
    re-priced on the cluster as the search saw it (``memory_headroom``); the best plan
    re-picked if compile reorders them."""
    from autopar.planner.headroom import with_headroom
    from autopar.simulator.api import PlanEvaluator

    gloo = cluster.backend == "gloo"
    ev = PlanEvaluator(graph, with_headroom(cluster, memory_headroom), cost_models)
    # structurally identical blocks share one compiled graph (dynamo guards on the class and shapes)
    distinct = len({l.signature for l in graph.layers if l.kind not in ("pre", "post")})
    choices: list[tuple[Evaluated, CompileChoice]] = []
    for item in [result.best] + list(result.runner_ups):
        eager_plan = replace(item.plan, compile=False)
        compiled_plan = replace(item.plan, compile=True)
        # torch's split-backward schedule classes refuse compiled stages (core/rules.py)
        refused = item.plan.mesh.pp > 1 and split_backward_problem(item.plan.pipeline.schedule, "none", 0, "none", True)
        eager = ev.evaluate(eager_plan)
        compiled = eager if refused else ev.evaluate(compiled_plan)
        if refused:
            on, why = False, f"torch's {item.plan.pipeline.schedule} schedule refuses compiled stages"
        elif flag is not None:
            on, why = flag, "--compile" if flag else "--no-compile"
        elif gloo:
            on, why = False, "gloo cluster: compiling takes longer than the CPU runs autopar plans; --compile turns it on"
        else:
            on = compiled.step_time_s < eager.step_time_s * (1.0 - TIDY_TOLERANCE)
            why = "faster" if on else "saves less than 0.2%"
        if on:
            plan = compiled_plan.with_predicted(compiled.predicted_dict()) if item.plan.predicted else compiled_plan
            chosen = Evaluated(item.candidate, plan, compiled)
        else:
            chosen = Evaluated(item.candidate, eager_plan, item.result)     # as the search priced it
        choices.append((chosen,
                        CompileChoice(on, why, eager.step_time_s, compiled.step_time_s, distinct)))
    return keep_best_unless_beaten(result, choices)
