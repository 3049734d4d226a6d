"""Bad inputs and faults against the real ``autopar`` CLI and runtime, and the tally.

    python benchmarks/fault_sweep.py                    # every case (a few minutes on 2 cores)
    python benchmarks/fault_sweep.py --only cli         # or: --only runtime; -k SUBSTRING
    python benchmarks/fault_sweep.py -o benchmarks/results/fault_sweep.txt

Each case is one process running ``autopar ...`` in a fresh directory, with a time limit and
an 8 GiB address-space limit (so a memory bomb fails the case, not the machine).  A CLI case
is a fork of this process after torch and autopar are imported -- the ``autopar`` entry point
in a child process, its own exit code, stdout and stderr, an uncaught exception printed as the
interpreter prints it -- which saves the ~5 s import per case (``--subprocess`` starts a fresh
``python -m autopar.cli`` instead).  The runtime cases start 2-3 torchrun ranks on gloo
through ``autopar run``, 1-2 steps of a tiny GPT.  The goal: exit code 2 (3 where no plan fits), a one-paragraph message
after "error:", no traceback, and nothing lost: the files a case guards (an output it must not
write, a file it must not clobber, the last good checkpoint) are compared before and after,
and no temporary file is left beside them, and no process naming the case's folder (torchrun,
a rank) outlives the command.  A few cases have another goal, said in their line: printed
output that stays valid JSON, a file mode kept, a command printed instead of a launch, a device
still a device.  The signal cases send SIGTERM / SIGHUP to ``autopar run`` (or SIGINT to its
whole group, as Ctrl-C does, once or twice) once its third step is logged: the goal is the
signal's exit code (128 + the signal), a "stopped by" message, a complete newest checkpoint and the
resume command.  Every run-time case also fails when its message shows twice, or torchrun's lines
about stopping the other ranks (or a "Logging error") show.
A few CLI cases run as a fresh process (``fresh``: how the process ends is what they test).

The tally lists per case the exit code, whether a traceback showed, the files lost or left
half-written, and PASS/FAIL; then the totals.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")
LLAMA = str(ROOT / "examples" / "llama.py")
CNN = str(ROOT / "examples" / "cnn.py")
TINY = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64, "dropout": 0.0}
TINY_ARGS = [x for k, v in TINY.items() for x in ("--model-arg", f"{k}={v}")]
UNWRITABLE_DIR = "/sys"          # sysfs refuses new files even to root


@dataclass
class Case:
    name: str
    kind: str                                   # "cli" or "runtime"
    argv: Callable[[Path], list[str]]           # arguments after "autopar", given the case's directory
    setup: Callable[[Path], None] = lambda d: None
    code: int = 2                               # the exit code the goal asks for
    guard: Callable[[Path], list[Path]] = lambda d: []   # files that must end as they began (absent stays absent)
    check: Callable[[Path, str, str], str] | None = None  # extra goal: returns "" when met, else why not
    env: dict = field(default_factory=dict)
    timeout: float = 120.0
    fresh: bool = False                         # a fresh process even for a CLI case (its exit matters)
    signal: tuple | None = None                 # (signum, text on stdout to wait for, to the whole group[, times])
    paragraph: bool = True                      # the goal includes "error:" and one paragraph


# ----------------------------------------------------------------------------- setup helpers
def w(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)


def model_file(body: str) -> Callable[[Path], None]:
    return lambda d: w(d / "m.py", body)


GOOD_MODEL = """
import torch
def build_model(**kw):
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
def make_batch(batch_size, **kw):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""


def cluster_file(body: str) -> Callable[[Path], None]:
    return lambda d: w(d / "c.yaml", body)


GOOD_CLUSTER = """
inter_node: {{bandwidth_GBps: 25, latency_us: 5}}
groups:
  - {{name: a, gpu: a100-80gb-sxm, nodes: {nodes}, gpus_per_node: 8, host_memory_GB: {host},
     gpu_memory_GB: {mem}, intra_node: {{bandwidth_GBps: {bw}, latency_us: 3}}}}
"""


def good_cluster(nodes="1", host="2048", mem="80", bw="300") -> str:
    return GOOD_CLUSTER.format(nodes=nodes, host=host, mem=mem, bw=bw)


_PLAN_CACHE: dict[tuple, dict] = {}


def make_plan(model: str, args: dict, *, dp=1, tp=1, pp=1, micro_batch=2, num_microbatches=1, zero=0,
              cluster="local-cpu", nodes=None) -> dict:
    """A plan (as a dict) made by config, cached per configuration."""
    key = (model, tuple(sorted(args.items())), dp, tp, pp, micro_batch, num_microbatches, zero, nodes)
    if key not in _PLAN_CACHE:
        from autopar.core.capture import capture_model_file
        from autopar.core.sharding import megatron_styles
        from autopar.simulator.configure import config_plan

        g = capture_model_file(model, dict(args), micro_batch)
        plan = config_plan(g, degrees={"dp": dp, "tp": tp, "pp": pp}, micro_batch=micro_batch,
                           global_batch=dp * micro_batch * num_microbatches, schedule="1f1b", virtual_stages=1,
                           zero=zero, recompute="none", offload="none", precision="fp32",
                           sequence_parallel=False, cluster_name=cluster)
        if tp > 1 and not any(lp.tp for lp in plan.layers):
            from dataclasses import replace

            plan = replace(plan, layers=tuple(replace(lp, tp=tuple(sorted(megatron_styles(g, i).items())))
                                              for i, lp in enumerate(plan.layers)))
        plan = plan.with_predicted({"step_time_s": 0.01}, cluster_ref=cluster, cluster_nodes=nodes)
        _PLAN_CACHE[key] = plan.to_dict()
    return json.loads(json.dumps(_PLAN_CACHE[key]))


def plan_file(edit: Callable[[dict], None] | None = None, **kw) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        p = make_plan(MLP, {}, dp=2, **kw)
        if edit:
            edit(p)
        w(d / "plan.json", json.dumps(p, indent=1))
    return setup


def tiny_plan(edit: Callable[[dict], None] | None = None, model: str = GPT, **kw) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        p = make_plan(model, TINY if model == GPT else {}, **kw)
        if edit:
            edit(p)
        w(d / "plan.json", json.dumps(p, indent=1))
    return setup


def measured_for(d: Path, **fields) -> None:
    p = json.loads((d / "plan.json").read_text())
    w(d / "measured.json", json.dumps({"step_time_s": 0.01, "fingerprint": p["model"]["fingerprint"],
                                        "world_size": p["mesh"]["world_size"], **fields}))


def both(*fns):
    def setup(d: Path) -> None:
        for f in fns:
            f(d)
    return setup


def setitem(path: str, value) -> Callable[[dict], None]:
    def edit(p: dict) -> None:
        keys = path.split(".")
        obj = p
        for k in keys[:-1]:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        last = keys[-1]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value
    return edit


def json_stdout(d: Path, out: str, err: str) -> str:
    try:
        json.loads(out)
    except ValueError:
        return "stdout is not valid JSON"
    return ""


def mode_kept(d: Path, out: str, err: str) -> str:
    mode = stat.S_IMODE((d / "plan.json").stat().st_mode)
    return "" if mode == 0o644 else f"mode {oct(mode)} instead of 0o644"


def names_the_loss_error(d: Path, out: str, err: str) -> str:
    return "" if "the loss cannot be computed" in " ".join(err.split()) else "the failing rank's error is not shown"


def no_launch(d: Path, out: str, err: str) -> str:
    return "" if ("--nnodes 2" in out and "starts nothing" in out) else "did not print the 2-node command"


def says(*needles: str) -> Callable[[Path, str, str], str]:
    """Extra goal: stderr holds every needle (whitespace-insensitive)."""
    def check(d: Path, out: str, err: str) -> str:
        flat = "".join(err.split())
        missing = [n for n in needles if "".join(n.split()) not in flat]
        return f"message lacks {missing}" if missing else ""
    return check


def short_message(limit: int = 3000) -> Callable[[Path, str, str], str]:
    def check(d: Path, out: str, err: str) -> str:
        return "" if len(err) <= limit else f"stderr is {len(err)} characters"
    return check


def still_device(path: str) -> Callable[[Path, str, str], str]:
    def check(d: Path, out: str, err: str) -> str:
        return "" if stat.S_ISCHR(os.stat(path).st_mode) else f"{path} is no longer a device"
    return check


def stopped_resumable(saved: bool) -> Callable[[Path, str, str], str]:
    """A run stopped by a signal: says so, names what was saved (a complete checkpoint, the
    resume command) or that nothing was."""
    def check(d: Path, out: str, err: str) -> str:
        flat = " ".join(err.split())
        if "stopped by SIG" not in flat:
            return "no 'stopped by' message"
        if not saved:
            return "" if "Nothing was saved" in flat else "does not say that nothing was saved"
        if "Resume with: autopar run" not in flat:
            return "no resume command"
        try:
            latest = json.loads((d / "ck" / "latest.json").read_text())
        except (OSError, ValueError):
            return "no latest.json"
        return "" if (d / "ck" / latest["path"] / "manifest.json").exists() else "newest checkpoint incomplete"
    return check


def no_graph_dump(d: Path, out: str, err: str) -> str:
    return "torch printed graphs on stderr" if "def forward" in err else ""


def plan_written_here(d: Path, out: str, err: str) -> str:
    return "" if (d / "p.json").is_file() else "the plan is not where -o named it"


def no_command_for(device: str) -> Callable[[Path, str, str], str]:
    def check(d: Path, out: str, err: str) -> str:
        return still_device(device)(d, out, err) or (f"prints a command that runs {device}" if "torchrun" in out else "")
    return check


def same_inode_link(target: str, link: str) -> Callable[[Path], None]:
    return lambda d: os.symlink(d / target, d / link)


MODEL_BODY = {
    "forward returns None": GOOD_MODEL.replace(
        "return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))",
        "class M(torch.nn.Module):\n        def __init__(self):\n            super().__init__()\n"
        "            self.l = torch.nn.Linear(4, 4)\n        def forward(self, x):\n            self.l(x)\n"
        "    return M()"),
    "mixed dtypes": GOOD_MODEL.replace("return torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                       "return torch.randn(batch_size, 4, dtype=torch.float64), torch.randn(batch_size, 4)"),
    "make_batch on meta": GOOD_MODEL.replace("return torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                             "return (torch.empty(batch_size, 4, device='meta'), "
                                             "torch.empty(batch_size, 4, device='meta'))"),
    "no parameters": GOOD_MODEL.replace("return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))",
                                        "return torch.nn.ReLU()"),
    "target of another shape": GOOD_MODEL.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                                  "torch.randn(batch_size, 4), torch.randn(batch_size, 3)"),
    "target that broadcasts": GOOD_MODEL.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                                 "torch.randn(batch_size, 4), torch.randn(batch_size, 1)"),
    "input of the wrong width": GOOD_MODEL.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                                   "torch.randn(batch_size, 5), torch.randn(batch_size, 4)"),
    "make_batch returns 2 rows": GOOD_MODEL.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                                    "torch.randn(2, 4), torch.randn(2, 4)"),
    "loss_fn returns None": GOOD_MODEL + "def loss_fn(out, target):\n    return None\n",
    "loss without gradient": GOOD_MODEL + "def loss_fn(out, target):\n    return torch.tensor(1.0)\n",
    "loss_fn returns a vector": GOOD_MODEL + "def loss_fn(out, target):\n    return (out - target) ** 2\n",
}
NEVER_RETURNS = GOOD_MODEL.replace("def build_model(**kw):\n", "def build_model(**kw):\n    while True:\n        pass\n")
SLEEPS_FOREVER = GOOD_MODEL.replace("def make_batch(batch_size, **kw):\n",
                                    "def make_batch(batch_size, **kw):\n    import time; time.sleep(10 ** 6)\n")
STRAY_THREAD = GOOD_MODEL.replace("def build_model(**kw):\n", "def build_model(**kw):\n    import threading, time\n"
                                  "    threading.Thread(target=time.sleep, args=(10 ** 6,)).start()\n")
OS_EXIT_BUILD = GOOD_MODEL.replace("def build_model(**kw):\n", "def build_model(**kw):\n    import os; os._exit(0)\n")
OS_EXIT_BATCH = GOOD_MODEL.replace("def make_batch(batch_size, **kw):\n",
                                   "def make_batch(batch_size, **kw):\n    import os; os._exit(0)\n")
RAISES_KEYBOARD_INTERRUPT = GOOD_MODEL.replace("def build_model(**kw):\n",
                                               "def build_model(**kw):\n    raise KeyboardInterrupt\n")
CATCHES_THE_STOP = GOOD_MODEL.replace("def build_model(**kw):\n", "def build_model(**kw):\n    import time\n"
                                      "    while True:\n        try:\n            time.sleep(1)\n"
                                      "        except BaseException:\n            pass\n")
CHDIR_AT_IMPORT = "import os\nos.chdir('/')\n" + GOOD_MODEL
DATA_DEPENDENT_GATE = """
import torch
class Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
    def forward(self, h):
        h = self.l(h)
        if h.sum().item() > 0:
            h = h * 2
        return h
def build_model(**kw):
    return torch.nn.Sequential(torch.nn.Linear(4, 4), Gate(), torch.nn.Linear(4, 4))
def make_batch(batch_size, **kw):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""
NOT_TRAINABLE = {
    "make_batch on meta": MODEL_BODY["make_batch on meta"],
    "mixed parameter dtypes": GOOD_MODEL.replace("torch.nn.Linear(4, 4))", "torch.nn.Linear(4, 4).double())"),
    "no parameters": MODEL_BODY["no parameters"],
}
ON_RANK_1 = """
import os, sys, torch
sys.path.insert(0, {root!r})
from examples.mlp import build_model as _build, make_batch as _batch
def build_model(**kw):
    if {where!r} == "build" and os.environ.get("RANK") == "1":
        raise ValueError("rank 1 cannot build this model (a test fault)")
    m = _build(**kw)
    if {where!r} == "forward" and os.environ.get("RANK") == "1":
        def bad(*a, **k):
            raise ValueError("rank 1 cannot run this forward (a test fault)")
        m.forward = bad
    return m
def make_batch(batch_size, **kw):
    if {where!r} == "batch" and os.environ.get("RANK") == "1":
        raise ValueError("rank 1 cannot draw this batch (a test fault)")
    return _batch(batch_size, **kw)
"""


def other_plans_measured(d: Path) -> None:
    """measured.json written by a run of another plan of the same model (its identity recorded)."""
    from autopar.core.plan import Plan

    other = Plan.from_dict(make_plan(MLP, {}, dp=4, micro_batch=1))
    measured_for(d, plan_identity=other.identity, plan="other/plan.json")


def this_plans_measured(d: Path) -> None:
    from autopar.core.plan import Plan

    p = Plan.from_dict(json.loads((d / "plan.json").read_text()))
    measured_for(d, plan_identity=p.identity)


# ------------------------------------------------------------------------ runtime helpers
LOSS_FAILS_ON_LAST_STAGE = """
import torch, torch.distributed as dist
import sys
sys.path.insert(0, {root!r})
from examples.gpt import build_model, make_batch
def loss_fn(out, target):
    if dist.is_initialized() and dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("the loss cannot be computed on this stage (a test fault)")
    return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), target.flatten())
"""
IGNORES_BATCH_SIZE = """
import sys, torch
sys.path.insert(0, {root!r})
from examples.gpt import build_model, loss_fn
def make_batch(batch_size, **kw):
    t = torch.randint(0, 64, (4, 17))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()
"""
NAN_INPUTS = """
import os, sys, torch
sys.path.insert(0, {root!r})
from examples.mlp import build_model, make_batch as _batch
def make_batch(batch_size, **kw):
    x, y = _batch(batch_size, **kw)
    if os.environ.get("AUTOPAR_SWEEP_NAN"):
        x = x * float("nan")
    return x, y
"""


def checkpointed(d: Path, steps: int = 2) -> None:
    """A good 2-rank run that leaves a checkpoint in d/ck (the state a fault must not destroy);
    of d/plan.json, or of a new 2-rank plan of the tiny GPT."""
    if not (d / "plan.json").exists():
        tiny_plan(dp=2)(d)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "autopar.cli", "run", str(d / "plan.json"), "--steps", str(steps),
                    "--checkpoint-dir", str(d / "ck"), "--measured", str(d / "good.json")],
                   cwd=d, env=env, capture_output=True, timeout=180)


def flip_distcp(d: Path) -> None:
    checkpointed(d)
    files = sorted((d / "ck").rglob("*.distcp"))
    if files:
        raw = bytearray(files[0].read_bytes())
        mid = len(raw) // 2
        raw[mid:mid + 64] = bytes(b ^ 0xFF for b in raw[mid:mid + 64])
        files[0].write_bytes(bytes(raw))


def ck_files(d: Path) -> list[Path]:
    return sorted(p for p in (d / "ck").rglob("*") if p.is_file()) if (d / "ck").exists() else [d / "ck"]


def run_args(*extra: str) -> Callable[[Path], list[str]]:
    return lambda d: ["run", str(d / "plan.json"), "--steps", "2", "--measured", str(d / "measured.json"), *extra]


# ---------------------------------------------------------------------------------- cases
def cases() -> list[Case]:
    C: list[Case] = []
    add = C.append
    out_plan = lambda d: [d / "out.json"]              # noqa: E731
    # -- model files
    add(Case("model file missing", "cli", lambda d: ["inspect", str(d / "nope.py")]))
    add(Case("model file is a directory", "cli", lambda d: ["inspect", str(d)]))
    add(Case("model file syntax error", "cli", lambda d: ["inspect", str(d / "m.py")], model_file("def (:\n")))
    add(Case("model file import error", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file("import no_such_module_here\n")))
    add(Case("sys.exit(0) at import (inspect)", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file("import sys\nsys.exit(0)\n")))
    add(Case("sys.exit(5) in build_model (plan)", "cli",
             lambda d: ["plan", str(d / "m.py"), "--cluster", "local-cpu", "--global-batch", "4", "-o",
                        str(d / "out.json")],
             model_file(GOOD_MODEL.replace("def build_model(**kw):\n", "def build_model(**kw):\n    import sys; sys.exit(5)\n")),
             guard=out_plan))
    add(Case("exit() in make_batch (simulate)", "cli",
             lambda d: ["simulate", str(d / "m.py"), "--cluster", "local-cpu", "--dp", "2"],
             model_file(GOOD_MODEL.replace("def make_batch(batch_size, **kw):\n",
                                           "def make_batch(batch_size, **kw):\n    raise SystemExit(1)\n"))))
    add(Case("sys.exit at import (run)", "cli", lambda d: ["run", str(d / "plan.json"), "--dry-run"],
             both(tiny_plan(dp=2), lambda d: w(d / "m.py", "import sys\nsys.exit(3)\n"),
                  lambda d: w(d / "plan.json", (d / "plan.json").read_text().replace(GPT, str(d / "m.py"))))))
    add(Case("build_model returns a str", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file(GOOD_MODEL.replace("return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))",
                                           "return 'model'"))))
    add(Case("make_batch returns one tensor", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file(GOOD_MODEL.replace("return torch.randn(batch_size, 4), torch.randn(batch_size, 4)",
                                           "return torch.randn(batch_size, 4)"))))
    add(Case("no build_model", "cli", lambda d: ["inspect", str(d / "m.py")], model_file("def make_batch(b):\n  pass\n")))
    add(Case("unknown --model-arg", "cli", lambda d: ["inspect", MLP, "--model-arg", "widht=3"]))
    add(Case("--model-arg without =", "cli", lambda d: ["inspect", MLP, "--model-arg", "layers"]))
    add(Case("gpt layers=0", "cli", lambda d: ["inspect", GPT, "--model-arg", "layers=0"]))
    add(Case("llama layers=0", "cli", lambda d: ["inspect", LLAMA, "--model-arg", "layers=0"]))
    add(Case("mlp layers=0", "cli", lambda d: ["inspect", MLP, "--model-arg", "layers=0"]))
    add(Case("cnn blocks=0", "cli", lambda d: ["inspect", CNN, "--model-arg", "blocks=0"]))
    add(Case("gpt heads do not divide hidden", "cli",
             lambda d: ["inspect", GPT, "--model-arg", "hidden=30", "--model-arg", "heads=4"]))
    add(Case("--batch-size 0", "cli", lambda d: ["inspect", MLP, "--batch-size", "0"]))
    add(Case("model prints, inspect --json (goal: JSON stdout, exit 0)", "cli",
             lambda d: ["inspect", str(d / "m.py"), "--json"],
             model_file("print('imported')\n" + GOOD_MODEL.replace("def build_model(**kw):\n",
                                                                   "def build_model(**kw):\n    print('built')\n")),
             code=0, check=json_stdout))
    add(Case("model prints, plan --json (goal: JSON stdout, exit 0)", "cli",
             lambda d: ["plan", str(d / "m.py"), "--cluster", "local-cpu", "--global-batch", "4", "--time-budget",
                        "2", "--json", "-o", str(d / "p.json")],
             model_file("print('imported')\n" + GOOD_MODEL), code=0, check=json_stdout))
    # -- cluster files
    sim = lambda d: ["simulate", MLP, "--dp", "1", "--cluster", str(d / "c.yaml")]   # noqa: E731
    add(Case("cluster file missing", "cli", lambda d: ["simulate", MLP, "--cluster", str(d / "none.yaml")]))
    add(Case("cluster YAML syntax error", "cli", sim, cluster_file("groups: [\n")))
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
    add(Case("YAML alias bomb", "cli", sim, cluster_file(bomb), timeout=60))
    add(Case("nodes: 1000000000000", "cli", sim, cluster_file(good_cluster(nodes="1000000000000")), timeout=60))
    add(Case("--nodes 100000000", "cli", lambda d: ["simulate", MLP, "--dp", "1", "--cluster", "local-cpu", "--nodes",
                                                   "100000000"], timeout=60))
    add(Case("gpu_memory_GB: 1e300", "cli", sim, cluster_file(good_cluster(mem="1.0e+300"))))
    add(Case("host_memory_GB: -1", "cli", sim, cluster_file(good_cluster(host="-1"))))
    add(Case("bandwidth as text 1e9", "cli", sim, cluster_file(good_cluster(bw="1e9"))))
    add(Case("unknown key in a group", "cli", sim,
             cluster_file(good_cluster().replace("host_memory_GB", "host_mem_GB"))))
    add(Case("duplicate key", "cli", sim,
             cluster_file(good_cluster().replace("nodes: 1,", "nodes: 1, nodes: 2,"))))
    add(Case("CPU group and GPU group on gloo", "cli", sim, cluster_file("""
backend: gloo
inter_node: {bandwidth_GBps: 1, latency_us: 100}
groups:
  - {name: cpu, gpu: local-cpu, nodes: 1, gpus_per_node: 2, host_memory_GB: 8}
  - {name: gpu, gpu: a100-80gb-sxm, nodes: 1, gpus_per_node: 2, host_memory_GB: 8}
""")))
    add(Case("nccl on a CPU profile", "cli", sim, cluster_file("""
backend: nccl
inter_node: {bandwidth_GBps: 1, latency_us: 100}
groups:
  - {name: cpu, gpu: local-cpu, nodes: 1, gpus_per_node: 2, host_memory_GB: 8}
""")))
    add(Case("empty cluster file", "cli", sim, cluster_file("")))
    add(Case("cluster file of 2 MiB", "cli", sim, cluster_file("# " + "x" * (2 << 20) + "\n" + good_cluster())))
    add(Case("cluster file not UTF-8", "cli", sim, lambda d: w(d / "c.yaml", b"\xff\xfe\x00groups: 1\n")))
    add(Case("--nodes 0", "cli", lambda d: ["simulate", MLP, "--dp", "1", "--cluster", "local-cpu", "--nodes", "0"]))
    add(Case("--nodes on a two-group cluster", "cli",
             lambda d: ["simulate", MLP, "--dp", "1", "--cluster", "mixed-a100-h100", "--nodes", "2"]))
    # -- plan files
    simp = lambda d: ["simulate", str(d / "plan.json"), "--cluster", "local-cpu"]   # noqa: E731
    add(Case("plan file missing", "cli", lambda d: ["simulate", str(d / "none.json"), "--cluster", "local-cpu"]))
    add(Case("plan not JSON", "cli", simp, lambda d: w(d / "plan.json", "{mesh: 1")))
    add(Case("plan is a list", "cli", simp, lambda d: w(d / "plan.json", "[1, 2]")))
    add(Case("dp: 2.7", "cli", simp, plan_file(setitem("mesh.dp", 2.7))))
    add(Case("dp: \"2\"", "cli", simp, plan_file(setitem("mesh.dp", "2"))))
    add(Case("extra stage element", "cli", simp, plan_file(lambda p: p["pipeline"]["stages"][0]["layers"].append(9))))
    add(Case("micro_batch: 1e999", "cli", simp,
             lambda d: (plan_file()(d), w(d / "plan.json", (d / "plan.json").read_text().replace(
                 '"micro_batch": 2', '"micro_batch": 1e999')))))
    add(Case("micro_batch: NaN", "cli", simp,
             lambda d: (plan_file()(d), w(d / "plan.json", (d / "plan.json").read_text().replace(
                 '"micro_batch": 2', '"micro_batch": NaN')))))
    add(Case("dp: 1000000000000 (run)", "cli", lambda d: ["run", str(d / "plan.json"), "--dry-run"],
             plan_file(lambda p: (setitem("mesh.dp", 10**12)(p), setitem("global_batch", 2 * 10**12)(p)))))
    add(Case("plan version 99", "cli", simp, plan_file(setitem("version", 99))))
    add(Case("plan without mesh", "cli", simp, plan_file(lambda p: p.pop("mesh"))))
    add(Case("stages not covering the layers", "cli", simp, plan_file(setitem("pipeline.stages.0.layers", [0, 2]))))
    add(Case("zero: 7", "cli", simp, plan_file(setitem("layers.0.zero", 7))))
    add(Case("layers[0] is a number", "cli", simp, plan_file(setitem("layers.0", 5))))
    add(Case("plan for another model (run)", "cli", lambda d: ["run", str(d / "plan.json"), "--dry-run"],
             plan_file(setitem("model.fingerprint", "0123456789abcdef"))))
    add(Case("plan nested 100000 deep", "cli", simp, lambda d: w(d / "plan.json", "[" * 100000 + "]" * 100000)))
    add(Case("plan file of 300 MiB (sparse)", "cli", simp,
             lambda d: os.truncate(open(d / "plan.json", "wb").name, 300 << 20)))
    # -- the planner
    add(Case("gpt3-175b on one A100, 256 GB host", "cli",
             lambda d: ["plan", GPT, "--model-arg", "size=gpt3-175b", "--cluster", str(d / "c.yaml"),
                        "--global-batch", "8", "--time-budget", "5", "-o", str(d / "out.json")],
             cluster_file("""
inter_node: {bandwidth_GBps: 25, latency_us: 5}
groups:
  - {name: a, gpu: a100-80gb-sxm, nodes: 1, gpus_per_node: 1, host_memory_GB: 256}
"""), code=3, guard=out_plan, timeout=180))
    add(Case("llama2-7b on local-cpu (8 GB host)", "cli",
             lambda d: ["plan", LLAMA, "--model-arg", "size=llama2-7b", "--cluster", "local-cpu", "--global-batch",
                        "4", "--time-budget", "5", "-o", str(d / "out.json")], code=3, guard=out_plan, timeout=180))
    add(Case("--global-batch 0", "cli", lambda d: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", "0",
                                                  "-o", str(d / "out.json")], guard=out_plan))
    add(Case("--time-budget -1", "cli", lambda d: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", "4",
                                                  "--time-budget", "-1", "-o", str(d / "out.json")], guard=out_plan))
    add(Case("--top-k -1", "cli", lambda d: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", "4",
                                            "--top-k", "-1", "-o", str(d / "out.json")], guard=out_plan))
    add(Case("simulate dp x tp x pp > devices", "cli",
             lambda d: ["simulate", MLP, "--cluster", "local-cpu", "--dp", "8"]))
    # -- output paths
    blocker = lambda d: w(d / "a_file", "keep me")      # noqa: E731
    add(Case("plan -o under a regular file", "cli",
             lambda d: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", "4", "-o", str(d / "a_file" / "p.json")],
             blocker, guard=lambda d: [d / "a_file"]))
    add(Case("plan -o in an unwritable directory", "cli",
             lambda d: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", "4", "-o", f"{UNWRITABLE_DIR}/p.json"]))
    add(Case("plan -o is a directory", "cli",
             lambda d: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", "4", "-o", str(d)]))
    add(Case("simulate --trace unwritable", "cli",
             lambda d: ["simulate", MLP, "--cluster", "local-cpu", "--dp", "2", "--trace", f"{UNWRITABLE_DIR}/t.json"]))
    add(Case("report --html unwritable", "cli",
             lambda d: ["report", str(d / "plan.json"), str(d / "measured.json"), "--html", f"{UNWRITABLE_DIR}/r.html"],
             both(plan_file(), measured_for)))
    add(Case("report --png under a regular file", "cli",
             lambda d: ["report", str(d / "plan.json"), str(d / "measured.json"), "--png", str(d / "a_file" / "r.png")],
             both(plan_file(), measured_for, blocker), guard=lambda d: [d / "a_file"]))
    add(Case("plan over a 0644 file (goal: exit 0, mode kept)", "cli",
             lambda d: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", "4", "--time-budget", "2", "--json",
                        "-o", str(d / "plan.json")],
             lambda d: (w(d / "plan.json", "{}"), os.chmod(d / "plan.json", 0o644)), code=0, check=mode_kept))
    # -- report
    rep = lambda d: ["report", str(d / "plan.json"), str(d / "measured.json")]    # noqa: E731
    add(Case("measured.json missing", "cli", rep, plan_file()))
    add(Case("step_time_s: \"fast\"", "cli", rep, both(plan_file(), lambda d: measured_for(d, step_time_s="fast"))))
    add(Case("step_time_s: 0", "cli", rep, both(plan_file(), lambda d: measured_for(d, step_time_s=0))))
    add(Case("world_size: \"two\"", "cli", rep, both(plan_file(), lambda d: measured_for(d, world_size="two"))))
    add(Case("measured for another model", "cli", rep,
             both(plan_file(), lambda d: measured_for(d, fingerprint="0123456789abcdef"))))
    add(Case("--calibrate on fwd_s: -1", "cli",
             lambda d: rep(d) + ["--calibrate", "-o", str(d / "cal.json")],
             both(plan_file(), lambda d: measured_for(d, fwd_s=-1.0)), guard=lambda d: [d / "cal.json"]))
    add(Case("--calibrate without -o", "cli", lambda d: rep(d) + ["--calibrate"], both(plan_file(), measured_for)))
    # -- run (launcher)
    add(Case("2-node plan, --nnodes 1", "cli", lambda d: ["run", str(d / "plan.json"), "--nnodes", "1", "--dry-run"],
             tiny_plan(model=MLP, dp=8, nodes=2)))
    add(Case("2-node plan, no --nnodes (goal: print, start nothing)", "cli",
             lambda d: ["run", str(d / "plan.json"), "--steps", "1"], tiny_plan(model=MLP, dp=8, nodes=2),
             code=0, check=no_launch))
    add(Case("--nnodes 0", "cli", lambda d: ["run", str(d / "plan.json"), "--nnodes", "0"], plan_file()))
    add(Case("--steps 0", "cli", lambda d: ["run", str(d / "plan.json"), "--steps", "0"], plan_file()))

    # -- issue 32: no output overwrites an input of the same command; devices written in place
    plan4 = lambda d, out: ["plan", str(d / "m.py"), "--cluster", str(d / "c.yaml"), "--global-batch", "4",  # noqa: E731
                            "--time-budget", "2", "-o", out]
    model_and_cluster = both(model_file(GOOD_MODEL), cluster_file(good_cluster()))
    add(Case("plan -o the model file", "cli", lambda d: plan4(d, str(d / "m.py")), model_and_cluster,
             guard=lambda d: [d / "m.py"]))
    add(Case("plan -o the cluster file", "cli", lambda d: plan4(d, str(d / "c.yaml")), model_and_cluster,
             guard=lambda d: [d / "c.yaml"]))
    add(Case("plan -o the model file by another spelling", "cli", lambda d: plan4(d, str(d / "." / "x" / ".." / "m.py")),
             both(model_and_cluster, lambda d: (d / "x").mkdir()), guard=lambda d: [d / "m.py"]))
    add(Case("plan -o a symlink to the model file", "cli", lambda d: plan4(d, str(d / "link.py")),
             both(model_and_cluster, same_inode_link("m.py", "link.py")), guard=lambda d: [d / "m.py"]))
    add(Case("report --calibrate -o the plan", "cli", lambda d: rep(d) + ["--calibrate", "-o", str(d / "plan.json")],
             both(plan_file(), measured_for), guard=lambda d: [d / "plan.json"]))
    add(Case("report --calibrate -o measured.json", "cli",
             lambda d: rep(d) + ["--calibrate", "-o", str(d / "measured.json")],
             both(plan_file(), measured_for), guard=lambda d: [d / "measured.json"]))
    add(Case("report --html the plan", "cli", lambda d: rep(d) + ["--html", str(d / "plan.json")],
             both(plan_file(), measured_for), guard=lambda d: [d / "plan.json"]))
    add(Case("report --png measured.json", "cli", lambda d: rep(d) + ["--png", str(d / "measured.json")],
             both(plan_file(), measured_for), guard=lambda d: [d / "measured.json"]))
    add(Case("simulate --trace the plan", "cli", lambda d: simp(d) + ["--trace", str(d / "plan.json")], plan_file(),
             guard=lambda d: [d / "plan.json"]))
    add(Case("run --measured the plan", "cli", lambda d: ["run", str(d / "plan.json"), "--measured", str(d / "plan.json")],
             plan_file(), guard=lambda d: [d / "plan.json"]))
    add(Case("run --measured the plan's model file", "cli",
             lambda d: ["run", str(d / "plan.json"), "--measured", str(d / "m.py")],
             both(model_file(GOOD_MODEL), _plan_for_model("m.py", dp=2)), guard=lambda d: [d / "m.py"]))
    add(Case("plan -o /dev/null (goal: exit 0, still a device, no command naming it)", "cli",
             lambda d: plan4(d, "/dev/null"), model_and_cluster, code=0, check=no_command_for("/dev/null")))
    add(Case("plan -o /dev/full (disk full)", "cli", lambda d: plan4(d, "/dev/full"), model_and_cluster,
             check=says("disk is full")))
    add(Case("simulate --trace /dev/full (disk full)", "cli",
             lambda d: ["simulate", MLP, "--cluster", "local-cpu", "--dp", "2", "--trace", "/dev/full"],
             check=says("disk is full")))
    add(Case("report --html /dev/full (disk full)", "cli", lambda d: rep(d) + ["--html", "/dev/full"],
             both(plan_file(), measured_for), check=says("disk is full")))
    add(Case("report --calibrate -o /dev/full (disk full)", "cli",
             lambda d: rep(d) + ["--calibrate", "-o", "/dev/full"], both(plan_file(), measured_for),
             check=says("disk is full")))
    # -- issue 32: every numeric flag checked while parsing
    for name, argv in [
            ("run --lr nan", ["--lr", "nan"]), ("run --lr -1", ["--lr", "-1"]),
            ("run --rdzv-endpoint host:abc", ["--rdzv-endpoint", "host:abc"]),
            ("run --max-restarts -1", ["--max-restarts", "-1"]), ("run --log-every 0", ["--log-every", "0"]),
            ("run --keep-checkpoints 0", ["--keep-checkpoints", "0"]), ("run --warmup-steps -1", ["--warmup-steps", "-1"]),
            ("run --steps 1e3", ["--steps", "1e3"]), ("run --seed 2^40", ["--seed", str(2 ** 40)]),
            ("run --lr inf", ["--lr", "inf"])]:
        add(Case(name, "cli", lambda d, a=argv: ["run", str(d / "plan.json"), *a], plan_file()))
    for name, argv in [
            ("simulate --virtual-stages 0", ["--virtual-stages", "0", "--schedule", "interleaved", "--pp", "2", "--dp", "1"]),
            ("simulate --dp 0", ["--dp", "0"]), ("simulate --micro-batch 0", ["--micro-batch", "0"]),
            ("simulate --global-batch -4", ["--global-batch", "-4"])]:
        add(Case(name, "cli", lambda d, a=argv: ["simulate", MLP, "--cluster", "local-cpu", *a]))
    plan_mlp = lambda d, *a: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", "4", "-o", str(d / "out.json"), *a]  # noqa: E731
    for name, argv in [
            ("plan --seed -1", ["--seed", "-1"]), ("plan --time-budget nan", ["--time-budget", "nan"]),
            ("plan --memory-headroom 1", ["--memory-headroom", "1"]), ("plan --micro-batch 0", ["--micro-batch", "0"]),
            ("plan --tp 0", ["--tp", "0"])]:
        add(Case(name, "cli", lambda d, a=argv: plan_mlp(d, *a), guard=out_plan))
    add(Case("plan --global-batch 10^18", "cli",
             lambda d: ["plan", MLP, "--cluster", "local-cpu", "--global-batch", str(10 ** 18), "-o", str(d / "out.json")],
             guard=out_plan, timeout=60))
    add(Case("profile --passes 0", "cli", lambda d: ["profile", "-o", str(d / "p.json"), "--passes", "0"],
             guard=lambda d: [d / "p.json"]))
    add(Case("profile --target-s inf", "cli", lambda d: ["profile", "-o", str(d / "p.json"), "--target-s", "inf"],
             guard=lambda d: [d / "p.json"]))
    # -- issue 32: model files that hang, leave threads, exit or interrupt by themselves
    add(Case("build_model never returns (inspect)", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file(NEVER_RETURNS), env={"AUTOPAR_MODEL_CALL_TIMEOUT_S": "3"}, timeout=60,
             check=says("did not return within 3 s")))
    add(Case("make_batch sleeps forever (simulate)", "cli",
             lambda d: ["simulate", str(d / "m.py"), "--cluster", "local-cpu", "--dp", "1"],
             model_file(SLEEPS_FOREVER), env={"AUTOPAR_MODEL_CALL_TIMEOUT_S": "3"}, timeout=60))
    add(Case("build_model leaves a thread running (goal: exit 0)", "cli",
             lambda d: ["inspect", str(d / "m.py")], model_file(STRAY_THREAD), code=0, fresh=True, timeout=90))
    add(Case("os._exit(0) in build_model (inspect)", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file(OS_EXIT_BUILD), fresh=True, check=says("os._exit(0)")))
    add(Case("os._exit(0) in make_batch (plan)", "cli", lambda d: plan4(d, str(d / "out.json")),
             both(model_file(OS_EXIT_BATCH), cluster_file(good_cluster())), guard=out_plan, check=says("os._exit(0)")))
    add(Case("KeyboardInterrupt raised by build_model", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file(RAISES_KEYBOARD_INTERRUPT), check=says("no Ctrl-C was pressed")))
    # -- issue 32: the model file's own failures, named as its own, once
    for name, body in MODEL_BODY.items():
        add(Case(f"model: {name} (plan)", "cli", lambda d: plan4(d, str(d / "out.json")),
                 both(model_file(body), cluster_file(good_cluster())), guard=out_plan,
                 check=lambda d, out, err: (short_message(1500)(d, out, err)
                                            or ("the advice is about knobs" if "Fix some knobs" in err else ""))))
    add(Case("model: input of the wrong width (inspect)", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file(MODEL_BODY["input of the wrong width"]), check=short_message(1500)))
    # -- issue 32: a plan paired with another plan's measurements
    add(Case("report: measured.json of another plan", "cli", rep, both(plan_file(), other_plans_measured),
             check=says("another plan")))
    add(Case("report: measured.json of this plan (goal: exit 0)", "cli", rep, both(plan_file(), this_plans_measured),
             code=0))

    # -- issue 42: the last bad inputs and rough edges
    for name in ("target of another shape", "loss_fn returns None"):
        add(Case(f"model: {name} (inspect)", "cli", lambda d: ["inspect", str(d / "m.py")],
                 model_file(MODEL_BODY[name]), check=short_message(1500)))
    add(Case("model: loss_fn raises (inspect)", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file(GOOD_MODEL + "def loss_fn(out, target):\n    raise ValueError('needs labels')\n"),
             check=says("loss_fn", "needs labels")))
    add(Case("build_model catches autopar's stop (inspect)", "cli", lambda d: ["inspect", str(d / "m.py")],
             model_file(CATCHES_THE_STOP), env={"AUTOPAR_MODEL_CALL_TIMEOUT_S": "2"}, timeout=60,
             check=says("did not return within 2 s", "caught autopar's stop")))
    add(Case("os.chdir at import, relative paths (goal: exit 0, plan written)", "cli",
             lambda d: ["plan", "m.py", "--cluster", "local-cpu", "--global-batch", "4", "--time-budget", "2",
                        "-o", "p.json"], model_file(CHDIR_AT_IMPORT), code=0, check=plan_written_here))
    add(Case("profile -o an existing plan file", "cli", lambda d: ["profile", "-o", str(d / "plan.json"), "--quick"],
             plan_file(), guard=lambda d: [d / "plan.json"], timeout=60, check=says("holds a plan", "plan.json")))
    add(Case("export cannot trace a valid model (goal: exit 0, no graph dumps)", "cli",
             lambda d: ["inspect", str(d / "m.py")], model_file(DATA_DEPENDENT_GATE), code=0, check=no_graph_dump))
    for name, body in NOT_TRAINABLE.items():
        add(Case(f"run: {name}, plan made with --no-runtime-check", "cli", run_args(),
                 both(model_file(body), _unchecked_plan_for_model("m.py", dp=2)),
                 guard=lambda d: [d / "measured.json"], check=short_message(1500)))

    # -- the runtime (torchrun, 2-3 ranks on gloo, 1-2 steps of a tiny GPT)
    R = "runtime"
    add(Case("tp=3 with 4 heads", R, run_args(), tiny_plan(tp=3, micro_batch=2)))
    add(Case("unwritable --measured", R,
             lambda d: ["run", str(d / "plan.json"), "--steps", "2", "--measured", f"{UNWRITABLE_DIR}/m.json"],
             tiny_plan(dp=2)))
    add(Case("unwritable --checkpoint-dir", R, run_args("--checkpoint-dir", f"{UNWRITABLE_DIR}/ck"),
             tiny_plan(dp=2), guard=lambda d: [d / "measured.json"]))
    with_ck = lambda d: run_args("--checkpoint-dir", str(d / "ck"))(d)     # noqa: E731
    add(Case("corrupt latest.json", R, with_ck,
             both(tiny_plan(dp=2), lambda d: w(d / "ck" / "latest.json", "{not json")), guard=ck_files))
    add(Case("checkpoint dir of another model", R, with_ck, _foreign, guard=ck_files, timeout=240))
    add(Case("64 bytes flipped in a .distcp, resume", R,
             lambda d: ["run", str(d / "plan.json"), "--steps", "4", "--checkpoint-dir", str(d / "ck"),
                        "--measured", str(d / "measured.json")], flip_distcp, guard=ck_files, timeout=240))
    add(Case("--steps below the checkpoint's step", R,
             lambda d: ["run", str(d / "plan.json"), "--steps", "1", "--checkpoint-dir", str(d / "ck"),
                        "--measured", str(d / "measured.json")], checkpointed, guard=ck_files, timeout=240))
    add(Case("loss_fn fails on the last rank only", R, run_args(),
             both(lambda d: w(d / "m.py", LOSS_FAILS_ON_LAST_STAGE.format(root=str(ROOT))),
                  _plan_for_model("m.py", pp=2, num_microbatches=2)), check=names_the_loss_error))
    add(Case("make_batch ignores batch_size", R, run_args(),
             both(lambda d: w(d / "m.py", IGNORES_BATCH_SIZE.format(root=str(ROOT))),
                  _plan_for_model("m.py", dp=2, micro_batch=4))))
    add(Case("loss is NaN, last checkpoint kept", R,
             lambda d: ["run", str(d / "plan.json"), "--steps", "4", "--checkpoint-dir", str(d / "ck"),
                        "--checkpoint-every", "1", "--measured", str(d / "measured.json")],
             both(lambda d: w(d / "m.py", NAN_INPUTS.format(root=str(ROOT))), _plan_for_model("m.py", dp=2),
                  checkpointed), env={"AUTOPAR_SWEEP_NAN": "1"}, guard=ck_files, timeout=240))
    # -- issue 32: a model file failing on rank 1 only; signals to a training run
    for where in ("build", "batch", "forward"):
        add(Case(f"{where} fails on rank 1 only", R, run_args(),
                 both(lambda d, wh=where: w(d / "m.py", ON_RANK_1.format(root=str(ROOT), where=wh)),
                      _plan_for_model("m.py", dp=2)), check=says("rank 1", "a test fault")))
    long_run = lambda d: ["run", str(d / "plan.json"), "--steps", "100000", "--checkpoint-dir", str(d / "ck"),  # noqa: E731
                          "--measured", str(d / "measured.json")]
    add(Case("SIGTERM to autopar run, checkpointing", R, long_run, tiny_plan(dp=2), code=143, paragraph=False,
             signal=(15, "step 3/", False), check=stopped_resumable(True), timeout=240))
    add(Case("Ctrl-C (SIGINT to the group), checkpointing", R, long_run, tiny_plan(dp=2), code=130, paragraph=False,
             signal=(2, "step 3/", True), check=stopped_resumable(True), timeout=240))
    add(Case("SIGTERM to autopar run, no --checkpoint-dir", R,
             lambda d: ["run", str(d / "plan.json"), "--steps", "100000", "--measured", str(d / "measured.json")],
             tiny_plan(dp=2), code=143, paragraph=False, signal=(15, "step 3/", False),
             check=stopped_resumable(False), guard=lambda d: [d / "measured.json"], timeout=240))
    add(Case("SIGHUP to autopar run, checkpointing", R, long_run, tiny_plan(dp=2), code=129, paragraph=False,
             signal=(1, "step 3/", False), check=stopped_resumable(True), timeout=240))
    # -- issue 42: a batch on meta from a plan no runtime check saw; Ctrl-C pressed twice
    add(Case("make_batch on meta, plan without provenance (ranks)", R, run_args(),
             both(model_file(MODEL_BODY["make_batch on meta"]), _plan_for_model("m.py", dp=2)),
             check=says("error: rank", "on the meta device")))
    add(Case("Ctrl-C twice (SIGINT to the group, twice)", R, long_run, tiny_plan(dp=2), code=130, paragraph=False,
             signal=(2, "step 3/", True, 2), check=stopped_resumable(True), timeout=240))
    return C


def _unchecked_plan_for_model(name: str, **kw) -> Callable[[Path], None]:
    """As ``_plan_for_model``, for a plan 'autopar plan --no-runtime-check' would write."""
    def setup(d: Path) -> None:
        _plan_for_model(name, **kw)(d)
        p = json.loads((d / "plan.json").read_text())
        p["provenance"]["runtime_check"] = "skipped (--no-runtime-check)"
        w(d / "plan.json", json.dumps(p, indent=1))
    return setup


def _plan_for_model(name: str, **kw) -> Callable[[Path], None]:
    """A plan of the case's own model file d/NAME (the tiny GPT's arguments when it wraps the GPT)."""
    def setup(d: Path) -> None:
        text = (d / name).read_text()
        p = make_plan(str(d / name), TINY if "examples.gpt" in text else {}, **kw)
        w(d / "plan.json", json.dumps(p, indent=1))
    return setup


def _foreign(d: Path) -> None:
    """A checkpoint of the tiny GPT, then a plan of a wider GPT pointed at it."""
    checkpointed(d)
    p = make_plan(GPT, {**TINY, "hidden": 64}, dp=2)
    w(d / "plan.json", json.dumps(p, indent=1))


# ---------------------------------------------------------------------------------- running
def digest(paths: list[Path]) -> dict[str, str | None]:
    out = {}
    for p in paths:
        out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    return out


def one_paragraph(err: str) -> bool:
    if "error:" not in err:
        return False
    message = err.split("error:", 1)[1].strip()
    return bool(message) and "\n\n" not in message


MEMORY_LIMIT = 8 << 30       # bytes of address space per case


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def forked_cli(argv: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int | str, str, str]:
    """``autopar ARGV`` in a forked child (see the module docstring): (exit code, stdout, stderr)."""
    out_f, err_f = cwd.parent / f"{cwd.name}.out", cwd.parent / f"{cwd.name}.err"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                               # the child: be the autopar process
        code = 1
        try:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            for fd, path in ((1, out_f), (2, err_f)):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            _limit_memory()
            from autopar.cli import main as cli_main

            sys.argv = ["autopar", *argv]
            code = cli_main(argv)
        except SystemExit as e:                                # what the interpreter does with it
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback as tb

            tb.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code if isinstance(code, int) else 1)
    deadline = time.monotonic() + timeout
    rc: int | str = "timeout"
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    read = lambda p: p.read_text(errors="replace") if p.exists() else ""     # noqa: E731
    return rc, read(out_f), read(err_f)


def _processes_under(d: Path) -> list[int]:
    """Processes whose command line names the case's folder (torchrun, ranks): after the case
    returned, any such is a run that outlived its user.  They are killed (the sweep goes on)."""
    import signal as sg

    found = []
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            if str(d) in pid_dir.joinpath("cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid_dir.name))
        except OSError:
            continue
    for pid in found:
        try:
            os.kill(pid, sg.SIGKILL)
        except OSError:
            pass
    return found


def signalled(case: Case, d: Path, env: dict) -> tuple[int | str, str, str]:
    """``autopar ARGV`` in a fresh process; once stdout shows the case's text, the signal goes to
    it (or, as Ctrl-C does, to its whole process group); then wait for it to end."""
    signum, text, group, times = (*case.signal, 1)[:4]
    out_f, err_f = d.parent / f"{d.name}.out", d.parent / f"{d.name}.err"
    with open(out_f, "w") as o, open(err_f, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "autopar.cli", *case.argv(d)], cwd=d, env=env, stdout=o,
                                stderr=e, stdin=subprocess.DEVNULL, preexec_fn=_limit_memory, start_new_session=True)
        deadline = time.monotonic() + case.timeout
        sent = False
        rc: int | str = "timeout"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                rc = proc.returncode
                break
            if not sent and text in out_f.read_text(errors="replace"):
                for _ in range(times):                 # a key pressed twice: back to back
                    (os.killpg if group else os.kill)(proc.pid, signum)
                sent = True
            time.sleep(0.1)
        else:
            os.killpg(proc.pid, 9)
            proc.wait()
    read = lambda p: p.read_text(errors="replace") if p.exists() else ""     # noqa: E731
    return rc, read(out_f), read(err_f) + ("" if sent else "\n(the signal was never sent)")


def run_case(case: Case, base: Path, fork: bool = True) -> dict:
    d = Path(tempfile.mkdtemp(prefix="case-", dir=base))
    try:
        case.setup(d)
    except Exception as e:                      # a broken setup is the sweep's fault, not autopar's
        return {"name": case.name, "kind": case.kind, "rc": None, "traceback": False, "lost": [],
                "verdict": "SETUP", "why": f"setup failed: {type(e).__name__}: {e}", "s": 0.0}
    guarded = case.guard(d)
    before = digest(guarded)
    before_names = {p.name for p in d.rglob("*")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", **case.env}
    t0 = time.perf_counter()
    if fork and case.kind == "cli" and not case.fresh:
        rc, out, err = forked_cli(case.argv(d), d, env, case.timeout)
    elif case.signal is not None:
        rc, out, err = signalled(case, d, env)
    else:
        try:
            proc = subprocess.run([sys.executable, "-m", "autopar.cli", *case.argv(d)], cwd=d, env=env,
                                  capture_output=True, text=True, timeout=case.timeout, stdin=subprocess.DEVNULL,
                                  preexec_fn=_limit_memory, start_new_session=True)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
    secs = time.perf_counter() - t0
    left_running = _processes_under(d)
    after = digest(guarded)
    lost = [Path(k).name for k in before if before[k] != after[k]]
    # dot-files the case created: temporary files left behind (DCP's own index of a checkpoint,
    # ".metadata", is a file a checkpoint holds, not a leftover)
    temps = [p.name for p in d.rglob(".*") if p.name not in before_names and p.is_file() and p.name != ".metadata"]
    traceback = "Traceback" in err or "Traceback" in out
    whys = []
    if rc != case.code:
        whys.append(f"exit {rc}, goal {case.code}")
    if traceback:
        whys.append("traceback shown")
    if case.code != 0 and case.paragraph and rc == case.code and not one_paragraph(err):
        whys.append("no one-paragraph error message")
    if case.kind == "runtime" and (err.count("error:") > 1 or "closing signal" in err or "Logging error" in err):
        whys.append("message repeated or torchrun's stop lines shown")
    if left_running:
        whys.append(f"{len(left_running)} process(es) still running")
    if lost:
        whys.append("changed: " + ", ".join(lost))
    if temps:
        whys.append("left behind: " + ", ".join(temps))
    if case.check is not None and rc == case.code:
        extra = case.check(d, out, err)
        if extra:
            whys.append(extra)
    message = err.split("error:", 1)[1].strip().split("\n\n")[0] if "error:" in err else ""
    shutil.rmtree(d, ignore_errors=True)
    return {"name": case.name, "kind": case.kind, "rc": rc, "traceback": traceback, "lost": lost + temps,
            "verdict": "FAIL" if whys else "PASS", "why": "; ".join(whys), "s": round(secs, 1),
            "message": " ".join(message.split())[:160]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("cli", "runtime"), default=None)
    ap.add_argument("-k", default=None, help="only cases whose name contains this")
    ap.add_argument("--subprocess", action="store_true",
                    help="run each CLI case as a fresh 'python -m autopar.cli' (slower) instead of a fork")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "fault_sweep.txt"))
    args = ap.parse_args(argv)
    selected = [c for c in cases() if (args.only in (None, c.kind)) and (args.k is None or args.k in c.name)]
    base = Path(tempfile.mkdtemp(prefix="autopar-fault-sweep-"))
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    cli_cases = [c for c in selected if c.kind == "cli"]
    rt_cases = [c for c in selected if c.kind == "runtime"]
    if cli_cases and not args.subprocess:
        import torch  # noqa: F401  (imported once, before the forks)

        import autopar.cli  # noqa: F401
    for c in cli_cases + rt_cases:
        r = run_case(c, base, fork=not args.subprocess)
        results[c.name] = r
        print(f"{r['verdict']:4} {r['rc']!s:>7} {r['s']:6.1f}s  {c.name}  {r['why']}", flush=True)
    shutil.rmtree(base, ignore_errors=True)
    total_s = time.perf_counter() - t0
    rows = [results[c.name] for c in selected]
    lines = [f"autopar fault sweep: {len(rows)} bad inputs ({len(cli_cases)} CLI, {len(rt_cases)} runtime), "
             f"{total_s:.0f} s",
             "goal: exit 2 (3 where no plan fits), a one-paragraph message, no traceback, nothing lost",
             "", f"{'verdict':7} {'exit':>7} {'tb':>3} {'lost':>4}  case  [why not]  | message"]
    for r in rows:
        lines.append(f"{r['verdict']:7} {r['rc']!s:>7} {'yes' if r['traceback'] else 'no':>3} {len(r['lost']):>4}  "
                     f"{r['name']}" + (f"  [{r['why']}]" if r["why"] else "") +
                     (f"  | {r.get('message', '')}" if r.get("message") else ""))
    codes: dict[str, int] = {}
    for r in rows:
        codes[str(r["rc"])] = codes.get(str(r["rc"]), 0) + 1
    lines += ["", "exit codes: " + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())),
              f"tracebacks shown: {sum(r['traceback'] for r in rows)}",
              f"files lost, clobbered or left half-written: {sum(bool(r['lost']) for r in rows)} cases",
              f"PASS {sum(r['verdict'] == 'PASS' for r in rows)} / {len(rows)}; FAIL "
              f"{sum(r['verdict'] == 'FAIL' for r in rows)}; setup errors {sum(r['verdict'] == 'SETUP' for r in rows)}",
              "FAIL: " + (", ".join(r["name"] for r in rows if r["verdict"] != "PASS") or "none")]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output and not (args.only or args.k):
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
