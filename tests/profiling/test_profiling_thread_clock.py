"""profiling/timing.py's thread clock: an op timed by its thread's CPU time leaves out the time
the thread did not run (here: a sleep, the closed form of waiting for a core), and reads a
busy op as the host clock does."""
from __future__ import annotations

import time

import pytest
import torch

from autopar.profiling.timing import RepeatPolicy, thread_clock_valid, time_call

POLICY = RepeatPolicy(warmup=1, min_samples=5, max_samples=5, target_total_s=0.0, min_sample_s=0.0)


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _busy(seconds: float) -> None:
    """Run (not wait) for ``seconds`` of this thread's CPU time, however loaded the machine."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_clock_leaves_out_time_off_the_core(one_thread):
    cpu = torch.device("cpu")
    assert thread_clock_valid(cpu)
    # 2 ms of work, then 20 ms off the core: the host clock sees 22 ms, the thread 2 ms
    op = lambda: (_busy(0.002), time.sleep(0.020))  # noqa: E731
    wall = time_call(op, cpu, POLICY, clock="wall").median_s
    thread = time_call(op, cpu, POLICY, clock="thread").median_s
    assert wall >= 0.022
    assert 0.002 <= thread <= 0.008           # the work, not the sleep (the wake-up's own cost allowed)


def test_ops_rows_name_their_clock(one_thread):
    from autopar.profiling.op_sweeps import op_cases
    from autopar.profiling.ops import measure_ops

    case = [c for c in op_cases("cpu", ["fp32"], quick=True) if c.kind == "linear"][:1]
    assert measure_ops(case, torch.device("cpu"), POLICY)[0]["clock"] == "thread"
    assert measure_ops(case, torch.device("cpu"), POLICY, clock="wall")[0]["clock"] == "wall"


def test_thread_clock_refused_where_it_cannot_see_the_whole_op():
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not thread_clock_valid(torch.device("cpu"))
        with pytest.raises(ValueError):
            time_call(lambda: None, torch.device("cpu"), POLICY, clock="thread")
    finally:
        torch.set_num_threads(old)
