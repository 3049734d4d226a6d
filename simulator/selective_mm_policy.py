"""Which matmuls a selective recompute saves: all of them (autopar's runtime) or every other one
(torchtitan's op-level policy of 2024) -- a real difference between two codes (issue 34).

autopar's runtime (runtime/recompute.py ``SAVED_OPS``) saves the output of every mm, addmm, bmm,
baddbmm and fused attention of a selectively checkpointed layer and recomputes the rest.
torchtitan's ``selective_ac_option = "op"`` (pytorch/torchtitan 9dec370, 2024-12-26,
``torchtitan/parallelisms/parallelize_llama.py`` ``_apply_ac_to_transformer_block``: the policy
counts ``aten.mm`` calls per forward of the block and saves "all compute ops, except every second
mm") recomputes the 2nd, 4th, ... ``aten.mm`` of each block forward in backward.  In a Llama block
(wq, wk, wv, wo, w1, w3, w2, in call order; bias-free linears, which dispatch to ``aten.mm``) those
are wk, wo and w3: 37% of the block's linear FLOPs at Llama 3 8B's widths run twice.  The torchtitan
H100 benchmark rows ran this policy (benchmarks/published_runs.py, the AUTOPAR family).

``recomputed_matmuls`` returns the ops the policy reruns; simulator/layer_cost.py prices their
forward once more in backward and keeps their outputs out of the saved activations.
"""
from __future__ import annotations

#: TrainingCode.selective_mm_policy values: "all" saves every matmul, "every_other" reruns every second mm
POLICIES = ("all", "every_other")


def is_plain_mm(op) -> bool:
    """A linear without bias: what ``F.linear`` dispatches to ``aten.mm`` (addmm where a bias is added)."""
    return op.kind == "linear" and not any(str(p).endswith("bias") for p in getattr(op, "params", ()))


def recomputed_matmuls(ops, policy: str) -> frozenset:
    """Names of the layer's matmul ops a selective recompute under ``policy`` reruns (module docstring)."""
    if policy == "all":
        return frozenset()
    if policy != "every_other":
        raise ValueError(f"selective matmul policy {policy!r}: one of {', '.join(POLICIES)}")
    mms = [op.name for op in ops if is_plain_mm(op)]
    return frozenset(mms[1::2])
