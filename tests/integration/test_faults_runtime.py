"""Runtime faults (issue 14): each a user's mistake or a damaged input that must end in one
clear message and a non-zero exit code, with nothing lost.

* damaged checkpoint: 64 bytes flipped in a ``.distcp`` shard -> refused (exit 2) naming the
  file and what to do; doing it (deleting the damaged step) resumes from the previous
  checkpoint and ends on the plain reference's losses and weights;
* a DCP ``.metadata`` replaced by a pickle that would run code, and a plain DCP folder given
  as ``--checkpoint-dir``: refused before anything is unpickled (the pickle's marker file is
  never created); another model's checkpoint: refused;
* a non-finite loss (``--lr 1e30``): the run stops (exit 2) and the newest checkpoint is the
  last one with finite weights;
* a loss_fn that fails on the last pipeline stage (rank 1): rank 1's message, exit 2;
* a plan with tp = 3 over 4 heads, and unwritable ``--checkpoint-dir`` / ``--measured``:
  refused before any process starts;
* a make_batch that ignores batch_size; --steps at or below the checkpoint's step: refused;
* --keep-checkpoints keeps the newest N;
* a checkpoint folder locked by a live process is refused at start (exit 2, naming its pid and
  host), a stale lock taken over; a save whose writer fails like a full disk on one rank stops
  the run with one message (exit 2), leaves no folder of that step and keeps the previous
  checkpoint, from which a rerun ends on the reference;
* a collective's figure is never below the same call timed back to back (a CPU collective
  was recorded at 1e-7 s).

Multi-rank cases are real torchrun launches (2 gloo ranks) of the small GPT; one launch
writes the checkpoint folder that the checkpoint cases copy.  The damaged checkpoint is resumed
through ``autopar run`` (message and exit code); the other refusals of a checkpoint call
``checkpointing.resume`` -- the checks every rank makes -- in this process on a one-rank group.
Each fault that ends a run is its own launch (its own exit code); the reruns that follow four
of them (damage, stale lock, failed save, SIGTERM) are cases of one shared launch (``faulted``).
Refusals made before any process starts run the CLI in this process (``cli_inprocess``).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from cli_inprocess import run_cli
from runtime_support import (GPT, MODEL_ARGS, ROOT, WORKER, assert_matches_reference, consolidated_params,
                             failure_summary, make_plan, reference, torchrun, worker_env)

TIMEOUT_S = 240


def autopar_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar.cli", "run", *map(str, args)], env=env or worker_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_clean_refusal(out: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    log = out.stdout + out.stderr
    assert out.returncode == code, log[-5000:]
    flat = "".join(out.stderr.split())          # messages are wrapped into a paragraph
    for n in needles:
        assert "".join(n.split()) in flat, (n, log[-5000:])
    assert "Connection closed" not in log, log[-5000:]
    assert "Traceback" not in log, log[-5000:]
    # one message per failure: no repeat, no torchrun lines about stopping the other ranks
    assert out.stderr.count("error:") == 1 and "closing signal" not in log, log[-5000:]


def plan_for_model_file(model_path: Path, plan_path: Path, **kw) -> Path:
    """A uniform plan for a model file written by a test (captured here, like 'autopar plan')."""
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = capture_model_file(str(model_path), dict(MODEL_ARGS), kw.get("micro_batch", 1))
    ref = ModelRef(file=str(model_path), args=dict(MODEL_ARGS), name=model_path.stem, fingerprint=g.fingerprint)
    save_plan(uniform_plan(model=ref, num_layers=len(g.layers), **kw), plan_path)
    return plan_path


def gpt_variant(path: Path, body: str) -> Path:
    """A model file that takes examples/gpt.py's model and overrides some of its functions."""
    path.write_text(textwrap.dedent(f"""
        import importlib.util
        _spec = importlib.util.spec_from_file_location("_gpt_base", {str(GPT)!r})
        _gpt = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_gpt)
        build_model = _gpt.build_model
        make_batch = _gpt.make_batch
        loss_fn = _gpt.loss_fn
    """) + textwrap.dedent(body))
    return path


# ------------------------------------------------------------------ one shared checkpoint run

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """dp=2 run of 4 steps, a checkpoint every step (the default --keep-checkpoints: 3 kept)."""
    d = tmp_path_factory.mktemp("trained")
    plan = make_plan(d / "plan.json", dp=2, micro_batch=2)
    out = autopar_run(plan, "--steps", 4, "--checkpoint-dir", d / "ckpt", "--checkpoint-every", 1,
                      "--timing-warmup", 1)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return d


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(trained / "ckpt", tmp_path / "ckpt")
    shutil.copy(trained / "plan.json", tmp_path / "plan.json")
    return tmp_path / "plan.json", tmp_path / "ckpt"


@pytest.mark.multiproc
def test_keep_checkpoints_keeps_the_newest_n(trained, tmp_path):
    ckpt = trained / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest.json", "step_00000002", "step_00000003",
                                                      "step_00000004"]
    manifest = json.loads((ckpt / "step_00000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 2 and len(manifest["losses"]) == 4
    on_disk = {p.name for p in (ckpt / "step_00000004").iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk
    # --keep-checkpoints 1 after the next save: the same pruning, on a copy
    from autopar.runtime.checkpointing import prune

    _, copy = _copy(trained, tmp_path)
    (copy / "step_00000005").mkdir()                  # an interrupted save (no manifest) is not counted
    prune(copy, keep=1)
    assert sorted(p.name for p in copy.iterdir()) == ["latest.json", "step_00000004", "step_00000005"]


_PAYLOAD = """
import pathlib, pickle, sys
class Payload:
    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(sys.argv[2]),))
pathlib.Path(sys.argv[1]).write_bytes(pickle.dumps(Payload()))
"""


def resume_here(ckpt: Path, tmp_path: Path, steps: int = 5, fingerprint: str | None = None):
    """``checkpointing.resume`` of the small GPT's plan in this process (a one-rank gloo group):
    the checks every rank of a run makes before DCP reads anything."""
    import torch.distributed as dist

    from autopar.runtime import checkpointing

    identity = checkpointing.CheckpointIdentity(
        fingerprint=fingerprint or _fingerprint(ckpt),
        world_size=2, mesh={"dp": 2, "pp": 1, "tp": 1}, zero=0)
    store = dist.FileStore(tempfile.mktemp(prefix="store", dir=tmp_path), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return checkpointing.resume(ckpt, [], [], identity, steps)
    finally:
        dist.destroy_process_group()


def _fingerprint(ckpt: Path) -> str:
    return json.loads(next(ckpt.glob("step_*/manifest.json")).read_text())["model_fingerprint"]


@pytest.mark.multiproc
def test_checkpoint_metadata_is_never_unpickled_unverified(trained, tmp_path):
    from autopar.runtime.checkpointing import CheckpointError

    _, ckpt = _copy(trained, tmp_path)
    marker = tmp_path / "pickle_ran"
    subprocess.run([sys.executable, "-c", _PAYLOAD, str(ckpt / "step_00000004" / ".metadata"), str(marker)],
                   check=True)
    with pytest.raises(CheckpointError, match=r"file \.metadata .*manifest.*was not loaded"):
        resume_here(ckpt, tmp_path)
    assert not marker.exists()
    # a plain DCP folder (no manifest) given as the checkpoint folder is not an autopar one
    dcp_dir = tmp_path / "dcp"
    shutil.copytree(ckpt / "step_00000003", dcp_dir)
    (dcp_dir / "manifest.json").unlink()
    subprocess.run([sys.executable, "-c", _PAYLOAD, str(dcp_dir / ".metadata"), str(marker)], check=True)
    with pytest.raises(CheckpointError, match=r"\.metadata.*not an autopar checkpoint folder"):
        resume_here(dcp_dir, tmp_path, fingerprint="x")
    assert not marker.exists()


@pytest.mark.multiproc
def test_another_models_checkpoint_is_refused(trained, tmp_path):
    from autopar.runtime.checkpointing import CheckpointError

    _, ckpt = _copy(trained, tmp_path)
    with pytest.raises(CheckpointError, match="feedfacefeedface.*another model's checkpoint.*new --checkpoint-dir"):
        resume_here(ckpt, tmp_path, fingerprint="feedfacefeedface")


@pytest.mark.multiproc
def test_steps_at_or_below_the_checkpoint_step_are_refused(trained, tmp_path):
    from autopar.runtime.checkpointing import CheckpointError

    _, ckpt = _copy(trained, tmp_path)
    for steps in (3, 4):
        with pytest.raises(CheckpointError, match=f"step 4, and --steps is {steps}.*--steps greater than 4"):
            resume_here(ckpt, tmp_path, steps=steps)


# ------------------------------------------------------------------ the non-finite guard

@pytest.mark.multiproc
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, micro_batch=2)
    ckpt = tmp_path / "ckpt"
    # an absurd learning rate: the weights overflow within a couple of steps
    out = autopar_run(plan, "--steps", 6, "--checkpoint-dir", ckpt, "--checkpoint-every", 1, "--lr", "1e30")
    assert_clean_refusal(out, 2, "training stopped")
    assert "loss is nan" in out.stderr or "loss is inf" in out.stderr or "non-finite" in out.stderr, out.stderr
    latest = json.loads((ckpt / "latest.json").read_text())
    assert latest["step"] < 6
    steps = sorted(int(p.name[5:]) for p in ckpt.glob("step_*"))
    assert steps[-1] == latest["step"]                          # nothing saved after the failure
    assert all(torch.isfinite(t).all() for t in consolidated_params(ckpt).values())
    assert all(v == v and abs(v) != float("inf") for v in latest["losses"])
    assert not (tmp_path / "measured.json").exists()


@pytest.mark.multiproc
def test_non_finite_weights_are_never_saved(tmp_path):
    """A loss whose value is finite but whose gradient is not (``sqrt`` at 0 has an infinite
    derivative, times 0 is nan): step 1's loss is finite, the weights it leaves are nan, and
    the checkpoint of step 1 is refused."""
    model = gpt_variant(tmp_path / "nan_grad.py", """
        import torch

        def loss_fn(logits, target):
            return _gpt.loss_fn(logits, target) + torch.sqrt(0.0 * logits.sum())
    """)
    plan = plan_for_model_file(model, tmp_path / "plan.json", dp=2, micro_batch=2)
    ckpt = tmp_path / "ckpt"
    out = autopar_run(plan, "--steps", 3, "--checkpoint-dir", ckpt, "--checkpoint-every", 1)
    assert_clean_refusal(out, 2, "after step 1 the weights hold non-finite values", "No checkpoint was saved")
    assert "step 1/3 loss" in out.stdout                       # the loss itself was finite
    assert not list(ckpt.glob("step_*")) and not (ckpt / "latest.json").exists()


# ------------------------------------------------------------------ errors on other ranks

@pytest.mark.multiproc
def test_loss_fn_failing_on_the_last_stage_reaches_the_user(tmp_path):
    model = gpt_variant(tmp_path / "bad_loss.py", """
        import torch.distributed as dist

        def loss_fn(logits, target):
            if dist.is_initialized():      # only in the run: the plan's capture still works
                raise ValueError("label smoothing must be in [0, 1), got 1.5")
            return _gpt.loss_fn(logits, target)
    """)
    plan = plan_for_model_file(model, tmp_path / "plan.json", pp=2, micro_batch=1, num_microbatches=2,
                               schedule="1f1b")
    out = autopar_run(plan, "--steps", 2)
    assert_clean_refusal(out, 2, "error: rank 1", "pp stage 1", "label smoothing must be in [0, 1), got 1.5")


# ------------------------------------------------------------------ refused before any process starts

def test_tp_that_does_not_divide_the_heads_is_refused_before_launch(tmp_path):
    plan = make_plan(tmp_path / "plan.json", tp=3, micro_batch=4)
    out = run_cli("run", plan, "--steps", 1)             # the CLI's own checks, in this process
    assert_clean_refusal(out, 2, "tp = 3", "does not divide by 3")
    assert "torch.distributed.run" not in out.stderr          # no process was started


def test_unwritable_outputs_are_refused_before_launch(tmp_path):
    plan = make_plan(tmp_path / "plan.json", dp=2, micro_batch=2)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder\n")
    out = run_cli("run", plan, "--steps", 1, "--checkpoint-dir", blocker / "ckpt")   # in this process
    assert_clean_refusal(out, 2, "--checkpoint-dir", str(blocker))
    assert "torch.distributed.run" not in out.stderr
    out = run_cli("run", plan, "--steps", 1, "--measured", blocker / "m.json")
    assert_clean_refusal(out, 2, "--measured", str(blocker))
    assert "torch.distributed.run" not in out.stderr


def test_make_batch_ignoring_batch_size_is_refused(tmp_path):
    # the plan is made while make_batch is right (capture itself now refuses the wrong one,
    # before any plan exists); then the file changes under it
    model = gpt_variant(tmp_path / "fixed_rows.py", "")
    plan = plan_for_model_file(model, tmp_path / "plan.json", micro_batch=4)
    gpt_variant(model, """
        def make_batch(batch_size, **kw):
            return _gpt.make_batch(2, **kw)          # ignores batch_size
    """)
    out = subprocess.run([sys.executable, "-m", "autopar.runtime", str(plan), "--steps", "1"], env=worker_env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert_clean_refusal(out, 2, "make_batch(4)", "2 rows", "batch_size = 4")
    assert not (tmp_path / "measured.json").exists()


# ------------------------------------------------------------------ the profiler's figures

def test_in_step_collective_figure_is_never_below_the_call_itself(tmp_path, monkeypatch):
    """Bursts that run slower alone than beside the call make the in-step difference negative;
    the figure must still be the call's own time.  A fake clock, advanced only by the burst and
    the call, makes the case exact whatever the host's load."""
    import types

    import torch.distributed as dist

    from autopar.profiling import cpu_in_step, timing
    from autopar.profiling.timing import RepeatPolicy

    clock = {"now": 0.0}
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    bursts = {"n": 0}

    def call():
        clock["now"] += 2e-3

    def burst():
        # with one call per sample, a sample runs [burst; call] then [burst]: odd bursts sit
        # beside the call, even ones are the bursts-alone pass, here 9 ms slower
        bursts["n"] += 1
        clock["now"] += 1e-3 + (9e-3 if bursts["n"] % 2 == 0 else 0.0)

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        policy = RepeatPolicy(warmup=1, min_samples=3, max_samples=3, min_sample_s=0.0, target_total_s=0.0)
        seconds, _ = cpu_in_step.time_in_step(call, torch.device("cpu"), policy, None, burst)
    finally:
        dist.destroy_process_group()
    assert seconds == pytest.approx(2e-3, rel=1e-9)


@pytest.mark.multiproc
def test_checkpoint_folder_without_manifests_is_refused(trained, tmp_path):
    """An autopar folder whose checkpoints have no manifest (an older autopar's, or step folders
    deleted by hand) cannot be verified: refused before any process group is needed."""
    from autopar.runtime import checkpointing

    plan, ckpt = _copy(trained, tmp_path)
    for d in ckpt.glob("step_*"):
        (d / "manifest.json").unlink()
    identity = checkpointing.CheckpointIdentity(fingerprint="x", world_size=2, mesh={}, zero=0)
    with pytest.raises(checkpointing.CheckpointError, match="no checkpoint with a manifest.json"):
        checkpointing.resume(ckpt, [], [], identity, steps=10)


# ------------------------------------------------------------------ faults whose rerun resumes

def _damaged_refusal(trained: Path, d: Path) -> dict:
    """64 bytes flipped in a shard of the newest checkpoint: 'autopar run' refuses to resume;
    then what the message says is done (the damaged step deleted)."""
    plan, ckpt = _copy(trained, d)
    shard = sorted((ckpt / "step_00000004").glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    shard.write_bytes(bytes(data))
    out = autopar_run(plan, "--steps", 5, "--checkpoint-dir", ckpt, "--timing-warmup", 1)
    got = {"out": out, "shard": shard.name, "measured_after_refusal": (d / "measured.json").exists()}
    shutil.rmtree(ckpt / "step_00000004")
    return got


def _lock_refusal(d: Path) -> dict:
    """A folder locked by this live process: 'autopar run' is refused; then the lock is
    replaced by one whose process is gone (a run killed with -9)."""
    import socket

    from autopar.runtime import checkpoint_lock

    plan = make_plan(d / "plan.json", dp=2, micro_batch=2)
    ckpt = d / "ckpt"
    ckpt.mkdir()
    checkpoint_lock.acquire(ckpt, "the-other-run.json")
    out = autopar_run(plan, "--steps", 2, "--checkpoint-dir", ckpt)
    got = {"out": out, "after_refusal": sorted(p.name for p in ckpt.iterdir()),
           "measured_after_refusal": (d / "measured.json").exists()}
    checkpoint_lock.release(ckpt)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (ckpt / "lock.json").write_text(json.dumps({"pid": int(gone.stdout), "host": socket.gethostname(),
                                                "plan": "killed.json", "started": "earlier"}))
    got["gone_pid"] = gone.stdout.strip()
    return got


def _failed_save(d: Path) -> dict:
    """Rank 1's writer fails like a full disk in the save of step 4 (after writing part of its
    shard), in a run of 6 steps with a checkpoint every 2."""
    from runtime_support import free_port

    plan = make_plan(d / "plan.json", dp=2, micro_batch=2)
    ckpt = d / "ckpt"
    worker = Path(__file__).resolve().parents[1] / "failing_save_worker.py"
    out = subprocess.run(
        [sys.executable, "-m", "autopar.runtime.launch", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(worker), str(plan), "--steps", "6",
         "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--timing-warmup", "1",
         "--measured", str(d / "measured.json")],
        env=worker_env(AUTOPAR_TEST_FULL_DISK="1:step_00000004"), cwd=ROOT, capture_output=True, text=True,
        timeout=TIMEOUT_S)
    return {"out": out, "after_failure": sorted(p.name for p in ckpt.iterdir()),
            "latest_after_failure": json.loads((ckpt / "latest.json").read_text())}


def _sigterm(d: Path) -> dict:
    """SIGTERM to 'autopar run' after step 3 of 1000 has been printed."""
    import os
    import signal
    import time

    plan = make_plan(d / "plan.json", dp=2, micro_batch=2)
    ckpt, measured = d / "ckpt", d / "measured.json"
    proc = subprocess.Popen([sys.executable, "-m", "autopar.cli", "run", str(plan), "--steps", "1000",
                             "--checkpoint-dir", str(ckpt), "--measured", str(measured)],
                            env=worker_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        seen = ""
        deadline = time.monotonic() + TIMEOUT_S
        while "step 3/1000" not in seen and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        if "step 3/1000" in seen:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    latest = json.loads((ckpt / "latest.json").read_text()) if (ckpt / "latest.json").exists() else None
    return {"seen": seen, "returncode": proc.returncode, "err": err, "left": _processes_naming(d),
            "latest": latest, "measured_after_stop": measured.exists()}


@pytest.fixture(scope="module")
def faulted(trained, tmp_path_factory):
    """Four faults, each its own launch with its own exit code (a damaged checkpoint, a folder
    locked by a live process, a save that fails like a full disk, a SIGTERM), what each leaves
    on disk noted before anything else runs; then ONE torchrun launch (tests/runtime_worker.py)
    runs the four reruns as cases of one process group: resume past the damage, take over the
    stale lock, resume after the failed save, resume after the SIGTERM.  Each case logs its own
    checkpoint folder's 'resumed from' / 'took over' line, so a test reads its own case."""
    dirs = {k: tmp_path_factory.mktemp(k) for k in ("damaged", "locked", "failed_save", "sigterm")}
    got = {"damaged": _damaged_refusal(trained, dirs["damaged"]), "locked": _lock_refusal(dirs["locked"]),
           "failed_save": _failed_save(dirs["failed_save"]), "sigterm": _sigterm(dirs["sigterm"])}
    k = got["sigterm"]["latest"]["step"] if got["sigterm"]["latest"] else None
    steps = {"damaged": 5, "locked": 2, "failed_save": 4, "sigterm": None if k is None else k + 2}
    cases = [{"name": name, "plan": str(d / "plan.json"), "steps": steps[name], "checkpoint_dir": str(d / "ckpt"),
              "measured": str(d / "measured.json")}
             for name, d in dirs.items() if steps[name] is not None]
    spec = tmp_path_factory.mktemp("reruns") / "cases.json"
    spec.write_text(json.dumps(cases))
    got["reruns"] = torchrun(2, str(WORKER), str(spec), timeout_s=TIMEOUT_S)
    got["dirs"] = dirs
    return got


def _rerun_ok(faulted: dict) -> str:
    out = faulted["reruns"]
    assert out.returncode == 0, failure_summary(out.stdout + out.stderr)
    return out.stdout


@pytest.mark.multiproc
def test_damaged_checkpoint_is_refused_then_resumes_from_the_previous_one(faulted):
    got, d = faulted["damaged"], faulted["dirs"]["damaged"]
    out, shard = got["out"], got["shard"]
    assert_clean_refusal(out, 2, shard, "checksum", "step_00000004", "to resume from step_00000003")
    assert out.stderr.count(f"file {shard}") <= 2          # said by one rank (and repeated once at the end)
    assert not got["measured_after_refusal"]
    # do what the message says (step 4 deleted): the run resumes from step 3 and matches the plain reference
    assert f"resumed from {d / 'ckpt' / 'step_00000003'}" in _rerun_ok(faulted)
    assert json.loads((d / "measured.json").read_text())["first_step"] == 3
    assert_matches_reference(d / "measured.json", d / "ckpt", reference(), "resume after damage")


# ------------------------------------------------------------------ one run per folder, saves that fail

@pytest.mark.multiproc
def test_checkpoint_folder_in_use_is_refused_and_a_stale_lock_taken_over(faulted):
    """A folder locked by a live process (this test's, standing in for another run) is refused
    at start, naming the folder and the holder's pid and host, with nothing written; a lock
    whose process is gone (a run killed with -9) is taken over and removed at the end."""
    import os
    import socket

    got, d = faulted["locked"], faulted["dirs"]["locked"]
    ckpt = d / "ckpt"
    assert_clean_refusal(got["out"], 2, f"--checkpoint-dir {ckpt} is in use by another run", f"pid {os.getpid()}",
                         f"on host {socket.gethostname()}", "the-other-run.json", "another --checkpoint-dir")
    assert got["after_refusal"] == ["lock.json"]
    assert not got["measured_after_refusal"]
    # the rerun, with a lock left by a process that no longer exists
    flat = " ".join(_rerun_ok(faulted).split())
    assert f"took over {ckpt / 'lock.json'}" in flat and f"pid {got['gone_pid']}" in flat
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest.json", "step_00000002"]


@pytest.mark.multiproc
def test_failed_save_keeps_the_last_good_checkpoint_and_says_so_once(faulted):
    """Rank 1's writer fails like a full disk in the save of step 4 (after writing part of its
    shard): the run stops with one message (exit 2, no traceback), step 4 leaves no folder, step
    2 stays the newest checkpoint, and a rerun resumes from it to the reference's losses and
    weights."""
    got, d = faulted["failed_save"], faulted["dirs"]["failed_save"]
    out = got["out"]
    assert_clean_refusal(out, 2, "saving the checkpoint of step 4", "No space left on device",
                         "step_00000002, is kept; a rerun resumes from it")
    flat = "".join((out.stdout + out.stderr).split())
    assert flat.count("savingthecheckpointofstep4") == 1, out.stderr[-5000:]
    assert got["after_failure"] == ["latest.json", "step_00000002"]
    assert got["latest_after_failure"]["step"] == 2
    assert f"resumed from {d / 'ckpt' / 'step_00000002'}" in _rerun_ok(faulted)
    assert_matches_reference(d / "measured.json", d / "ckpt", reference(4), "after a failed save", steps=4)


# ------------------------------------------------------------------ issue 32: signals, silent ranks

def _processes_naming(folder: Path) -> list[int]:
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if str(folder) in d.joinpath("cmdline").read_bytes().decode(errors="replace"):
                out.append(int(d.name))
        except OSError:
            continue
    return out


@pytest.mark.multiproc
def test_sigterm_stops_after_a_consistent_checkpoint_and_the_run_resumes(faulted):
    """SIGTERM to 'autopar run' reaches torchrun and both ranks: they stop after the same step,
    save it, say how to resume, leave no process behind; resuming ends on the plain loop's
    losses and weights, as an uninterrupted run would."""
    import signal

    got, d = faulted["sigterm"], faulted["dirs"]["sigterm"]
    err = got["err"]
    assert "step 3/1000" in got["seen"], got["seen"][-3000:]
    assert got["returncode"] == 128 + signal.SIGTERM, err[-5000:]
    assert "Traceback" not in err and "Connection closed" not in err, err[-5000:]
    flat = " ".join(err.split())
    assert "stopped by SIGTERM after step" in flat and "Resume with: autopar run" in flat, err[-3000:]
    assert got["left"] == []                                      # torchrun and the ranks are gone
    ckpt, latest = d / "ckpt", got["latest"]
    k = latest["step"]
    assert k >= 3 and (ckpt / latest["path"] / "manifest.json").exists()
    assert f"after step {k}/1000" in flat                         # the checkpoint is the step it names
    assert not got["measured_after_stop"]
    assert f"resumed from {ckpt / latest['path']}" in _rerun_ok(faulted)
    assert_matches_reference(d / "measured.json", ckpt, reference(k + 2), "stopped by SIGTERM, resumed", steps=k + 2)


@pytest.mark.multiproc
def test_a_model_failing_on_one_rank_only_is_reported_by_that_rank(tmp_path):
    model = gpt_variant(tmp_path / "rank1.py", """
        import os

        def build_model(**kw):
            if os.environ.get("RANK") == "1":
                raise ValueError("the shard index file is missing on this host (a test fault)")
            return _gpt.build_model(**kw)
    """)
    plan = plan_for_model_file(model, tmp_path / "plan.json", dp=2, micro_batch=2)
    out = autopar_run(plan, "--steps", 2)
    assert_clean_refusal(out, 2, "error: rank 1", "build_model", "the shard index file is missing on this host")
    assert "stopped by SIG" not in out.stderr                     # rank 0, stopped by torchrun, stays quiet
