"""Which ops move fp32 bytes when a bf16/fp16 step runs under ``torch.autocast``.

Under autocast the parameters stay fp32 and each op picks its dtype (PyTorch, "Automatic Mixed
Precision package - torch.amp", op reference): matmuls, linears, convolutions and attention run
in the low precision (the "autocast to lower precision" list); normalisations, softmax,
log-softmax and the losses run in fp32 (the "autocast to float32" list); every other op runs in
its inputs' dtype.  With fp32 parameters the embedding's output is fp32, and so is the residual
stream the blocks add their (low-precision) outputs to.  So the memory-bound ops that a
``bf16`` price would count at 2 bytes an element move 4: norms, softmax, losses, residual adds
and embeddings; activation functions applied to a linear's output stay in its low precision.

When it applies (``autocast_mode``), as the runtime runs a plan (runtime/parallelize.py,
``autocast_dtype``; runtime/apply_dp.py, ``data_parallel_kind``): a bf16/fp16 plan whose data
parallelism is DDP or ZeRO-1 without tensor or pipeline parallelism, or with one data-parallel
rank, runs under autocast with fp32 parameters; FSDP2 (ZeRO-2/3, and ZeRO-0/1 with tensor or
pipeline parallelism, which run on FSDP2's machinery) holds low-precision parameters
(``MixedPrecisionPolicy(param_dtype=...)``) without autocast, and nothing changes.

The residual stream is recognised as the elementwise ``add`` ops; adds applied to a linear's
output (rotary embeddings) are counted in fp32 too, an over-count of those few ops.

The cost model's training code may name one mode for every layer (``TrainingCode.autocast``,
simulator/training_code.py) to price a run that was made otherwise (benchmarks/published_runs.py:
llm-foundry's FSDP runs under composer's ``amp_bf16``, autocast with fp32 -- DEFAULT -- or
bf16 -- PURE -- parameters).
"""
from __future__ import annotations

OFF, FP32_PARAMS, LOW_PARAMS = "off", "fp32_params", "low_params"

#: op kinds on autocast's float32 list (normalisation, softmax and log-softmax, losses)
FP32_KINDS = frozenset({"norm", "softmax", "loss"})


def autocast_mode(zero: int, mesh, precision: str, override: str | None = None) -> str:
    """How the runtime runs a layer of a plan: autocast with fp32 parameters, or not (see module doc).
    ``mesh``: the plan's ParallelDims (core/parallel_dims.py); ``override``: one mode for every
    layer (``TrainingCode.autocast``), None for the runtime's choice."""
    if override is not None:
        return override
    if precision not in ("bf16", "fp16"):
        return OFF
    if zero >= 2 or (mesh.dp > 1 and mesh.splits_model):
        return OFF
    return FP32_PARAMS


def bytes_factor(kind: str, variant: str | None, mode: str) -> float:
    """Bytes an op moves over those of its low-precision price: 2.0 where it runs in fp32."""
    if mode == OFF:
        return 1.0
    if kind in FP32_KINDS:
        return 2.0
    if mode == FP32_PARAMS and (kind == "embedding" or (kind == "elementwise" and variant == "add")):
        return 2.0
    return 1.0
