"""profiling/cpu_speed_check.py: the machine's speed now against a profile's op rows."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from autopar.profiling.cpu_speed_check import KINDS, reference_rows, speed_ratio

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "local-cpu.json"


def _profile() -> dict:
    return json.loads(PROFILE.read_text())


def test_reference_rows_take_one_mid_sized_fp32_row_per_kind():
    prof = _profile()
    rows = reference_rows(prof)
    assert [r["kind"] for r in rows] == list(KINDS)
    for r in rows:
        same = sorted((x for x in prof["op_table"] if x["kind"] == r["kind"] and x["dtype"] == "fp32"),
                      key=lambda x: x["flops"] if r["kind"] == "linear" else x["bytes"])
        assert r["dtype"] == "fp32" and r in same
        assert 0 < same.index(r) < len(same) - 1          # neither the smallest nor the largest
    assert reference_rows({"op_table": []}) == []
    assert speed_ratio({"op_table": []})["ratio"] is None


def test_speed_ratio_times_the_rows_again():
    """Rows that claim a thousand times the real time read ~1e-3; a thousandth, ~1e3: the check
    times the cases itself and divides by the rows' figures (a 10x margin either way)."""
    prof = _profile()
    slow, fast = copy.deepcopy(prof), copy.deepcopy(prof)
    for r in slow["op_table"]:
        r["measured_seconds"] *= 1e3
    for r in fast["op_table"]:
        r["measured_seconds"] *= 1e-3
    low = speed_ratio(slow, processes=1, target_s=0.02)
    high = speed_ratio(fast, processes=2, target_s=0.02)
    assert low["processes"] == 1 and high["processes"] == 2
    assert 1e-4 < low["ratio"] < 1e-2
    assert 1e2 < high["ratio"] < 1e4
    assert set(high["per_case"]) == {f"{r['kind']} {'x'.join(map(str, r['shape']))}" for r in reference_rows(prof)}
