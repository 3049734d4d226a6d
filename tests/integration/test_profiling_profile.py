"""`autopar profile`: the op sweep on this CPU, the collectives under a 2-rank torchrun, smoothing.

Checks compare against independent references: closed-form FLOP counts, scipy's isotonic
regression, a sleep of known length, physical bounds on bandwidth, and rates recomputed
from the rows themselves.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autopar.cli import main as cli_main
from autopar.profiling.isotonic import isotonic_non_decreasing, monotone_seconds
from autopar.profiling.op_sweeps import COMPUTE_KINDS, op_cases
from autopar.profiling.timing import RepeatPolicy, time_call
from runtime_support import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("prof") / "quick-cpu.json"
    assert cli_main(["profile", "-o", str(out), "--quick"]) == 0
    return json.loads(out.read_text())


def _work(row: dict) -> float:
    return row["flops"] if row["kind"] in COMPUTE_KINDS else row["bytes"]


@pytest.mark.slow                      # the quick profile it reads takes ~15 s to measure
def test_profile_has_schema_and_every_kind(quick_profile):
    p = quick_profile
    for key in ("name", "device", "memory_bytes", "memory_bandwidth_Bps", "peak_flops", "efficiency",
                "collective_efficiency", "sources", "op_table", "collective_table", "measured_by"):
        assert key in p, key
    assert set(p["peak_flops"]) == {"fp32", "tf32", "bf16", "fp16"}
    assert set(p["efficiency"]) >= {"linear", "matmul", "attention", "conv", "memory_bound"}
    kinds = {(r["kind"], r["variant"]) for r in p["op_table"]}
    assert kinds >= {("linear", "linear"), ("matmul", "bmm"), ("attention", "sdpa"), ("attention_math", "math"),
                     ("norm", "layer_norm"), ("norm", "rms_norm"), ("elementwise", "gelu"), ("elementwise", "add"),
                     ("softmax", "softmax"), ("embedding", "embedding"), ("optimizer", "adamw"), ("copy", "copy")}
    assert "profile -o" in p["measured_by"] and "--quick" in p["measured_by"]
    assert p["machine"]["torch_version"] == torch.__version__


@pytest.mark.slow                      # the quick profile it reads takes ~15 s to measure
def test_flop_and_byte_counts_match_closed_forms(quick_profile):
    for r in quick_profile["op_table"]:
        if r["kind"] == "linear":
            m, k, n = r["shape"]
            assert r["flops"] == 2 * m * n * k
            assert r["bytes"] == 4 * (m * k + k * n + m * n)
        if r["kind"] in ("attention", "attention_math"):
            b, h, s, d = r["shape"]
            assert r["flops"] == 4 * b * h * s * s * d
        if r["kind"] == "optimizer":
            assert r["bytes"] == 28 * r["shape"][0]


@pytest.mark.slow                      # the quick profile it reads takes ~15 s to measure
def test_op_times_non_decreasing_and_growing_with_size(quick_profile):
    groups: dict[tuple, list[dict]] = {}
    for r in quick_profile["op_table"]:
        groups.setdefault((r["kind"], r["variant"], r["dtype"]), []).append(r)
    for key, rows in groups.items():
        rows = sorted(rows, key=_work)
        secs = [r["seconds"] for r in rows]
        assert all(a <= b for a, b in zip(secs, secs[1:])), (key, secs)
        assert all(s > 0 for s in secs)
    # the sweep spans the sizes it is meant to (64x the work, 256x the bytes); how the measured
    # medians compare across sizes is left unchecked: on a shared machine a small op preempted
    # by another process can take longer than a large one, and a test must not depend on load
    lin = sorted((r for r in quick_profile["op_table"] if r["kind"] == "linear"), key=_work)
    assert _work(lin[-1]) / _work(lin[0]) == 64
    copy = sorted((r for r in quick_profile["op_table"] if r["kind"] == "copy"), key=_work)
    assert _work(copy[-1]) / _work(copy[0]) == 256


@pytest.mark.slow                      # the quick profile it reads takes ~15 s to measure
def test_peaks_recomputed_from_rows(quick_profile):
    p = quick_profile
    best = max(r["flops"] / r["measured_seconds"] for r in p["op_table"] if r["kind"] in ("linear", "matmul"))
    assert p["peak_flops"]["fp32"] == pytest.approx(best, rel=1e-12)
    copies = [r for r in p["op_table"] if r["kind"] == "copy"]
    big = max(r["bytes"] for r in copies)
    bw = max(r["bytes"] / r["measured_seconds"] for r in copies if r["bytes"] * 16 >= big)
    assert p["memory_bandwidth_Bps"] == pytest.approx(bw, rel=1e-12)
    # physical bounds for one CPU core: under 1 TFLOP/s and 1 TB/s, above 0.1 GFLOP/s and 0.1 GB/s
    assert 1e8 < p["peak_flops"]["fp32"] < 1e12
    assert 1e8 < p["memory_bandwidth_Bps"] < 1e12
    for kind, eff in p["efficiency"].items():
        assert 0 < eff <= 1.0, (kind, eff)
    lin = sorted(r["flops"] / r["measured_seconds"] for r in p["op_table"] if r["kind"] == "linear")
    median = lin[len(lin) // 2] if len(lin) % 2 else 0.5 * (lin[len(lin) // 2 - 1] + lin[len(lin) // 2])
    assert p["efficiency"]["linear"] == pytest.approx(min(1.0, median / p["peak_flops"]["fp32"]), rel=1e-12)


@pytest.mark.slow                      # the quick profile it reads takes ~15 s to measure
def test_profile_validates_and_prices_ops_as_measured(quick_profile, tmp_path):
    from autopar.profiles import load_profile
    from autopar.simulator.device.cost_model import CostModel

    path = tmp_path / "p.json"
    path.write_text(json.dumps(quick_profile))
    cm = CostModel.from_profile(load_profile(str(path)))
    # kinds timed with one variant (norm and elementwise hold two, which the cost model's
    # per-kind curve merges)
    for kind in ("linear", "matmul", "attention", "softmax", "embedding"):
        rows = [r for r in quick_profile["op_table"] if r["kind"] == kind]
        assert rows, kind
        for r in rows:
            t, measured = cm.compute_time_ex(kind, r["flops"], r["bytes"], "float32")
            assert measured, kind
            size = (lambda x: x["flops"] if x["flops"] > 0 else x["bytes"])
            same_size = max(x["seconds"] for x in rows if size(x) == size(r))
            assert t == pytest.approx(same_size, rel=1e-9), (kind, r["shape"])


def test_isotonic_against_scipy_and_hand_example():
    from scipy.optimize import isotonic_regression

    assert np.allclose(isotonic_non_decreasing([1, 3, 2, 4]), [1, 2.5, 2.5, 4])
    rng = np.random.default_rng(0)
    for _ in range(20):
        y = np.cumsum(rng.random(12)) + rng.normal(0, 0.8, 12)
        assert np.allclose(isotonic_non_decreasing(y), isotonic_regression(y).x, atol=1e-12)
    # one slow outlier at the small end does not lift every larger size to it (a running max would)
    s = monotone_seconds([5.0, 1.0, 2.0, 4.0, 8.0])
    assert all(a <= b for a, b in zip(s, s[1:])) and s[-1] == pytest.approx(8.0) and s[2] < 5.0


def test_alpha_beta_fit_recovers_a_known_link():
    from autopar.profiling.estimate import fitted_links

    alpha_s, bw_Bps, n = 30e-6, 2.5e9, 4
    rows = [{"op": "all_reduce", "bytes": m, "group_size": n, "level": "intra",
             "measured_seconds": alpha_s + 2 * (n - 1) / n * m / bw_Bps} for m in (1 << 10, 1 << 16, 1 << 22)]
    link = fitted_links(rows)["intra"]
    assert link["bandwidth_GBps"] == pytest.approx(2.5, rel=1e-6)
    assert link["latency_us"] == pytest.approx(30.0, rel=1e-6)


def test_timer_measures_a_known_sleep():
    # a real sleep: the timer never reads less than the call took (an upper bound would be a
    # timing window on a shared machine)
    t = time_call(lambda: time.sleep(0.004), torch.device("cpu"), RepeatPolicy(warmup=1, min_samples=5,
                                                                              target_total_s=0.02))
    assert 0.004 <= t.median_s
    assert t.num_samples >= 5


def test_timer_divides_each_sample_by_its_calls(monkeypatch):
    """On a clock that only the call advances (exactly 4 ms a call), the median per call is 4 ms
    whatever number of calls each sample packs -- the arithmetic, free of the machine's load."""
    import autopar.profiling.timing as timing

    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def call():
        now[0] += 0.004

    t = time_call(call, torch.device("cpu"), RepeatPolicy(warmup=1, min_samples=5, target_total_s=0.02))
    assert t.median_s == pytest.approx(0.004, rel=1e-12)
    assert t.num_samples >= 5 and t.spread == pytest.approx(0.0, abs=1e-9)


def test_quick_sweep_is_small():
    assert len(op_cases("cpu", ["fp32"], quick=True)) < 60


def test_bad_dtype_is_user_error(tmp_path, capsys):
    assert cli_main(["profile", "-o", str(tmp_path / "x.json"), "--quick", "--dtypes", "fp8"]) == 2
    assert "fp8" in capsys.readouterr().err


@pytest.mark.slow                      # the quick profile it reads takes ~15 s to measure
def test_merge_replaces_only_the_sweeps_measured_again(quick_profile):
    from autopar.profiling.profile_file import build_profile

    base = dict(quick_profile, collective_table=[
        {"op": "all_reduce", "bytes": b, "group_size": 2, "level": "intra", "seconds": 1e-3} for b in (1024, 4096)])
    new_coll = [{"op": "all_reduce", "bytes": b, "group_size": 4, "level": "intra", "seconds": 2e-3,
                 "measured_seconds": 2e-3} for b in (1024, 4096)]
    new_ops = [dict(r, dtype="bf16") for r in quick_profile["op_table"] if r["kind"] == "linear"]
    p = build_profile(base=base, name="x", device_kind="cpu", description="d", machine={"device_type": "cpu"},
                      measured_by="SECOND", op_rows=new_ops, collective_rows=new_coll, memory_bytes=None)
    assert len(p["op_table"]) == len(quick_profile["op_table"]) + len(new_ops)
    assert sorted(r["group_size"] for r in p["collective_table"]) == [2, 2, 4, 4]
    assert p["measured_by"] == quick_profile["measured_by"] + " ; SECOND"
    assert "bf16" in p["sources"]["peak_flops.bf16"] and p["sources"]["peak_flops.bf16"].startswith("measured")
    # a run that measures only ops keeps the collective table and the command that made it
    ops_only = build_profile(base=p, name="x", device_kind="cpu", description="d", machine={}, measured_by="OPS",
                             op_rows=new_ops, collective_rows=None, memory_bytes=None)
    assert ops_only["collective_table"] == p["collective_table"]
    assert ops_only["measured_by"].endswith("SECOND ; OPS")
    # measuring the same sweep again replaces it
    again = build_profile(base=p, name="x", device_kind="cpu", description="d", machine={}, measured_by="THIRD",
                          op_rows=None, collective_rows=new_coll, memory_bytes=None)
    assert sorted(r["group_size"] for r in again["collective_table"]) == [2, 2, 4, 4]


@pytest.mark.multiproc
def test_collectives_under_torchrun_merge_into_existing_profile(tmp_path, quick_profile):
    out = tmp_path / "two-ranks.json"
    out.write_text(json.dumps(quick_profile))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "autopar.cli", "profile", "--quick", "--skip-ops", "-o", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = json.loads(out.read_text())
    assert p["op_table"] == quick_profile["op_table"]            # --skip-ops keeps the measured op table
    ops = {r["op"] for r in p["collective_table"]}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"}
    assert {(r["group_size"], r["level"], r["backend"]) for r in p["collective_table"]} == {(2, "intra", "gloo")}
    for op in ops:
        for timing in ("in_step", "chained"):
            rows = sorted((r for r in p["collective_table"] if r["op"] == op and r["timing"] == timing),
                          key=lambda r: r["bytes"])
            # a CPU times collectives after compute; broadcasts also as calls of a chain
            assert len(rows) == (3 if timing == "in_step" or op == "broadcast" else 0), (op, timing)
            assert all(a["seconds"] <= b["seconds"] for a, b in zip(rows, rows[1:]))
            # a transfer over shared memory cannot beat 1 TB/s nor take under 1 us
            for r in rows:
                assert r["seconds"] > max(1e-6, r["bytes"] / 1e12)
    # the overheads were timed on the pair of ranks in step, and the meeting wait of 2 processes
    assert "overheads_in_step" in p["sources"]["framework_overheads"]
    assert {r["processes"] for r in p["sync_wait"]} == {2}
    assert "torchrun --nproc-per-node 2" in p["measured_by"]
    assert p["measured_by"].startswith(quick_profile["measured_by"] + " ; ")   # the kept op table's command


class _FakeClock:
    """``time.perf_counter`` for the timing code under test: it advances only when a fake
    burst or call says so, so the test has no timing window whatever the host's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_in_step_timing_takes_the_compute_burst_out(tmp_path, monkeypatch):
    """A call of 3 ms timed in step after a 1 ms burst costs 3 ms: the burst is measured alone
    and taken out (one-process gloo group; a fake clock that the burst and the call advance)."""
    import types

    import torch.distributed as dist

    from autopar.profiling import cpu_in_step, timing
    from autopar.profiling.timing import RepeatPolicy

    clock = _FakeClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))

    def burst():
        clock.now += 1e-3

    def call():
        clock.now += 3e-3

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        seconds, n = cpu_in_step.time_in_step(call, torch.device("cpu"),
                                              RepeatPolicy(min_samples=5, target_total_s=0.05), None, burst)
    finally:
        dist.destroy_process_group()
    assert n >= 5
    assert seconds == pytest.approx(3e-3, rel=1e-9)


def test_measured_by_lists_only_commands_whose_rows_remain():
    """Each row names its command; measuring a sweep again drops the command whose rows it
    replaced from ``measured_by`` and from the table's source."""
    from autopar.profiling.profile_file import build_profile

    def run(base, cmd, processes):
        rows = [{"op": "all_reduce", "bytes": b, "group_size": 2, "level": "intra", "seconds": 1e-3,
                 "measured_seconds": 1e-3, "processes": processes, "timing": "in_step"} for b in (1024, 4096)]
        return build_profile(base=base, name="x", device_kind="cpu", description="d", machine={}, measured_by=cmd,
                             op_rows=None, collective_rows=rows, memory_bytes=None)

    p = run(run(run(None, "FIRST", 4), "SECOND", 2), "THIRD", 4)     # THIRD replaces FIRST's rows
    assert p["measured_by"] == "SECOND ; THIRD"
    assert {r["measured_by"] for r in p["collective_table"]} == {"SECOND", "THIRD"}
    assert "FIRST" not in p["sources"]["collective_table"]
    assert "`SECOND`" in p["sources"]["collective_table"] and "`THIRD`" in p["sources"]["collective_table"]


def test_measured_by_keeps_commands_that_measured_only_meeting_waits():
    """A command that measured only a process count's meeting wait stays listed while its row
    remains, and leaves when that count is measured again."""
    from autopar.profiling.profile_file import build_profile

    coll = [{"op": "all_reduce", "bytes": 1024, "group_size": 2, "level": "intra", "seconds": 1e-3,
             "measured_seconds": 1e-3, "processes": 2, "timing": "in_step"}]

    def sync(base, cmd, processes):
        row = {"processes": processes, "gaps_s": [1e-3, 2e-3], "extra_s": [1e-3, 1.5e-3], "fixed_s": 5e-4,
               "per_compute": 0.5, "rounds": 8, "backend": "gloo"}
        return build_profile(base=base, name="x", device_kind="cpu", description="d", machine={}, measured_by=cmd,
                             op_rows=None, collective_rows=None, memory_bytes=None, sync_wait=row)

    first = build_profile(base=None, name="x", device_kind="cpu", description="d", machine={}, measured_by="COLL",
                          op_rows=None, collective_rows=coll, memory_bytes=None)
    p = sync(sync(first, "SYNC4", 4), "SYNC2", 2)
    assert p["measured_by"] == "COLL ; SYNC4 ; SYNC2"
    assert [r["measured_by"] for r in p["sync_wait"]] == ["SYNC2", "SYNC4"]
    assert sync(p, "SYNC4-AGAIN", 4)["measured_by"] == "COLL ; SYNC2 ; SYNC4-AGAIN"


def test_best_of_passes_keeps_each_rows_fastest_pass():
    from autopar.profiling.ops import best_of_passes

    def row(kind, shape, s):
        return {"kind": kind, "variant": kind, "dtype": "fp32", "shape": shape, "flops": 1.0, "bytes": 1.0,
                "seconds": s, "measured_seconds": s, "num_samples": 5}
    slow_first = [row("linear", [1], 3e-3), row("copy", [2], 1e-3)]
    slow_second = [row("linear", [1], 2e-3), row("copy", [2], 4e-3)]
    best = best_of_passes([slow_first, slow_second])
    assert [r["measured_seconds"] for r in best] == [2e-3, 1e-3]
    assert all(r["passes"] == 2 for r in best)
    assert best_of_passes([slow_first]) == slow_first


def test_profile_refuses_zero_passes(tmp_path):
    from cli_inprocess import run_cli

    proc = run_cli("profile", "--passes", "0", "-o", tmp_path / "p.json")     # refused before any measuring
    # refused while parsing (core/cli_types.py), naming the flag and the value
    assert proc.returncode == 2 and "--passes" in proc.stderr and "'0' is not a whole number >= 1" in proc.stderr
    assert not (tmp_path / "p.json").exists()
