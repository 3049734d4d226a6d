"""The training log's figures (runtime/metrics.py) against hand-computed values: tokens/s, MFU in
closed form, the device peak from the plan's cluster, the log line, the --metrics jsonl (resumes
included), TensorBoard where the package is installed, the progress line (a pseudo-terminal and
a forced one), and the output checks of --metrics / --tensorboard."""
from __future__ import annotations

import io
import json
import os
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autopar.core.errors import UserError
from autopar.core.plan import ModelRef, uniform_plan
from autopar.runtime import metrics as M
from autopar.runtime.options import RunOptions

REPO = Path(__file__).resolve().parents[2]


def _plan(**kw):
    return uniform_plan(model=ModelRef(file="m.py", args={}, name="m", fingerprint="f"), num_layers=2, dp=2,
                        micro_batch=2, **kw)


def test_throughput_and_mfu_closed_form():
    # 8 samples of 128 tokens in 0.5 s: 16 samples/s, 2048 tokens/s
    assert M.throughput(8, 128, 0.5) == (16.0, 2048.0)
    assert M.throughput(8, None, 0.5) == (16.0, None)
    # 3e12 model FLOPs per step in 0.5 s on 4 devices of 2e12 FLOP/s each: 3e12 / (0.5 * 4 * 2e12) = 0.75
    assert M.mfu(3e12, 0.5, 4, 2e12) == pytest.approx(0.75)
    assert M.mfu(3e12, 0.5, 4, None) is None


def test_flops_per_sample_does_not_depend_on_the_captured_batch():
    from autopar.core.capture import capture_model_file

    args = dict(layers=1, hidden=32, inputs=8, outputs=4)
    a, b = (capture_model_file(str(REPO / "examples" / "mlp.py"), args, n) for n in (3, 5))
    assert a.flops_per_sample == pytest.approx(b.flops_per_sample) == pytest.approx(a.flops_per_step / 3)
    assert a.flops_per_sample > 6 * (8 * 32 + 32 * 32 + 32 * 4) * 0.8     # about 6 x parameters (Kaplan et al.)


def test_the_device_peak_comes_from_the_plans_cluster():
    from autopar.core.profile_schema import load_profile

    cpu = M.plan_device_peak(_plan(cluster="local-cpu"), "plan.json", "cpu")
    assert cpu.flops_per_s == load_profile("local-cpu")["peak_flops"]["fp32"]
    assert "local-cpu" in cpu.note and "fp32" in cpu.note
    # a CPU profile says nothing of a GPU, nor a GPU profile of a CPU
    assert M.plan_device_peak(_plan(cluster="local-cpu"), "plan.json", "cuda").flops_per_s is None
    assert M.plan_device_peak(_plan(cluster="h100-16x8", precision="bf16"), "plan.json", "cpu").flops_per_s is None
    h100 = M.plan_device_peak(_plan(cluster="h100-16x8", precision="bf16"), "plan.json", "cuda")
    assert h100.flops_per_s == 989.4e12
    # a 500 W part holds a lower clock: the datasheet peak x sustained / boost (1545 / 1830 MHz)
    w500 = M.plan_device_peak(_plan(cluster="h100-96gb-500w-1x8", precision="bf16"), "plan.json", "cuda")
    assert w500.flops_per_s == pytest.approx(989.4e12 * 1545 / 1830)
    none = M.plan_device_peak(_plan(), "plan.json", "cpu")
    assert none.flops_per_s is None and none.note.startswith("mfu n/a: the plan names no cluster")
    gone = M.plan_device_peak(_plan(cluster="no-such-cluster"), "plan.json", "cpu")
    assert gone.flops_per_s is None and "no-such-cluster or its device profile does not load" in gone.note


def test_log_line():
    f = M.StepFigures(step=4, loss=3.25, step_time_s=0.0125, lr=3e-4, grad_norm=0.5, samples_per_s=320.0,
                      tokens_per_s=5120.0, mfu=0.123456, peak_memory_bytes=3 * 2**20)
    assert M.format_line(f, 10) == ("step 4/10 loss 3.250000 step_time 12.5 ms lr 3.000e-04 grad_norm 0.5000 "
                                    "tokens/s 5120 mfu 12.35% peak_mem 3.00 MiB")
    g = M.StepFigures(step=1, loss=1.0, step_time_s=0.5, lr=None, grad_norm=None, samples_per_s=16.0,
                      tokens_per_s=None, mfu=None, peak_memory_bytes=0)
    assert M.format_line(g, 2) == ("step 1/2 loss 1.000000 step_time 500.0 ms lr n/a grad_norm n/a "
                                   "samples/s 16.0 mfu n/a peak_mem 0 B")


def _fake_trainer(tmp_path, logged: list, **opts):
    """What Metrics.for_trainer reads of a Trainer: a plan on local-cpu (dp 2, global batch 4), a
    graph of 1e6 model FLOPs per sample and 16 tokens, rank 0 of 2 on the CPU."""
    plan = _plan(cluster="local-cpu")
    graph = SimpleNamespace(flops_per_sample=1e6, seq_len=16)
    t = SimpleNamespace(opts=RunOptions(plan_path=tmp_path / "plan.json", **opts), plan=plan,
                        ctx=SimpleNamespace(is_logging_rank=True, world_size=2, device=torch.device("cpu")),
                        checked=SimpleNamespace(graph=graph), first_step=0, losses=[],
                        memory=SimpleNamespace(peak_bytes=lambda: 5 * 2**20), log=logged.append)
    return t


def test_metrics_jsonl_and_log_lines_hand_computed(tmp_path):
    from autopar.core.profile_schema import load_profile

    logged: list[str] = []
    path = tmp_path / "m.jsonl"
    t = _fake_trainer(tmp_path, logged, steps=3, metrics_path=path, progress="off", lr=2e-3)
    m = M.Metrics.for_trainer(t)
    peak = load_profile("local-cpu")["peak_flops"]["fp32"]
    times = [0.5, 0.25, 0.125]
    for done, (dt, loss) in enumerate(zip(times, [4.0, 3.5, 3.0]), start=1):
        t.losses.append(loss)
        if done == 2:                                   # what the optimizer helper sets after a step
            t.last_lr, t.last_grad_norm = 1e-3, torch.tensor(2.5)
        m.after_step(t, done, dt, logged=done != 1)
    m.record({"step": 3, "val_loss": 2.75})
    m.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 3] and rows[2] == {"step": 3, "val_loss": 2.75}
    for r, dt, loss in zip(rows[:2], times[1:], [3.5, 3.0]):
        assert list(r) == list(M.STEP_KEYS)
        assert r["loss"] == loss and r["step_time_s"] == dt
        assert r["samples_per_s"] == 4 / dt and r["tokens_per_s"] == 4 * 16 / dt
        assert r["mfu"] == pytest.approx(1e6 * 4 / (dt * 2 * peak))
        assert r["lr"] == 1e-3 and r["grad_norm"] == 2.5 and r["peak_memory_bytes"] == 5 * 2**20
    lines = [l for l in logged if l.startswith("step ")]
    assert lines[0].startswith("step 2/3 loss 3.500000 step_time 250.0 ms lr 1.000e-03 grad_norm 2.5000 tokens/s 256 ")
    assert any(l.startswith("mfu against profile local-cpu's fp32 peak") for l in logged)


def test_without_the_optimizer_figures_lr_is_the_constant_one_and_grad_norm_na(tmp_path):
    logged: list[str] = []
    t = _fake_trainer(tmp_path, logged, steps=1, lr=2e-3)
    m = M.Metrics.for_trainer(t)
    t.losses.append(1.0)
    m.after_step(t, 1, 0.1, logged=True)
    assert "lr 2.000e-03 grad_norm n/a" in logged[-1]


def test_other_ranks_write_nothing(tmp_path):
    logged: list[str] = []
    t = _fake_trainer(tmp_path, logged, steps=1, metrics_path=tmp_path / "m.jsonl", progress="on")
    t.ctx.is_logging_rank = False
    m = M.Metrics.for_trainer(t)
    t.losses.append(1.0)
    m.after_step(t, 1, 0.1, logged=True)
    m.record({"step": 1, "val_loss": 1.0})
    m.close()
    assert logged == [] and not (tmp_path / "m.jsonl").exists()


def test_a_resumed_run_keeps_the_records_up_to_its_first_step(tmp_path):
    path = tmp_path / "m.jsonl"
    old = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
    path.write_text("\n".join(old) + '\n{"step": 7, "lo')        # torn by a crash mid-line
    w = M.JsonlWriter(path, first_step=4)
    w.write({"step": 5, "loss": 0.5, "grad_norm": float("inf")})
    w.close()
    lines = path.read_text().splitlines()
    assert lines[:4] == old[:4]
    assert json.loads(lines[4]) == {"step": 5, "loss": 0.5, "grad_norm": "inf"} and len(lines) == 5
    M.JsonlWriter(path, first_step=0).close()                        # a fresh run starts the file afresh
    assert path.read_text() == ""


def test_tensorboard_folder_default():
    assert M.tensorboard_folder(None, None) is None
    assert M.tensorboard_folder(Path("a/m.jsonl"), Path("tb")) == Path("tb")
    want = Path("a/m_tb") if M.tensorboard_available() else None
    assert M.tensorboard_folder(Path("a/m.jsonl"), None) == want


@pytest.mark.skipif(not M.tensorboard_available(), reason="the tensorboard package is not installed")
def test_tensorboard_events_hold_the_records(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = M.TensorBoardWriter(tmp_path / "tb")
    w.write({"step": 2, "loss": 3.5, "lr": None, "tokens_per_s": 256.0})
    w.write({"step": 3, "val_loss": 2.75})
    w.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(2, 3.5)]
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [(3, 2.75)]
    assert "lr" not in acc.Tags()["scalars"]


def test_progress_line_and_eta_forced_on(tmp_path):
    out = io.StringIO()
    logged: list[str] = []
    t = _fake_trainer(tmp_path, logged, steps=4)
    m = M.Metrics.for_trainer(t)
    m.progress = M.Progress(out)                       # --progress on, into a non-terminal
    m.log = lambda msg: (m.end_line(), out.write(f"[autopar] {msg}\n"))
    times = [0.4, 1.0, 0.2, 0.3]
    for done, dt in enumerate(times, start=1):
        t.losses.append(5.0 - done)
        m.after_step(t, done, dt, logged=done in (2, 4))
    text = out.getvalue()
    # ETA = median of the step times so far x steps left: after step 1, 0.4 s x 3; after step 3,
    # median(0.4, 1.0, 0.2) = 0.4 s x 1
    first = f"step 1/4 (25%) {400.0:.1f} ms/step ETA {M.fmt_duration(0.4 * 3)}"
    assert text.startswith("\r" + first)
    assert M.eta_s(times[:3], 3, 4) == statistics.median(times[:3]) * 1
    assert f"\rstep 3/4 (75%) loss 3.0000 400.0 ms/step ETA 0:00:00" in text
    # the log line replaces the progress line (blanked first) and ends with a newline
    assert "\r" + " " * len(first) + "\r[autopar] step 2/4 loss 3.000000" in text
    assert text.endswith("\n") and "step 4/4 (100%)" not in text


def test_progress_auto_is_on_in_a_terminal_only():
    import pty

    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w") as tty:
            assert M.progress_wanted("auto", tty)
            assert not M.progress_wanted("off", tty)
    finally:
        os.close(master)
    assert not M.progress_wanted("auto", io.StringIO())
    assert M.progress_wanted("on", io.StringIO())


def test_eta_format():
    assert M.fmt_duration(3725.4) == "1:02:05" and M.fmt_duration(0) == "0:00:00"
    assert M.progress_text(2, 4, None, [1.0, 3.0]) == "step 2/4 (50%) 2000.0 ms/step ETA 0:00:04"


@pytest.mark.parametrize("case,words", [
    ("folder", "is a folder"),
    ("measured", "is the file --measured writes"),
    ("input", "is the same file as"),
])
def test_bad_metrics_paths_are_refused(tmp_path, case, words):
    from autopar.core.output_file import forget_inputs, note_input
    from autopar.runtime.output_paths import check_output_paths

    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    target = {"folder": tmp_path, "measured": tmp_path / "measured.json", "input": plan}[case]
    if case == "input":
        note_input(plan, "plan file")
    try:
        with pytest.raises(UserError, match=words):
            check_output_paths(RunOptions(plan_path=plan, metrics_path=target))
    finally:
        forget_inputs()
    check_output_paths(RunOptions(plan_path=plan, metrics_path=tmp_path / "new" / "m.jsonl"))
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(M.tensorboard_available(), reason="checks the refusal where tensorboard is missing")
def test_tensorboard_without_the_package_is_refused(tmp_path):
    from autopar.runtime.output_paths import check_output_paths

    with pytest.raises(UserError, match="pip install tensorboard"):
        check_output_paths(RunOptions(plan_path=tmp_path / "plan.json", tensorboard_dir=tmp_path / "tb"))


def test_run_flags_reach_the_options():
    import argparse

    from autopar.runtime.options import add_run_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_run_arguments(p)
    o = options_from_args(p.parse_args(["plan.json", "--metrics", "m.jsonl", "--tensorboard", "tb",
                                        "--progress", "on"]))
    assert (o.metrics_path, o.tensorboard_dir, o.progress) == (Path("m.jsonl"), Path("tb"), "on")
    assert options_from_args(p.parse_args(["plan.json"])).progress == "auto"
