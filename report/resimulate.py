"""Re-simulate a plan for the report: find its model, cluster and profile, run the simulator.

The plan records where it came from: the model file and arguments (``plan.model``), the
cluster file (``provenance.cluster_file``, or the ``"name (file)"`` label in ``plan.cluster``)
and the profile (``provenance.profile``).  Each can be overridden from the command line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from autopar.core.errors import UserError
from autopar.core.graph import OpGraph
from autopar.core.plan import Plan
from autopar.core.plan_cluster import load_plan_cluster
from autopar.report.timelines import simulated_breakdown


@dataclass
class PlanContext:
    graph: OpGraph
    cluster: Any                     # autopar.core.cluster.Cluster
    profile: dict                    # the profile dict the cost model is built from
    profile_name: str


def load_context(plan: Plan, plan_path: str | Path, *, cluster_path: str | None = None,
                 profile: str | None = None) -> PlanContext:
    from autopar.core.capture import capture_model_file

    model_file = Path(plan.model.file)
    if not model_file.is_file():
        alt = Path(plan_path).parent / model_file
        if alt.is_file():
            model_file = alt
        else:
            raise UserError(f"{plan_path}: the plan's model file {plan.model.file} does not exist here; run the report "
                            f"from the directory the plan was made in, or where that path resolves.")
    graph = capture_model_file(model_file, dict(plan.model.args), batch_size=plan.micro_batch)
    cluster = load_plan_cluster(plan, plan_path, cluster_path)
    name = profile or plan.provenance.get("profile") or cluster.groups[0].gpu
    return PlanContext(graph=graph, cluster=cluster, profile=load_profile_dict(str(name)), profile_name=str(name))


def load_profile_dict(name_or_path: str) -> dict:
    """A profile as a dict: a JSON file path, or a name in profiles/ (validated on load)."""
    from autopar.profiles import load_profile

    return load_profile(name_or_path)


def simulate_figures(ctx: PlanContext, plan: Plan, profile: Mapping | None = None, *,
                     timeline: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The simulated figures (predicted block + breakdown + memory per rank) and the events."""
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.plan_price import price_plan

    from autopar.core.errors import InfeasibleError

    cm = CostModel.from_profile(dict(profile if profile is not None else ctx.profile))
    try:
        # priced as plan.json's predicted block and 'autopar simulate plan.json' (simulator/plan_price.py)
        res = price_plan(plan, ctx.cluster, cm, graph=ctx.graph, timeline=timeline)
    except InfeasibleError as e:
        raise UserError(f"the plan cannot be simulated on cluster {ctx.cluster.name}: {e}. Pass the cluster it was "
                        f"made for with --cluster.") from None
    figs = dict(res.predicted_dict())
    events = list(res.timeline or [])
    if events:
        figs.update(simulated_breakdown(events, device=0))
    per_stage = [float(m.total_bytes) for m in res.memory]
    if per_stage:
        figs["memory_per_rank_bytes"] = [per_stage[min(plan.mesh.coord(r, "pp"), len(per_stage) - 1)]
                                         for r in range(plan.world_size)]
    return figs, events
