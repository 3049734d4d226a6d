"""SimResult: what the simulator says a plan costs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.simulator.memory import MemoryBreakdown


@dataclass
class SimResult:
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    model_flops_per_step: float          # fwd + bwd of the model, whole global batch
    hardware_flops_per_step: float       # + recompute (what Megatron-LM reports)
    tflops_per_gpu: float                # model FLOPs / step / GPUs (the MFU numerator)
    hw_tflops_per_gpu: float
    mfu: float
    max_memory_bytes: float
    memory: list[MemoryBreakdown]        # one per pipeline rank (representative device)
    capacity_bytes: float
    fits: bool                           # device_fits and host_fits
    comm_bytes: dict[str, float]         # bytes sent per step over all devices, by link level
    bubble_fraction: float
    sources: dict[str, int]              # {"measured": n, "estimated": n} cost figures used
    timeline: list[dict[str, Any]] | None = None
    stage_step_s: list[float] = field(default_factory=list)   # when each pipeline rank finishes
    world_size: int = 0
    peak_flops_per_gpu: float = 0.0
    device_fits: bool = True             # every device's total within its memory
    host_fits: bool = True               # every node's offloaded state within its host memory
    host_bytes_per_node: float = 0.0     # offloaded bytes on the node closest to (or past) its limit
    host_capacity_bytes: float = 0.0     # that node's host memory

    def predicted_dict(self) -> dict[str, Any]:
        """The plan.json ``predicted`` block (keys joined with measured.json)."""
        worst = max(range(len(self.memory)), key=lambda i: self.memory[i].total_bytes) if self.memory else 0
        return {
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu,
            "mfu": self.mfu,
            "max_memory_bytes": self.max_memory_bytes,
            "memory_breakdown": self.memory[worst].to_dict() if self.memory else {},
            "memory_per_stage": [m.to_dict() for m in self.memory],
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_capacity_bytes": self.host_capacity_bytes,
            "host_fits": self.host_fits,
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
