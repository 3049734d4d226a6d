"""``autopar.simulate(target, ...)``: the step time, throughput and memory of a configuration or
of a plan.json, as a Python function (``autopar simulate`` prints what it returns).

    import autopar
    sim = autopar.simulate("examples/gpt.py", cluster="dgx-a100-1x8", degrees={"dp": 4, "tp": 2},
                           model_args={"size": "gpt2-small"})
    print(sim.result.step_time_s, sim.result.fits)
    sim = autopar.simulate("plan.json")       # the figures the plan file holds, on its own cluster

A model file is captured at ``micro_batch`` and configured from the degrees given
(``degrees``: axis name -> degree; the batch axis takes the devices the others leave, the
others default to 1) and the knobs (simulator/configure.py); a plan.json is priced as
``autopar plan`` priced it (simulator/plan_price.py).  Bad input raises ``UserError``; nothing
is printed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from autopar.core.errors import UserError


@dataclass
class Simulation:
    """What ``simulate`` priced: the graph, the plan (the one given or the one configured), the
    cluster and the simulator's result, with the seconds capture and simulation took."""
    graph: object                        # core.graph.OpGraph
    plan: object                         # core.plan.Plan
    cluster: object                      # core.cluster.Cluster
    result: object                       # simulator.result.SimResult
    capture_s: float
    simulate_s: float
    trace: str | None = None             # the Chrome trace written, if any

    def to_dict(self) -> dict:
        """``autopar simulate --json``'s object."""
        plan = self.plan
        out = self.result.to_dict()
        out.update(cluster=self.cluster.name, world_size=plan.world_size, capture_s=self.capture_s,
                   simulate_s=self.simulate_s,
                   plan={**plan.mesh.degrees,
                         "micro_batch": plan.micro_batch, "global_batch": plan.global_batch,
                         "num_microbatches": plan.pipeline.num_microbatches, "schedule": plan.pipeline.schedule,
                         "precision": plan.precision, "compile": plan.compile})
        if self.trace:
            out["trace"] = str(self.trace)
            out["trace_end_s"] = trace_end_s(self.result.timeline)
        return out


def simulate(target: str | Path, *, cluster=None, nodes: int | None = None,
             model_args: Mapping | None = None, degrees: Mapping[str, int | None] | None = None, ep: int = 1,
             micro_batch: int = 1, global_batch: int | None = None, schedule: str = "1f1b",
             virtual_stages: int = 2, zero: int = 0, recompute: str = "none", offload: str = "none",
             precision: str | None = None, fp8_recipe: str = "tensorwise", sequence_parallel: bool = False,
             compile: bool = False, grad_clip: bool = False, profile: str | None = None,
             trace: str | Path | None = None) -> Simulation:
    """Price ``target``, a model file (configured by the other arguments, on ``cluster``: a
    cluster file, a bundled cluster's name or a ``core.cluster.Cluster``) or a plan.json (on
    ``cluster``, default the one it was made for; the configuration arguments are ignored).
    ``nodes`` rescales a single-group cluster; ``profile``: the cost profile (default each
    group's GPU type); ``trace``: write a Chrome trace there."""
    from autopar.core.capture import capture_model_file
    from autopar.core.errors import InfeasibleError
    from autopar.core.plan import load_plan
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.simulate import simulate_plan
    from autopar.simulator.step.timeline import write_chrome_trace

    t0 = time.perf_counter()
    if trace:
        from autopar.core.output_file import check_not_read, check_writable

        check_writable(trace, "--trace")              # before the work, not after it
        check_not_read(trace, "--trace", {"model file or plan file": target})
    target = Path(target)
    plan = load_plan(target) if target.suffix == ".json" else None
    the_cluster = _load_cluster(target, cluster, nodes, plan)
    cms = {g.gpu: CostModel.from_profile(profile or g.gpu) for g in the_cluster.groups}
    if plan is not None:
        model_file = plan.model.file
        graph = capture_model_file(model_file, dict(plan.model.args), plan.micro_batch)
        if graph.fingerprint != plan.model.fingerprint:
            raise UserError(f"plan file {target} was made for a different model (fingerprint "
                            f"{plan.model.fingerprint}, {model_file} now gives {graph.fingerprint}); re-plan it.")
    else:
        graph = capture_model_file(str(target), dict(model_args or {}), micro_batch)
        plan = _configure(graph, the_cluster, degrees or {}, ep=ep, micro_batch=micro_batch,
                          global_batch=global_batch, schedule=schedule, virtual_stages=virtual_stages, zero=zero,
                          recompute=recompute, offload=offload, precision=precision, fp8_recipe=fp8_recipe,
                          sequence_parallel=sequence_parallel, compile=compile)
    if grad_clip:
        plan = replace(plan, grad_clip=True)
    _check_cp_ep(graph, plan)
    capture_s = time.perf_counter() - t0
    if plan.world_size > the_cluster.world_size:
        raise UserError(f"the configuration needs {' x '.join(plan.mesh.degrees)} = {plan.world_size} devices; "
                        f"cluster {the_cluster.name} has {the_cluster.world_size}. Lower a degree or add nodes with "
                        f"--nodes.")
    try:
        plan.validate(len(graph.layers))
        if target.suffix == ".json":    # the figures the plan file holds (simulator/plan_price.py)
            from autopar.simulator.plan_price import price_plan

            result = price_plan(plan, the_cluster, cms, graph=graph, timeline=bool(trace))
        else:
            result = simulate_plan(graph, plan, the_cluster, cms, timeline=bool(trace))
    except InfeasibleError as e:
        raise UserError(f"cannot simulate this configuration: {e}") from None
    sim_s = time.perf_counter() - t0 - capture_s
    if trace:
        names = {d: f"rank {d} (pipeline rank {plan.mesh.coord(d, 'pp')})" for d in {e['device'] for e in result.timeline}}
        write_chrome_trace(trace, result.timeline, names)
    return Simulation(graph, plan, the_cluster, result, capture_s, sim_s, None if not trace else str(trace))


def _load_cluster(target: Path, cluster, nodes: int | None, plan=None):
    """``cluster`` (a file, a bundled name or a Cluster; scaled to ``nodes``), else the cluster
    the plan was made for."""
    from autopar.core.cluster import Cluster
    from autopar.core.cluster_file import load_cluster

    if isinstance(cluster, Cluster):
        return cluster if nodes is None else cluster.scaled(nodes)
    if plan is not None and not cluster:
        from autopar.core.plan_cluster import load_plan_cluster

        found = load_plan_cluster(plan, str(target))
        return found if nodes is None else found.scaled(nodes)
    if not cluster:
        raise UserError("simulate needs --cluster NAME_OR_FILE for a model file (see examples/clusters/); "
                        "a plan.json names its own cluster.")
    return load_cluster(cluster, nodes=nodes)


def _configure(graph, cluster, degrees: Mapping[str, int | None], *, ep: int, precision: str | None,
               fp8_recipe: str, compile: bool, **knobs):
    """The plan of a configuration: ``degrees`` completed (``axis_degrees``), the precision
    defaulted by the cluster's backend, ep, compile and float8 layers applied."""
    from autopar.simulator.configure import config_plan

    precision = precision or ("fp32" if cluster.backend == "gloo" else "bf16")
    fp8 = precision == "fp8"               # float8 linears on a bf16 plan
    plan = config_plan(graph, degrees=axis_degrees(degrees, cluster.world_size), precision="bf16" if fp8 else precision,
                       cluster_name=cluster.name, **knobs)
    if compile:
        plan = replace(plan, compile=True)
    if ep > 1:
        plan = replace(plan, mesh=replace(plan.mesh, ep=ep))
    if fp8:
        plan = replace(plan, fp8_recipe=fp8_recipe, layers=tuple(replace(lp, precision="fp8") for lp in plan.layers))
    return plan


def axis_degrees(given: Mapping[str, int | None], world_size: int) -> dict[str, int]:
    """The degree of every declared axis: the given ones; the batch axis, when not given, takes
    the devices the others leave; any other axis not given is 1."""
    from autopar.core.parallel_dims import AXIS_BY_NAME, DEGREE_NAMES

    unknown = sorted(set(given) - set(DEGREE_NAMES))
    if unknown:
        raise UserError(f"degrees names {', '.join(map(repr, unknown))}, which is not a parallel axis; the axes are "
                        f"{', '.join(DEGREE_NAMES)}.")
    degrees = {name: given.get(name, None if AXIS_BY_NAME[name].splits == "batch" else 1) for name in DEGREE_NAMES}
    fixed = 1
    for v in degrees.values():
        fixed *= v or 1
    return {name: max(1, world_size // fixed) if v is None else v for name, v in degrees.items()}


def _check_cp_ep(graph, plan) -> None:
    """Refuse (exit 2) a cp or ep the model cannot take, with the reason (core/cp_support.py,
    simulator/ep_cost.py), and an ep that does not divide dp x cp."""
    from autopar.core.cp_support import cp_refusal
    from autopar.simulator.axes.ep import ep_refusal

    m = plan.mesh
    if m.cp > 1 and (why := cp_refusal(graph, m.cp)):
        raise UserError(f"cp {m.cp}: {graph.model_file} cannot take context parallelism: {why}. Use --cp 1.")
    if m.ep > 1 and (why := ep_refusal(graph, m.ep)):
        raise UserError(f"ep {m.ep}: {graph.model_file} cannot take expert parallelism: {why}. Use --ep 1.")
    if m.ep > 1 and any(p[0] == "mesh.ep" for p in m.problems()):      # the ep rule
        raise UserError(f"ep {m.ep}: expert parallelism borrows its ranks from dp x cp = {m.grad_degree}, which "
                        f"{m.ep} does not divide; choose an ep that divides dp x cp.")


def trace_end_s(events) -> float:
    """When the trace's last event ends (the step time, or later where the schedule cannot meet
    the pipeline formula: simulator/step_trace.py)."""
    return max((e["start_s"] + e["dur_s"] for e in events or ()), default=0.0)
