"""What the end of a training step costs besides AdamW's own state, by the code that ran it.

``CostModel.optimizer_time`` prices AdamW as memory bound over its state: per parameter it reads
the parameter, the gradient, m and v and writes the parameter, m and v (28 bytes in fp32; Kingma &
Ba 2015, Alg. 1).  That is the whole step of autopar's runtime (``torch.optim.AdamW`` on the
parameters the runtime trains), whose data-parallel gradient all-reduce (DDP) overlaps the
backward.  Mixed-precision training code with separate fp16 model weights and fp32 main weights
runs more element-wise passes at the end of the step, each as bound by HBM as AdamW, and older
code synchronises gradients only after the last backward:

``MEGATRON_FP16_2021``: Megatron-LM of April 2021 (NVIDIA/Megatron-LM 9ec547c9ff), the code of the
PTD-P rows of Narayanan et al. 2021, run with ``--fp16`` (fp16 model weights and gradients, fp32
main weights; ``--accumulate-allreduce-grads-in-fp32`` and ``--use-contiguous-buffers-in-ddp`` are
off by default, so the gradients are fp16 and Megatron's DDP keeps no contiguous buffer).  The
paper's run scripts name 6985e58938 (August 2021, ``examples/sc21/README.md``); between the two the
passes below are unchanged (that version also frees each fp16 gradient once copied, which saves
memory, not time):

* ``megatron/training.py`` ``train_step``: ``forward_backward_func`` runs the whole pipeline, then
  ``allreduce_gradients()`` of Megatron's own DDP (``--DDP-impl local``, the default) -- nothing
  overlaps it (``sync_after_flush``).  ``megatron/model/distributed.py``: with no contiguous
  buffer it flattens the fp16 gradients into one tensor (read 2 bytes a parameter, write 2),
  divides it by the data-parallel size in place (2 + 2), all-reduces it and copies it back into
  the gradients (2 + 2);
* ``megatron/optimizer/optimizer.py`` ``Float16OptimizerWithFloat16Params.step``:
  ``_copy_model_grads_to_main_grads``, ``main_grad.float()`` (read 2, write 4);
  ``_unscale_main_grads_and_check_for_nan``, ``torch._amp_foreach_non_finite_check_and_unscale_``
  on the fp32 main gradients in place (4 + 4); ``clip_grad_norm_fp32`` (``--clip-grad`` 1.0 in its
  GPT examples), ``amp_C.multi_tensor_l2norm`` over them (read 4; the scaling pass that follows
  only when the norm exceeds the threshold is not priced); apex ``FusedAdam`` over the fp32 main
  weights (AdamW's 28); ``_copy_main_params_to_model_params``, ``amp_C.multi_tensor_scale`` by 1.0
  from fp32 main to fp16 model weights (read 4, write 2).

12 + 24 = 36 bytes a parameter beyond AdamW's 28.

``MEGATRON_FP16_TORCH_DDP_2021``: the same code run with ``--DDP-impl torch``, as Megatron-LM's
scripts for the paper's Table 1 run its models without pipeline parallelism (NVIDIA/Megatron-LM
6985e58938, ``examples/sc21/run_table_1.sh``, ``DDP=torch`` for 1.7B-18B).  ``megatron/training.py``
then wraps the model in ``torch.nn.parallel.DistributedDataParallel`` and skips its own
``allreduce_gradients()``; ``megatron/schedules.py`` runs every micro-batch but the last under
``no_sync()``, so the all-reduce runs in DDP's buckets during the last backward, overlapped with
it (Li et al. 2020, "PyTorch Distributed", Sec. 3.2.3).  DDP copies each fp16 gradient into its
bucket, divides the bucket by the group size and copies it back (``gradient_as_bucket_view`` off
by default): the same 12 bytes a parameter as the local DDP's flatten, divide and copy-back, on
the compute stream, so the extra bytes are the same 36; only ``sync_after_flush`` differs.

In both, the found-inf and grad-norm all-reduces over the model-parallel group move one number
each, and the tied-embedding all-reduce between the first and the last stage is small beside the
step (docs/validation.md); neither is priced.

Which one is priced is the cost model's training code (``TrainingCode.optimizer``,
simulator/training_code.py): ``TORCH_ADAMW`` for every plan the planner writes;
benchmarks/published_runs.py prices the PTD-P rows with ``MEGATRON_FP16_2021``.
``simulator/layer_cost.py`` applies ``sync_after_flush`` by moving a
layer's DDP all-reduce into the step's serial tail (the optimizer column, which the step model
adds after each pipeline rank's last backward).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class OptimizerRuntime:
    """The end of the step of one training code (module docstring)."""
    name: str
    #: bytes per parameter read and written by element-wise passes at the end of the step besides
    #: AdamW's own state
    extra_bytes_per_param: float
    #: the data-parallel gradient all-reduce runs after the last backward, not overlapped with it
    sync_after_flush: bool = False


TORCH_ADAMW = OptimizerRuntime("torch.optim.AdamW", 0.0)
MEGATRON_FP16_2021 = OptimizerRuntime("Megatron-LM 2021: local DDP after the flush, fp16 optimizer",
                                      (2 + 2) + (2 + 2) + (2 + 2)             # flatten, divide, copy back
                                      + (2 + 4) + (4 + 4) + 4 + (4 + 2),     # grad copy, unscale, norm, weight copy
                                      sync_after_flush=True)
MEGATRON_FP16_TORCH_DDP_2021 = replace(MEGATRON_FP16_2021,
                                       name="Megatron-LM 2021 with torch DDP: overlapped all-reduce, fp16 optimizer",
                                       sync_after_flush=False)


# ---------------------------------------------------------------------------- gradient clipping
#: ``--grad-clip`` as autopar's runtime runs it (runtime/grad_norm.py), per gradient element this
#: rank holds: one read for the norm (``torch._foreach_norm``, as torch.nn.utils.get_total_norm),
#: then a read and a write for the scaling (``torch._foreach_mul_`` by the clamped coefficient,
#: applied whether or not the norm exceeds the threshold: torch.nn.utils.clip_grads_with_norm_
#: avoids a host-side branch, and so does the runtime)
GRAD_CLIP_PASSES = 3
#: the all-reduced value: the sum of the squares, one fp32 scalar
GRAD_NORM_BYTES = 4


def grad_clip_pass_time(cm, grad_elements: float, grad_bytes_per_element: float) -> float:
    """Seconds of the clip's ``GRAD_CLIP_PASSES`` memory-bound passes over ``grad_elements``
    gradient elements on one rank: bytes over the achievable HBM bandwidth, as
    ``CostModel.optimizer_time`` prices AdamW."""
    return GRAD_CLIP_PASSES * grad_elements * grad_bytes_per_element / cm.achievable_memory_Bps


def grad_norm_allreduce_time(cm, world_size: int, link, level: str = "intra") -> float:
    """Seconds of the one all-reduce of ``GRAD_NORM_BYTES`` over every rank that the runtime issues
    per clipped step (``cm.collective_time`` over ``link``: for a scalar, its latency term)."""
    return cm.collective_time("all_reduce", GRAD_NORM_BYTES, world_size, link, level)


def grad_clip_time(cm, grad_elements: float, grad_bytes_per_element: float, world_size: int, link,
                   level: str = "intra") -> float:
    """Seconds the gradient clip adds to a step on one rank: its passes over the ``grad_elements``
    gradient elements it holds (``grad_clip_pass_time``) plus the norm's all-reduce over every rank
    (``grad_norm_allreduce_time``).  A plan priced with clipping (``TrainingCode.grad_clip``) has
    the passes in each layer's optimizer column (simulator/layer_cost.py) and the all-reduce once
    per pipeline rank after its last backward (simulator/axes/dp_sync.py ``after_backward``)."""
    return (grad_clip_pass_time(cm, grad_elements, grad_bytes_per_element)
            + grad_norm_allreduce_time(cm, world_size, link, level))
