"""One published run priced as its software ran, through the simulator's public entry points --
the helper of benchmarks/nvme_runs.py and benchmarks/grad_compression_runs.py.

A run is a model file with its arguments (captured on meta at the run's micro-batch), a cluster
file, a uniform layout (``simulator.configure.config_plan``: degrees, micro-batch, global batch,
ZeRO stage, recompute, offload, precision, gradient compression) and the training code it ran
(``simulator.device.training_code.TrainingCode``: its sharded data parallelism, reduce bytes),
priced by ``simulator.simulate.simulate_plan`` with the calibration every benchmark uses
(``simulator.device.calibration.FITTED``).  Nothing here is fitted to the runs it prices.
``autopar.simulate`` prices a configuration as autopar's own runtime runs it, with no argument for
another code (DeepSpeed's ZeRO-3) or a gradient compression; so this calls the entry points under
it, as benchmarks/published_runs.py does.

Error = predicted throughput / published throughput - 1, as benchmarks/published_runs.py
reports it: positive means the simulator promises more than the run delivered.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_results(script: str, lines: list[str], rows: list[dict], error: str) -> None:
    """benchmarks/results/<script>.txt (the command and the printed ``lines``) and <script>.json
    (the command, what the error means and the priced ``rows``)."""
    results = ROOT / "benchmarks" / "results"
    command = f"python benchmarks/{script}.py"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{script}.txt").write_text(f"$ {command}\n" + "\n".join(lines) + "\n")
    (results / f"{script}.json").write_text(json.dumps({"command": command, "error": error, "rows": rows},
                                                       indent=1) + "\n")


def ratio_error(predicted: float, published: float) -> float:
    """predicted throughput / published throughput - 1 (any throughput: samples/s, a speed-up)."""
    return predicted / published - 1.0


def row_cluster(name_or_path: str, nodes: int, gpus_per_node: int | None = None):
    """The cluster file (a bundled name or a path under the repository) rescaled to ``nodes``;
    ``gpus_per_node`` narrows its one group (a one-GPU baseline on the same node type)."""
    from autopar.core.cluster import load_cluster

    path = ROOT / name_or_path
    cl = load_cluster(str(path) if path.exists() else name_or_path, nodes=nodes)
    if gpus_per_node is not None:
        cl = replace(cl, groups=tuple(replace(g, gpus_per_node=gpus_per_node) for g in cl.groups))
    return cl


def training_code(code: dict):
    """``TrainingCode`` from a row's ``code``: ``sharded`` names a runtime of
    simulator/axes/sharded_dp.py (e.g. DEEPSPEED_ZERO3_2021), ``reduce_bytes`` the bytes of a
    reduced gradient element, ``nvme_swap_overlapped`` whether the NVMe tier's swap overlaps the
    compute; the rest keep TrainingCode's defaults (torch's AdamW, DDP)."""
    from autopar.simulator.axes import sharded_dp
    from autopar.simulator.device.training_code import TrainingCode

    kw = {}
    if code.get("sharded"):
        kw["sharded"] = getattr(sharded_dp, code["sharded"])
    if code.get("reduce_bytes"):
        kw["reduce_bytes"] = float(code["reduce_bytes"])
    if "nvme_swap_overlapped" in code:
        kw["nvme_swap_overlapped"] = bool(code["nvme_swap_overlapped"])
    return TrainingCode(**kw)


def price(model: dict, cluster, layout: dict, code: dict, graph_cache: dict, timeline: bool = False):
    """The simulator's result (``SimResult``) for one run: ``model`` {"file", "args"},
    ``layout`` the config_plan choices (``dp``, ``micro_batch``, ``global_batch``, ``zero``,
    ``recompute``, ``offload``, ``precision``, optional ``grad_compression``); ``timeline``:
    keep the step's events (``SimResult.timeline``)."""
    from autopar.core.capture import capture_model_file
    from autopar.simulator.configure import config_plan
    from autopar.simulator.device.calibration import FITTED
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.simulate import simulate_plan

    path, mb = str(ROOT / model["file"]), layout["micro_batch"]
    key = (path, tuple(sorted(model.get("args", {}).items())), mb)
    if key not in graph_cache:
        graph_cache[key] = capture_model_file(path, dict(model.get("args", {})), mb)
    graph = graph_cache[key]
    tc = training_code(code)
    cms = {g.gpu: CostModel.from_profile(g.gpu).for_code(tc).for_calibration(FITTED) for g in cluster.groups}
    plan = config_plan(graph, degrees={"dp": layout["dp"]}, micro_batch=mb, global_batch=layout["global_batch"],
                       schedule="1f1b", virtual_stages=1, zero=layout.get("zero", 0),
                       recompute=layout.get("recompute", "none"), offload=layout.get("offload", "none"),
                       precision=layout["precision"], sequence_parallel=False, cluster_name=cluster.name)
    if layout.get("grad_compression", "none") != "none":
        plan = replace(plan, grad_compression=layout["grad_compression"])
    return simulate_plan(graph, plan, cluster, cms, timeline=timeline)


def step_phases(result, device: int = 0) -> dict[str, float]:
    """Seconds of a one-micro-batch step's phases on ``device``, from its timeline (``price``
    with ``timeline=True``), as a training log splits them: forward (to the last forward op's
    end), backward (to the last backward, recompute, reduce or copy out of the backward), and the
    optimizer (the rest of the step)."""
    fwd_end = bwd_end = 0.0
    for e in result.timeline:
        if e["device"] != device:
            continue
        end, kind = e["start_s"] + e["dur_s"], e["name"].split(" ")[0]
        if kind == "fwd":
            fwd_end = max(fwd_end, end)
        elif kind in ("bwd", "recompute", "reduce_scatter", "d2h"):
            bwd_end = max(bwd_end, end)
    return {"forward_s": fwd_end, "backward_s": bwd_end - fwd_end, "optimizer_s": result.step_time_s - bwd_end}
