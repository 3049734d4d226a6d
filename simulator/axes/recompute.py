"""What a selective recompute saves: all matmuls and all collectives (autopar's runtime), or
every other matmul and the reduce-scatters (torchtitan's op-level policy of 2024) -- a real
difference between two codes, in the matmuls and in the collectives.

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

from dataclasses import dataclass

from autopar.core.plan import LayerPlan
from autopar.simulator.device.cost_model import CostModel

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


@dataclass
class Recompute:
    recompute_s: float                     # the forward rerun inside backward (full: with its tp collectives)
    recompute_flops: float
    activation_bytes: float                # kept for backward per micro-batch
    transient_bytes: float                 # materialised again during this layer's backward
    tp_s: float = 0.0                      # the tp collectives in recompute_s
    tp_wire: float = 0.0                   # ... the bytes this device sends for them
    tp_meetings: int = 0                   # ... where the ranks meet


def recompute(lp: LayerPlan, w: "OpWork", tpc: "TensorParallelComm", layer_input_bytes: float,
               cm: CostModel) -> Recompute:
    """Recompute (Chen et al. 2016; Korthikanti et al. 2022, Sec. 5): "full" keeps the layer's
    input and reruns its forward with its collectives; "selective" keeps the matmul outputs and
    the outputs of the collectives the code's policy saves (``selective_saved_bytes``), and reruns
    the cheap ops between them, context parallelism's K/V all-gather and the collectives the
    policy does not save (``TensorParallelComm.selective_fwd_s``).  Adjusts ``w``: a
    checkpointed forward keeps nothing, and the checkpoint wrapper costs per op (profiling/overheads.py: saved-tensor hooks; the
    selective policy's dispatch mode on every op).

    A full recompute by non-reentrant ``torch.utils.checkpoint`` (``cm.code.recompute_early_stop``)
    stops once it has rebuilt the last tensor the forward saved for backward: its recomputation
    hook counts the tensors packed and raises ``_StopRecomputationError`` at the last
    (torch/utils/checkpoint.py, ``_recomputation_hook``; on by default since PyTorch 2.1,
    pytorch/pytorch PR #96866, "Make early stop the default for checkpoint").  So the ops after a
    wrapped module's last saving op never rerun, nor does that op's kernel where it saves only its
    inputs (SAVES_INPUTS_ONLY): in a transformer block the MLP's output projection and the residual
    add after it -- a third of the block's matmul FLOPs at an MLP ratio of 4.  A reentrant
    checkpoint (an ``autograd.Function`` that reruns the forward under ``enable_grad``) has no such
    stop."""
    saved = w.saved_bytes
    if lp.recompute == "full":
        # (the skipped figures are zero where the recompute does not stop early: compute_layer_cost)
        tp_s = tpc.fwd_s - tpc.skipped_fwd_s
        out = Recompute(w.fwd_s - w.early_stop_skipped_s + tp_s, w.fwd_flops - w.early_stop_skipped_flops,
                         min(saved, layer_input_bytes) if saved > 0 else layer_input_bytes, saved,
                         tp_s=tp_s, tp_wire=tpc.wire_fwd - tpc.skipped_wire,
                         tp_meetings=tpc.fwd_meetings - tpc.skipped_meetings)
        w.fwd_s -= w.autograd_kept_s       # the checkpointed forward keeps nothing: its outputs are freed
    elif lp.recompute == "selective":
        # the matmuls the code's policy does not save rerun too (simulator/selective_mm_policy.py)
        # the kept collectives' outputs on top: the checkpoint's cache holds them whether or not
        # autograd would keep them without recompute (an all-reduced output feeds a residual add,
        # which keeps nothing)
        activation = (min(saved, layer_input_bytes + w.matmul_output_bytes - w.rerun_mm_output_bytes)
                      + tpc.selective_saved_bytes)
        out = Recompute(w.cheap_fwd_s + w.rerun_mm_fwd_s + tpc.selective_fwd_s,
                         w.cheap_fwd_flops + w.rerun_mm_fwd_flops, activation, max(0.0, saved - activation),
                         tp_s=tpc.selective_fwd_s, tp_wire=tpc.selective_wire, tp_meetings=tpc.selective_meetings)
    else:
        out = Recompute(0.0, 0.0, saved, 0.0)
    if lp.recompute in ("full", "selective"):
        w.fwd_s += w.priced_ops * cm.overhead(f"recompute_{lp.recompute}_fwd_per_op_s")
        w.bwd_s += w.priced_ops * cm.overhead(f"recompute_{lp.recompute}_bwd_per_op_s")
    return out
