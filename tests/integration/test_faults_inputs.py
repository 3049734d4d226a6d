"""Bad input on the CLI side (issue 14, cases 1, 3, 4, 7, 8, 9, 10a): each stops with one
paragraph naming what is wrong, where and what to do, exit code 2 (3 when no plan fits), no
traceback, and nothing half-written or clobbered.

The verbs run in this process through ``autopar.cli.main`` (what the ``autopar`` script calls),
so an escaping exception -- a ``SystemExit`` from a model file, an ``OverflowError`` -- fails
the test instead of being turned into an exit code by a wrapper.  The host-memory figure is
checked against a closed form (parameters x bytes of fp32 Adam state), not against autopar.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from autopar.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")
LLAMA = str(ROOT / "examples" / "llama.py")
SMALL_GPT = ["--model-arg", "layers=2", "--model-arg", "hidden=32", "--model-arg", "heads=4",
             "--model-arg", "seq=16", "--model-arg", "vocab=64"]


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return rc, out, err


def refused(capsys, *argv, code: int = 2, words: tuple[str, ...] = ()) -> str:
    """Run a verb that must refuse; return its message after the common checks."""
    rc, out, err = run(capsys, *argv)
    assert rc == code, (rc, out, err)
    assert f"autopar {argv[0]}: error:" in err, err
    message = err.split("error:", 1)[1]
    assert "\n\n" not in message.strip()                      # one paragraph
    for w in words:
        assert w in " ".join(message.split()), (w, err)
    return message


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory) -> Path:
    """A 4-rank plan of the bundled MLP on local-cpu (built by config, no search)."""
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import save_plan
    from autopar.simulator.configure import config_plan

    g = capture_model_file(MLP, {}, 2)
    plan = config_plan(g, degrees={"dp": 4, "tp": 1, "pp": 1},
                       micro_batch=2, global_batch=8, schedule="1f1b", virtual_stages=1,
                       zero=0, recompute="none", offload="none", precision="fp32", sequence_parallel=False,
                       cluster_name="local-cpu")
    path = tmp_path_factory.mktemp("plan") / "mlp.json"
    save_plan(plan.with_predicted({"step_time_s": 0.01}, cluster_ref="local-cpu", cluster_nodes=None), path)
    return path


def edited_plan(src: Path, dst: Path, edit) -> str:
    d = json.loads(src.read_text())
    edit(d)
    dst.write_text(json.dumps(d))
    return str(dst)


# ------------------------------------------------------------------- 1. host memory
ONE_A100_256GB = """
name: one-a100
inter_node: {bandwidth_GBps: 25, latency_us: 5}
groups:
  - {name: a, gpu: a100-80gb-sxm, nodes: 1, gpus_per_node: 1, host_memory_GB: 256}
"""


def test_host_memory_is_a_constraint(capsys, tmp_path):
    # gpt3-175b's blocks, 12 of them (22 B parameters, so the plan's capture and dry runs are
    # short), on one A100 with a 256 GB host: offloading their ~360 GB of fp32 Adam state
    # cannot fit; exit 3, no plan
    out = tmp_path / "p.json"
    msg = refused(capsys, "plan", GPT, "--model-arg", "size=gpt3-175b", "--model-arg", "layers=12", "--cluster",
                  write(tmp_path / "c.yaml", ONE_A100_256GB), "--global-batch", "8", "--time-budget", "5",
                  "-o", out, code=3, words=("host memory", "256.0 GB", "host_memory_GB", "What would make one fit"))
    assert not out.exists() and "gpt3-175b" in msg
    # Llama-7B's blocks, 2 of them (0.67 B parameters, 10.7 GB of fp32 Adam state), on local-cpu
    # (8 GB of host memory): exit 3, no plan
    refused(capsys, "plan", LLAMA, "--model-arg", "size=llama2-7b", "--model-arg", "layers=2", "--cluster", "local-cpu",
            "--global-batch", "4",
            "--time-budget", "5", "-o", out, code=3, words=("host memory", "8.0 GB"))
    assert not out.exists()


def test_host_bytes_per_node_closed_form():
    """ZeRO-3 + offload on every layer, dp = 4 on one 4-device node: the node's host holds the
    whole fp32 Adam state, 16 bytes per parameter (4 param + 4 grad + 8 moments), which is
    compared with the parameter count torch reports for the same model."""
    import torch

    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.core.modelfile import load_model_file
    from autopar.simulator.configure import config_plan
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator

    args = {"size": "llama2-7b", "layers": 2}               # 0.67 B parameters: 10.7 GB > the 8 GB host
    with torch.device("meta"):
        n_params = sum(p.numel() for p in load_model_file(LLAMA).build(**args).parameters())
    g = capture_model_file(LLAMA, args, 1)
    cluster = load_cluster("local-cpu")
    plan = config_plan(g, degrees={"dp": 4, "tp": 1, "pp": 1},
                       micro_batch=1, global_batch=4, schedule="1f1b", virtual_stages=1,
                       zero=3, recompute="full", offload="cpu", precision="fp32", sequence_parallel=False)
    res = PlanEvaluator(g, cluster, CostModel.from_profile("local-cpu")).evaluate(plan)
    assert res.host_bytes_per_node == pytest.approx(16 * n_params, rel=1e-9)
    assert res.host_capacity_bytes == 8e9
    assert not res.host_fits and not res.fits


# -------------------------------------------------------------- 3. sys.exit in a model file
EXIT_AT_IMPORT = "import sys\nsys.exit(0)\n"
EXIT_IN_BUILD = """
import os, sys, torch
if os.environ.get("AUTOPAR_TEST_EXIT_AT_IMPORT"):
    sys.exit(4)
def build_model(**kw):
    if os.environ.get("AUTOPAR_TEST_EXIT_IN_BUILD"):
        sys.exit(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
def make_batch(batch_size, **kw):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""


def test_sys_exit_in_model_file(capsys, tmp_path, monkeypatch):
    at_import = write(tmp_path / "exit_import.py", EXIT_AT_IMPORT)
    in_build = write(tmp_path / "exit_build.py", EXIT_IN_BUILD)
    words = ("sys.exit", "must not exit")
    refused(capsys, "inspect", at_import, words=words + ("exit_import.py",))
    out = tmp_path / "p.json"
    monkeypatch.setenv("AUTOPAR_TEST_EXIT_IN_BUILD", "1")
    refused(capsys, "plan", in_build, "--cluster", "local-cpu", "--global-batch", "4", "-o", out,
            words=words + ("build_model",))
    assert not out.exists()
    refused(capsys, "simulate", in_build, "--cluster", "local-cpu", "--dp", "2", words=words)
    # run: a plan made while the file behaved, then the file exits at import
    monkeypatch.delenv("AUTOPAR_TEST_EXIT_IN_BUILD")
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import save_plan
    from autopar.simulator.configure import config_plan

    g = capture_model_file(in_build, {}, 2)
    plan = config_plan(g, degrees={"dp": 2, "tp": 1, "pp": 1},
                       micro_batch=2, global_batch=4, schedule="1f1b", virtual_stages=1,
                       zero=0, recompute="none", offload="none", precision="fp32", sequence_parallel=False)
    save_plan(plan, tmp_path / "run.json")
    monkeypatch.setenv("AUTOPAR_TEST_EXIT_AT_IMPORT", "1")
    refused(capsys, "run", tmp_path / "run.json", "--dry-run", words=words)


# ------------------------------------------------------------------ 4. bounded loaders
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
CLUSTER = """
inter_node: {{bandwidth_GBps: 25, latency_us: 5}}
groups:
  - {{name: a, gpu: a100-80gb-sxm, nodes: {nodes}, gpus_per_node: 8, host_memory_GB: 2048,
     gpu_memory_GB: {memory}}}
"""


def test_bounded_cluster_and_plan_files(capsys, tmp_path, mlp_plan):
    sim = ("simulate", MLP, "--dp", "1", "--cluster")
    refused(capsys, *sim, write(tmp_path / "bomb.yaml", BOMB), words=("alias", "bomb.yaml"))
    refused(capsys, *sim, write(tmp_path / "n.yaml", CLUSTER.format(nodes=1000000000000, memory=80)),
            words=("groups[0].nodes", "1000000000000", "at most 131072"))
    refused(capsys, *sim, "local-cpu", "--nodes", "100000000", words=("--nodes 100000000", "at most 131072"))
    refused(capsys, *sim, write(tmp_path / "m.yaml", CLUSTER.format(nodes=1, memory="1.0e+300")),
            words=("groups[0].gpu_memory_GB", "at most"))
    (tmp_path / "mb.json").write_text(mlp_plan.read_text().replace('"micro_batch": 2', '"micro_batch": 1e999'))
    refused(capsys, "simulate", tmp_path / "mb.json", "--cluster", "local-cpu", words=("1e999", "mb.json"))
    (tmp_path / "nan.json").write_text(mlp_plan.read_text().replace('"micro_batch": 2', '"micro_batch": NaN'))
    refused(capsys, "simulate", tmp_path / "nan.json", "--cluster", "local-cpu", words=("NaN", "nan.json"))


# -------------------------------------------------------------- 7. run and the plan's nodes
def test_run_prints_the_command_for_a_multi_node_plan(capsys, tmp_path):
    plan = tmp_path / "two.json"
    rc, _, _ = run(capsys, "plan", MLP, "--cluster", "local-cpu", "--nodes", "2", "--global-batch", "16",
                   "--time-budget", "3", "--json", "-o", plan)
    assert rc == 0 and json.loads(plan.read_text())["mesh"]["world_size"] == 8
    rc, out, _ = run(capsys, "run", plan, "--steps", "1", "--dry-run")
    assert rc == 0
    assert "--nnodes 2" in out and "--nproc-per-node 4" in out and "starts nothing here" in out
    refused(capsys, "run", plan, "--nnodes", "1", "--dry-run", words=("--nnodes 2", "two.json"))


def test_absurd_world_size_refused(capsys, tmp_path, mlp_plan):
    def huge(d):
        d["mesh"]["dp"] = 1000000000000
        d["global_batch"] = 2 * 1000000000000
    refused(capsys, "run", edited_plan(mlp_plan, tmp_path / "w.json", huge), "--dry-run", words=("mesh.dp",))


# --------------------------------------------------------------- 8. outputs before the work
MARKING = """
import os, pathlib, torch
def build_model(**kw):
    pathlib.Path(os.environ["AUTOPAR_TEST_MARK"]).write_text("built")
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
def make_batch(batch_size, **kw):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""


def test_outputs_checked_before_the_work(capsys, tmp_path, monkeypatch, mlp_plan):
    model = write(tmp_path / "marking.py", MARKING)
    mark = tmp_path / "mark"
    monkeypatch.setenv("AUTOPAR_TEST_MARK", str(mark))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    refused(capsys, "plan", model, "--cluster", "local-cpu", "--global-batch", "4", "-o", blocker / "p.json",
            words=("-o", "a_file", "not a directory"))
    assert not mark.exists()                                  # refused before the model was built
    measured = tmp_path / "measured.json"
    plan = json.loads(mlp_plan.read_text())
    measured.write_text(json.dumps({"step_time_s": 0.01, "fingerprint": plan["model"]["fingerprint"],
                                    "world_size": 4}))
    for flag in ("--html", "--png"):
        refused(capsys, "report", mlp_plan, measured, flag, blocker / "r.out", words=(flag, "a_file"))


def test_plan_keeps_the_mode_of_the_file_it_replaces(capsys, tmp_path):
    out = tmp_path / "p.json"
    out.write_text("{}")
    os.chmod(out, 0o644)
    rc, _, _ = run(capsys, "plan", MLP, "--cluster", "local-cpu", "--global-batch", "4", "--time-budget", "2",
                   "--json", "-o", out)
    assert rc == 0 and json.loads(out.read_text())["version"] == 1
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_png_written_atomically_and_calibrate_on_bad_figures(capsys, tmp_path, mlp_plan):
    plan = json.loads(mlp_plan.read_text())
    good = {"step_time_s": 0.01, "fingerprint": plan["model"]["fingerprint"], "world_size": 4}
    measured = write(tmp_path / "m.json", json.dumps(good))
    png = tmp_path / "r.png"
    png.write_bytes(b"old")
    os.chmod(png, 0o644)
    rc, _, _ = run(capsys, "report", mlp_plan, measured, "--png", png)
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and stat.S_IMODE(png.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary left
    bad = write(tmp_path / "bad.json", json.dumps({**good, "fwd_s": -1.0}))
    prof = tmp_path / "cal.json"
    refused(capsys, "report", mlp_plan, bad, "--calibrate", "-o", prof, words=("fwd_s", "-1.0", "bad.json"))
    assert not prof.exists()


# ------------------------------------------------------------------ 9. bad values refused
def test_plan_values_must_be_exact(capsys, tmp_path, mlp_plan):
    def frac(d):
        d["mesh"]["dp"] = 2.7
    refused(capsys, "simulate", edited_plan(mlp_plan, tmp_path / "f.json", frac), "--cluster", "local-cpu",
            words=("mesh.dp", "2.7", "JSON integer"))

    def extra(d):
        d["pipeline"]["stages"][0]["layers"].append(99)
    refused(capsys, "simulate", edited_plan(mlp_plan, tmp_path / "e.json", extra), "--cluster", "local-cpu",
            words=("pipeline.stages[0].layers", "two layer indices"))


@pytest.mark.parametrize("step", ["fast", 0, -0.5])
def test_report_refuses_bad_step_time(capsys, tmp_path, mlp_plan, step):
    plan = json.loads(mlp_plan.read_text())
    # with another figure to compare, a bad step time was once shown as a comparison, exit 0
    m = write(tmp_path / "m.json", json.dumps({"step_time_s": step, "fingerprint": plan["model"]["fingerprint"],
                                                "world_size": 4, "fwd_s": 0.004, "max_memory_bytes": 10**6}))
    refused(capsys, "report", mlp_plan, m, words=("step_time_s", "m.json"))


@pytest.mark.parametrize("model,arg", [(GPT, "layers=0"), (LLAMA, "layers=0"), (MLP, "layers=0"),
                                       (str(ROOT / "examples" / "cnn.py"), "blocks=0")])
def test_examples_refuse_zero_layers(capsys, model, arg):
    refused(capsys, "inspect", model, "--model-arg", arg, words=(arg, ">= 1"))


MIXED = """
backend: gloo
inter_node: {bandwidth_GBps: 1, latency_us: 100}
groups:
  - {name: cpu, gpu: local-cpu, nodes: 1, gpus_per_node: 2, host_memory_GB: 8}
  - {name: gpu, gpu: a100-80gb-sxm, nodes: 1, gpus_per_node: 2, host_memory_GB: 8}
"""


def test_cluster_mixing_cpu_and_gpu_refused(capsys, tmp_path):
    refused(capsys, "simulate", MLP, "--dp", "1", "--cluster", write(tmp_path / "mixed.yaml", MIXED),
            words=("'cpu'", "'gpu'", "mixed.yaml", "two cluster files"))


# ---------------------------------------------------------- 10a. prints do not corrupt --json
PRINTING = """
import torch
print("model file imported")
def build_model(**kw):
    print("building")
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
def make_batch(batch_size, **kw):
    print("a batch")
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""


def test_model_prints_do_not_corrupt_json(capsys, tmp_path):
    model = write(tmp_path / "printing.py", PRINTING)
    for argv in (("inspect", model, "--json"),
                 ("simulate", model, "--cluster", "local-cpu", "--dp", "2", "--json"),
                 ("plan", model, "--cluster", "local-cpu", "--global-batch", "4", "--time-budget", "2", "--json",
                  "-o", tmp_path / "p.json")):
        rc, out, err = run(capsys, *argv)
        assert rc == 0
        json.loads(out)                                       # stdout is the JSON alone
        assert "model file imported" in err                   # the prints went to stderr
        # a capture reuses the meta module of an earlier one of the same model file and arguments
        # in the process (core/capture.py): the first command's build prints
        if argv[0] == "inspect":
            assert "building" in err


# ------------------------------------------------------------------ issue 32: what new users hit
GOOD = """
import torch
def build_model(**kw):
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
def make_batch(batch_size, **kw):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""


def test_outputs_never_overwrite_an_input(capsys, tmp_path, mlp_plan):
    model = tmp_path / "m.py"
    model.write_text(GOOD)
    plan = tmp_path / "plan.json"
    plan.write_bytes(mlp_plan.read_bytes())
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.py").symlink_to(model)
    before = {p: p.read_bytes() for p in (model, plan)}
    base = ["plan", model, "--cluster", "local-cpu", "--global-batch", "4", "--time-budget", "2", "-o"]
    for out in (model, tmp_path / "sub" / ".." / "m.py", tmp_path / "link.py"):   # other spellings, a symlink
        refused(capsys, *base, out, words=("-o", "MODEL_FILE", "Give another path for -o"))
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"step_time_s": 0.01, "fingerprint": json.loads(plan.read_text())["model"]["fingerprint"],
                                    "world_size": 4}))
    before[measured] = measured.read_bytes()
    refused(capsys, "report", plan, measured, "--calibrate", "-o", plan, words=("-o", "plan.json"))
    refused(capsys, "report", plan, measured, "--html", measured, words=("--html", "measured.json"))
    refused(capsys, "run", plan, "--measured", plan, words=("--measured", "PLAN_JSON"))
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.py", "m.py", "measured.json", "plan.json", "sub"]


def test_a_file_read_as_input_is_never_replaced(tmp_path):
    """The loaders note what they read (here a plan), so even a writer that was not given the
    path as an argument refuses it."""
    from autopar.core import output_file
    from autopar.core.plan import load_plan

    plan = tmp_path / "plan.json"
    model = tmp_path / "m.py"
    model.write_text(GOOD)
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import save_plan
    from autopar.simulator.configure import config_plan

    g = capture_model_file(str(model), {}, 2)
    save_plan(config_plan(g, degrees={"dp": 1, "tp": 1, "pp": 1},
                          micro_batch=2, global_batch=2, schedule="1f1b", virtual_stages=1,
                          zero=0, recompute="none", offload="none", precision="fp32", sequence_parallel=False,
                          cluster_name="local-cpu"), plan)
    output_file.forget_inputs()
    try:
        load_plan(plan)
        text = plan.read_bytes()
        with pytest.raises(output_file.OutputFileError, match="does not overwrite its inputs"):
            output_file.write_text_atomic(plan, "{}")
        assert plan.read_bytes() == text
        other = tmp_path / "other.json"
        output_file.write_text_atomic(other, "{}")           # anything else is written as before
        assert other.read_text() == "{}"
    finally:
        output_file.forget_inputs()


def test_devices_are_written_in_place_and_a_full_disk_is_a_clear_error(capsys, tmp_path, monkeypatch):
    import errno
    import stat

    from autopar.core import output_file

    output_file.write_text_atomic("/dev/null", "x")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)          # not replaced by a regular file
    with pytest.raises(output_file.OutputFileError, match="disk is full"):
        output_file.write_text_atomic("/dev/full", "x")
    refused(capsys, "simulate", MLP, "--cluster", "local-cpu", "--dp", "2", "--trace", "/dev/full",
            words=("/dev/full", "disk is full"))
    # a regular file on a full disk: the old content stays, no temporary file is left
    target = tmp_path / "plan.json"
    target.write_text("old")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(output_file.os, "replace", full)
    with pytest.raises(output_file.OutputFileError, match="disk is full"):
        output_file.write_text_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize("argv,flag", [
    (["run", "PLAN", "--lr", "nan"], "--lr"), (["run", "PLAN", "--lr", "-1"], "--lr"),
    (["run", "PLAN", "--rdzv-endpoint", "host:abc"], "--rdzv-endpoint"),
    (["run", "PLAN", "--max-restarts", "-1"], "--max-restarts"), (["run", "PLAN", "--steps", "1e3"], "--steps"),
    (["simulate", MLP, "--virtual-stages", "0"], "--virtual-stages"), (["simulate", MLP, "--dp", "0"], "--dp"),
    (["simulate", MLP, "--micro-batch", "0"], "--micro-batch"),
    (["plan", MLP, "--global-batch", "4", "--seed", "-1"], "--seed"),
    (["plan", MLP, "--global-batch", "4", "--time-budget", "nan"], "--time-budget"),
    (["plan", MLP, "--global-batch", str(10 ** 18)], "--global-batch"),
    (["plan", MLP, "--global-batch", "4", "--memory-headroom", "1"], "--memory-headroom"),
    (["profile", "-o", "p.json", "--passes", "0"], "--passes"),
])
def test_numeric_flags_are_checked_while_parsing(capsys, argv, flag, mlp_plan, tmp_path):
    argv = [str(mlp_plan) if a == "PLAN" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}" in err and "Traceback" not in err, err
    assert not (tmp_path / "p.json").exists()


def test_cli_types_accept_what_is_in_range():
    from autopar.core import cli_types as T

    assert T.positive("3") == 3 and T.non_negative("0") == 0 and T.seed(str(2 ** 32 - 1)) == 2 ** 32 - 1
    assert T.positive_number("1e-3") == 1e-3 and T.host_port("node0:29500") == "node0:29500"
    assert T.global_batch(str(2 ** 40)) == 2 ** 40


def test_divisors_from_prime_factors():
    from autopar.planner.space import divisors, prime_factors

    for n in range(1, 400):                                   # against the definition
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    n = 10 ** 18                                              # 2^18 5^18: (18+1)^2 divisors
    assert prime_factors(n) == {2: 18, 5: 18}
    ds = divisors(n)
    assert len(ds) == 19 * 19 and all(n % d == 0 for d in ds) and ds == sorted(set(ds))
    assert divisors(1099511627689) == [1, 1099511627689]      # a prime just below 2^40


NEVER_RETURNS = GOOD.replace("def build_model(**kw):\n", "def build_model(**kw):\n    while True:\n        pass\n")


def test_a_model_file_that_never_returns_is_an_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_MODEL_CALL_TIMEOUT_S", "1")
    refused(capsys, "inspect", write(tmp_path / "m.py", NEVER_RETURNS),
            words=("did not return within 1 s", "build_model", "AUTOPAR_MODEL_CALL_TIMEOUT_S"))


def test_os_exit_and_a_raised_keyboard_interrupt_are_the_model_files_errors(capsys, tmp_path):
    import posix

    exits = GOOD.replace("def make_batch(batch_size, **kw):\n", "def make_batch(batch_size, **kw):\n    import os; os._exit(0)\n")
    refused(capsys, "inspect", write(tmp_path / "e.py", exits), words=("os._exit(0)", "make_batch"))
    assert os._exit is posix._exit                            # the guard is gone after the call
    raises = GOOD.replace("def build_model(**kw):\n", "def build_model(**kw):\n    raise KeyboardInterrupt\n")
    refused(capsys, "inspect", write(tmp_path / "k.py", raises), words=("KeyboardInterrupt", "no Ctrl-C"))


def test_a_stray_thread_does_not_hold_the_command(tmp_path):
    """A model file that leaves a non-daemon thread sleeping: the command still ends, exit 0."""
    import subprocess
    import sys

    body = GOOD.replace("def build_model(**kw):\n", "def build_model(**kw):\n    import threading, time\n"
                        "    threading.Thread(target=time.sleep, args=(10 ** 6,)).start()\n")
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "inspect", write(tmp_path / "t.py", body)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]


OWN_FAILURES = {
    "forward returns None": (GOOD.replace(
        "return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))",
        "class M(torch.nn.Module):\n        def __init__(self):\n            super().__init__()\n"
        "            self.l = torch.nn.Linear(4, 4)\n        def forward(self, x):\n            self.l(x)\n"
        "    return M()"), "returned None"),
    "mixed dtypes": (GOOD.replace("return torch.randn(batch_size, 4), torch.randn",
                                  "return torch.randn(batch_size, 4, dtype=torch.float64), torch.randn"),
                     "same dtype"),
    "batch on meta": (GOOD.replace("return torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                   "return torch.empty(batch_size, 4, device='meta'), torch.empty(batch_size, 4, "
                                   "device='meta')"), "meta device"),
    "no parameters": (GOOD.replace("return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))",
                                   "return torch.nn.ReLU()"), "no parameters"),
    "target of another shape": (GOOD.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                             "torch.randn(batch_size, 4), torch.randn(batch_size, 1)"), "(2, 1)"),
    "loss without gradient": (GOOD + "def loss_fn(out, target):\n    return torch.tensor(1.0)\n", "no gradient"),
    "input of the wrong width": (GOOD.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                              "torch.randn(batch_size, 5), torch.randn(batch_size, 4)"),
                                 "cannot be multiplied"),
}


@pytest.mark.parametrize("case", sorted(OWN_FAILURES))
def test_a_model_files_own_failure_is_named_as_its_own(tmp_path, case):
    """One plain CPU step (core.model_check) names what the file got wrong."""
    from autopar.core.errors import ModelFileError
    from autopar.core.model_check import own_failure
    from autopar.core.modelfile import load_model_file

    body, needle = OWN_FAILURES[case]
    err = own_failure(load_model_file(write(tmp_path / "m.py", body)), {}, 2)
    assert isinstance(err, ModelFileError), case
    assert needle in str(err) and "m.py" in str(err), str(err)
    assert own_failure(load_model_file(write(tmp_path / "good.py", GOOD)), {}, 2) is None


def test_plan_names_the_model_files_failure_once(capsys, tmp_path):
    body = OWN_FAILURES["mixed dtypes"][0]
    msg = refused(capsys, "plan", write(tmp_path / "m.py", body), "--cluster", "local-cpu", "--global-batch", "4",
                  "--time-budget", "2", "-o", tmp_path / "p.json", words=("m.py", "forward"))
    assert msg.count("same dtype") == 1 and "Fix some knobs" not in msg
    assert not (tmp_path / "p.json").exists()


def test_make_batch_with_fewer_rows_is_refused_at_capture(capsys, tmp_path):
    body = GOOD.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 4)", "torch.randn(2, 4), torch.randn(2, 4)")
    refused(capsys, "inspect", write(tmp_path / "m.py", body), words=("make_batch(8)", "2 rows"))


def test_report_refuses_another_plans_measurements(capsys, tmp_path, mlp_plan):
    from autopar.core.plan import load_plan

    plan = load_plan(mlp_plan)
    other = edited_plan(mlp_plan, tmp_path / "other.json", lambda d: d["layers"][0].update(recompute="full"))
    other_identity = load_plan(other).identity
    assert other_identity != plan.identity
    # the identity ignores what does not change the run
    assert plan.with_predicted({"step_time_s": 9.0}, cluster_ref="x", cluster_nodes=None).identity == plan.identity
    measured = tmp_path / "measured.json"
    base = {"step_time_s": 0.01, "fingerprint": plan.model.fingerprint, "world_size": 4}
    measured.write_text(json.dumps({**base, "plan_identity": other_identity, "plan": "other.json"}))
    refused(capsys, "report", mlp_plan, measured, words=("another plan", other_identity, plan.identity))
    measured.write_text(json.dumps({**base, "plan_identity": plan.identity}))
    rc, out, err = run(capsys, "report", mlp_plan, measured, "--json")
    assert rc == 0, err
