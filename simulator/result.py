"""SimResult: what the simulator says a plan costs.

The figures the search reads for every candidate (step time, peak memory, whether it fits) are
computed when the result is made; the rest -- FLOPs and MFU, bytes on the wire, the count of
measured and estimated cost figures, the memory breakdown per pipeline rank -- when first read
(``SimResult.work``), since the search prices thousands of plans and reports a handful.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from autopar.simulator.step.memory import MemoryBreakdown


@dataclass(frozen=True)
class StepWork:
    """The work and traffic of one step of a plan."""
    model_flops_per_step: float          # fwd + bwd of the model, whole global batch
    hardware_flops_per_step: float       # + recompute (what Megatron-LM reports)
    tflops_per_gpu: float                # model FLOPs / step / GPUs (the MFU numerator)
    hw_tflops_per_gpu: float
    mfu: float
    comm_bytes: dict[str, float]         # bytes sent per step over all devices, by link level
    sources: dict[str, int]              # {"measured": n, "estimated": n} cost figures used


@dataclass
class SimResult:
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    max_memory_bytes: float
    capacity_bytes: float
    fits: bool                           # device_fits and host_fits
    bubble_fraction: float
    #: per pipeline rank (representative device): params, grads, optimizer, activations,
    #: buffers, total and host bytes -- one array each (memory.StageMemory order)
    memory_arrays: tuple[np.ndarray, ...] = field(repr=False)
    work_fn: Callable[[], StepWork] = field(repr=False, compare=False)
    timeline: list[dict[str, Any]] | None = None
    stage_step_s: list[float] = field(default_factory=list)   # when each pipeline rank finishes
    world_size: int = 0
    peak_flops_per_gpu: float = 0.0
    _work: StepWork | None = field(default=None, init=False, repr=False, compare=False)
    device_fits: bool = True             # every device's total within its memory
    host_fits: bool = True               # every node's offloaded state within its host memory
    host_bytes_per_node: float = 0.0     # offloaded bytes on the node closest to (or past) its limit
    host_capacity_bytes: float = 0.0     # that node's host memory
    nvme_fits: bool = True               # every node's NVMe-tier moments within its drives (simulator/nvme_tier.py)
    nvme_bytes_per_node: float = 0.0     # the moments on the fullest node's NVMe tier (0: no layer offloads there)
    nvme_capacity_bytes: float = 0.0     # the tier's capacity per node

    @property
    def work(self) -> StepWork:
        if self._work is None:
            self._work = self.work_fn()
        return self._work

    @property
    def memory(self) -> list[MemoryBreakdown]:
        """One breakdown per pipeline rank (representative device)."""
        return [MemoryBreakdown(*row) for row in zip(*(a.tolist() for a in self.memory_arrays))]

    def predicted_dict(self) -> dict[str, Any]:
        """The plan.json ``predicted`` block (keys joined with measured.json)."""
        memory = self.memory
        worst = max(range(len(memory)), key=lambda i: memory[i].total_bytes) if memory else 0
        return {
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu,
            "mfu": self.mfu,
            "max_memory_bytes": self.max_memory_bytes,
            "memory_breakdown": memory[worst].to_dict() if memory else {},
            "memory_per_stage": [m.to_dict() for m in memory],
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_capacity_bytes": self.host_capacity_bytes,
            "host_fits": self.host_fits,
            **({"nvme_bytes_per_node": self.nvme_bytes_per_node, "nvme_capacity_bytes": self.nvme_capacity_bytes,
                "nvme_fits": self.nvme_fits} if self.nvme_bytes_per_node else {}),
            "bubble_fraction": self.bubble_fraction,
            "comm_bytes": dict(self.comm_bytes),
            "sources": dict(self.sources),
        }

    def to_dict(self) -> dict[str, Any]:
        d = self.predicted_dict()
        d.update(model_flops_per_step=self.model_flops_per_step,
                 hardware_flops_per_step=self.hardware_flops_per_step,
                 stage_step_s=list(self.stage_step_s), world_size=self.world_size,
                 peak_flops_per_gpu=self.peak_flops_per_gpu)
        return d


def _work_property(name: str) -> property:
    return property(lambda self: getattr(self.work, name), doc=f"StepWork.{name}")


# the step's work and traffic read through the result: result.mfu is result.work.mfu
for _name in StepWork.__dataclass_fields__:
    setattr(SimResult, _name, _work_property(_name))
