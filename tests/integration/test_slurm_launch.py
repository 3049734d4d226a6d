"""``autopar launch PLAN --slurm``: the batch script, run as it is under stand-ins for SLURM.

* the script: ``#SBATCH`` lines from the plan's cluster (GPUs per node on a GPU cluster, none on
  a CPU one), the cluster file's ``env`` exported, the run's options forwarded with absolute
  paths; bad input exits 2 and writes nothing.
* the job: ``bash job.sbatch`` with stub ``srun`` and ``scontrol`` first on PATH and SLURM's
  batch variables set as sbatch sets them; the stub ``srun`` starts the per-node command on two
  "nodes" (two torchrun agents of 2 gloo ranks each, SLURM's task variables set as srun sets
  them).  The checkpoint folder holds the lock a dead earlier incarnation of the same job left
  on another node (a requeue after a node failure): the run takes it over, trains a dp2 x tp2
  plan 5 steps and matches the plain loop.  (A checkpoint of this 4-rank dp2 x tp2 ZeRO-3 plan
  re-planned for fewer ranks and resumed, as the plain loop goes on, is the elastic launch's
  first switch: tests/integration/test_elastic_run.py.)
* the lock: a lock left on another host by an earlier incarnation of the same SLURM job (a lower
  restart count) is taken over; the same incarnation's, another job's, or one outside SLURM is not.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from cli_inprocess import run_cli
from runtime_support import assert_matches_reference, free_port, make_plan, reference, worker_env

CPU_CLUSTER = """\
name: two-cpu-nodes
backend: gloo
inter_node: {bandwidth_GBps: 1.4, latency_us: 750}
env: {GLOO_SOCKET_IFNAME: lo}
groups:
  - name: cpu
    gpu: local-cpu
    nodes: 2
    gpus_per_node: 2
    host_memory_GB: 8
"""

GPU_CLUSTER = """\
name: two-a100-nodes
inter_node: {bandwidth_GBps: 25, latency_us: 5}
env: {NCCL_IB_HCA: mlx5, NCCL_DEBUG: WARN}
groups:
  - name: a100
    gpu: a100-80gb-sxm
    nodes: 2
    gpus_per_node: 2
    host_memory_GB: 1024
    env: {NCCL_SOCKET_IFNAME: "ib0,ib1", NCCL_DEBUG: INFO}
"""

HOSTS = ("localhost", "127.0.0.1")       # two "nodes", both this machine; the first hosts the rendezvous

# srun as it starts a job step of one task per node: each task is a process here, with the
# variables srun gives a task (srun manual, "OUTPUT ENVIRONMENT VARIABLES"); it records its
# options, and exits with the first failing task's code
SRUN = """#!/bin/bash
opts=()
while [[ $# -gt 0 && "$1" == -* ]]; do opts+=("$1"); shift; done
printf '%s\\n' "${opts[@]}" > "$STUB_LOG/srun_options"
n=$SLURM_NNODES
hosts=(HOSTS)
pids=()
for ((i = 0; i < n; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_STEP_ID=0 SLURM_NTASKS=$n SLURM_NPROCS=$n \\
  SLURM_STEP_NUM_NODES=$n SLURM_STEP_NUM_TASKS=$n SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST \\
  SLURMD_NODENAME=${hosts[$i]} SLURM_TOPOLOGY_ADDR=${hosts[$i]} "$@" > "$STUB_LOG/node$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  wait "$p"; s=$?
  if [ $s -ne 0 ] && [ $rc -eq 0 ]; then rc=$s; fi
done
exit $rc
""".replace("HOSTS", " ".join(HOSTS))

# scontrol show hostnames NODELIST: one host name a line
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && [ "$3" = "$SLURM_JOB_NODELIST" ] || { echo "stub scontrol: $*" >&2; exit 1; }
printf '%s\\n' HOSTS
""".replace("HOSTS", " ".join(HOSTS))


def _flat(text: str) -> str:
    """A message with its paragraph's line breaks undone."""
    return " ".join(text.split())


def _stubs(folder: Path) -> Path:
    folder.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def _sbatch_env(stubs: Path, log: Path, job_id: str) -> dict[str, str]:
    """The variables sbatch sets in a batch script of a 2-node job (sbatch manual, "OUTPUT
    ENVIRONMENT VARIABLES"), the stubs first on PATH."""
    return worker_env(PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", STUB_LOG=str(log),
                      SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NAME="autopar-plan",
                      SLURM_JOB_NODELIST="node[01-02]", SLURM_NODELIST="node[01-02]", SLURM_NNODES="2",
                      SLURM_JOB_NUM_NODES="2", SLURM_CPUS_PER_TASK="2", SLURM_NTASKS_PER_NODE="1",
                      SLURM_SUBMIT_DIR=str(log), SLURM_NODEID="0", SLURMD_NODENAME=HOSTS[0])


@pytest.mark.multiproc
def test_slurm_script_runs_as_two_nodes_and_matches_the_plain_loop(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, tp=2, micro_batch=2, zero=3)
    (tmp_path / "cluster.yaml").write_text(CPU_CLUSTER)
    port = free_port()
    work = tmp_path / "submit"
    work.mkdir()
    out = run_cli("launch", "../plan.json", "--slurm", "--cluster", "../cluster.yaml", "-o", "job.sbatch",
                  "--requeue", "--steps", 5, "--checkpoint-dir", "ck", "--checkpoint-every", 2,
                  "--rdzv-port", port, cwd=work)
    assert out.returncode == 0, out.stderr
    script = work / "job.sbatch"
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "--gpus-per-node" not in text and "export GLOO_SOCKET_IFNAME=lo" in text
    ckpt = work / "ck"
    ckpt.mkdir()
    # what a node failure leaves: rank 0 of the job's earlier incarnation died on another node
    (ckpt / "lock.json").write_text(json.dumps({"pid": 12345, "host": "node01-that-died", "plan": str(plan),
                                                "started": "earlier", "slurm_job": "4242",
                                                "slurm_restart": 0}))
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**_sbatch_env(_stubs(tmp_path / "bin"), logs, "4242"), "SLURM_RESTART_COUNT": "1"}   # requeued once
    job = subprocess.run(["bash", str(script)], env=env,
                         cwd=logs, capture_output=True, text=True, timeout=240)
    node_logs = {p.name: p.read_text() for p in sorted(logs.glob("node*.log"))}
    everything = job.stdout + job.stderr + "".join(node_logs.values())
    assert job.returncode == 0, everything[-6000:]
    assert sorted(node_logs) == ["node0.log", "node1.log"]
    assert f"rendezvous at localhost:{port}" in job.stdout
    assert (logs / "srun_options").read_text().split() == ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                                                          "--kill-on-bad-exit=1"]
    assert f"took over {ckpt / 'lock.json'}" in everything and "incarnation 0 of this SLURM job 4242" in everything
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert measured["world_size"] == 4
    assert_matches_reference(tmp_path / "measured.json", ckpt, reference(), "slurm dp2xtp2")
    assert not (ckpt / "lock.json").exists()


def test_slurm_script_lines_from_the_cluster_and_the_run_options(tmp_path):
    """A GPU cluster: --gpus-per-node, the cluster's and the group's env (the group's wins), the
    scheduler flags, and every run option forwarded with its path made absolute."""
    make_plan(tmp_path / "plan.json", dp=2, tp=2, micro_batch=2, zero=3)
    (tmp_path / "gpus.yaml").write_text(GPU_CLUSTER)
    out = run_cli("launch", "plan.json", "--slurm", "--cluster", "gpus.yaml", "-o", "jobs/train.sbatch",
                  "--partition", "gpu", "--time", "2-00:00:00", "--account", "proj1", "--job-name", "gpt",
                  "--steps", 7, "--lr", "0.002", "--checkpoint-dir", "ck dir", "--checkpoint-every", 3,
                  "--metrics", "m.jsonl", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "WARNING" not in out.stderr and "sbatch" in out.stdout
    text = (tmp_path / "jobs" / "train.sbatch").read_text()
    sbatch = [l.split(None, 1)[1] for l in text.splitlines() if l.startswith("#SBATCH ")]
    assert sbatch == ["--job-name=gpt", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2",
                      "--cpus-per-task=2", "--partition=gpu", "--time=2-00:00:00", "--account=proj1",
                      f"--output={tmp_path / 'jobs'}/%x-%j.out", "--open-mode=append", "--no-requeue",
                      "--signal=TERM@120"]
    exports = [l for l in text.splitlines() if l.startswith("export ")]
    assert exports == ["export NCCL_IB_HCA=mlx5", "export NCCL_DEBUG=INFO", "export NCCL_SOCKET_IFNAME=ib0,ib1"]
    command = " ".join(l.rstrip("\\").strip() for l in text.splitlines()[text.splitlines().index(
        next(l for l in text.splitlines() if l.startswith("srun "))):])
    for piece in ('--nnodes "$SLURM_NNODES" --nproc-per-node 2 --rdzv-backend c10d',
                  '--rdzv-endpoint "$RDZV_HOST:29400" --rdzv-id "$SLURM_JOB_ID"', "-m autopar.runtime",
                  f"{tmp_path / 'plan.json'} --steps 7 --lr 0.002", f"--checkpoint-dir '{tmp_path / 'ck dir'}'",
                  "--checkpoint-every 3", f"--metrics {tmp_path / 'm.jsonl'}"):
        assert piece in command, (piece, command)
    # a job given another node count stops before srun, naming replan
    wrong = subprocess.run(["bash", str(tmp_path / "jobs" / "train.sbatch")], env=worker_env(SLURM_NNODES="3"),
                           capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "the plan runs on 2" in wrong.stderr and "autopar replan" in wrong.stderr


def test_slurm_bad_input_exits_2_and_writes_nothing(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, tp=2, micro_batch=2, zero=3)
    before = plan.read_text()
    (tmp_path / "c.yaml").write_text(CPU_CLUSTER)
    (tmp_path / "small.yaml").write_text(CPU_CLUSTER.replace("nodes: 2", "nodes: 1"))
    (tmp_path / "bad-env.yaml").write_text(CPU_CLUSTER.replace("GLOO_SOCKET_IFNAME: lo", "2BAD: lo"))
    base = ("launch", plan, "--cluster", tmp_path / "c.yaml", "-o", tmp_path / "job.sbatch")
    for extra, said in (((), "--slurm"),
                        (("--slurm", "--requeue"), "--requeue needs --checkpoint-dir"),
                        (("--slurm", "--time", "tomorrow"), "--time 'tomorrow'"),
                        (("--slurm", "--partition", "a b"), "#SBATCH line"),
                        (("--slurm", "--steps", "0"), "--steps")):
        out = run_cli(*base, *extra)
        assert out.returncode == 2, (extra, out.stderr)
        assert said in _flat(out.stderr) and "Traceback" not in out.stderr, (extra, out.stderr)
    for cluster, said in (("small.yaml", "has 2 devices"), ("bad-env.yaml", "field env.2BAD")):
        out = run_cli("launch", plan, "--slurm", "--cluster", tmp_path / cluster, "-o", tmp_path / "job.sbatch")
        assert out.returncode == 2 and said in _flat(out.stderr), out.stderr
    out = run_cli("launch", plan, "--slurm", "--cluster", tmp_path / "c.yaml", "-o", plan)
    assert out.returncode == 2 and "would destroy it" in _flat(out.stderr), out.stderr
    assert plan.read_text() == before
    assert not (tmp_path / "job.sbatch").exists()


def test_lock_of_an_earlier_incarnation_of_the_slurm_job_is_taken_over(tmp_path, monkeypatch):
    """A requeued job's rank 0 may start on another node than the incarnation that died holding
    the lock; the job id (kept by a requeue) and a lower restart count say the holder is gone.
    The same incarnation's lock from another host (a run that may be alive), another job's, and
    any lock outside SLURM stay refused."""
    from autopar.runtime import checkpoint_lock

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    elsewhere = {"pid": os.getpid(), "host": socket.gethostname() + "-other", "plan": "p.json", "started": "then"}
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    for holder in ({"slurm_job": "76", "slurm_restart": 0}, {"slurm_job": "77", "slurm_restart": 2}):
        (ckpt / "lock.json").write_text(json.dumps({**elsewhere, **holder}))
        with pytest.raises(checkpoint_lock.CheckpointLockError, match="in use by another run"):
            checkpoint_lock.acquire(ckpt, "p.json")
    (ckpt / "lock.json").write_text(json.dumps({**elsewhere, "slurm_job": "77", "slurm_restart": 1}))
    note = checkpoint_lock.acquire(ckpt, "p.json")
    assert note is not None and "incarnation 1 of this SLURM job 77" in note
    held = json.loads((ckpt / "lock.json").read_text())
    assert (held["slurm_job"], held["slurm_restart"], held["host"], held["pid"]) == \
        ("77", 2, socket.gethostname(), os.getpid())
    checkpoint_lock.release(ckpt)
    assert not (ckpt / "lock.json").exists()
    # outside SLURM the same lock is another host's run: refused
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    (ckpt / "lock.json").write_text(json.dumps({**elsewhere, "slurm_job": "77", "slurm_restart": 1}))
    with pytest.raises(checkpoint_lock.CheckpointLockError):
        checkpoint_lock.acquire(ckpt, "p.json")


# ----------------------------------------------------------------------------- replan

def _planned(tmp_path: Path, cluster: str) -> Path:
    """A plan made by 'autopar plan' for the small GPT on ``cluster`` (4 ranks, dp 2 x tp 2 fixed)."""
    from runtime_support import GLOBAL_BATCH, GPT, MODEL_ARGS

    (tmp_path / "cluster.yaml").write_text(cluster)
    margs = [f for k, v in MODEL_ARGS.items() for f in ("--model-arg", f"{k}={v}")]
    out = run_cli("plan", GPT, *margs, "--cluster", tmp_path / "cluster.yaml", "--global-batch", GLOBAL_BATCH,
                  "--dp", 2, "--tp", 2, "--time-budget", 1, "-o", tmp_path / "plan4.json")
    assert out.returncode == 0, out.stderr
    return tmp_path / "plan4.json"


def test_replan_for_fewer_nodes_keeps_the_model_and_the_global_batch(tmp_path):
    """4 ranks on two nodes -> 2 ranks on one (--nodes 1): the same model file, arguments and
    fingerprint, the same global batch, the predicted step times of both plan files printed,
    the checkpoint described and the resume command given; a cluster where nothing fits and the
    rank count does not divide the batch asks for --global-batch (exit 2), writing nothing."""
    from autopar.core.plan import load_plan

    from runtime_support import GLOBAL_BATCH, MODEL_ARGS

    old_path = _planned(tmp_path, CPU_CLUSTER.replace("env: {GLOO_SOCKET_IFNAME: lo}\n", ""))
    ck = tmp_path / "ck"
    (ck / "step_00000003").mkdir(parents=True)
    (ck / "latest.json").write_text(json.dumps({"step": 3, "path": "step_00000003"}))
    (ck / "step_00000003" / "manifest.json").write_text(json.dumps(
        {"step": 3, "world_size": 4, "mesh": {"dp": 2, "pp": 1, "tp": 2}, "zero": 3}))
    out = run_cli("replan", old_path, "--nodes", 1, "--time-budget", 1, "--checkpoint-dir", ck,
                  "-o", tmp_path / "plan2.json")
    assert out.returncode == 0, out.stderr
    old, new = load_plan(old_path), load_plan(tmp_path / "plan2.json")
    assert new.world_size == 2 and new.global_batch == old.global_batch == GLOBAL_BATCH
    assert new.model.args == MODEL_ARGS and new.model.fingerprint == old.model.fingerprint
    assert new.provenance["cluster_nodes"] == 1
    text = _flat(out.stdout)
    assert (f"predicted step time: {1e3 * old.predicted['step_time_s']:.2f} ms before, "
            f"{1e3 * new.predicted['step_time_s']:.2f} ms after") in text
    assert f"({old.world_size} ranks, dp 2 x tp 2, on two-cpu-nodes" in text and "-> " in text
    assert f"global batch: {GLOBAL_BATCH} samples per step, kept" in text
    assert "is step 3 saved by 4 ranks (dp2 x tp2, ZeRO-3)" in text
    assert f"autopar run {tmp_path / 'plan2.json'} --checkpoint-dir {ck}" in text
    tiny = CPU_CLUSTER.replace("nodes: 2", "nodes: 3").replace("gpus_per_node: 2", "gpus_per_node: 1") \
                      .replace("host_memory_GB: 8", "host_memory_GB: 8\n    gpu_memory_GB: 0.0001")
    (tmp_path / "tiny.yaml").write_text(tiny)
    out = run_cli("replan", old_path, "--cluster", tmp_path / "tiny.yaml", "--time-budget", 1,
                  "-o", tmp_path / "plan3.json")
    assert out.returncode == 2, out.stderr
    assert "--global-batch 3 or --global-batch 6" in _flat(out.stderr), out.stderr
    assert not (tmp_path / "plan3.json").exists()
