"""The cluster a plan was made for, found from what the plan records.

``autopar plan`` writes the cluster it was given (``provenance.cluster_ref`` and
``cluster_nodes``), the file it read (``provenance.cluster_file``) and a ``"name (file)"``
label (``plan.cluster``); ``autopar simulate plan.json`` and ``autopar report`` load the
cluster from these unless ``--cluster`` overrides it.
"""
from __future__ import annotations

import re
from pathlib import Path

from autopar.core.cluster import Cluster
from autopar.core.errors import UserError
from autopar.core.plan import Plan


def load_plan_cluster(plan: Plan, plan_path: str | Path, cluster_path: str | None = None) -> Cluster:
    """``cluster_path`` (--cluster), else the plan's cluster reference, file or label."""
    from autopar.core.cluster_file import load_cluster

    if not cluster_path and plan.provenance.get("cluster_ref"):
        try:   # what 'autopar plan' was given: --cluster and --nodes
            return load_cluster(str(plan.provenance["cluster_ref"]), nodes=plan.provenance.get("cluster_nodes"))
        except UserError:
            pass
    candidates = [cluster_path] if cluster_path else []
    if plan.provenance.get("cluster_file"):
        candidates.append(str(plan.provenance["cluster_file"]))
    m = re.match(r"^(.*?)\s*\((.+)\)\s*$", plan.cluster or "")
    if m:
        candidates += [m.group(2), m.group(1)]
    elif plan.cluster:
        candidates.append(plan.cluster)
    tried = []
    for c in candidates:
        rel = Path(plan_path).parent / c
        try:
            return load_cluster(str(rel) if not Path(c).is_file() and rel.is_file() else c)
        except UserError as e:
            if cluster_path and c == cluster_path:
                raise
            tried.append(f"{c} ({str(e)[:80]}...)")
    raise UserError(f"{plan_path}: cannot find the plan's cluster (tried {'; '.join(tried) or 'nothing: the plan names none'}); "
                    f"pass --cluster CLUSTER.yaml or a bundled cluster name.")
