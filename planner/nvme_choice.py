"""When the planner offloads to the NVMe tier, and what it puts there: only where no plan fits host
memory, and no more than host memory needs.

A search runs with host offload first (``PlanOptions.offload_tier`` "cpu"), so every plan that fits
the hosts stays as it was.  Where that search finds none (``NoFeasiblePlanError``), the cluster
file gives every node group an NVMe tier and the search may offload, the tiers are tried in
order -- "nvme" (AdamW's moments), "nvme+grads" (the sharded gradients too), "nvme+params+grads"
(the sharded parameters too) -- and the first whose frugal corner (feasibility.frugal_fit: ZeRO-3,
full recompute, micro-batch 1) fits is searched (``offload_tier``), and the summary says why
(``SearchResult.tier_note``).  Gradients go before parameters: they sit on the tier only from the
backward to the step, while every forward needs the parameters (ZeRO-Infinity, Rajbhandari et al.
2021, Sec. 6.2: the parameters' reads are the ones the step waits on).  The tier's price is
simulator/axes/nvme_tier.py's.
"""
from __future__ import annotations

from dataclasses import replace

from autopar.core.cluster import Cluster

#: the tiers the planner tries, in order, and what each puts on the NVMe drives
TIERS = (("nvme", "AdamW's moments"), ("nvme+grads", "AdamW's moments and the gradients"),
         ("nvme+params+grads", "AdamW's moments, the gradients and the parameters"))


def _least_host_need(graph, cluster: Cluster, cost_model, options) -> str:
    """' at least X GB per node against the Y GB of host_memory_GB' (the least host memory a
    frugal corner that fits its devices needs), or '' where none fits its devices."""
    from autopar.planner.feasibility import frugal_fit

    host_need: list = []
    frugal_fit(graph, cluster, cost_model, options, all_meshes=True, host_need=host_need)
    if not host_need:
        return ""
    need, cap = min(host_need)
    return f" at least {need / 1e9:.1f} GB per node against the {cap / 1e9:.1f} GB of host_memory_GB"


def nvme_retry(graph, cluster: Cluster, cost_model, options):
    """(options of the NVMe search, the summary's reason) where that search can find a plan the
    host-offload search could not (module docstring), else None."""
    from autopar.planner.feasibility import frugal_fit

    if (not options.allow_offload or options.offload_tier != "cpu" or options.offload is not None
            or cluster.nvme_missing() is not None):          # (--offload fixed: the user's choice stands)
        return None
    need = _least_host_need(graph, cluster, cost_model, options)
    why = "no plan fits host memory" + (f" (offloading to the host needs{need})" if need else "")
    for i, (tier, what) in enumerate(TIERS):
        retry = replace(options, offload_tier=tier)
        if frugal_fit(graph, cluster, cost_model, retry)[0]:
            return retry, why + f": {what} go to the NVMe tier"
        if i + 1 < len(TIERS):
            need = _least_host_need(graph, cluster, cost_model, retry)
            why += f"; with {what} on the NVMe tier" + (f" it still needs{need}" if need else " none fits")
    return None
