"""plan.json's figures: every plan ``autopar plan`` keeps, priced as ``autopar simulate
plan.json`` prices it (simulator/plan_price.py: the model captured at the plan's micro-batch,
on the cluster less the plan's headroom), so that trials and reports compare their
measurements with the figures the file holds.  The compile and float8 choices get both of
their step times priced the same way."""
from __future__ import annotations

from dataclasses import replace

from autopar.core.rules import split_backward_problem


def price_written(result, compile_choice, float8_choice, graph, cluster, cost_models, headroom: float):
    """The search result with its best plan and runner-ups priced as written (the runner-ups
    recording the headroom), and the compile and float8 choices priced on the best plan;
    returns those and the graphs captured, by micro-batch size (shared by the later steps)."""
    graphs = {graph.batch_size: graph}
    result.best = _priced(result.best, cluster, cost_models, graphs)
    result.runner_ups = [_priced(replace(ev, plan=ev.plan.with_predicted(ev.plan.predicted, memory_headroom=headroom)),
                                 cluster, cost_models, graphs) for ev in result.runner_ups]
    compile_choice = _priced_choice(compile_choice, result.best.plan, cluster, cost_models, graphs)
    float8_choice = _priced_float8(float8_choice, result.best.plan, cluster, cost_models, graphs)
    return result, compile_choice, float8_choice, graphs


def _priced(ev, cluster, cost_models, graphs: dict):
    """``ev`` with the figures ``autopar simulate`` gives its plan: the model captured at the
    plan's micro-batch (``graphs``: by batch size, shared between plans) on the cluster less the
    plan's headroom (simulator/plan_price.py)."""
    from autopar.simulator.api import price_plan

    res = price_plan(ev.plan, cluster, cost_models, graph=captured_for(ev.plan, graphs))
    return replace(ev, plan=ev.plan.with_predicted(res.predicted_dict()), result=res)


def captured_for(plan, graphs: dict):
    """The model captured at ``plan``'s micro-batch, once per batch size (``graphs``)."""
    from autopar.simulator.api import plan_graph

    mb = plan.micro_batch
    if mb not in graphs:
        graphs[mb] = plan_graph(plan)
    return graphs[mb]


def _priced_choice(choice, plan, cluster, cost_models, graphs: dict):
    """The compile choice with both of its step times priced as plan.json's figures are
    (``_priced``): the chosen one is then the plan's predicted step."""
    from autopar.simulator.api import price_plan

    graph = captured_for(plan, graphs)
    eager = price_plan(replace(plan, compile=False), cluster, cost_models, graph=graph).step_time_s
    # a split-backward schedule cannot run compiled (compile_choice.choose_compile): its eager step
    refused = plan.mesh.pp > 1 and split_backward_problem(plan.pipeline.schedule, "none", 0, "none", True)
    compiled = eager if refused else price_plan(replace(plan, compile=True), cluster, cost_models,
                                                graph=graph).step_time_s
    return replace(choice, eager_step_s=eager, compiled_step_s=compiled)


def _priced_float8(choice, plan, cluster, cost_models, graphs: dict):
    """The float8 choice with both of its step times priced as plan.json's figures are
    (``_priced``): the plan as chosen and with every layer in bf16.  Its layers are the written
    plan's (the validation order or the runtime check may have kept another of the kept plans)."""
    layers = tuple(lp.layer for lp in plan.layers if lp.precision == "fp8")
    if layers != choice.layers:
        choice = replace(choice, layers=layers, why=choice.why if layers else
                         f"{choice.why} for the fastest plan; the plan kept after validation and the runtime check "
                         f"has none")
    if not choice.on:
        return choice
    from autopar.planner.float8_choice import with_fp8
    from autopar.simulator.api import price_plan

    graph = captured_for(plan, graphs)
    bf16, fp8 = (price_plan(p, cluster, cost_models, graph=graph).step_time_s for p in (with_fp8(plan, ()), plan))
    return replace(choice, bf16_step_s=bf16, fp8_step_s=fp8)
