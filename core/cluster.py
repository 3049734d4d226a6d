"""Cluster description (cluster.yaml): the data classes and the file reader under one name.

``from autopar.core.cluster import Cluster, load_cluster`` is the door callers use; the data
classes live in ``cluster_types.py`` and the YAML reader, which builds them, in
``cluster_file.py``, so neither of those two imports the other back.
"""
from __future__ import annotations

from autopar.core.cluster_file import (add_cluster_arguments, available_clusters, cluster_from_args, load_cluster,
                                       parse_cluster)
from autopar.core.cluster_types import BACKENDS, MAX_DEVICES, Cluster, Device, Link, NodeGroup

__all__ = ["BACKENDS", "MAX_DEVICES", "Cluster", "Device", "Link", "NodeGroup", "add_cluster_arguments",
           "available_clusters", "cluster_from_args", "load_cluster", "parse_cluster"]
