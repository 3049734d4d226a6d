"""Shared pieces of the runtime tests: a small GPT, plans for it, torchrun launches, the reference.

Every multi-process test is a real ``torchrun`` on gloo (OMP_NUM_THREADS=1, a free port, a
timeout); parity is checked against ``plain_loop`` (a plain PyTorch loop) run in the test process.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
WORKER = Path(__file__).resolve().parent / "runtime_worker.py"
# small GPT: 4 blocks (so 2 pipeline stages hold 2+ layers each, or 4 interleaved stages), dropout 0
MODEL_ARGS = {"layers": 4, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64, "dropout": 0.0}
TP_STYLES = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"}
GLOBAL_BATCH = 4
STEPS = 5
LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-5
# Adam divides by sqrt(v) + eps (eps = 1e-8): an element whose gradient is rounding noise
# (|g| below eps at every step -- e.g. the key bias, whose exact gradient is zero because
# softmax ignores a shift shared by all keys) takes updates of O(lr) with the noise's sign, so
# the layouts legitimately disagree there by up to steps * lr.  Those elements are held to
# that bound; every other element to PARAM_ATOL.
from autopar.runtime.options import ADAM_EPS, DEFAULT_LR  # noqa: E402
from autopar.runtime.ports import free_port  # noqa: E402,F401  (the tests import it from here)

NOISE_GRAD = ADAM_EPS


@functools.lru_cache(maxsize=None)
def graph():
    from capture_memo import captured   # the ranks' plan checks read this capture (tests/capture_memo.py)

    return captured(str(GPT), dict(MODEL_ARGS), 1)


def make_plan(path: Path, **kw) -> Path:
    """A uniform plan for the small GPT; TP styles on every block when tp > 1."""
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = graph()
    tp = kw.get("tp", 1)
    if tp > 1 and "tp_styles_per_layer" not in kw:
        kw["tp_styles_per_layer"] = {i: {f"{l.name}.{k}": v for k, v in TP_STYLES.items()}
                                     for i, l in enumerate(g.layers) if l.name.startswith("blocks.")}
    ref = ModelRef(file=str(GPT), args=dict(MODEL_ARGS), name="gpt", fingerprint=g.fingerprint)
    plan = uniform_plan(model=ref, num_layers=len(g.layers), **kw)
    assert plan.global_batch == GLOBAL_BATCH, plan.global_batch
    save_plan(plan, path)
    return path


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env.pop("AUTOPAR_FAULT_AT", None)
    env.update(extra)
    return env


def torchrun(nproc: int, *args: str, timeout_s: float, env: dict | None = None, extra_launch=(),
             port: int | None = None, background: bool = False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port or free_port()}", *extra_launch, *args]
    if background:
        return subprocess.Popen(cmd, env=env or worker_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env or worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def run_cases(nproc: int, cases: list[dict], tmp: Path, timeout_s: float) -> subprocess.CompletedProcess:
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    out = torchrun(nproc, str(WORKER), str(spec), timeout_s=timeout_s)
    assert out.returncode == 0, failure_summary(out.stdout + out.stderr)
    return out


def failure_summary(log: str) -> str:
    """The workers' own error lines first (torchrun's summary at the end says little)."""
    errors = [l for l in log.splitlines() if "Error" in l and "elastic" not in l][:20]
    return "\n".join(errors) + "\n----\n" + log[-4000:]


@functools.lru_cache(maxsize=None)
def reference(steps: int = STEPS, init: str = "auto"):
    """The plain single-process PyTorch loop (``plain_loop``, which never enters the runtime) on
    the same global batches, computed once per test session.  ``init="per-module"``: the loop
    starts from the runtime's per-module init values (that init is the runtime's own
    definition); it still trains them without the runtime."""
    from plain_loop import train_plain

    initial = None
    if init == "per-module":
        from autopar.core.modelfile import load_model_file
        from autopar.runtime.materialize import per_module_source
        from plain_loop import SEED, load

        source = per_module_source(load_model_file(GPT), dict(MODEL_ARGS), SEED)
        with torch.device("meta"):
            names = [n for n, _ in load(GPT).build_model(**MODEL_ARGS).named_parameters()]
        initial = {n: source(n).clone() for n in names}
    return train_plain(GPT, dict(MODEL_ARGS), GLOBAL_BATCH, steps, initial=initial)


def consolidated_params(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The full model parameters of the latest DCP checkpoint, read back by DCP's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = json.loads((checkpoint_dir / "latest.json").read_text())
    out = checkpoint_dir / "consolidated.pt"
    dcp_to_torch_save(checkpoint_dir / latest["path"], out)
    state = torch.load(out, weights_only=False)
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state["model"].items()}


def assert_matches_reference(measured_path: Path, checkpoint_dir: Path, ref, label: str,
                             steps: int = STEPS, aliases: dict[str, str] | None = None) -> None:
    """``aliases``: tied names -> the canonical name under which the checkpoint holds them
    (``runtime.state_names``); the reference's every name is checked against the checkpoint's."""
    m = json.loads(measured_path.read_text())
    assert len(m["losses"]) == steps, (label, m["losses"])
    diffs = [abs(a - b) for a, b in zip(m["losses"], ref.losses)]
    assert max(diffs) <= LOSS_ATOL, f"{label}: losses {m['losses']} vs reference {ref.losses}"
    params = consolidated_params(checkpoint_dir)
    aliases = aliases or {}
    saved = {name: aliases.get(name, name) for name in ref.params}
    assert set(saved.values()) <= set(params), (label, sorted(set(saved.values()) - set(params)))
    for name, want in ref.params.items():
        got = params[saved[name]].float()
        assert got.shape == want.shape, (label, name, got.shape, want.shape)
        diff = (got - want).abs()
        noise = ref.grad_abs_max[name] < NOISE_GRAD
        err = diff[~noise].max().item() if (~noise).any() else 0.0
        assert err <= PARAM_ATOL, f"{label}: parameter {name} differs from the reference by {err:.3g}"
        if noise.any():
            bound = steps * DEFAULT_LR * 1.01
            assert diff[noise].max().item() <= bound, \
                f"{label}: {name} (noise-gradient elements) off by more than {bound}"
