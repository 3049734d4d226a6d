"""Model files and outputs that used to slip past the CLI's checks: each now ends as the bad-input
rules say (one paragraph, exit 2, nothing written), and valid ones stay quiet.

* ``inspect`` of a model whose loss cannot be computed (a target of another shape, a ``loss_fn``
  that raises) exits 2, as ``plan`` does;
* a model-file call that never returns says what autopar waits on, then stops with exit 2 -- also
  when the model file catches the stop and goes on;
* a model file that calls ``os.chdir`` at import: autopar's relative paths still resolve from
  where it started, the model's own from where it moved to;
* ``profile -o`` naming an existing non-profile file is refused before anything is timed;
* ``plan -o /dev/null`` prints no command that would run /dev/null;
* a model that torch.export cannot trace but capture handles otherwise prints no graph dumps;
* a plan made with ``--no-runtime-check`` of a model file that cannot train is refused by
  ``autopar run`` before any process starts (the ranks run the same check).

The verbs run in this process (``autopar.cli.main``) except where how the process ends is the
point.  What must be refused is compared with the plain-PyTorch failure it stands for.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autopar.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
GOOD = """
import torch
def build_model(**kw):
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
def make_batch(batch_size, **kw):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def refused(capsys, *argv, words: tuple[str, ...] = ()) -> str:
    rc = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err + out
    assert f"autopar {argv[0]}: error:" in err, err
    message = " ".join(err.split("error:", 1)[1].split())
    assert "\n\n" not in err.split("error:", 1)[1].strip()
    for w in words:
        assert w in message, (w, err)
    return message


# ------------------------------------------------------------------ inspect and the loss

@pytest.mark.parametrize("body,words", [
    (GOOD.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                  "torch.randn(batch_size, 4), torch.randn(batch_size, 3)"), ("(8, 4)", "(8, 3)", "default loss")),
    (GOOD + "def loss_fn(out, target):\n    raise ValueError('this loss needs labels')\n",
     ("loss_fn", "this loss needs labels", "line 8")),
])
def test_inspect_refuses_a_loss_that_cannot_be_computed(capsys, tmp_path, body, words):
    import torch

    path = write(tmp_path / "m.py", body)
    # the reference: the same step in plain PyTorch fails
    ns: dict = {}
    exec(compile(body, path, "exec"), ns)
    x, y = ns["make_batch"](8)
    with pytest.raises((RuntimeError, ValueError)), warnings.catch_warnings():
        warnings.simplefilter("ignore")              # mse_loss's broadcasting warning
        (ns.get("loss_fn") or torch.nn.functional.mse_loss)(ns["build_model"]()(x), y)
    refused(capsys, "inspect", path, words=("m.py", *words))
    refused(capsys, "inspect", path, "--json", words=("m.py",))
    assert cli_main(["inspect", write(tmp_path / "good.py", GOOD)]) == 0     # the good file still inspects


# ------------------------------------------------------------------ a model file that never returns

def test_a_call_that_never_returns_says_what_it_waits_on(capfd, tmp_path, monkeypatch):
    from autopar.core import modelfile

    monkeypatch.setattr(modelfile, "PROGRESS_AFTER_S", 0.3)
    monkeypatch.setenv("AUTOPAR_MODEL_CALL_TIMEOUT_S", "1")
    body = GOOD.replace("def build_model(**kw):\n", "def build_model(**kw):\n    import time\n    time.sleep(10 ** 6)\n")
    rc = cli_main(["inspect", write(tmp_path / "m.py", body)])
    err = capfd.readouterr().err                # the progress line goes to file descriptor 2
    assert rc == 2, err
    before, message = err.split("error:", 1)
    assert "autopar inspect: still calling build_model() in m.py" in before and "stops it after 1 s" in before
    message = " ".join(message.split())           # the paragraph is wrapped to the terminal's width
    assert "did not return within 1 s" in message and "build_model" in message


def test_a_model_file_that_catches_the_stop_still_ends(tmp_path):
    """build_model catches every exception in a retry loop, autopar's stop included: the process
    prints the error and exits 2 a grace period after the limit."""
    body = GOOD.replace("def build_model(**kw):\n", "def build_model(**kw):\n    import time\n    while True:\n"
                        "        try:\n            time.sleep(1)\n        except BaseException:\n            pass\n")
    path = write(tmp_path / "m.py", body)
    code = ("import sys; from autopar.core import modelfile; modelfile.HARD_STOP_GRACE_S = 0.5; "
            "from autopar.cli import main; sys.exit(main(['inspect', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "AUTOPAR_MODEL_CALL_TIMEOUT_S": "1"})
    assert out.returncode == 2, out.stderr[-3000:]
    flat = " ".join(out.stderr.split())
    assert "autopar inspect: error:" in flat and "did not return within 1 s" in flat, flat
    assert "caught autopar's stop" in flat and "Traceback" not in out.stderr


# ------------------------------------------------------------------ os.chdir at import

def test_a_model_file_that_changes_folder_at_import(capsys, tmp_path, monkeypatch):
    """The model moves to its data folder at import and reads a file there in make_batch;
    autopar's relative paths (the model file, -o) still resolve from where it was started."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "width.txt").write_text("4\n")
    body = (f"import os\nos.chdir({str(data)!r})\n" + GOOD.replace(
        "def make_batch(batch_size, **kw):\n",
        "def make_batch(batch_size, **kw):\n    assert int(open('width.txt').read()) == 4\n"))
    work = tmp_path / "work"
    work.mkdir()
    write(work / "m.py", body)
    monkeypatch.chdir(work)
    assert cli_main(["inspect", "m.py"]) == 0, capsys.readouterr().err
    assert os.getcwd() == str(work)
    rc = cli_main(["plan", "m.py", "--cluster", "local-cpu", "--global-batch", "4", "--time-budget", "1", "--json",
                   "-o", "p.json"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert (work / "p.json").is_file() and not (data / "p.json").exists()
    assert json.loads((work / "p.json").read_text())["model"]["file"] == str(work / "m.py")
    assert os.getcwd() == str(work)


# ------------------------------------------------------------------ profile -o an existing file

def test_profile_refuses_an_output_it_could_not_merge_into_before_timing(capsys, tmp_path, monkeypatch):
    from autopar.profiling import profile_run

    def never(opts):
        raise AssertionError("profiling started")
    monkeypatch.setattr(profile_run, "run_profile", never)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "mesh": {"dp": 1}, "layers": []}))
    before = plan.read_bytes()
    refused(capsys, "profile", "-o", plan, "--quick", words=(str(plan), "holds a plan", "Give -o a new path"))
    other = tmp_path / "other.json"
    other.write_text('{"name": "x", "colour": 1}')
    refused(capsys, "profile", "-o", other, "--quick", words=(str(other), "unknown key"))
    assert plan.read_bytes() == before


# ------------------------------------------------------------------ plan -o a device

def test_plan_to_a_device_prints_no_command_for_it(capsys, tmp_path):
    import stat

    args = ["plan", write(tmp_path / "m.py", GOOD), "--cluster", "local-cpu", "--global-batch", "4",
            "--time-budget", "1", "--no-runtime-check", "-o", "/dev/null"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "not a regular file" in flat and "torchrun" not in out and "-o PLAN.json" in flat, out[-2000:]
    assert cli_main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["torchrun"] is None
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


# ------------------------------------------------------------------ no graph dumps

DATA_DEPENDENT_GATE = """
import torch
class Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)
    def forward(self, h):
        h = self.l(h)
        if h.sum().item() > 0:          # data-dependent: torch.export fails here
            h = h * 2
        return h
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.g, self.b = torch.nn.Linear(8, 8), Gate(), torch.nn.Linear(8, 8)
    def forward(self, x):
        return self.b(self.g(self.a(x)))
def build_model(**kw):
    return M()
def make_batch(batch_size, **kw):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 8)
"""


def test_a_model_export_cannot_trace_prints_no_graph_dumps(capsys, tmp_path):
    import torch

    from autopar.core.modelfile import load_model_file
    from autopar.core.quiet_export import quiet_export

    path = write(tmp_path / "m.py", DATA_DEPENDENT_GATE)
    mf = load_model_file(path)
    model = mf.build()
    inputs, _ = mf.make_batch(2)
    with pytest.raises(Exception) as e:        # torch's own export fails, carrying the partial graph
        quiet_export(model, inputs, strict=False)
    assert getattr(e.value, "partial_fx_graph", None)
    assert "def forward" not in capsys.readouterr().err
    assert isinstance(quiet_export(torch.nn.Linear(2, 2), (torch.randn(1, 2),)), torch.export.ExportedProgram)
    assert cli_main(["inspect", path]) == 0
    out, err = capsys.readouterr()
    assert "def forward" not in err and "leaf" in out, err[-2000:]


# ------------------------------------------------------------------ run: a plan made without the runtime check

NOT_TRAINABLE = {
    "batch on meta": (GOOD.replace("return torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                   "return torch.empty(batch_size, 4, device='meta'), "
                                   "torch.empty(batch_size, 4, device='meta')"), "on the meta device"),
    "mixed parameter dtypes": (GOOD.replace("torch.nn.Linear(4, 4))", "torch.nn.Linear(4, 4).double())"),
                               "must have the same dtype"),
    "no parameters": (GOOD.replace("return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))",
                                   "return torch.nn.ReLU()"), "with no parameters"),
}


@pytest.mark.parametrize("case", sorted(NOT_TRAINABLE))
def test_run_refuses_a_model_that_cannot_train_before_any_process_starts(capsys, tmp_path, case):
    body, needle = NOT_TRAINABLE[case]
    model = write(tmp_path / "m.py", body)
    plan = tmp_path / "plan.json"
    assert cli_main(["plan", model, "--cluster", "local-cpu", "--global-batch", "4", "--time-budget", "1",
                     "--no-runtime-check", "--json", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert json.loads(plan.read_text())["provenance"]["runtime_check"].startswith("skipped")
    message = refused(capsys, "run", plan, "--steps", "1", words=("m.py", needle))
    assert message.count(needle) == 1
    assert not (tmp_path / "measured.json").exists()
    # every rank runs the same check (runtime/plan_check.check_plan) before its process group exists
    from autopar.core.errors import ModelFileError
    from autopar.runtime.plan_check import check_plan

    with pytest.raises(ModelFileError, match=needle.replace("(", r"\(")):
        check_plan(plan, None)
