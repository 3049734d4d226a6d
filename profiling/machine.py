"""A description of the machine a profile was measured on (stored in the profile's ``machine``)."""
from __future__ import annotations

import os
import platform
import shlex
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe(device: torch.device, world_size: int, backend: str | None) -> dict:
    d = {
        "cpu_model": cpu_model(),
        "num_cpu_cores": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "host_memory_bytes": host_memory_bytes(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device_type": device.type,
        "world_size": world_size,
        "backend": backend,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        d.update({"gpu_name": props.name, "gpu_memory_bytes": int(props.total_memory),
                  "gpu_count": torch.cuda.device_count(), "cuda_version": torch.version.cuda,
                  "compute_capability": f"{props.major}.{props.minor}"})
    return d


def command_line(args: list[str]) -> str:
    """The command that reproduces this run: the environment that matters, the launcher, ``args``."""
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in os.environ)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        local = os.environ.get("LOCAL_WORLD_SIZE", str(world))
        nnodes = world // max(1, int(local))
        launcher = f"torchrun --nproc-per-node {local}" + (f" --nnodes {nnodes}" if nnodes > 1 else "") + " -m autopar.cli"
    else:
        launcher = "autopar"
    return " ".join(x for x in (env, launcher, shlex.join(args)) if x)
