"""When no plan fits: find out, by re-running the memory check, what would make one fit.

The least memory a mesh can need is its frugal corner: ZeRO-3 on every layer, full recompute,
offload to the host where allowed, one sample per micro-batch, 1F1B (at most p micro-batches in
flight).  If no mesh's frugal corner fits, nothing does.  Each suggestion below is the result
of pricing those corners again under the changed condition -- a larger cluster (more nodes of
the same kind, or of the group with the most memory per GPU), offload enabled, or a smaller
global batch -- not a guess.
"""
from __future__ import annotations

from dataclasses import replace

from autopar.core.cluster import Cluster
from autopar.core.errors import InfeasibleError, NoFeasiblePlanError, UserError
from autopar.core.graph import OpGraph
from autopar.core.plan import equal_bounds
from autopar.planner.candidate import Candidate
from autopar.planner.constraints import cluster_meshes
from autopar.planner.space import LayerChoice, microbatch_candidates

MAX_SCALE = 64          # look for up to 64x the nodes


def frugal_fit(graph: OpGraph, cluster: Cluster, cost_model, options, *, all_meshes: bool = False,
               host_need: list | None = None) -> tuple[bool, float]:
    """(does the frugal corner of some mesh fit, the least max_memory_bytes seen).

    Offload lowers device memory but fills host memory, so the corner is tried with and without
    it.  Stops at the first mesh that fits unless ``all_meshes`` (then the least is over all).
    ``host_need`` collects (host bytes per node, host capacity) of the offloading corners that fit
    their devices but not their hosts."""
    from autopar.core.plan import ModelRef
    from autopar.core.sharding import megatron_styles
    from autopar.simulator.api import PlanEvaluator

    L = len(graph.layers)
    styles = [megatron_styles(graph, i) for i in range(L)]
    model = ModelRef(graph.model_file, dict(graph.model_args), graph.model_name, graph.fingerprint)
    ev = PlanEvaluator(graph, cluster, cost_model)
    meshes = cluster_meshes(options, cluster, L)
    least, fits = float("inf"), False
    recompute = "full" if "full" in options.recompute else options.recompute[-1]
    offloads = (options.offload_tier, "none") if options.allow_offload else ("none",)
    for mesh in meshes:
        mbs = microbatch_candidates(options.global_batch, mesh.batch_degree,
                                    refused=options.refused_micro_batches)
        if not mbs:
            continue
        mb, m = mbs[0]
        for offload in offloads:
            choices = tuple(LayerChoice(tp=mesh.tp > 1 and bool(styles[i]), zero=3, recompute=recompute,
                                        offload=offload) for i in range(L))
            c = Candidate(mesh=mesh, micro_batch=mb, num_microbatches=m, schedule="1f1b",
                          bounds=equal_bounds(L, mesh.pp), choices=choices)
            try:
                res = ev.evaluate(c.to_plan(model=model, styles=styles, precision=options.precision,
                                            cluster=cluster.name))
            except (InfeasibleError, UserError):
                continue
            if offload == "none" or res.host_fits:      # device memory of corners the hosts can hold
                least = min(least, float(res.max_memory_bytes))
            if host_need is not None and res.device_fits and not res.host_fits:
                host_need.append((res.host_bytes_per_node, res.host_capacity_bytes))
            fits = fits or res.fits
            if fits:
                break
        if fits and not all_meshes:
            break
    return fits, least


def explain_infeasible(graph: OpGraph, cluster: Cluster, cost_model, options, *, searched: int) -> NoFeasiblePlanError:
    """A NoFeasiblePlanError whose message names what would make a plan fit."""
    host_need: list = []
    fits, least = frugal_fit(graph, cluster, cost_model, options, all_meshes=True, host_need=host_need)
    cap = max(g.gpu_memory_bytes for g in cluster.groups)
    head = (f"no plan for {graph.model_name} fits on cluster {cluster.name} ({cluster.world_size} devices): "
            f"of {searched} plans priced none fits memory on every device and host memory on every node")
    if least < float("inf"):
        head += (f"; the least memory any needs is {least / 2**30:.1f} GiB per device against "
                 f"{cap / 2**30:.1f} GiB available")
    if host_need:
        need, host_cap = min(host_need)
        head += (f"; offloading to the host would fit the devices but needs {need / 1e9:.1f} GB of host memory "
                 f"per node against the {host_cap / 1e9:.1f} GB the cluster file gives (host_memory_GB)")
    tips = []
    if fits:
        tips.append("a frugal plan (ZeRO-3, full recompute, offload, micro-batch 1) does fit, so give the search "
                    "more time (--time-budget)")
    if not options.allow_offload:
        ok, _ = frugal_fit(graph, cluster, cost_model, replace(options, allow_offload=True))
        if ok:
            tips.append("allow offloading to host memory")
    more = _more_devices(graph, cluster, cost_model, options)
    if more:
        tips.append(more)
    b = options.global_batch // 2
    while b >= 1:
        ok, _ = frugal_fit(graph, cluster, cost_model, replace(options, global_batch=b))
        if ok:
            tips.append(f"a global batch of {b} (--global-batch {b})")
            break
        b //= 2
    if tips:
        msg = head + ". What would make one fit: " + "; or ".join(tips) + "."
    else:
        msg = head + (f". Nothing tried makes one fit (up to {MAX_SCALE}x the nodes, offload, a global batch of 1): "
                      f"the model needs devices with more memory.")
    return NoFeasiblePlanError(msg)


def _more_devices(graph: OpGraph, cluster: Cluster, cost_model, options) -> str | None:
    """The fewest extra nodes (doubling, then bisecting) with which a frugal plan fits."""
    gi = max(range(len(cluster.groups)), key=lambda i: cluster.groups[i].gpu_memory_bytes)
    g = cluster.groups[gi]

    def with_nodes(n: int) -> Cluster:
        groups = list(cluster.groups)
        groups[gi] = replace(g, nodes=n)
        return replace(cluster, groups=tuple(groups), name=f"{cluster.name}+{n - g.nodes}")

    def ok(n: int) -> bool:
        return frugal_fit(graph, with_nodes(n), cost_model, options)[0]

    lo, hi = g.nodes, None
    n = g.nodes * 2
    while n <= g.nodes * MAX_SCALE:
        if ok(n):
            hi = n
            break
        lo, n = n, n * 2
    if hi is None:
        return None
    while hi - lo > 1:                       # bisect between the last failing and first fitting count
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    extra = hi - g.nodes
    return (f"{extra} more node{'s' if extra > 1 else ''} of {g.gpus_per_node} x {g.gpu} "
            f"({extra * g.gpus_per_node} more GPUs, {hi} nodes in group {g.name!r})")
