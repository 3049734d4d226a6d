"""What an optimizer step moves through device memory besides AdamW's own state, by the code that ran it.

``CostModel.optimizer_time`` prices AdamW as memory bound over its state: per parameter it reads
the parameter, the gradient, m and v and writes the parameter, m and v (28 bytes in fp32; Kingma &
Ba 2015, Alg. 1).  That is the whole step of autopar's runtime (``torch.optim.AdamW`` on the
parameters the runtime trains).  Mixed-precision training code with separate fp16 model weights
and fp32 main weights runs more element-wise passes around it, each as bound by HBM as AdamW:

``MEGATRON_FP16_2021``: Megatron-LM of April 2021 (NVIDIA/Megatron-LM 9ec547c9ff,
``megatron/optimizer/optimizer.py``, ``Float16OptimizerWithFloat16Params.step``), the code of the
PTD-P rows of Narayanan et al. 2021, run with ``--fp16`` (fp16 model weights and gradients, fp32
main weights; ``--accumulate-allreduce-grads-in-fp32`` is off by default, so the model's gradient
buffers are fp16), per parameter:

* ``_copy_model_grads_to_main_grads``: ``main_grad.float()`` -- read 2 bytes, write 4;
* ``_unscale_main_grads_and_check_for_nan``: ``torch._amp_foreach_non_finite_check_and_unscale_``
  on the fp32 main gradients in place -- read 4, write 4;
* ``clip_grad_norm_fp32`` (``--clip-grad`` 1.0 in its GPT examples): ``amp_C.multi_tensor_l2norm``
  over the main gradients -- read 4 (the scaling pass that follows only when the norm exceeds the
  threshold is not priced);
* ``_copy_main_params_to_model_params``: ``amp_C.multi_tensor_scale`` by 1.0 from fp32 main to
  fp16 model weights -- read 4, write 2.

24 bytes a parameter beyond AdamW's 28 (apex ``FusedAdam`` over the fp32 main weights).  The
found-inf and grad-norm all-reduces over the model-parallel group move one number each and are
not priced.

``RUNTIME`` is what the simulator prices; it stays ``TORCH_ADAMW`` for every plan the planner
writes, and benchmarks/published_runs.py sets it per row, as it sets sharded_dp.RUNTIME and
pipeline_p2p.RUNTIME.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerRuntime:
    """The optimizer step of one training code (module docstring)."""
    name: str
    #: bytes per parameter read and written by element-wise passes besides AdamW's own state
    extra_bytes_per_param: float


TORCH_ADAMW = OptimizerRuntime("torch.optim.AdamW", 0.0)
MEGATRON_FP16_2021 = OptimizerRuntime("Megatron-LM 2021 fp16 optimizer (Float16OptimizerWithFloat16Params)",
                                      2 + 4 + 4 + 4 + 4 + 4 + 2)
#: the optimizer step priced; TORCH_ADAMW unless a caller prices a run made otherwise
RUNTIME: OptimizerRuntime = TORCH_ADAMW
