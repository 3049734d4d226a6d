"""What a run measured: step times, memory per rank, throughput, losses; measured.json.

The file's keys are defined once, in ``autopar.core.measured`` (``Measured``); this module
takes the measurements and fills it.

* ``step_time_s``: median of the step times after ``warmup_steps`` (the first steps pay for
  allocator growth, lazy initialisation and pipeline shape inference).  On CUDA each step ends
  with ``torch.cuda.synchronize()`` so the wall time covers the queued kernels.
* memory: on CUDA ``torch.cuda.max_memory_allocated`` (the caching allocator's peak of live
  tensors).  On the CPU there is no allocator counter, so it is the growth of the process's
  peak resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``) over the resident size measured
  just before the model was materialised -- parameters, gradients, optimizer state,
  activations and communication buffers, plus allocator slack.  ``memory_kind`` says which.
* ``model_state_bytes_per_rank``: per rank, the bytes of its parameter, gradient and
  optimizer-state shards after the last step (``autopar.runtime.model_state``).
* ``samples_per_s`` = global batch / step time; ``tokens_per_s`` multiplies by the sequence
  length when the graph knows it.
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.core.measured import CPU_RSS_GROWTH, CUDA_ALLOCATED, Measured, RankModelState


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


@dataclass
class MemoryProbe:
    device: torch.device
    baseline_bytes: int = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = 0
        else:
            self.baseline_bytes = current_rss_bytes()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, peak_rss_bytes() - self.baseline_bytes)

    @property
    def kind(self) -> str:
        return CUDA_ALLOCATED if self.device.type == "cuda" else CPU_RSS_GROWTH


@dataclass
class StepClock:
    device: torch.device
    times_s: list[float] = field(default_factory=list)
    _t0: float = 0.0

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        dt = time.perf_counter() - self._t0
        self.times_s.append(dt)
        return dt

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def median_after_warmup(times_s: list[float], warmup_steps: int) -> float:
    kept = times_s[warmup_steps:] or times_s
    return float(statistics.median(kept)) if kept else 0.0


def gather_per_rank(value: int) -> list[int]:
    out = [0] * dist.get_world_size()
    dist.all_gather_object(out, int(value))
    return out


def measured_report(*, step_times_s: list[float], warmup_steps: int, global_batch: int, seq_len: int | None,
                    memory_per_rank_bytes: list[int], memory_kind: str, losses: list[float], fingerprint: str,
                    world_size: int, device: torch.device, plan_file: str, first_step: int,
                    breakdown: dict | None, trace_file: str | None, init_mode: str,
                    model_state_bytes_per_rank: list[dict] | None = None,
                    plan_identity: str | None = None, float8: dict | None = None,
                    val_losses: list[tuple[int, float]] | None = None) -> Measured:
    """The run's ``Measured`` (autopar.core.measured: the schema of measured.json)."""
    step_time_s = median_after_warmup(step_times_s, warmup_steps)
    samples_per_s = global_batch / step_time_s if step_time_s > 0 else 0.0
    state = None if model_state_bytes_per_rank is None else tuple(
        RankModelState(**row) for row in model_state_bytes_per_rank)
    return Measured(
        step_time_s=step_time_s,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * seq_len if seq_len else None,
        max_memory_bytes=max(memory_per_rank_bytes),
        memory_per_rank_bytes=tuple(memory_per_rank_bytes),
        memory_kind=memory_kind,
        losses=tuple(losses),
        step_times_s=tuple(step_times_s),
        warmup_steps=warmup_steps,
        first_step=first_step,
        fingerprint=fingerprint,
        world_size=world_size,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        device_kind=device.type,
        global_batch=global_batch,
        init=init_mode,
        plan=plan_file,
        plan_identity=plan_identity,
        model_state_bytes_per_rank=state,
        **(breakdown or {}),
        trace_file=trace_file or None,
        float8=float8,
        val_losses=tuple((int(s), float(v)) for s, v in val_losses) if val_losses else None,
    )
