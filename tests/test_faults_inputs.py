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

ROOT = Path(__file__).resolve().parent.parent
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
    plan = config_plan(g, dp=4, tp=1, pp=1, micro_batch=2, global_batch=8, schedule="1f1b", virtual_stages=1,
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
    # gpt3-175b on one A100 with a 256 GB host: offloading 2.8 TB cannot fit; exit 3, no plan
    out = tmp_path / "p.json"
    msg = refused(capsys, "plan", GPT, "--model-arg", "size=gpt3-175b", "--cluster",
                  write(tmp_path / "c.yaml", ONE_A100_256GB), "--global-batch", "8", "--time-budget", "5",
                  "-o", out, code=3, words=("host memory", "256.0 GB", "host_memory_GB", "What would make one fit"))
    assert not out.exists() and "gpt3-175b" in msg
    # Llama-7B on local-cpu (8 GB of host memory): exit 3, no plan
    refused(capsys, "plan", LLAMA, "--model-arg", "size=llama2-7b", "--cluster", "local-cpu", "--global-batch", "4",
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
    from autopar.simulator.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator

    args = {"size": "llama2-7b"}
    with torch.device("meta"):
        n_params = sum(p.numel() for p in load_model_file(LLAMA).build(**args).parameters())
    g = capture_model_file(LLAMA, args, 1)
    cluster = load_cluster("local-cpu")
    plan = config_plan(g, dp=4, tp=1, pp=1, micro_batch=1, global_batch=4, schedule="1f1b", virtual_stages=1,
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
    plan = config_plan(g, dp=2, tp=1, pp=1, micro_batch=2, global_batch=4, schedule="1f1b", virtual_stages=1,
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
        assert "building" in err                              # the prints went to stderr
