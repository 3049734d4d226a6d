"""The planner against the best uniform Megatron-style configuration, under the same simulator.

The grid is what an expert would sweep by hand (Narayanan et al. 2021, Sec. 3 and 5.4): every
dp x tp x pp that divides the cluster with tp a power of two inside a node, recompute none or
full, ZeRO 0 or 1, every micro-batch size dividing the per-replica batch, 1F1B, equal
stages of transformer blocks, the Megatron column/row split on every layer.  For GPT 145.6B on
1536 A100s the reference is also Megatron-LM's own configuration (Table 1: tp 8, pp 8, dp 24,
global batch 2304, full recompute; micro-batch and schedule as its script ran them, or faster).  Prints, per case, the planner's
predicted throughput over the grid's best (>= 1.0 means the planner is at least as fast).

    python benchmarks/planner_vs_grid.py [--time-budget 40] [--only NAME] [--wider K] [--knobs]

``--wider K`` gives the search K times its default breadth (settings assembled, MCMC iterations,
MCMC starts): whether a longer search finds faster plans than the default one returns.

``--knobs`` then decides compile and float8 on the search's plans as ``autopar plan`` does
(planner/compile_choice.choose_compile, planner/float8_choice.choose_float8, no flag fixing
either; float8 needs torchao importable) and prints, under each case, what each chose and what it
bought.  The grid stays eager bf16: the ratio column compares the search's plans as before.
"""
from __future__ import annotations

import argparse
import math
import time

from autopar.core.capture import capture_model_file
from autopar.core.cluster import load_cluster
from autopar.core.plan import ModelRef, uniform_plan
from autopar.core.sharding import megatron_styles
from autopar.planner.search import PlanOptions, search
from autopar.planner.space import divisors, mesh_candidates
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.evaluator import PlanEvaluator

GPT = "examples/gpt.py"
# (name, model args, cluster, nodes, global batch)
CASES = [
    ("gpt-1.3b / 8 H100", {"layers": 24, "hidden": 2048, "heads": 16, "seq": 2048}, "h100-16x8", 1, 128),
    ("gpt3-2.7b / 8 A100", {"size": "gpt3-2.7b"}, "dgx-a100-1x8", None, 64),
    ("gpt3-13b / 32 A100", {"size": "gpt3-13b"}, "dgx-a100-4x8", None, 256),
    ("gpt3-6.7b / 128 H100", {"size": "gpt3-6.7b"}, "h100-16x8", None, 512),
    ("gpt3-175b / 1024 H100", {"size": "gpt3-175b"}, "h100-128x8", None, 1536),
    ("gpt-145.6b / 1536 A100", {"layers": 80, "hidden": 12288, "heads": 96, "seq": 2048, "vocab": 51200},
     "dgx-a100-192x8", None, 2304),
]


def block_bounds(graph, num_stages: int) -> list[int] | None:
    """Equal numbers of transformer blocks per stage; embeddings join the first, the head the last."""
    L = len(graph.layers)
    blocks = L - 2
    if num_stages > blocks:
        return None
    base, extra = divmod(blocks, num_stages)
    b = [0]
    for i in range(num_stages):
        b.append(b[-1] + base + (1 if i < extra else 0))
    b = [0] + [x + 1 for x in b[1:-1]] + [L]
    return b


def grid_best(graph, cluster, cms, global_batch: int, precision: str = "bf16"):
    ev = PlanEvaluator(graph, cluster, cms)
    L = len(graph.layers)
    styles = {i: megatron_styles(graph, i) for i in range(L)}
    model = ModelRef(graph.model_file, dict(graph.model_args), graph.model_name, graph.fingerprint)
    best, best_cfg, n = math.inf, None, 0
    for mesh in mesh_candidates(cluster.world_size, gpus_per_node=cluster.gpus_per_node, num_layers=L,
                                global_batch=global_batch, max_tp=cluster.gpus_per_node, sequence_parallel=False):
        bounds = block_bounds(graph, mesh.pp)
        if bounds is None:
            continue
        for mb in divisors(global_batch // mesh.dp):
            m = global_batch // (mesh.dp * mb)
            for zero in ((0, 1) if mesh.dp > 1 else (0,)):
                for rc in ("none", "full"):
                    plan = uniform_plan(model=model, num_layers=L, dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, micro_batch=mb,
                                        num_microbatches=m, tp_styles_per_layer=styles, zero=zero, recompute=rc,
                                        precision=precision, stage_bounds=bounds)
                    r = ev.evaluate(plan)
                    n += 1
                    if r.fits and r.step_time_s < best:
                        best, best_cfg = r.step_time_s, f"dp{mesh.dp} tp{mesh.tp} pp{mesh.pp} mb{mb} zero{zero} rc-{rc}"
    return best, best_cfg, n


def megatron_145b(graph, cluster, cms):
    """Megatron-LM Table 1: tp 8, pp 8, dp 24, batch 2304, full recompute; the fastest of 1F1B and
    interleaved at micro-batch 1, and what the paper's script ran (NVIDIA/Megatron-LM 6985e58938,
    examples/sc21/run_table_1.sh: micro-batch 2, 5 layers per virtual stage = 2 chunks per rank)."""
    ev = PlanEvaluator(graph, cluster, cms)
    L = len(graph.layers)
    styles = {i: megatron_styles(graph, i) for i in range(L)}
    model = ModelRef(graph.model_file, dict(graph.model_args), graph.model_name, graph.fingerprint)
    best = math.inf
    for mb, schedule, v in ((1, "1f1b", 1), (1, "interleaved", 2), (1, "interleaved", 5), (2, "interleaved", 2)):
        bounds = block_bounds(graph, 8 * v)
        plan = uniform_plan(model=model, num_layers=L, dp=24, tp=8, pp=8, micro_batch=mb, num_microbatches=96 // mb,
                            schedule=schedule, virtual_stages=v, tp_styles_per_layer=styles, recompute="full",
                            precision="bf16", stage_bounds=bounds)
        r = ev.evaluate(plan)
        if r.fits:
            best = min(best, r.step_time_s)
    return best


def print_knobs(res, graph, cluster, cms) -> None:
    """What ``autopar plan`` would decide for compile and float8 on this search result."""
    from autopar.planner.compile_choice import choose_compile
    from autopar.planner.float8_choice import choose_float8

    res, compiled = choose_compile(res, graph, cluster, cms, None)
    res, float8 = choose_float8(res, graph, cluster, cms, None, "bf16")
    p = res.best.plan
    print(f"    {compiled.summary()}", flush=True)
    print(f"    {float8.summary()}", flush=True)
    print(f"    with both: {res.best.step_time_s:.3f} s, dp{p.mesh.dp} tp{p.mesh.tp} pp{p.mesh.pp}"
          f"{' sp' if p.mesh.sequence_parallel else ''} mb{p.micro_batch}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-budget", type=float, default=40.0)
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--wider", type=int, default=1,
                    help="search K times as many settings, MCMC iterations and MCMC starts as the default")
    ap.add_argument("--knobs", action="store_true",
                    help="also decide compile and float8 on the planner's plans, as autopar plan does")
    args = ap.parse_args()
    # PlanOptions' defaults, K times (a dataclass keeps a field's default as its class attribute)
    breadth = {k: getattr(PlanOptions, k) * args.wider for k in ("num_screened", "mcmc_iterations", "mcmc_starts")}
    print(f"{'case':<26} {'grid best (s)':>13} {'planner (s)':>12} {'ratio':>6}  grid config / planner mesh")
    for name, margs, cname, nodes, gb in CASES:
        if args.only and args.only not in name:
            continue
        cluster = load_cluster(cname, nodes=nodes)
        cms = {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}
        graph = capture_model_file(GPT, margs, 1)
        t0 = time.perf_counter()
        grid_s, cfg, n = grid_best(graph, cluster, cms, gb)
        grid_time = time.perf_counter() - t0
        res = search(graph, cluster, cms, PlanOptions(global_batch=gb, time_budget_s=args.time_budget, **breadth))
        p = res.best.plan
        ratio = grid_s / res.best.step_time_s
        print(f"{name:<26} {grid_s:>13.3f} {res.best.step_time_s:>12.3f} {ratio:>6.3f}  {cfg} ({n} configs, "
              f"{grid_time:.0f} s) / dp{p.mesh.dp} tp{p.mesh.tp} pp{p.mesh.pp}{' sp' if p.mesh.sequence_parallel else ''} "
              f"mb{p.micro_batch} {p.pipeline.schedule} ({res.plan.provenance['search_s']:.0f} s)", flush=True)
        if "145.6b" in name:
            ref = megatron_145b(graph, cluster, cms)
            print(f"{'  vs Megatron tp8 pp8 dp24':<26} {ref:>13.3f} {res.best.step_time_s:>12.3f} "
                  f"{ref / res.best.step_time_s:>6.3f}  (Narayanan et al. 2021, Table 1 configuration)", flush=True)
        if args.knobs:
            print_knobs(res, graph, cluster, cms)


if __name__ == "__main__":
    main()
