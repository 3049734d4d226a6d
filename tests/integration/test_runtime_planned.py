"""Plans written by ``autopar plan`` for the local-cpu cluster train like the reference.

The planner runs as the user runs it (the ``autopar plan`` command); the runtime never imports
it.  The 4-rank plan is for examples/clusters/local-cpu.yaml as shipped; the 2-rank plan for
the same cluster with 2 processes per node (a copy of the file with ``gpus_per_node: 2``).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_support import (GLOBAL_BATCH, GPT, MODEL_ARGS, ROOT, assert_matches_reference, reference, run_cases,
                             worker_env)

CLUSTER = ROOT / "examples" / "clusters" / "local-cpu.yaml"


def _plan(tmp: Path, cluster: Path, out: Path) -> dict:
    args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    cmd = [sys.executable, "-m", "autopar.cli", "plan", str(GPT), *args, "--cluster", str(cluster),
           "--global-batch", str(GLOBAL_BATCH), "--precision", "fp32", "--seed", "0", "-o", str(out)]
    res = subprocess.run(cmd, env=worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.multiproc
@pytest.mark.parametrize("ranks", [2, 4])
def test_planner_plan_trains_like_reference(tmp_path, ranks):
    cluster = CLUSTER
    if ranks != 4:
        cluster = tmp_path / "local-cpu-2.yaml"
        text = CLUSTER.read_text()
        assert re.search(r"gpus_per_node: 4\b", text)
        cluster.write_text(re.sub(r"gpus_per_node: 4\b", f"gpus_per_node: {ranks}", text))
    plan_path = tmp_path / "plan.json"
    plan = _plan(tmp_path, cluster, plan_path)
    assert plan["mesh"]["world_size"] == ranks
    case = {"plan": str(plan_path), "measured": str(tmp_path / "measured.json"),
            "checkpoint_dir": str(tmp_path / "ckpt")}
    run_cases(ranks, [case], tmp_path, timeout_s=240)
    assert_matches_reference(tmp_path / "measured.json", tmp_path / "ckpt", reference(),
                             f"planned {ranks} ranks: {plan['mesh']}")
