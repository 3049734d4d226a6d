"""When the planner offloads to the NVMe tier: only where no plan fits host memory.

A search runs with host offload first (``PlanOptions.offload_tier`` "cpu"), so every plan that fits
the hosts stays as it was.  Where that search finds none (``NoFeasiblePlanError``), the cluster
file gives every node group an NVMe tier, the search may offload and the frugal corner
(feasibility.frugal_fit: ZeRO-3, full recompute, micro-batch 1) fits with AdamW's moments on the
tier, the search runs again with ``offload_tier`` "nvme" and the summary says why
(``SearchResult.tier_note``).  The tier's price is simulator/nvme_tier.py's.
"""
from __future__ import annotations

from dataclasses import replace

from autopar.core.cluster import Cluster


def nvme_retry(graph, cluster: Cluster, cost_model, options):
    """(options of the NVMe search, the summary's reason) where that search can find a plan the
    host-offload search could not (module docstring), else None."""
    from autopar.planner.feasibility import frugal_fit

    if (not options.allow_offload or options.offload_tier != "cpu" or options.offload is not None
            or cluster.nvme_missing() is not None):          # (--offload fixed: the user's choice stands)
        return None
    retry = replace(options, offload_tier="nvme")
    if not frugal_fit(graph, cluster, cost_model, retry)[0]:
        return None
    host_need: list = []
    frugal_fit(graph, cluster, cost_model, options, all_meshes=True, host_need=host_need)
    why = "no plan fits host memory"
    if host_need:
        need, cap = min(host_need)
        why += (f" (offloading to the host needs at least {need / 1e9:.1f} GB per node against the "
                f"{cap / 1e9:.1f} GB of host_memory_GB)")
    return retry, why + ": AdamW's moments go to the NVMe tier"
