"""What a selective recompute saves: all matmuls and all collectives (autopar's runtime), or
every other matmul and the reduce-scatters (torchtitan's op-level policy of 2024) -- a real
difference between two codes (issue 34; the collectives: issue 36).

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

The layer's forward collectives.  autopar's runtime saves the outputs of tensor parallelism's
all-reduces, reduce-scatters and all-gathers and of expert parallelism's dispatch and combine
all-to-alls (runtime/recompute.py ``SAVED_COLLECTIVES``), so its rerun issues none of them
again.  torchtitan 9dec370's ``_save_list`` holds ``_c10d_functional.reduce_scatter_tensor`` and
no other collective: its tensor parallelism is always sequence-parallel (``apply_tp``:
``SequenceParallel`` norms, ``PrepareModuleInput`` from ``Shard(1)``), so the reduce-scatter
after each row-wise linear is kept and the all-gather before each column-wise block reruns in
backward.  ``saves_collective`` says which kinds a policy keeps; simulator/layer_cost.py adds a
kept collective's output on the device (``collective_output_bytes``) to the layer's saved
activations and prices a rerun one's time in backward.  Both codes rerun context parallelism's
K/V all-gather (runtime/recompute.py, module docstring; torchtitan's is inside its attention
op), priced in backward by simulator/layer_cost.py.
"""
from __future__ import annotations

#: TrainingCode.selective_mm_policy values: "all" saves every matmul, "every_other" reruns every second mm
POLICIES = ("all", "every_other")
#: the forward collectives (core/sharding.py TPCollective kinds, and expert parallelism's
#: "all_to_all") whose outputs each policy saves (module docstring)
SAVED_COLLECTIVES = {"all": frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}),
                     "every_other": frozenset({"reduce_scatter"})}


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


def saves_collective(kind: str, policy: str) -> bool:
    """Whether a selective recompute under ``policy`` keeps the output of a forward collective of
    ``kind`` (else it reruns the collective in backward)."""
    if policy not in SAVED_COLLECTIVES:
        raise ValueError(f"selective matmul policy {policy!r}: one of {', '.join(POLICIES)}")
    return kind in SAVED_COLLECTIVES[policy]


def collective_output_bytes(kind: str, full_bytes: float, group: int) -> float:
    """Bytes of a collective's output on one rank, from the full tensor it carries (TPCollective
    ``bytes``): an all-reduce's and an all-gather's output is the full tensor, a reduce-scatter's
    the rank's 1/group of it; an all-to-all's ``full_bytes`` is the rank's own buffer, the
    rows it receives as many as it sends."""
    if kind == "reduce_scatter":
        return full_bytes / group
    if kind in ("all_reduce", "all_gather", "all_to_all"):
        return float(full_bytes)
    raise ValueError(f"collective kind {kind!r}")
