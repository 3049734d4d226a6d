"""Two "nodes" of an elastic run on this machine, one of them lost, and back later: shared by
tests/integration/test_elastic_run.py and benchmarks/elastic_switch.py.

Each node is ``autopar run PLAN --elastic`` (its own torchrun agent of 2 gloo ranks, c10d
rendezvous on 127.0.0.1).  Node 0 starts first and hosts the rendezvous store; node 1 starts
once the store listens.  Once the metrics file logs step ``kill_after``, node 1 -- its
``autopar run``, its agent and its ranks -- is killed with SIGKILL.

With ``return_after``, node 1 comes back (the same command, started again) once node 0 has
switched to training alone and logged step ``return_after``.  So that node 0 cannot finish the
run before torch's agent on node 0 sees node 1 waiting, node 0's ranks are paused (SIGSTOP)
before node 1 starts, and continued (SIGCONT) once the agent has sent them the SIGTERM that
stops them for the new round (seen pending in ``/proc/PID/status``): which step they stop
after does not depend on how fast the machine is.
"""
from __future__ import annotations

import contextlib
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


def ranks_of(pid: int) -> list[int]:
    """The elastic ranks under ``pid``: the processes whose first ``-m`` module is
    ``autopar.elastic.worker`` (the agent names it too, after its own)."""
    out = []
    for p in tree(pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv[:-1] and argv[argv.index(b"-m") + 1] == b"autopar.elastic.worker":
            out.append(p)
    return out


def sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits to be delivered to ``pid`` (or it is gone): the process-wide
    pending mask of /proc/PID/status (proc(5), ``ShdPnd``), bit SIGTERM - 1."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    masks = [int(l.split()[1], 16) for l in status.splitlines() if l.startswith(("ShdPnd:", "SigPnd:"))]
    return any(m >> (signal.SIGTERM - 1) & 1 for m in masks)


def _switches(checkpoint_dir: Path) -> list[dict]:
    try:
        return json.loads((checkpoint_dir / "elastic" / "state.json").read_text()).get("switches", [])
    except (OSError, ValueError):
        return []


@dataclass
class LostNodeRun:
    code: int
    node0: str            # node 0's output (it survives)
    node1: str            # node 1's output until it was killed
    killed_at: float      # time.time() of the SIGKILL
    node1_back: str = ""  # with return_after: node 1's output once it came back
    back_code: int | None = None     # and its exit code
    returned_at: float | None = None  # time.time() node 1 was started again


def run_losing_a_node(tmp: Path, plan: Path, checkpoint_dir: Path, steps: int, kill_after: int,
                      extra: tuple[str, ...] = (), timeout_s: float = 300,
                      return_after: int | None = None) -> LostNodeRun:
    port = free_port()
    cmd = [sys.executable, "-m", "autopar.cli", "run", str(plan), "--checkpoint-dir", str(checkpoint_dir),
           "--steps", str(steps), "--elastic", "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]
    names = ["node0.log", "node1.log", "node1_back.log"]
    logs = [open(tmp / n, "w") for n in names]
    nodes: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout_s
    returned_at, paused = None, []

    def wait_for(done) -> None:
        while not done():
            assert nodes[0].poll() is None and time.monotonic() < deadline, (tmp / "node0.log").read_text()
            time.sleep(0.05)

    def start(log) -> subprocess.Popen:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=worker_env(),
                                start_new_session=True)

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    try:
        nodes.append(start(logs[0]))
        wait_for(listening)
        nodes.append(start(logs[1]))
        metrics = checkpoint_dir / "elastic" / "metrics.jsonl"
        wait_for(lambda: last_step(metrics) >= kill_after)
        killed_at = time.time()
        kill_tree(nodes[1].pid)
        nodes[1].wait(timeout=30)
        if return_after is not None:
            # node 0 trains alone: its switch recorded its first step after, and it logged return_after
            wait_for(lambda: any("first_step_after_at" in s for s in _switches(checkpoint_dir))
                     and last_step(metrics) >= return_after and len(ranks_of(nodes[0].pid)) == 2)
            paused = ranks_of(nodes[0].pid)
            for p in paused:
                os.kill(p, signal.SIGSTOP)
            returned_at = time.time()
            nodes.append(start(logs[2]))
            while not all(sigterm_pending(p) for p in paused):     # node 0's agent saw node 1 and stops them
                assert nodes[2].poll() is None and time.monotonic() < deadline, (tmp / names[2]).read_text()
                time.sleep(0.05)
            for p in paused:
                os.kill(p, signal.SIGCONT)
            paused = []
        code = nodes[0].wait(timeout=max(1.0, deadline - time.monotonic()))
        back = nodes[2].wait(timeout=max(1.0, deadline - time.monotonic())) if len(nodes) > 2 else None
    finally:
        for p in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
        for p in nodes:
            if p.poll() is None:
                kill_tree(p.pid)
        for f in logs:
            f.close()
    text = [(tmp / n).read_text() for n in names]
    return LostNodeRun(code, text[0], text[1], killed_at, text[2], back, returned_at)
