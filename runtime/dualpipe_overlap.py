"""DualPipeV's forward-backward pairs with the expert all-to-alls overlapped.

torch 2.13's ``ScheduleDualPipeV`` pairs, on each rank, the forward of one model chunk with the
full backward of the other as one ``OVERLAP_F_B`` action and, unless a function is registered
for that action (``register_custom_function``), runs the pair's two actions one after the other.
DeepSeek-V3's DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 3.2.1, Fig. 4)
runs them so that each one's expert-parallel dispatch and combine all-to-alls are hidden behind
the other's compute.  ``OverlappedPairs`` is that function: it waits for the pair's received
activation and gradient as torch's own runtime does (``_PipelineScheduleRuntime._step_microbatches``),
then runs the stage's ``forward_one_chunk`` (and the loss on the last stage) and the other stage's
``backward_one_chunk`` in turns on two threads (runtime/turns.py), handing over where expert
parallelism has launched an all-to-all (runtime/apply_ep.py ``route_rows``), and hands the
outputs to the rank's neighbouring stage as torch does for the V's local stages.  torchtitan ran
DualPipeV's pairs on two threads meeting at barriers around its MoE dispatch and combine
(torchtitan/distributed/dual_pipe_v.py, 2025; removed in 2026); here exactly one pass runs at a
time, so every rank launches its collectives in one fixed order.
"""
from __future__ import annotations

import torch
from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B, _wait_batch_p2p

from autopar.runtime.turns import Turns


class OverlappedPairs:
    """The ``OVERLAP_F_B`` function (module docstring); ``pairs`` and ``handovers`` count what it
    ran: pairs, and hand-overs between a pair's passes at an all-to-all."""

    def __init__(self) -> None:
        self.pairs = 0
        self.handovers = 0

    def __call__(self, action, ctx) -> None:
        schedule = ctx.schedule_ref
        stages = {stage.stage_index: stage for stage in schedule._stages}
        fwd, bwd = action.sub_actions
        if (fwd.computation_type, bwd.computation_type) != (FORWARD, FULL_BACKWARD) or \
                fwd.stage_index == bwd.stage_index:
            raise AssertionError(f"DualPipeV pair {action} is not a forward and another stage's full backward")
        f_stage, b_stage = stages[fwd.stage_index], stages[bwd.stage_index]
        f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
        # what torch's runtime waits for before each compute action: the activation from the
        # previous rank, the gradient from the next (none from a stage on this rank: the V)
        if not f_stage.is_first and fwd.stage_index - 1 not in stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
        if not b_stage.is_last and bwd.stage_index + 1 not in stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
        schedule._assert_unsharded(f_stage)
        schedule._assert_unsharded(b_stage)

        def forward() -> None:
            output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb])
            schedule._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
            if fwd.stage_index + 1 in stages:
                stages[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)

        def backward() -> None:
            loss = schedule._maybe_get_loss(b_stage, b_mb)
            schedule.backward_counter[bwd.stage_index] += 1
            last = schedule.backward_counter[bwd.stage_index] == schedule._n_microbatches
            b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)
            if bwd.stage_index - 1 in stages:
                stages[bwd.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb), b_mb)

        turns = Turns()
        turns.run(forward, backward, _same_stream())
        self.pairs += 1
        self.handovers += turns.handovers


def _same_stream():
    """On an accelerator, the backward thread's current stream set to the forward's (a thread
    starts on the default stream); nothing on the CPU."""
    accel = torch.accelerator.current_accelerator()
    if accel is None:
        return lambda: None
    stream = torch.accelerator.current_stream(accel)
    return lambda: torch.accelerator.set_stream(stream)


def overlap_pairs(schedule) -> OverlappedPairs:
    """Register ``OverlappedPairs`` for ``schedule``'s (a ``ScheduleDualPipeV``) pairs."""
    pairs = OverlappedPairs()
    schedule.register_custom_function(OVERLAP_F_B, pairs)
    return pairs
