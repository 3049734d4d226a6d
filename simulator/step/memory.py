"""Per-device memory: model state by precision and ZeRO stage, activations by schedule.

Model state (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and 5): mixed-precision Adam keeps
2 bytes of fp16/bf16 parameters, 2 bytes of gradients and 12 bytes of optimizer state (fp32
master copy, momentum and variance) per parameter; fp32 training keeps 4 + 4 + 8.  ZeRO-1
divides the optimizer state by the data-parallel degree, ZeRO-2 also the gradients, ZeRO-3
also the parameters.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Sec. 4-5): what each layer keeps for backward, per micro-batch, times the micro-batches
in flight on the stage: GPipe keeps all m (Huang et al. 2019); 1F1B keeps at most p - r on
pipeline rank r (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Sec. 2.2.1); the interleaved schedule keeps
min(2(p - r - 1) + (v - 1)p + 1, m v) model chunks in flight on rank r (the warm-up depth of
its schedule, Sec. 2.2.2), i.e. p + (p - 1)/v stages' worth on the first rank.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from autopar.core.dtypes import DTYPE_BYTES, PRECISION_BYTES
from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES
from autopar.simulator.axes.pp_zero_bubble import inflight_chunks

#: bytes per parameter (params, grads, optimizer) -- ZeRO Sec. 3.1 (mixed: 16-bit parameters and
#: gradients, an fp32 master copy and Adam's two moments) and Adam in fp32 (two moments); element
#: sizes from core/dtypes.py
_F32, _LOW = float(DTYPE_BYTES["float32"]), float(PRECISION_BYTES["bf16"])
STATE_BYTES = {"mixed": (_LOW, _LOW, 3 * _F32), "fp32": (_F32, _F32, 2 * _F32)}

#: PyTorch DDP default bucket size (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25);
#: two buckets are in flight at once (one reducing, one filling).
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_BUCKETS_IN_FLIGHT = 2


def precision_class(precision: str) -> str:
    return "fp32" if precision == "fp32" else "mixed"


def state_bytes(num_params: float, precision: str, zero: int, dp: int,
                trainable: float | None = None) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes on one device for ``num_params`` tp-local parameters, of
    which ``trainable`` (default: all) require grad: a frozen parameter (requires_grad=False)
    has no gradient and no optimizer state -- in mixed precision no fp32 master copy either,
    which ZeRO's 12 bytes include (Sec. 3.1)."""
    p, g, o = STATE_BYTES[precision_class(precision)]
    dp = max(1, dp)
    t = num_params if trainable is None else trainable
    return (num_params * p / (dp if zero >= 3 else 1),
            t * g / (dp if zero >= 2 else 1),
            t * o / (dp if zero >= 1 else 1))


def inflight_microbatches(schedule: str, pp: int, stage_rank: int, num_microbatches: int,
                          virtual_stages: int = 1) -> int:
    """Micro-batches (model chunks for the schedules with several per rank) whose activations rank
    ``stage_rank`` holds at peak (the split-backward schedules: pipeline_zero_bubble.inflight_chunks)."""
    m, p, r, v = num_microbatches, pp, stage_rank, max(1, virtual_stages)
    if p == 1:
        return 1                     # no pipeline: micro-batches are accumulation steps, one at a time
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        return inflight_chunks(schedule, p, r, m, v)
    return min(p - r, m)                                   # 1F1B


def ddp_bucket_bytes(grad_bytes):
    """DDP's gradient buckets in flight on a device that holds ``grad_bytes`` of gradients."""
    return np.minimum(DDP_BUCKETS_IN_FLIGHT * DDP_BUCKET_BYTES, grad_bytes)


def fsdp_buffer_bytes(param_buffer_bytes, grad_buffer_bytes):
    """FSDP's unsharded buffers: the layer being computed and the one prefetched hold their full
    parameters, and the layer being reduce-scattered its full gradient (Zhao et al. 2023,
    "PyTorch FSDP", Sec. 3.3)."""
    return 2.0 * param_buffer_bytes + grad_buffer_bytes


def backward_gradient_bytes(ops, local_output_bytes) -> float:
    """The largest pair of gradients one op's backward holds at once in a layer: the gradient of
    its output, which autograd's engine passes in and frees only once the op's backward function
    returns (torch/csrc/autograd/engine.cpp, ``Engine::evaluate_function`` calls the node with its
    moved ``InputBuffer``), and the gradients of its inputs that the function allocates (e.g.
    ``_log_softmax_backward_data`` writes a new [tokens, vocab] tensor; ``_to_copy``'s backward a
    copy in the input's dtype).  Both are live on top of the tensors still saved for backward, so
    they add to the layer's transient: at the loss over a large vocabulary, the gradients of the
    fp32 log-probabilities and of the fp32 logits, two [tokens, vocab] fp32 tensors beside the
    saved log-probabilities.  ``ops``: the layer's ops; ``local_output_bytes(op)``: an op's output
    bytes on this device (micro-batch, precision and shards applied).  Views allocate nothing
    (their backward reshapes the gradient), and ops that do not require grad have no backward."""
    by_name = {o.name: o for o in ops}
    best = 0.0
    for o in ops:
        if o.kind == "view" or not getattr(o, "requires_grad", True):
            continue
        grad_in = sum(local_output_bytes(by_name[i]) for i in set(o.inputs)
                      if i in by_name and getattr(by_name[i], "requires_grad", True))
        best = max(best, local_output_bytes(o) + grad_in)
    return best


def p2p_buffer_bytes(boundary_bytes):
    """A pipeline stage's send and receive buffers of one micro-batch's boundary activation."""
    return 2.0 * boundary_bytes


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device of a pipeline stage at its peak (host_bytes: offloaded state)."""
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    comm_buffer_bytes: float
    total_bytes: float
    host_bytes: float = 0.0

    @classmethod
    def of(cls, params: float, grads: float, optimizer: float, activations: float, buffers: float,
           host: float = 0.0) -> "MemoryBreakdown":
        return cls(params, grads, optimizer, activations, buffers,
                   params + grads + optimizer + activations + buffers, host)

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


def stage_memory(*, params, grads, optimizer, host, activation_per_chunk, transient_max, inflight,
                 num_chunks: int, ddp_active, grad_bytes_total, fsdp_param_buffer_max, fsdp_grad_buffer_max,
                 p2p_bytes) -> tuple[np.ndarray, ...]:
    """Each pipeline rank's bytes from sums over its layers (numpy arrays of floats, one entry per
    rank): (params, grads, optimizer, activations, buffers, total, host), the fields of
    MemoryBreakdown, as arrays of the same length.

    ``activation_per_chunk`` (chunks x ranks): bytes one micro-batch keeps in each model chunk;
    ``inflight`` is in chunk units for interleaved schedules, so the mean chunk stands for
    each.  ``transient_max``: the largest extra a recomputed layer materialises during its
    backward (its full activations).
    """
    acts = np.asarray(activation_per_chunk, dtype=float)
    per_mb = acts.mean(axis=0) if num_chunks > 1 else acts[0]
    activations = per_mb * np.asarray(inflight, dtype=float) + transient_max
    fsdp = fsdp_buffer_bytes(fsdp_param_buffer_max, fsdp_grad_buffer_max)
    if np.count_nonzero(ddp_active):          # (count_nonzero: a cheaper any)
        buffers = np.where(ddp_active, ddp_bucket_bytes(grad_bytes_total), 0.0) + fsdp + p2p_buffer_bytes(p2p_bytes)
    else:
        buffers = fsdp + p2p_buffer_bytes(p2p_bytes)
    total = params + grads + optimizer + activations + buffers
    return params, grads, optimizer, activations, buffers, total, host
