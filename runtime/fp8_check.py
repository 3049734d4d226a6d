"""Refuse, before launch, a plan that asks for float8 linears where they cannot run.

Float8 GEMMs need fp8 tensor cores: NVIDIA compute capability 8.9 (Ada) or 9.0 (Hopper) and
later (``torch._scaled_mm`` refuses older devices; NVIDIA H100 datasheet: FP8 Tensor Core).
The CPU has none.  The conversion itself is torchao's (``autopar[fp8]``; runtime/apply_fp8.py),
so a machine without torchao is refused too, naming the install command.  Both before any
process starts (``autopar run`` checks the plan before launching torchrun), exit 2.
"""
from __future__ import annotations

from pathlib import Path

import torch

from autopar.core.errors import PlanFileError
from autopar.core.plan import Plan

FP8_MIN_CAPABILITY = (8, 9)     # Ada / Hopper: first NVIDIA devices with fp8 tensor cores


def device_fp8_support() -> tuple[bool, str]:
    """(whether this machine's accelerator has fp8 tensor cores, what it is)."""
    if not torch.cuda.is_available():
        return False, "this machine has no CUDA device (the CPU has no fp8 matrix units)"
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if cap < FP8_MIN_CAPABILITY:
        return False, f"its GPU, {name}, has compute capability {cap[0]}.{cap[1]} (fp8 needs 8.9 or later)"
    return True, name


def check_fp8(plan: Plan, plan_path: Path) -> None:
    """PlanFileError (exit 2) when some layer asks for fp8 and this machine or install cannot run it."""
    layers = [lp.layer for lp in plan.layers if lp.precision == "fp8"]
    if not layers:
        return
    where = f"plan file {plan_path}: layers {layers[:8]}{' ...' if len(layers) > 8 else ''} ask for precision fp8"
    ok, what = device_fp8_support()
    if not ok:
        raise PlanFileError(f"{where}, but {what}. Plan again without float8 (--precision bf16), or run on "
                            f"Hopper-class GPUs.")
    from autopar.runtime.apply_fp8 import INSTALL_HINT, torchao_available

    if not torchao_available():
        raise PlanFileError(f"{where}, but torchao, which trains the float8 linears, is not installed. Install it "
                            f"with '{INSTALL_HINT}', or plan again with --precision bf16.")

