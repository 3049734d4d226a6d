"""The price of a written plan: what ``plan.json``'s ``predicted`` block holds and what
``autopar simulate plan.json`` prints, computed one way.

Two things would make the two differ if each priced the plan its own way:

* the graph.  The search prices every candidate on the graph captured at ``--batch-size``,
  scaling each op's work by micro-batch / captured batch (simulator/layer_cost.py); ``simulate``,
  ``report`` and the runtime's plan check capture the model at the plan's micro-batch.  Not all
  of an op's work grows with the batch (a linear's weight read, examples/gpt.py's position
  embedding and causal mask), and a matmul's layout copy can appear at one batch size and not at
  another, so the two graphs price one plan differently (1.7e-4 of a step on local-cpu, 0.5% for
  gpt3-175b on 1024 H100).  Here the model is captured at the plan's micro-batch, as every
  reader of a plan file does; the search's own figures are left as they are (its ranking of
  candidates is unchanged);
* the memory.  The search fits plans in each device's memory less the plan's headroom
  (planner/headroom.py); the plan records the fraction (``provenance.memory_headroom``) and the
  cluster is priced with it here, so both report the same capacity and the same ``fits``.
"""
from __future__ import annotations

from collections.abc import Mapping

from autopar.core.cluster import Cluster
from autopar.core.graph import OpGraph
from autopar.core.plan import Plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.result import SimResult


def plan_graph(plan: Plan, graph: OpGraph | None = None) -> OpGraph:
    """The plan's model captured at the plan's micro-batch; ``graph`` where it already is."""
    if graph is not None and graph.batch_size == plan.micro_batch:
        return graph
    from autopar.core.capture import capture_model_file

    return capture_model_file(plan.model.file, dict(plan.model.args), plan.micro_batch)


def plan_cluster(plan: Plan, cluster: Cluster) -> Cluster:
    """``cluster`` as the plan was searched against: less the plan's recorded memory headroom."""
    return cluster.with_memory_headroom(float(plan.provenance.get("memory_headroom") or 0.0))


def price_plan(plan: Plan, cluster: Cluster, cost_models: CostModel | Mapping[str, CostModel], *,
               graph: OpGraph | None = None, timeline: bool = False) -> SimResult:
    """``simulate`` of ``plan`` on its model captured at its micro-batch (``plan_graph``; ``graph``
    serves where it was captured so) and on ``cluster`` less its headroom (``plan_cluster``)."""
    from autopar.simulator.simulate import simulate_plan

    return simulate_plan(plan_graph(plan, graph), plan, plan_cluster(plan, cluster), cost_models, timeline=timeline)
