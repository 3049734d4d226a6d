"""The NVMe tier's price: a layer with ``offload: "nvme"`` keeps AdamW's two fp32 moments of its
shard in files on the node's NVMe drives (runtime/nvme_tier.py), the rest of its state in host
memory as ``offload: "cpu"`` does; "nvme+params", "nvme+grads" and "nvme+params+grads" put
FSDP2's sharded parameters and/or gradients in the files too (core/rules.py ``nvme_states``).

ZeRO-Infinity (Rajbhandari et al. 2021, SC'21) names the parts priced here:

* **bandwidth-centric partitioning** (its Sec. 6.1): every device moves only its own shard of the
  state, all the devices at once, so the tier's bandwidth is the aggregate of the node's drives,
  shared by the node's devices: a device's bytes take ``bytes x devices on the node / node
  bandwidth`` (``Nvme.read_GBps`` / ``write_GBps`` are per node, all drives together);
* **overlap** (its Sec. 6.2, overlap-centric design): each step reads every byte on the tier and
  writes it back once (``moment_io_s``: read at the read bandwidth plus write at the write
  bandwidth -- the drives serve one stream after the other): the moments read for the optimizer
  step and written back after it; the parameters read for the step's first forward (the
  runtime's pages stay mapped through the step, so the backward's re-gather and the step's
  update find them in memory) and written back after the step; the gradients written by the
  backward, read by the step and zeroed again at the next step's first forward (a read of
  their pages).  The runtime starts the parameters' and gradients' read at the start of the
  forward, the moments' at its end, and writes back after the step while the next step's
  forward and backward run, so the disk's work hides behind the layer's compute of the step
  (its micro-batches' forward, backward and recompute) and only what exceeds it stalls
  (``exposed_io_s``, added to the layer's optimizer step, once per step);
* **capacity**: the node's states on the tier must fit the drives (``node_need``), and they
  leave host memory (``nvme_state_bytes``, subtracted from the offloaded host bytes).

The tier's reads and writes are per step, not per micro-batch: accumulation adds into the
gradients' mapped pages and re-gathers parameters from mapped pages.  Not priced: the parameters
on the tier are not pinned (runtime/apply_dp.py), so on an accelerator their host-to-device copies
are pageable, priced as the pinned copies of offload "cpu" are.
"""
from __future__ import annotations

import numpy as np

from autopar.core.cluster_types import Cluster, Nvme
from autopar.core.rules import nvme_states

#: bytes on the tier per trainable parameter of the shard: AdamW's exp_avg and exp_avg_sq in fp32
#: (torch.optim.AdamW's state; runtime/nvme_tier.py MOMENTS), whatever the training precision
MOMENT_BYTES = 2 * 4
#: bytes on the tier per parameter of the shard (trainable for the gradient) for "params" and
#: "grads": FSDP2 keeps the sharded parameter in its own dtype, fp32, under a MixedPrecisionPolicy
#: (which casts only the all-gather) and casts the reduce-scatter's output back to it (torch 2.13
#: _fsdp_collectives.foreach_reduce, ``_to_dtype_if_needed(reduce_output, orig_dtype)``)
SHARD_BYTES = 4


def nvme_moment_bytes(shard_trainable_params: float) -> float:
    return shard_trainable_params * MOMENT_BYTES


def nvme_state_bytes(offload: str, shard_params: float, shard_trainable_params: float) -> float:
    """Bytes of one device's shard that ``offload`` keeps on the tier: the moments, and the
    parameters and gradients where it names them (0 off the tier)."""
    states = nvme_states(offload)
    if not states:
        return 0.0
    return (nvme_moment_bytes(shard_trainable_params)
            + (shard_params * SHARD_BYTES if "params" in states else 0.0)
            + (shard_trainable_params * SHARD_BYTES if "grads" in states else 0.0))


def slowest_tier(cluster: Cluster) -> Nvme | None:
    """The group NVMe tier with the least bandwidth (a plan's ranks may sit on any group), or None
    where some group has none."""
    tiers = [g.nvme for g in cluster.groups]
    if any(t is None for t in tiers):
        return None
    return min(tiers, key=lambda t: 1.0 / t.read_GBps + 1.0 / t.write_GBps)


def moment_io_s(device_bytes, devices_per_node: int, tier: Nvme):
    """Seconds of the node's drives to read and then write ``device_bytes`` (a device's states on
    the tier: moments, and parameters and gradients where the plan puts them there) of every one of its
    ``devices_per_node`` devices (bandwidth-centric partitioning: all shards move at once, at the
    node's aggregate bandwidth)."""
    node_bytes = np.asarray(device_bytes, dtype=float) * devices_per_node
    return node_bytes / tier.read_Bps + node_bytes / tier.write_Bps


def exposed_io_s(io_s, window_s):
    """What of the tier's read and write the step's compute does not hide (module docstring)."""
    return np.maximum(0.0, np.asarray(io_s, dtype=float) - np.asarray(window_s, dtype=float))


def with_tier_stalls(rows, ctx, cluster: Cluster):
    """The layer table with each NVMe layer's exposed read and write (of every state it keeps on
    the tier) added to its optimizer step
    (the "nvme_tier" table term).  A cluster without an NVMe tier on every group adds nothing here:
    ``node_need`` finds such a plan does not fit."""
    b = rows.nvme_bytes
    if not np.count_nonzero(b):
        return rows
    tier = slowest_tier(cluster)
    if tier is None:
        return rows
    io = moment_io_s(b, ctx.processes, tier)
    # what hides the disk's work: the step's compute where the code overlaps the swap, nothing
    # where it swaps serially in the optimizer step (TrainingCode.nvme_swap_overlapped)
    window = (ctx.num_microbatches * (rows.fwd_s + rows.bwd_s + rows.recompute_s)
              if ctx.rank_cm[0].code.nvme_swap_overlapped else 0.0)
    return rows.with_columns(optimizer_s=rows.optimizer_s + exposed_io_s(io, window))


def node_need(per_rank_bytes: np.ndarray, node_counts: np.ndarray, cluster: Cluster) -> tuple[float, float, bool]:
    """(NVMe bytes on the fullest node, its capacity, fits): ``per_rank_bytes`` per pipeline rank
    (one device's), ``node_counts`` (nodes x pp) the devices of each node on each pipeline rank
    (topology.node_stage_counts).  The capacity is the smallest group tier's (0 without a tier)."""
    per_node = node_counts @ per_rank_bytes
    need = float(per_node.max()) if len(per_node) else 0.0
    caps = [g.nvme.capacity_bytes if g.nvme is not None else 0 for g in cluster.groups]
    cap = float(min(caps))
    return need, cap, need <= cap
