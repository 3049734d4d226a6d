"""For each zoo model: ``autopar plan`` on a 2-device gloo cluster, then the plan it wrote passes
``autopar run``'s pre-launch check and trains (finite losses, the measured file written).  Whatever
kinds the planner picked, the runtime must run them: the planner offers only what it checked
against the runtime's own code.

3 steps (AdamW's first update moves each weight by lr times the sign of its gradient; the third
loss follows a second update, which weighs the gradients' sizes), a global batch of 4, a 1 s
search: whichever plan the search returns must run, and the parity checks compare that plan's
run with the plain loop.  The models are planned in this process
(``autopar.cli.main``, what ``autopar plan`` runs) and checked as ``autopar run`` checks a plan
before it starts torchrun (``runtime.plan_check.check_plan``); then ONE torchrun launch trains
every plan in turn (``tests/zoo_worker.py``: ``runtime.train.run`` per plan, one process group),
instead of one ``autopar run`` per model: 19 launches cost the suite ~6 minutes of interpreter
and transformers start-up.  The BatchNorm models' runs also match the plain loop
(tests/plain_loop.py, with BatchNorm's statistics over each micro-batch): whatever plan the
planner chose trains the model the file wrote.  ``autopar run``'s own launch path (torchrun, its
exit codes and messages) is tested by tests/integration/test_runtime_launch.py and
test_trial_steps.py.

The same launch trains the 2-rank plans of ``autopar plan --cp 2`` (the zoo's Llama and GPT-2, both
attending through SDPA; the zoo's nanoGPT writes its attention as matmul and softmax, which cp
refuses) and ``autopar plan --ep 2`` (the zoo's Mixtral, MoE and DeepSeek-V3 style MoE), at a
global batch of 2 (the cp plans hold it on one dp rank, the ep plans one sample per rank), 3 steps:
the run says it ran cp = 2 / ep = 2 (``test_plan_with_cp_or_ep_then_run_trains``; the 4-rank ep x
pp and cp x pp cases are tests/integration/test_plan_run_cp_ep.py's). They are planned only when
that test is selected (it is marked slow).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plain_loop  # noqa: E402

pytestmark = pytest.mark.multiproc          # each case plans, then runs torchrun

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "tests" / "zoo"
MODELS = sorted(p.stem for p in ZOO.glob("*.py") if p.stem != "__init__")
STEPS = 3

# two gloo CPU processes; the link figures are local-cpu's (examples/clusters/local-cpu.yaml)
CLUSTER = """\
name: two-cpu
backend: gloo
inter_node: {bandwidth_GBps: 1.4, latency_us: 750}
groups:
  - name: cpu
    gpu: local-cpu
    nodes: 1
    gpus_per_node: 2
    compute_slots: 2
    gpu_memory_GB: 4
    intra_node: {bandwidth_GBps: 1.4, latency_us: 750}
    host_memory_GB: 8
    host_to_device: {bandwidth_GBps: 7, latency_us: 1.2}
"""


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "two-cpu.yaml"
    path.write_text(CLUSTER)
    return path


WORKER = ROOT / "tests" / "zoo_worker.py"


# further plans of zoo models with fixed knobs: case -> (model, autopar plan flags)
FIXED = {"lora_gpt_tp2": ("lora_gpt", ("--tp", "2"))}
# plans with a fixed cp or ep degree, at a global batch of 2: case -> (model, the axis fixed at 2)
CP_EP = {
    "hf_llama_cp2": ("hf_llama", "cp"),
    "hf_gpt2_cp2": ("hf_gpt2", "cp"),
    "hf_mixtral_ep2": ("hf_mixtral", "ep"),
    "moe_ep2": ("moe", "ep"),
    "deepseek_moe_ep2": ("deepseek_moe", "ep"),
}
CP_EP_TEST = "test_plan_with_cp_or_ep_then_run_trains"


def _plan(model: str, cluster_file: Path, folder: Path, flags: tuple[str, ...] = (), case: str = "",
          batch: int = 4) -> dict:
    """Plan one model in this process and check the plan as ``autopar run`` would; the case for the
    shared launch, or why there is none."""
    from autopar.cli import main as cli_main
    from autopar.runtime.plan_check import check_plan

    case = case or model
    plan_path = folder / f"{case}.plan.json"
    rc = cli_main(["plan", str(ZOO / f"{model}.py"), "--cluster", str(cluster_file), "--global-batch", str(batch),
                   "--time-budget", "1", "-o", str(plan_path), "--json", *flags])
    if rc != 0:
        return {"error": f"autopar plan {model} {' '.join(flags)} exited {rc}"}
    check_plan(plan_path, None)
    plan = json.loads(plan_path.read_text())
    kinds = (plan["mesh"], sorted({(l["zero"], l["recompute"], l["offload"], bool(l["tp"])) for l in plan["layers"]}))
    return {"plan": str(plan_path), "steps": STEPS, "measured": str(folder / f"{case}.measured.json"),
            "result": str(folder / f"{case}.result.json"), "kinds": repr(kinds)}


def _plan_all(cluster_file: Path, folder: Path, request) -> dict[str, dict]:
    """Every case planned (``_plan``): model (or case of FIXED, CP_EP) -> its case, or its error."""
    cases = {}
    for model in MODELS:
        if model.startswith("hf_"):
            try:
                import transformers  # noqa: F401
            except ImportError:
                continue
        try:
            cases[model] = _plan(model, cluster_file, folder)
        except Exception as e:  # noqa: BLE001 -- shown by that model's test, the others still run
            cases[model] = {"error": f"{type(e).__name__}: {e}"}
    for case, (model, flags) in FIXED.items():
        try:
            cases[case] = _plan(model, cluster_file, folder, flags, case)
        except Exception as e:  # noqa: BLE001
            cases[case] = {"error": f"{type(e).__name__}: {e}"}
    if any(getattr(item, "originalname", "") == CP_EP_TEST for item in request.session.items):
        for case, (model, axis) in CP_EP.items():
            try:
                cases[case] = _plan(model, cluster_file, folder, (f"--{axis}", "2"), case, batch=2)
            except Exception as e:  # noqa: BLE001
                cases[case] = {"error": f"{type(e).__name__}: {e}"}
    return cases


@pytest.fixture(scope="module")
def trained(cluster_file, tmp_path_factory, request) -> dict[str, dict]:
    """model (or case of FIXED, CP_EP) -> its case (plan, kinds, result file, the launch's log),
    after one torchrun launch trained them all."""
    from runtime_support import failure_summary, torchrun, worker_env

    import capture_memo

    folder = tmp_path_factory.mktemp("zoo_plans")
    with capture_memo.in_this_process():    # a model planned twice, and the plan check, capture it once
        cases = _plan_all(cluster_file, folder, request)
    runnable = [c for c in cases.values() if "plan" in c]
    spec = folder / "cases.json"
    spec.write_text(json.dumps(runnable))
    out = torchrun(2, str(WORKER), str(spec), timeout_s=900, env=worker_env())
    log = out.stdout + out.stderr
    for c in runnable:
        c["log"] = log
        c["launch"] = "" if out.returncode == 0 else failure_summary(log)
    return cases


@pytest.mark.parametrize("model", MODELS)
def test_plan_then_run_trains(model, trained):
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    case = trained[model]
    assert "error" not in case, case.get("error")
    result = Path(case["result"])
    assert result.exists(), f"{model} plan {case['kinds']} did not finish in the shared launch:\n{case['launch']}"
    out = json.loads(result.read_text())
    assert "losses" in out, f"{model} plan {case['kinds']}: {out}"
    losses = out["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), (model, case["kinds"], losses)
    measured = json.loads(Path(case["measured"]).read_text())
    assert measured["losses"] == losses


# models whose BatchNorm normalises each micro-batch by its own statistics; resnet18_bn cannot
# train on one sample per micro-batch, which its plan leaves out (planner/micro_batches.py)
BATCH_NORM = ("cnn_bn", "resnet18_bn")
LOSS_ATOL = 1e-5


@pytest.mark.parametrize("model", BATCH_NORM)
def test_batch_norm_plan_trains_like_the_plain_loop(model, trained):
    """The planned run's losses are the plain loop's with the global batch cut into the plan's
    micro-batches (``chunks``: BatchNorm's statistics are each micro-batch's)."""
    case = trained[model]
    assert "error" not in case, case.get("error")
    plan = json.loads(Path(case["plan"]).read_text())
    out = json.loads(Path(case["result"]).read_text()) if Path(case["result"]).exists() else {}
    assert "losses" in out, f"{model} plan {case['kinds']}: {out}\n{case.get('launch', '')}"
    assert plan["micro_batch"] >= 2 or model != "resnet18_bn", plan["micro_batch"]
    want = plain_loop.train_plain(ZOO / f"{model}.py", {}, plan["global_batch"], STEPS,
                                  chunks=plan["global_batch"] // plan["micro_batch"]).losses
    diff = max(abs(a - b) for a, b in zip(out["losses"], want))
    assert diff <= LOSS_ATOL, f"{model} plan {case['kinds']}: losses {out['losses']} vs plain loop {want} ({diff:.3g})"


def test_lora_tp2_plan_trains_like_the_plain_loop(trained):
    """``autopar plan --tp 2`` of the LoRA GPT (base weights, embedding and head frozen) runs on
    two ranks -- its row-wise frozen embedding has no gradient to hook -- and trains like the
    plain loop, whose AdamW skips the frozen parameters (no gradient)."""
    case = trained["lora_gpt_tp2"]
    assert "error" not in case, case.get("error")
    plan = json.loads(Path(case["plan"]).read_text())
    assert plan["mesh"]["tp"] == 2
    out = json.loads(Path(case["result"]).read_text()) if Path(case["result"]).exists() else {}
    assert "losses" in out, f"lora_gpt --tp 2 plan {case['kinds']}: {out}\n{case.get('launch', '')}"
    want = plain_loop.train_plain(ZOO / "lora_gpt.py", {}, plan["global_batch"], STEPS).losses
    diff = max(abs(a - b) for a, b in zip(out["losses"], want))
    assert diff <= LOSS_ATOL, f"lora_gpt --tp 2 plan {case['kinds']}: losses {out['losses']} vs plain loop {want} ({diff:.3g})"


def _trained(case: dict, needles: tuple[str, ...], world: int) -> tuple[dict, dict]:
    """(the plan, its measured file) of a case a shared launch trained: it finished, the run's
    own line for the plan names ``needles`` (what it ran), and the measured file is this plan's,
    on ``world`` ranks, with the losses the worker recorded."""
    assert "error" not in case, case.get("error")
    plan = json.loads(open(case["plan"]).read())
    assert os.path.exists(case["result"]), f"{plan['mesh']} did not finish in the shared launch:\n{case['launch']}"
    out = json.loads(open(case["result"]).read())
    assert "losses" in out, f"{plan['mesh']}: {out}"
    line = next((l for l in case["log"].splitlines() if f"plan {case['plan']}: mesh" in l), "")
    assert all(n in line for n in needles), case["log"][-3000:]
    m = json.loads(open(case["measured"]).read())
    assert m["plan"] == case["plan"] and m["world_size"] == world and m["losses"] == out["losses"]
    return plan, m


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CP_EP))
def test_plan_with_cp_or_ep_then_run_trains(name, trained):
    """``autopar plan --cp 2`` / ``--ep 2`` writes a plan with that degree, noted as fixed by the
    flag, and the plan trains on 2 ranks with that degree, at the global batch planned."""
    pytest.importorskip("transformers")
    _model, axis = CP_EP[name]
    plan, m = _trained(trained[name], (f" {axis}=2",), 2)
    assert plan["mesh"][axis] == 2 and plan["mesh"]["world_size"] == 2, plan["mesh"]
    left = {x["kind"]: x["reason"] for x in plan["provenance"]["left_out"]}
    assert left[{"cp": "context parallel (used)", "ep": "expert parallel (used)"}[axis]] == f"{axis} 2 fixed by --{axis}"
    assert m["global_batch"] == 2
    assert len(m["losses"]) == STEPS and all(math.isfinite(x) for x in m["losses"]), m["losses"]
