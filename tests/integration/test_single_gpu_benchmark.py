"""benchmarks/single_gpu.py as a lent GPU would run it, here on the CPU (no CUDA: fp32, local-cpu):
each one-rank plan it writes is the configuration it names, runs through the runtime, and the
figures it saves are the kept run's measured.json."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiproc
def test_single_gpu_benchmark_runs_its_plans_through_the_runtime(tmp_path):
    out, save = tmp_path / "runs", tmp_path / "single.json"
    cmd = [sys.executable, "benchmarks/single_gpu.py", "--only", "plain,offload recompute full", "--steps", "3",
           "--repeats", "1", "--out", str(out), "--save", str(save)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    saved = json.loads(save.read_text())
    assert saved["precision"] == "fp32" and saved["device"] == "cpu"
    assert [r["name"] for r in saved["plans"]] == ["plain", "offload recompute full"]

    for row, (zero, offload, recompute) in zip(saved["plans"], [(0, "none", "none"), (3, "cpu", "full")]):
        run_dir = out / row["name"].replace(" ", "_")
        plan = json.loads((run_dir / "plan.json").read_text())
        assert plan["mesh"]["world_size"] == 1 and plan["precision"] == "fp32"
        layers = plan["layers"]
        assert {lp["zero"] for lp in layers} == {zero}
        assert {lp["offload"] for lp in layers} == {offload}
        blocks = [lp["recompute"] for lp in layers if lp["recompute"] != "none"]
        assert (recompute == "none" and not blocks) or (blocks and set(blocks) == {recompute})
        measured = json.loads((run_dir / "measured.json").read_text())
        assert measured["world_size"] == 1
        assert all(math.isfinite(x) for x in measured["losses"])
        # the saved figure is the kept run's own measurement, and the simulated one the plan's prediction
        assert row["meas_step_s"] == pytest.approx(measured["step_time_s"])
        assert row["sim_step_s"] == pytest.approx(plan["predicted"]["step_time_s"])
