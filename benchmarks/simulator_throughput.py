"""Plan evaluations per second of the simulator's fast path (PlanEvaluator.evaluate).

GPT-3 175B (examples/gpt.py, size=gpt3-175b) on 1024 H100s (128 nodes x 8), dp 8 x tp 8 x pp 16,
1F1B, 64 micro-batches; between evaluations a search-like move changes the recompute or
ZeRO (2/3) choice of 3 random layers.  Target: >= 10,000 evaluations/s on the 2-core dev machine.
Prints evaluations per second of wall time and per second of this process's CPU time (on a
shared machine the second says what the code costs, the first what the machine gave it).

    python benchmarks/simulator_throughput.py [--seconds 5]
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace
from pathlib import Path

from autopar.core.capture import capture_model_file
from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.simulator.configure import config_plan
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator

TARGET_EVALS_PER_S = 10000.0


def h100_cluster(nodes: int) -> Cluster:
    try:
        from autopar.core.cluster import load_cluster   # type: ignore[attr-defined]
        return load_cluster("h100-128x8", nodes=nodes)
    except Exception:
        # DGX H100: NVLink4 450 GB/s per direction per GPU, 8 x 400 Gb/s NDR per node
        g = NodeGroup("dgx-h100", "h100-sxm", nodes, 8, 80 * 2**30, Link(450.0, 3.0), 2 * 2**40, Link(64.0, 10.0))
        return Cluster("h100-128x8", (g,), Link(50.0, 5.0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    model = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
    t0 = time.perf_counter()
    graph = capture_model_file(str(model), {"size": "gpt3-175b"}, 1)
    capture_s = time.perf_counter() - t0
    cluster = h100_cluster(128)
    evaluator = PlanEvaluator(graph, cluster, CostModel.from_profile("h100-sxm"))
    plan = config_plan(graph, degrees={"dp": 8, "tp": 8, "pp": 16},
                       micro_batch=1, global_batch=512, schedule="1f1b", virtual_stages=1,
                       zero=2, recompute="selective", offload="none", precision="bf16", sequence_parallel=True)
    first = evaluator.evaluate(plan)
    rng = random.Random(0)
    layers = list(plan.layers)
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < args.seconds:
        for _ in range(50):
            for i in rng.sample(range(len(layers)), 3):
                layers[i] = replace(layers[i], recompute=rng.choice(("none", "selective", "full")),
                                    zero=rng.choice((2, 3)))
            evaluator.evaluate(replace(plan, layers=tuple(layers)))
            n += 1
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    rate = n / elapsed
    print(f"capture {capture_s:.1f} s; first plan: step {first.step_time_s:.3f} s, {first.tflops_per_gpu:.0f} model "
          f"TFLOP/s per GPU, max memory {first.max_memory_bytes / 2**30:.1f} GiB, fits {first.fits}")
    print(f"gpt3-175b on {cluster.world_size} GPUs: {rate:,.0f} plan evaluations/s "
          f"({n} in {elapsed:.2f} s; {n / cpu:,.0f} per CPU-second); ratio to target {TARGET_EVALS_PER_S:,.0f}/s = "
          f"{rate / TARGET_EVALS_PER_S:.2f}; "
          f"layer costs computed: {evaluator.num_layer_costs_computed}")


if __name__ == "__main__":
    main()
