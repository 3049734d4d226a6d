"""For each zoo model: ``autopar plan`` on a 2-device gloo cluster, then ``autopar run`` of the
plan it wrote trains (exit 0, finite losses).  Whatever kinds the planner picked, the runtime
must run them: the planner offers only what it checked against the runtime's own code.

One plan-and-run per model, 3 steps, a global batch of 4; the planning of all models shares
one cluster file.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc          # each case plans, then runs torchrun

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "tests" / "zoo"
MODELS = sorted(p.stem for p in ZOO.glob("*.py") if p.stem != "__init__")
STEPS = 3

# two gloo CPU processes; the link figures are local-cpu's (examples/clusters/local-cpu.yaml)
CLUSTER = """\
name: two-cpu
backend: gloo
inter_node: {bandwidth_GBps: 1.4, latency_us: 750}
groups:
  - name: cpu
    gpu: local-cpu
    nodes: 1
    gpus_per_node: 2
    compute_slots: 2
    gpu_memory_GB: 4
    intra_node: {bandwidth_GBps: 1.4, latency_us: 750}
    host_memory_GB: 8
    host_to_device: {bandwidth_GBps: 7, latency_us: 1.2}
"""


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "two-cpu.yaml"
    path.write_text(CLUSTER)
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("AUTOPAR_FAULT_AT", None)
    return env


@pytest.mark.parametrize("model", MODELS)
def test_plan_then_run_trains(model, cluster_file, tmp_path):
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    plan_path, measured = tmp_path / "plan.json", tmp_path / "measured.json"
    # planned in this process, as `autopar plan` does (autopar.cli.main; its runtime check runs on
    # fake ranks in-process): a fresh interpreter per model cost the suite ~5 s of imports each
    from autopar.cli import main as cli_main

    rc = cli_main(["plan", str(ZOO / f"{model}.py"), "--cluster", str(cluster_file), "--global-batch", "4",
                   "--time-budget", "2", "-o", str(plan_path), "--json"])
    assert rc == 0, f"autopar plan {model} exited {rc}"
    plan = json.loads(plan_path.read_text())
    kinds = (plan["mesh"], sorted({(l["zero"], l["recompute"], l["offload"], bool(l["tp"])) for l in plan["layers"]}))
    ran = subprocess.run(
        [sys.executable, "-m", "autopar.cli", "run", str(plan_path), "--steps", str(STEPS), "--measured", str(measured)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())
    assert ran.returncode == 0, f"{model} plan {kinds}:\n{ran.stdout[-2000:]}\n{ran.stderr[-4000:]}"
    losses = json.loads(measured.read_text())["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), (model, kinds, losses)
