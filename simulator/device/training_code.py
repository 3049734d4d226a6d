"""Which training code runs a priced plan: autopar's runtime, or the code a published run used.

The device's speeds (profiles/*.json) are one half of a price; the other is what the training
code does with them.  Every plan the planner writes is run by autopar's runtime and priced as
``AUTOPAR``.  benchmarks/published_runs.py prices runs made with other code (Megatron-LM of
2021, DeepSpeed ZeRO-3 of 2021, llm-foundry) and describes each with its own ``TrainingCode``.

A ``CostModel`` carries the code it prices (``CostModel.code``), so a price never depends on
module state: two evaluators of the same graph can price two codes side by side.  Each field
names the module that owns its mechanism:

* ``sharded``: how sharded data parallelism gathers parameters (simulator/sharded_dp.py, item 4);
* ``reduce_bytes``: bytes of one gradient element as it is reduced across data parallelism --
  FSDP's reduce-scatter (sharded_dp.py, item 3) and DDP's all-reduce (axes/dp.py
  ``ddp_reduce_bytes``); the runtime reduces in fp32, runtime/apply_dp.py;
* ``p2p``: the pipeline's exchange between stages (simulator/pipeline_p2p.py);
* ``optimizer``: the end of the step around AdamW (simulator/optimizer_step.py);
* ``autocast``: None to run each layer as the runtime does (simulator/autocast.py), or one of
  autocast.py's modes for every layer;
* ``attention_kernel``: the flash-attention kernel a fused attention runs (the profile's
  ``attention_kernels``, simulator/cost_model.py ``fused_attention_s``);
* ``recompute_early_stop``: whether a full recompute stops once it has rebuilt the last tensor the
  layer's backward needs (simulator/layer_cost.py ``_recompute``);
* ``selective_mm_policy``: which matmuls a selective recompute keeps (simulator/selective_mm_policy.py);
* ``cp_attention``: how a context-parallel rank runs attention (simulator/cp_cost.py);
* ``loss_parallel``: whether the loss runs on vocabulary-sharded logits under tp (core/sharding.py);
* ``fused_cross_entropy``: whether a fused kernel leaves out the loss's gradient pair (simulator/memory.py);
* ``expert_load``: the busiest expert's routed tokens over the mean, ep > 1 (simulator/ep_cost.py);
* ``ep_dispatch``: how the routed tokens reach their experts, ep > 1 (simulator/ep_cost.py);
* ``distributed_optimizer``: whether ZeRO-0's optimizer state is sharded over the data-parallel ranks
  (simulator/layer_cost.py ``_data_parallel``);
* ``grad_clip``: whether the run clips the gradients by their global norm (``--grad-clip``,
  runtime/grad_norm.py; its cost: simulator/optimizer_step.py ``grad_clip_time``);
* ``grad_compression``: how the data-parallel gradient reduce is compressed (the plan's
  ``grad_compression``, core/grad_compression.py; its price: simulator/grad_compression.py);
* ``nvme_swap_overlapped``: whether the NVMe tier's reads and writes run beside the step's
  compute or serially in the optimizer step (simulator/axes/nvme_tier.py ``with_tier_stalls``).
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.dtypes import DTYPE_BYTES

from autopar.simulator.step.optimizer_step import TORCH_ADAMW, OptimizerRuntime
from autopar.simulator.axes.pp_p2p import TORCH_PIPELINING, P2PRuntime
from autopar.simulator.axes.sharded_dp import FSDP2, ShardedRuntime

#: the busiest expert's tokens over the mean: Switch Transformer's training capacity factor
#: (Fedus et al. 2022, Sec. 2.2, Table 1); simulator/ep_cost.py prices expert parallelism with it
CAPACITY_FACTOR = 1.25

#: the token dispatchers simulator/ep_cost.py prices (TrainingCode.ep_dispatch)
EP_DISPATCHES = ("all_to_all", "deepep")

#: the attention kernel PyTorch's scaled_dot_product_attention runs for bf16/fp16 on Ampere and
#: Hopper GPUs (its FLASH backend, FlashAttention-2 since PyTorch 2.2): autopar's runtime, and runs
#: that name no other kernel
DEFAULT_ATTENTION_KERNEL = "flash2"


@dataclass(frozen=True)
class TrainingCode:
    """What the training code does that a price depends on (module docstring)."""
    sharded: ShardedRuntime = FSDP2
    #: fp32: runtime/apply_dp.py ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``, and DDP's
    #: buckets of autocast's fp32 gradients
    reduce_bytes: float = float(DTYPE_BYTES["float32"])
    p2p: P2PRuntime = TORCH_PIPELINING
    optimizer: OptimizerRuntime = TORCH_ADAMW
    autocast: str | None = None
    attention_kernel: str = DEFAULT_ATTENTION_KERNEL
    #: non-reentrant ``torch.utils.checkpoint`` (runtime/recompute.py's ``checkpoint_wrapper``,
    #: torch 2.1 on) stops a layer's recompute at its last saved tensor; a reentrant checkpoint
    #: (Megatron-LM's and DeepSpeed's ``CheckpointFunction`` of 2021) reruns the whole forward
    recompute_early_stop: bool = True
    #: which matmul outputs a selective recompute saves (simulator/selective_mm_policy.py): "all"
    #: (runtime/recompute.py) or "every_other" (torchtitan's op-level policy of 2024)
    selective_mm_policy: str = "all"
    #: how a context-parallel rank runs attention (simulator/cp_cost.py): "causal_blocks"
    #: (runtime/apply_cp.py since 2026-11-26 -- each query chunk against its causal key prefix --,
    #: Llama 3's all-gather CP, Dubey et al. 2024 Sec. 3.3.2, and torch's ``context_parallel``:
    #: each rank computes only the causal pairs of its chunks, no mask tensor) or "explicit_mask"
    #: (code that passes the head-tail causal mask as an explicit ``attn_mask``, as autopar's
    #: runtime did before: the kernel computes the whole S/cp x S block and keeps the mask)
    cp_attention: str = "causal_blocks"
    #: the loss runs on logits sharded over the vocabulary under tp (core/sharding.propagate
    #: ``loss_parallel``: torchtitan's default with tp > 1); autopar's runtime gathers them
    loss_parallel: bool = False
    #: a fused cross-entropy kernel computes the loss's gradient in forward into one [tokens, vocab]
    #: fp32 tensor kept for backward (the size of the log-softmax output the ops keep otherwise) and
    #: allocates no gradient pair at the loss's backward (memory.backward_gradient_bytes): Megatron
    #: Bridge's GPT provider (``cross_entropy_loss_fusion = True``, v0.2.0 and v0.5.0
    #: gpt_provider.py) with its performance scripts' ``cross_entropy_fusion_impl = "te"``
    #: (Transformer Engine's ``parallel_cross_entropy``: ``CrossEntropyFunction.forward`` saves the
    #: fp32 ``grad_input`` its Triton kernel writes, backward scales it); autopar's runtime runs the
    #: model's own loss (False)
    fused_cross_entropy: bool = False
    #: the busiest expert's tokens over the mean under expert parallelism (simulator/ep_cost.py
    #: ``expert_work``): Switch Transformer's training capacity factor, CAPACITY_FACTOR above, for
    #: learned routing; 1.0 for code that balances the routing by construction (a benchmark that
    #: forces every expert the same number of tokens)
    expert_load: float = CAPACITY_FACTOR
    #: how the dispatch and combine move tokens (simulator/ep_cost.py ``ep_layer_terms``):
    #: "all_to_all" (one copy per routed expert, an all-to-all of T x k rows: runtime/apply_ep.py,
    #: Megatron-Core's ``alltoall`` dispatcher) or "deepep" (Megatron-Core's ``flex`` dispatcher with
    #: the DeepEP or HybridEP backend: one copy per destination node over the network and one per
    #: destination rank over NVLink, ep_cost.deepep_dispatch_s)
    ep_dispatch: str = "all_to_all"
    #: Megatron-Core's distributed optimizer beside DDP (``use_distributed_optimizer``): the optimizer
    #: state -- fp32 main weights and Adam's moments -- sharded over each parameter's data-parallel
    #: ranks and stepped there, while the gradients still cross the wire once per step (reduce-scatter
    #: and all-gather: one all-reduce's bytes); autopar's runtime shards nothing at ZeRO-0
    distributed_optimizer: bool = False
    grad_clip: bool = False
    grad_compression: str = "none"
    #: the NVMe tier's read and write overlap the step's forward, backward and recompute
    #: (simulator/axes/nvme_tier.py): autopar's runtime reads ahead from the end of the forward and
    #: writes back in a background thread while the next step computes (runtime/nvme_tier.py).
    #: False: code that swaps the optimizer state in and out inside its optimizer step, one
    #: sub-group after another, each read and write waited for -- DeepSpeed's ZeRO-Infinity
    #: optimizer swapper with ``offload_optimizer`` ``pipeline_read`` and ``pipeline_write`` at
    #: their default, false ("For tile-based optimizer step processing, overlap read of next tile
    #: with computation of current tile", deepspeedai/DeepSpeed
    #: deepspeed/runtime/zero/offload_config.py ``DeepSpeedZeroOffloadOptimizerConfig``)
    nvme_swap_overlapped: bool = True

    def __post_init__(self):
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ValueError(f"TrainingCode.ep_dispatch {self.ep_dispatch!r}: one of {EP_DISPATCHES}")


#: autopar's runtime (runtime/): what every plan the planner writes is priced as
AUTOPAR = TrainingCode()
