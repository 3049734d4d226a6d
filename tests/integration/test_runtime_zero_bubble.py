"""Parity of the split-backward pipeline schedules (torch's ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) with the single-process reference (fp32, gloo).

One 2-rank torchrun launch runs every case: each schedule plain, under full recompute and under
FSDP (ZeRO-2 on the pp = 2 mesh: FSDP2 units per block at dp = 1; selective recompute, ZeRO-3 and
compile are refused with these schedules, core/rules.split_backward_problem), on the 4-block GPT of
test_runtime_parity (6 layers, global batch 4); each must give the reference's losses within
1e-5 over 5 steps and its parameters at the end.  The V schedules put the first and the last
stage on pp rank 0 (core/rules.stage_rank).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime_support import assert_matches_reference, make_plan, reference, run_cases

# name -> uniform_plan arguments (micro_batch * num_microbatches = 4; 2 stages per pp rank)
CASES = {
    "zbv": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="zbv", virtual_stages=2),
    "zbv_recompute_full": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="zbv", virtual_stages=2,
                               recompute="full"),
    "zbv_zero2": dict(pp=2, micro_batch=2, num_microbatches=2, schedule="zbv", virtual_stages=2, zero=2),
    "interleaved_zb": dict(pp=2, micro_batch=2, num_microbatches=2, schedule="interleaved-zb", virtual_stages=2),
    "interleaved_zb_recompute_full_zero2": dict(pp=2, micro_batch=1, num_microbatches=4,
                                                schedule="interleaved-zb", virtual_stages=2,
                                                recompute="full", zero=2),
    "dualpipev": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="dualpipev", virtual_stages=2),
    "dualpipev_recompute_full_zero2": dict(pp=2, micro_batch=1, num_microbatches=4, schedule="dualpipev",
                                           virtual_stages=2, recompute="full", zero=2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_bubble")
    cases = [{"name": name, "plan": str(make_plan(tmp / f"{name}.json", **kw)),
              "measured": str(tmp / f"{name}.measured.json"), "checkpoint_dir": str(tmp / f"{name}.ckpt")}
             for name, kw in CASES.items()]
    run_cases(2, cases, tmp, timeout_s=300)
    return {c["name"]: c for c in cases}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES))
def test_split_backward_schedule_matches_reference(runs, name):
    case = runs[name]
    assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), reference(), name)


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
