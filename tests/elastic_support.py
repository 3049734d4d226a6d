"""Two "nodes" of an elastic run on this machine, one of them lost for good: shared by
tests/integration/test_elastic_run.py and benchmarks/elastic_switch.py.

Each node is ``autopar run PLAN --elastic`` (its own torchrun agent of 2 gloo ranks, c10d
rendezvous on 127.0.0.1).  Node 0 starts first and hosts the rendezvous store; node 1 starts
once the store listens.  Once the metrics file logs step ``kill_after``, node 1 -- its
``autopar run``, its agent and its ranks -- is killed with SIGKILL and never restarted.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from runtime_support import free_port, make_plan, worker_env

CLUSTER = """\
name: two-cpu-nodes
backend: gloo
inter_node: {bandwidth_GBps: 1.4, latency_us: 750}
groups:
  - name: cpu
    gpu: local-cpu
    nodes: 2
    gpus_per_node: 2
    host_memory_GB: 8
"""


def plan_on_cluster(tmp: Path) -> Path:
    """The small GPT's dp2 x tp2 (ZeRO-3) plan, recorded as planned for the two-node cluster
    (what 'autopar plan --cluster' writes in provenance), so an elastic run can re-plan it."""
    (tmp / "cluster.yaml").write_text(CLUSTER)
    plan = make_plan(tmp / "plan.json", dp=2, tp=2, micro_batch=2, zero=3)
    data = json.loads(plan.read_text())
    data.setdefault("provenance", {}).update(cluster_ref=str(tmp / "cluster.yaml"), cluster_nodes=None)
    plan.write_text(json.dumps(data))
    return plan


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        x = todo.pop()
        out.append(x)
        todo += children.get(x, [])
    return out


def kill_tree(pid: int) -> None:
    for p in tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def last_step(metrics: Path) -> int:
    try:
        return max([json.loads(l)["step"] for l in metrics.read_text().splitlines() if l.strip()] or [0])
    except (OSError, ValueError, KeyError):
        return 0


@dataclass
class LostNodeRun:
    code: int
    node0: str            # node 0's output (it survives)
    node1: str            # node 1's output until it was killed
    killed_at: float      # time.time() of the SIGKILL


def run_losing_a_node(tmp: Path, plan: Path, checkpoint_dir: Path, steps: int, kill_after: int,
                      extra: tuple[str, ...] = (), timeout_s: float = 300) -> LostNodeRun:
    port = free_port()
    cmd = [sys.executable, "-m", "autopar.cli", "run", str(plan), "--checkpoint-dir", str(checkpoint_dir),
           "--steps", str(steps), "--elastic", "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]
    logs = [open(tmp / f"node{i}.log", "w") for i in range(2)]
    nodes: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout_s
    try:
        nodes.append(subprocess.Popen(cmd, stdout=logs[0], stderr=subprocess.STDOUT, cwd=tmp, env=worker_env(),
                                      start_new_session=True))
        while True:
            assert nodes[0].poll() is None and time.monotonic() < deadline, (tmp / "node0.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        nodes.append(subprocess.Popen(cmd, stdout=logs[1], stderr=subprocess.STDOUT, cwd=tmp, env=worker_env(),
                                      start_new_session=True))
        metrics = checkpoint_dir / "elastic" / "metrics.jsonl"
        while last_step(metrics) < kill_after:
            assert nodes[0].poll() is None and time.monotonic() < deadline, (tmp / "node0.log").read_text()
            time.sleep(0.05)
        killed_at = time.time()
        kill_tree(nodes[1].pid)
        nodes[1].wait(timeout=30)
        code = nodes[0].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in nodes:
            if p.poll() is None:
                kill_tree(p.pid)
        for f in logs:
            f.close()
    return LostNodeRun(code, (tmp / "node0.log").read_text(), (tmp / "node1.log").read_text(), killed_at)
