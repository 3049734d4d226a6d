"""The fitted constants of the cost model, as one value.

Most of a price comes from the device's profile (profiles/*.json) and from what the training code
does with it (simulator/training_code.py).  A few numbers are neither measured on the device nor
read from the code: they are fitted on published runs (benchmarks/published_runs.py --fit) and
stand for a mechanism whose size no profile row gives.  They live here, as fields of a frozen
``Calibration``, and a ``CostModel`` carries the one it prices with (``CostModel.calibration``,
``CostModel.for_calibration``), as it carries its ``TrainingCode``.  So no price reads module
state: the fit prices each grid value with its own cost models, and two evaluators of the same
graph can price two calibrations side by side.

Fields, each named by the module that owns its mechanism:

* ``nccl_overlap_slowdown``: extra compute time per second of compute overlapped by a sharded
  collective that streams at the node's own link speed (simulator/sharded_dp.py, item 2);
* ``sharded_ring_efficiency``: the fraction of the node's network a sharded all-gather or
  reduce-scatter reaches on a ring over nodes (simulator/sharded_dp.py, item 6).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    """The fitted constants a price reads (module docstring)."""
    #: fitted by ``python benchmarks/published_runs.py --fit`` on the sharded-data-parallel rows of
    #: the published runs: with the ZeRO-3 rows priced fetch by fetch (sharded_dp item 4c) the
    #: median fit on all 85 rows picks 0.3, half A 0.3 and half B 0.4 (docs/validation.md, "The
    #: ZeRO-3 rows priced fetch by fetch"; before item 4c all rows and half B picked 0.5)
    nccl_overlap_slowdown: float = 0.3
    #: fitted by ``python benchmarks/published_runs.py --fit`` together with the overlap slowdown;
    #: the value is the fit on all sharded rows (checked against, not taken from, NVIDIA/nccl
    #: issue #1218's all-gather at 0.5 of the node's network: sharded_dp item 6)
    sharded_ring_efficiency: float = 0.39


#: the constants as last fitted: what every plan the planner writes is priced with
FITTED = Calibration()
