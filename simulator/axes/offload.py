"""Host (CPU) offload's costs in a layer: the twin of runtime/apply_dp.py ``offload_policy``.

A layer with ``offload: "cpu"`` (or ``"nvme"``) runs under FSDP2's ``CPUOffloadPolicy``
(torch.distributed.fsdp): its sharded parameters, gradients and optimizer state live in host
memory, FSDP2 copies the parameter shard to the device before each all-gather and the reduced
gradient shard back after each reduce-scatter, and the optimizer steps on the host (ZeRO-Offload,
Ren et al. 2021, USENIX ATC, Sec. 4: the Adam update on the CPU).  Priced here:

* **state** (``host_state``): the device keeps none of the layer's state; what ZeRO left on the
  device (step/memory.state_bytes) is in host memory instead -- less what the NVMe tier holds
  (``offload: "nvme"``, ``"nvme+params"``, ``"nvme+grads"``, ``"nvme+params+grads"``, nvme_tier.py);
* **copies** (``host_copies``): the parameter shard host -> device before each use and the
  gradient shard device -> host after each backward, each a copy over the host link
  (``CostModel.h2d_time``, PCIe: topology.MeshLinks.host), on the data-parallel stream beside
  FSDP's all-gathers and reduce-scatters: the "offload" traffic term (``offload_parts``,
  registered in step/builtin_terms.py; step/overlap.fsdp_traffic sums the traffic terms);
* **optimizer** (``host_optimizer_s``): Adam on the host over the rank's shard
  (``CostModel.host_optimizer_time``).  The profile's ``host_adam_params_per_s`` is the rate of
  one node's host, all its cores (profiles/*.json state it per node; docs/profiles.md), and every
  rank of the node steps its shard at the same time, after its backward, on that host: each rank
  process runs torch's AdamW on the CPU (runtime/apply_dp.py ``build_optimizer``), as each
  DeepSpeed rank runs its CPU-Adam (DeepSpeed's ``--bind_cores_to_rank`` splits the host's cores
  among the node's ranks for that reason: microsoft/DeepSpeed PR #7474).  So the node's ranks
  share the rate: a rank's shard takes ``shard x ranks on the node / node rate``, the time the
  node needs for all the shards at once.  The cost model holds no core count, so a rank that uses
  fewer cores than its share (torchrun's default OMP_NUM_THREADS=1 with more cores than ranks) is
  priced at its share all the same.  It runs on the host, so the device's compute sharing does
  not stretch it (step/layer_cost.compute_layer_cost).

The host memory these bytes need per node is checked in step/memory.py and step/assemble.py.
"""
from __future__ import annotations

import numpy as np

from autopar.core.plan import LayerPlan
from autopar.simulator.axes.nvme_tier import nvme_state_bytes
from autopar.simulator.device.cost_model import CostModel


def offloaded(lp: LayerPlan) -> bool:
    """The layer's state lives on the host (``offload`` "cpu" or "nvme")."""
    return lp.offload != "none"


def host_state(param_bytes: float, grad_bytes: float, optimizer_bytes: float, lp: LayerPlan,
               shard_params: float, shard_trainable: float) -> tuple[float, float]:
    """(host bytes, NVMe bytes) of an offloaded layer whose device state after ZeRO would be
    ``param_bytes``, ``grad_bytes`` and ``optimizer_bytes``: all of it on the host, less what ``lp``
    puts on the NVMe tier (nvme_tier.nvme_state_bytes: AdamW's moments of the ``shard_trainable``
    parameters, and the fp32 shards of the ``shard_params`` parameters and of their gradients where
    the offload names them; FSDP2 shards the parameters over dp at ZeRO-2 too)."""
    nvme = nvme_state_bytes(lp.offload, shard_params, shard_trainable)
    return max(0.0, param_bytes + grad_bytes + optimizer_bytes - nvme), nvme


def host_copies(cm: CostModel, host_link, param_full_bytes: float, grad_sync_bytes: float,
                dp: int) -> tuple[float, float]:
    """(host -> device, device -> host) seconds per use: the rank's 1/``dp`` shard of the layer's
    parameters copied in, of its gradients copied out, over ``host_link``."""
    return cm.h2d_time(param_full_bytes / dp, host_link), cm.h2d_time(grad_sync_bytes / dp, host_link)


def host_optimizer_s(cm: CostModel, shard_params: float, node_processes: int | None) -> float:
    """Adam on the host over the ``shard_params`` parameters the rank steps while the
    ``node_processes`` ranks of its node (None: 1) step theirs on the same host, at the node's
    rate (module docstring): the node's parameters at the node's rate."""
    return cm.host_optimizer_time(shard_params * max(1, node_processes or 1))


def offload_parts(src, zero, offload, pipeline_m: int | None = None):
    """The offloaded state's copies on the data-parallel stream, per micro-batch: (sharded
    parameters host -> device before forward, again before backward under ZeRO-3, sharded
    gradients device -> host after backward), read from ``src`` by column name; None where
    nothing is offloaded (no copies: fewer operations).  ``offload``: 1 (or True) where the
    layer's state is on the host; ``pipeline_m`` is not read: under a pipeline the copies are
    priced per micro-batch too."""
    if not np.count_nonzero(offload):
        return None
    h2d = src.h2d_s * offload
    return h2d, h2d * (zero >= 3), src.d2h_s * offload * (zero >= 2)
