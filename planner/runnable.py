"""What the runtime runs of a search's plans: the kinds it can apply to this model, checked on
fake ranks at the tp degrees the cluster admits (``check_kinds``), and the first of the fastest
plans it builds and runs whole (``runnable_result``).  The checks themselves are
planner/runtime_check.py's."""
from __future__ import annotations


def check_kinds(graph, model_file: str, cluster, options, float8: bool = False):
    """What the runtime runs for this model (planner/runtime_check.py), at the tp degrees the
    cluster admits (``float8``: float8 linears too)."""
    from autopar.core.modelfile import load_model_file
    from autopar.planner.constraints import cluster_meshes
    from autopar.planner.runtime_check import find_executable

    meshes = cluster_meshes(options, cluster, len(graph.layers))
    degrees = tuple(sorted({m.tp for m in meshes if m.tp > 1} | ({options.degrees["tp"]} if options.degrees.get("tp", 1) > 1 else set())))
    return find_executable(graph, load_model_file(model_file), tp_degrees=degrees, precision=options.precision,
                           float8=float8)


MAX_PLAN_CHECKS = 12      # plans tried in order of predicted speed before giving up


def runnable_result(result, graph, model_file: str):
    """The search result with a best plan the runtime builds and runs (on fake ranks).

    The kinds were each checked alone; the pick combines them (a tp split with FSDP units and
    stage cuts), so it is checked whole.  A plan that fails gives way to the next fastest that
    fits; the failures are reported as left out.  Runner-ups are not checked."""
    from autopar.core.errors import UserError
    from autopar.core.modelfile import load_model_file
    from autopar.planner.runtime_check import LeftOut, whole_plan_error

    mf = load_model_file(model_file)
    refused: list[LeftOut] = []
    pool = [result.best] + list(result.runner_ups)
    for ev in pool[:MAX_PLAN_CHECKS]:
        err = whole_plan_error(ev.plan, graph, mf)
        if err is None:
            if ev is not result.best:
                result.runner_ups = [e for e in pool if e is not ev]
                result.best = ev
            return result, refused
        refused.append(LeftOut(f"plan {ev.plan.mesh.describe('{name}{size}', ' ')} zero{ev.plan.zero}", err))
    by_reason: dict[str, list[str]] = {}              # each distinct failure once, with its plans
    for x in refused:
        by_reason.setdefault(x.reason, []).append(x.kind)
    raise UserError("the runtime cannot run any of the fastest plans found for this model: "
                    + "; ".join(f"{', '.join(dict.fromkeys(kinds))}: {reason}" for reason, kinds in by_reason.items())
                    + ". Fix some knobs (--tp 1, --pp 1, --zero 0) to plan a simpler layout.")
