"""The runtime as a user starts it: ``autopar run``, a killed rank, two nodes, bad input.

* fault: rank 1 exits abruptly after step 3 on the first attempt (``AUTOPAR_FAULT_AT``);
  torchrun (``--max-restarts 1``) restarts the group, the run resumes from the step-2
  checkpoint and ends with the reference's losses and parameters.
* two nodes on one machine: two torchrun launches (``--nnodes 2``, c10d rendezvous on
  127.0.0.1) train a dp2 x tp2 plan (ZeRO-3 on the dp axis) and a dp2 x tp2 ZeRO-0 plan
  (DDP semantics over TP) and a dp2 x pp2 plan, each matching the reference.
* bad input: fingerprint mismatch, world size mismatch and a malformed plan exit with code 2
  and a message naming the problem (the CLI's refusals, and the per-node commands it prints,
  run in this process: nothing is launched for them).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_inprocess import run_cli
from runtime_support import (ROOT, WORKER, assert_matches_reference, free_port, make_plan, reference, torchrun,
                             worker_env)


@pytest.mark.multiproc
def test_killed_rank_resumes_from_checkpoint(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, micro_batch=2, zero=3)
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "autopar.cli", "run", str(plan), "--steps", "5", "--checkpoint-dir", str(ckpt),
           "--checkpoint-every", "2", "--max-restarts", "1", "--timing-warmup", "1"]
    out = subprocess.run(cmd, env=worker_env(AUTOPAR_FAULT_AT="1:3"), cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    assert "exiting abruptly after step 3" in log, log[-3000:]
    assert "resumed from" in log and "step_00000002" in log, log[-3000:]
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert measured["first_step"] == 2
    assert len(measured["step_times_s"]) == 3          # only steps 3..5 ran after the restart
    assert_matches_reference(tmp_path / "measured.json", ckpt, reference(), "fault+resume")


@pytest.mark.multiproc
def test_two_nodes_on_one_machine(tmp_path):
    cases = []
    for name, kw in {"dp2tp2_zero3": dict(dp=2, tp=2, micro_batch=2, zero=3),
                     "dp2tp2_zero0": dict(dp=2, tp=2, micro_batch=2),
                     "dp2pp2_1f1b": dict(dp=2, pp=2, micro_batch=1, num_microbatches=2, schedule="1f1b")}.items():
        cases.append({"name": name, "plan": str(make_plan(tmp_path / f"{name}.json", **kw)),
                      "measured": str(tmp_path / f"{name}.measured.json"),
                      "checkpoint_dir": str(tmp_path / f"{name}.ckpt")})
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    port = free_port()
    launch = ["--nnodes", "2", "--rdzv-id", "autopar-two-nodes"]
    nodes = [torchrun(2, str(WORKER), str(spec), timeout_s=0, port=port, background=True, extra_launch=launch)
             for _ in range(2)]
    logs = []
    for p in nodes:
        try:
            logs.append(p.communicate(timeout=240)[0])
        finally:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in nodes), "\n".join(l[-4000:] for l in logs)
    for c in cases:
        m = json.loads(Path(c["measured"]).read_text())
        assert m["world_size"] == 4
        assert_matches_reference(Path(c["measured"]), Path(c["checkpoint_dir"]), reference(), c["name"])


def _autopar_run(*args: str) -> subprocess.CompletedProcess:
    """``autopar run`` in this process (``cli_inprocess``): these checks refuse, or print the
    per-node commands, before any process is started."""
    return run_cli("run", *args, cwd=ROOT)


def test_fingerprint_mismatch_exits_2(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, micro_batch=2)
    d = json.loads(plan.read_text())
    d["model"]["fingerprint"] = "0123456789abcdef"
    plan.write_text(json.dumps(d))
    out = _autopar_run(str(plan), "--steps", "1")
    assert out.returncode == 2, out.stderr
    assert "fingerprint" in out.stderr and "0123456789abcdef" in out.stderr
    assert "Traceback" not in out.stderr


def test_world_size_mismatch_exits_2(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, micro_batch=2)
    # a plain single-process start: WORLD_SIZE is 1, the plan needs 2
    out = subprocess.run([sys.executable, "-m", "autopar.runtime", str(plan), "--steps", "1"], env=worker_env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "is for 2 ranks" in out.stderr and "this launch has 1" in out.stderr
    assert "Traceback" not in out.stderr


def test_malformed_plan_exits_2(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, micro_batch=2)
    d = json.loads(plan.read_text())
    d["global_batch"] = 5
    plan.write_text(json.dumps(d))
    out = _autopar_run(str(plan), "--steps", "1")
    assert out.returncode == 2, out.stderr
    assert "global_batch" in out.stderr
    assert "Traceback" not in out.stderr


def test_run_prints_per_node_commands_for_two_nodes(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, tp=2, micro_batch=2, zero=3)
    out = _autopar_run(str(plan), "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400", "--steps", "7")
    assert out.returncode == 0, out.stderr
    cmd = [l for l in out.stdout.splitlines() if "torch.distributed.run" in l]
    assert len(cmd) == 1
    for piece in ("--nnodes 2", "--nproc-per-node 2", "--rdzv-backend c10d", "--rdzv-endpoint 10.0.0.1:29400",
                  "-m autopar.runtime", "--steps 7", str(plan)):
        assert piece in cmd[0], (piece, cmd[0])
