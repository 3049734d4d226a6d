"""Plans written by ``autopar plan`` for the local-cpu cluster train like the reference.

The planner runs as the user runs it (the ``autopar plan`` command, in the test process:
tests/cli_inprocess.py); the runtime never imports it.  The 4-rank plan is for
examples/clusters/local-cpu.yaml as shipped; the 2-rank plan for the same cluster with 2
processes per node (a copy of the file with ``gpus_per_node: 2``).  A 2 s search: for this
4-layer GPT it writes the plan the default 40 s budget writes (pp 4, micro-batch 4, no ZeRO,
no recompute, on 4 ranks).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli_inprocess import run_cli
from runtime_support import GLOBAL_BATCH, GPT, MODEL_ARGS, ROOT, assert_matches_reference, reference, run_cases

CLUSTER = ROOT / "examples" / "clusters" / "local-cpu.yaml"


def _plan(tmp: Path, cluster: Path, out: Path) -> dict:
    args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    res = run_cli("plan", GPT, *args, "--cluster", cluster, "--global-batch", GLOBAL_BATCH, "--precision", "fp32",
                  "--seed", "0", "--time-budget", "2", "-o", out, cwd=ROOT)
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
