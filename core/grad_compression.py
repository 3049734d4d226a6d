"""Gradient compression on the data-parallel reduce: what a plan's ``grad_compression`` names and
where it can run.

* ``none``: gradients cross the wire at the reduce dtype the runtime uses without compression
  (fp32: runtime/apply_dp.py).
* ``bf16`` / ``fp16``: each gradient is rounded to the 16-bit type, reduced in it, and cast back
  (torch's DDP communication hooks ``bf16_compress_hook`` / ``fp16_compress_hook``;
  FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)``).  Half the bytes of fp32; bf16 keeps fp32's
  exponent range, fp16 its 5-bit exponent (FSDP2 and the hook divide before the sum against
  overflow).
* ``powersgd:R``: rank-R PowerSGD with error feedback (Vogels et al. 2019, "PowerSGD: Practical
  Low-Rank Gradient Compression for Distributed Optimization", NeurIPS, Algorithm 1), as torch's
  ``powerSGD_hook`` runs it -- a DDP communication hook only: torch ships no FSDP2 form.  It
  changes the training (a biased compressor whose error feedback keeps what it left out for the
  next step), so the planner uses it only when the user asks (``--grad-compression powersgd:R``).

``compression_problem`` is the one rule of where each runs; the plan's validation, the planner
and the runtime all ask it.  Nothing here imports torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.core import rules

COMPRESSION_KINDS = ("none", "bf16", "fp16", "powersgd")
#: the lossless-enough kinds the planner may choose by itself (the 16-bit casts)
CASTS = ("bf16", "fp16")
#: bytes of one gradient element on the wire under a cast
WIRE_BYTES = {"bf16": 2, "fp16": 2}
#: PowerSGD compresses from this step on; the steps before it all-reduce plainly.  Torch's minimum
#: with error feedback or warm start (``PowerSGDState``: DDP rebuilds its buckets after step 1,
#: which would invalidate the memorised error and P/Q buffers).
POWERSGD_START_ITER = 2
#: torch's ``PowerSGDState`` default: an n x m matrix is compressed only where
#: (n + m) * R * 2 < n * m (``_should_compress``), else all-reduced whole
POWERSGD_MIN_COMPRESSION_RATE = 2
_SPEC = re.compile(r"(none|bf16|fp16)|powersgd:([1-9][0-9]*)")
SPEC_HELP = "none, bf16, fp16 or powersgd:R (R a positive whole number, the approximation rank)"


@dataclass(frozen=True)
class GradCompression:
    """A parsed ``grad_compression`` value: its kind and, for PowerSGD, the rank."""
    kind: str = "none"
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> "GradCompression":
        """ValueError (with what is allowed) when ``text`` is not one of ``SPEC_HELP``."""
        m = _SPEC.fullmatch(str(text).strip().lower())
        if m is None:
            raise ValueError(f"{text!r} is not a gradient compression; use {SPEC_HELP}")
        return cls(m.group(1)) if m.group(1) else cls("powersgd", int(m.group(2)))

    def __str__(self) -> str:
        return f"powersgd:{self.rank}" if self.kind == "powersgd" else self.kind

    @property
    def lossy(self) -> bool:
        """Whether it changes the training beyond a rounding of each gradient (PowerSGD)."""
        return self.kind == "powersgd"


def powersgd_compresses(n: int, m: int, rank: int) -> bool:
    """Whether torch's ``powerSGD_hook`` compresses an n x m gradient matrix at ``rank``
    (``_should_compress`` with the rank capped at min(n, m))."""
    r = min(n, m, rank)
    return (n + m) * r * POWERSGD_MIN_COMPRESSION_RATE < n * m


def compression_problem(spec: str, mesh, zero: int) -> str | None:
    """Why ``spec`` cannot run on a plan of ``mesh`` (core.parallel_dims.ParallelDims) with
    largest ZeRO stage ``zero``, or None.  Compression acts on a gradient reduce, so the plan
    needs more than one rank holding each parameter's replica (dp x cp > 1); PowerSGD needs the
    ``DistributedDataParallel`` path (core/rules.py ``native_data_parallel``: ZeRO-0/1 and no axis
    other than dp), the only one torch gives a hook."""
    try:
        c = GradCompression.parse(spec)
    except ValueError as e:
        return str(e)
    if c.kind == "none":
        return None
    grad_ranks = mesh.grad_degree
    if grad_ranks <= 1:
        return (f"{c} compresses the data-parallel gradient reduce, and this plan has none (dp x cp = 1: every "
                f"rank holds its own gradients)")
    if c.kind == "powersgd":
        kind = rules.native_data_parallel(zero, grad_ranks, mesh.splits_model or mesh.ep > 1)
        if kind not in ("ddp", "zero1"):
            return (f"{c} runs as torch's DDP communication hook (powerSGD_hook), and this plan's data parallelism "
                    f"runs on FSDP2 ({kind}: ZeRO-{zero} or an axis besides dp), for which torch ships no PowerSGD; "
                    f"use bf16 or fp16 there, or a plan with ZeRO-0/1 and only dp")
    return None
