"""The split-backward pipeline schedules (torch's ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) before launch: the combinations their split backward
cannot run are plan errors, and the V schedules place stages as torch does.  Their parity with
the plain loop (under full recompute and FSDP ZeRO-2) runs in test_runtime_parity's two-rank
launch (the ``pp2_*_zero2`` cases)."""
from __future__ import annotations

import pytest

from runtime_support import make_plan


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-zb", "dualpipev"])
@pytest.mark.parametrize("choice, words", [(dict(recompute="selective"), "selective activation checkpoint"),
                                           (dict(zero=3), "ZeRO-3"), (dict(compile=True), "compiled")])
def test_refused_combinations_exit_before_launch(tmp_path, schedule, choice, words):
    """A combination the split backward cannot run is a plan error (exit 2 from ``autopar run``'s
    plan check, core/rules.split_backward_problem), never a launch."""
    from autopar.core.errors import PlanFileError
    from autopar.runtime.plan_check import check_plan

    path = tmp_path / "plan.json"
    with pytest.raises(PlanFileError, match=words):
        make_plan(path, pp=2, micro_batch=1, num_microbatches=4, schedule=schedule, virtual_stages=2, **choice)
        check_plan(path, 2)


def test_v_layout_is_torchs():
    """The V schedules' stage placement is torch's own (``generate_stage_to_rank_mapping``)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from autopar.core.rules import stage_rank

    for pp in (2, 3, 4, 8):
        assert {i: stage_rank("zbv", i, pp) for i in range(2 * pp)} == generate_stage_to_rank_mapping(pp, 2 * pp, "v")
        assert {i: stage_rank("interleaved-zb", i, pp) for i in range(2 * pp)} == \
            generate_stage_to_rank_mapping(pp, 2 * pp, "loop")
