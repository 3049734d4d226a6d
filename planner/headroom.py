"""Memory kept free on every device for what the simulator's accounting does not hold.

The simulator sums parameters, gradients, optimizer state, activations and communication
buffers.  A real run also loses memory to the caching allocator's fragmentation (freed blocks
too small or split for the next request) and to kernel workspaces, so a plan that fills a
device to its last gigabyte runs out of memory.  Plans are therefore searched against
``(1 - headroom) x`` each device's memory.

Default: 9.2 GB of 80 GB = 11.5%.  GMLake (Guo et al., ASPLOS 2024, "GMLake: Efficient and
Transparent GPU Memory Defragmentation for Large-scale DNN Training with Virtual Memory
Stitching", arXiv:2401.08156, evaluation on eight LLMs on A100-80GB) measures that stitching
freed blocks together saves 9.2 GB of GPU memory on average (up to 25 GB) relative to
PyTorch's caching allocator -- memory that allocator holds but cannot hand out, i.e. its
fragmentation on large-model training with recompute, offload and ZeRO, the techniques these
plans use.  ``--memory-headroom`` sets another fraction (0 keeps none).
"""
from __future__ import annotations

from autopar.core.cluster import Cluster

GMLAKE_AVG_FRAGMENTATION_BYTES = 9.2e9      # Guo et al. 2024: mean memory saved over eight LLMs
GMLAKE_DEVICE_BYTES = 80e9                  # on A100-80GB
DEFAULT_MEMORY_HEADROOM = GMLAKE_AVG_FRAGMENTATION_BYTES / GMLAKE_DEVICE_BYTES     # 0.115


def with_headroom(cluster: Cluster, fraction: float) -> Cluster:
    """The cluster as the search sees it: each device's memory less ``fraction`` of it
    (``Cluster.with_memory_headroom``, which ``autopar simulate plan.json`` applies too)."""
    return cluster.with_memory_headroom(fraction)
