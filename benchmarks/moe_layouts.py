"""Three mixtures of experts, each priced twice on the same cluster and batch: the layout its
trainers published (or an expert's choice, said so) and the plan ``autopar plan`` finds freely.

Both are priced alike: ``simulator.plan_price.price_plan`` with the bundled H100 profile's cost
model (``CostModel.from_profile``), bf16, eager (the planner runs with ``--no-compile``, so
neither plan is priced compiled), on ``h100-16x8`` scaled to the row's node count.  The models
are built from ``examples/moe.py`` at each one's published shape (plain attention: DeepSeek-V3's
multi-head latent attention and multi-token prediction are not modelled).

The rows:

- DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437): Sec. 4.2
  gives the shape (61 layers, hidden 7168, 128 heads of 128, 256 routed experts of ffn 2048, top
  8, one shared expert, the first 3 layers dense with ffn 18432, vocabulary 129K) and the batch
  (15360 sequences of 4096 tokens once ramped up); Sec. 3.2 the layout on 2048 GPUs: 16-way
  pipeline parallelism (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 data
  parallelism, no tensor parallelism, and the recomputation of RMSNorm and the MLA
  up-projections (priced here as the selective recompute).  By default the hand layout runs
  interleaved 1F1B with two model chunks per rank (DualPipe's two chunks) where the micro-batch
  count allows (a multiple of pp), else 1F1B -- DeepSeek-V3's 120 micro-batches per dp rank over
  pp 16 run 1F1B; ``--schedule dualpipev`` runs it as DualPipe: torch's ScheduleDualPipeV, whose
  forward-backward pairs the runtime runs with the expert all-to-alls hidden behind the other
  pass's compute (runtime/dualpipe_overlap.py), priced so (simulator/axes/pp_zero_bubble.py).
- Mixtral 8x22B (mistralai/Mixtral-8x22B-v0.1 config.json: 56 layers, hidden 6144, 48 heads, 8
  K/V heads, 8 experts of ffn 16384, top 2, vocabulary 32768): no training layout is published
  by Mistral; the hand layout is an expert's choice (this benchmark's author, after Megatron-Core
  MoE practice: tp 2 with sequence parallelism, pp 8 interleaved in 2 chunks, ep 8, ZeRO-1) on 256
  GPUs, 1024 sequences of 4096.
- Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 heads of 128, 4 K/V
  heads, q/k norm, 128 experts of ffn 768, top 8, vocabulary 151936): the layout of Megatron
  Bridge's published H100 pre-training benchmark, benchmarks/data/published_runs_cp_ep.json row
  ``mbridge2606_qwen3_30b_a3b_16gpu_ep16`` (16 GPUs, dp 16 x ep 16, micro-batch 1, 1024
  sequences of 4096; FP8 there, bf16 here for both plans), with ZeRO-1 (Megatron's distributed
  optimizer): at ZeRO 0, as published_runs.py prices that row, it does not fit 80 GB in bf16.

Prints step time, model TFLOP/s per GPU (the simulator's, 6 N per token counted as
simulator/result.py counts it) and planner / hand step ratio (below 1: the planner's plan is
faster); the CPU seconds of each free search (the whole ``autopar plan``: capture, runtime check
on fake ranks, search).  Writes benchmarks/results/moe_layouts.txt.

    python benchmarks/moe_layouts.py [--schedule interleaved] [--time-budget 40] [--only deepseek]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL = ROOT / "examples" / "moe.py"
CLUSTER = "h100-16x8"


@dataclass(frozen=True)
class Row:
    name: str
    args: dict
    nodes: int                 # of 8 H100
    global_batch: int          # sequences
    hand: dict                 # dp, tp, pp, ep, sp, zero, recompute, micro_batch, virtual_stages
    source: str


ROWS = (
    Row("DeepSeek-V3", dict(layers=61, hidden=7168, heads=128, kv_heads=128, head_dim=128, experts=256, top_k=8,
                            expert_ffn=2048, shared_ffn=2048, dense_layers=3, dense_ffn=18432, seq=4096, vocab=129280),
        256, 15360,
        dict(dp=128, tp=1, pp=16, ep=64, sp=False, zero=1, recompute="selective", micro_batch=1, virtual_stages=2),
        "DeepSeek-V3 report Sec. 3.2 (PP16 DualPipe, EP64, ZeRO-1 DP), batch Sec. 4.2"),
    Row("Mixtral-8x22B", dict(layers=56, hidden=6144, heads=48, kv_heads=8, head_dim=128, experts=8, top_k=2,
                              expert_ffn=16384, seq=4096, vocab=32768),
        32, 1024,
        dict(dp=16, tp=2, pp=8, ep=8, sp=True, zero=1, recompute="none", micro_batch=1, virtual_stages=2),
        "an expert's choice (none published): tp2+SP, pp8 x2 chunks, ep8, ZeRO-1"),
    Row("Qwen3-30B-A3B", dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, qk_norm=1, experts=128,
                              top_k=8, expert_ffn=768, seq=4096, vocab=151936),
        2, 1024,
        dict(dp=16, tp=1, pp=1, ep=16, sp=False, zero=1, recompute="none", micro_batch=1, virtual_stages=1),
        "Megatron Bridge 26.06 H100 benchmark (published_runs_cp_ep.json mbridge2606_qwen3_30b_a3b_16gpu_ep16), "
        "ZeRO-1 for its distributed optimizer (at ZeRO 0 it does not fit in bf16)"),
)


def model_args(row: Row) -> dict:
    return {**row.args, "dtype": "bfloat16"}


def hand_plan(row: Row, schedule: str, cluster):
    """The row's hand layout as a Plan (simulator.configure.config_plan, then ep); under ep the
    routed experts are split by ep alone (the runtime refuses a tp style on them as well)."""
    from autopar.core.capture import capture_model_file
    from autopar.simulator.configure import config_plan

    h = row.hand
    graph = capture_model_file(str(MODEL), model_args(row), h["micro_batch"])
    sched = schedule if h["pp"] > 1 else "1f1b"
    micro = row.global_batch // (h["dp"] * h["micro_batch"])
    if sched == "interleaved" and micro % h["pp"]:
        # torch's interleaved 1F1B takes a multiple of pp micro-batches (core/rules.py): DeepSeek-V3's
        # 15360 / dp 128 = 120 is not one of 16, so its hand layout runs plain 1F1B
        sched = "1f1b"
    from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES

    recompute = h["recompute"]
    if sched in SPLIT_BACKWARD_SCHEDULES and recompute == "selective":
        # torch's selective checkpoint allows one backward per region and these schedules run two
        # (core/rules.split_backward_problem): full recompute, as the planner's split-backward twins
        recompute = "full"
    plan = config_plan(graph, degrees={"dp": h["dp"], "tp": h["tp"], "pp": h["pp"]}, micro_batch=h["micro_batch"],
                       global_batch=row.global_batch, schedule=sched, virtual_stages=h["virtual_stages"],
                       zero=h["zero"], recompute=recompute, offload="none", precision="bf16",
                       sequence_parallel=h["sp"], cluster_name=cluster.name)
    plan = replace(plan, mesh=replace(plan.mesh, ep=h["ep"]))
    if h["ep"] > 1:
        plan = replace(plan, layers=tuple(replace(lp, tp=tuple((k, v) for k, v in lp.tp if v != "expert"))
                                          for lp in plan.layers))
    return plan, graph


def free_plan(row: Row, time_budget: float, folder: Path):
    """(the plan ``autopar plan`` writes for the row, CPU seconds of the whole command, the plan's
    provenance: its search's wall seconds ``search_s``)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from cli_inprocess import run_cli

    from autopar.core.plan import load_plan

    out = folder / f"{row.name}.plan.json"
    flags = [x for k, v in model_args(row).items() for x in ("--model-arg", f"{k}={v}")]
    t0 = time.process_time()
    r = run_cli("plan", MODEL, *flags, "--cluster", CLUSTER, "--nodes", row.nodes, "--global-batch",
                row.global_batch, "--precision", "bf16", "--no-compile", "--time-budget", time_budget, "-o", out)
    cpu = time.process_time() - t0
    if r.returncode != 0:
        raise SystemExit(f"autopar plan for {row.name} exited {r.returncode}:\n{r.stderr[-3000:]}")
    prov = json.loads(out.read_text()).get("provenance", {})
    return load_plan(out), cpu, prov


def ep_in_search(plan, prov: dict) -> str:
    """How the free search treated ep: chosen (the plan's ep), or the reason and price under
    ``left out`` (the check that ep is considered at this size, tests/planner/test_ep_real_sizes.py
    checks it on the runtime check alone)."""
    left = {x.get("kind"): x.get("reason", "") for x in prov.get("left_out", [])}
    if plan.mesh.ep > 1:
        return f"chosen, ep {plan.mesh.ep} ({left.get('expert parallel (used)', '')})"
    return f"not chosen: {left.get('expert parallel', 'no entry under left out')}"


def describe(plan) -> str:
    m = plan.mesh
    sp = "+sp" if m.sequence_parallel else ""
    s = f"dp{m.dp} tp{m.tp}{sp} pp{m.pp} cp{m.cp} ep{m.ep}"
    if m.pp > 1:
        v = len(plan.pipeline.stages) // m.pp
        s += f" {plan.pipeline.schedule}" + (f" x{v}" if v > 1 else "")
    zeros = sorted({lp.zero for lp in plan.layers})
    recs = sorted({lp.recompute for lp in plan.layers})
    return s + f", mb {plan.micro_batch}, ZeRO {'/'.join(map(str, zeros))}, recompute {'/'.join(recs)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="interleaved",
                    help="pipeline schedule of the hand layouts with pp > 1 (default interleaved; dualpipev: "
                         "DualPipe with its all-to-alls overlapped)")
    ap.add_argument("--time-budget", type=float, default=40.0, help="wall-clock budget of each free search")
    ap.add_argument("--only", default="", help="rows whose name contains this")
    args = ap.parse_args(argv)

    from autopar.core.cluster import load_cluster
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.plan_price import price_plan

    lines = [f"MoE layouts: hand layout vs the planner's free plan, priced alike (simulator, {CLUSTER} profile "
             f"h100-sxm, bf16, eager); hand pipelines run '{args.schedule}'", ""]
    header = (f"{'model':<15} {'GPUs':>5} {'batch':>6} {'plan':<8} {'step s':>9} {'TFLOP/s/GPU':>12} {'peak GiB':>9} "
              f"{'fits':>5}  layout")
    lines += [header, "-" * len(header)]
    records = []
    folder = Path(tempfile.mkdtemp(prefix="moe_layouts_"))
    for row in ROWS:
        if args.only.lower() not in row.name.lower():
            continue
        cluster = load_cluster(CLUSTER, nodes=row.nodes)
        cms = {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}
        hplan, graph = hand_plan(row, args.schedule, cluster)
        hres = price_plan(hplan, cluster, cms, graph=graph)
        fplan, cpu_s, prov = free_plan(row, args.time_budget, folder)
        fres = price_plan(fplan, cluster, cms)
        gpus = row.nodes * 8
        for label, plan, res in (("hand", hplan, hres), ("planner", fplan, fres)):
            lines.append(f"{row.name:<15} {gpus:>5} {row.global_batch:>6} {label:<8} {res.step_time_s:>9.2f} "
                         f"{res.tflops_per_gpu:>12.1f} {res.max_memory_bytes / 2**30:>9.1f} "
                         f"{'yes' if res.fits else 'NO':>5}  {describe(plan)}")
        ratio = fres.step_time_s / hres.step_time_s
        lines.append(f"{'':<15} planner / hand step time = {ratio:.3f} "
                     f"({'planner faster or equal' if ratio <= 1 else 'PLANNER SLOWER'}); free search "
                     f"{cpu_s:.1f} CPU-s (whole autopar plan; its search {prov.get('search_s', float('nan')):.1f} s "
                     f"wall)")
        lines.append(f"{'':<15} hand layout: {row.source}")
        lines.append(f"{'':<15} expert parallelism in the free search: {ep_in_search(fplan, prov)}")
        lines.append("")
        records.append({"model": row.name, "gpus": gpus, "global_batch": row.global_batch,
                        "hand": {"layout": describe(hplan), "step_s": hres.step_time_s,
                                 "tflops_per_gpu": hres.tflops_per_gpu, "fits": hres.fits, "source": row.source},
                        "planner": {"layout": describe(fplan), "step_s": fres.step_time_s,
                                    "tflops_per_gpu": fres.tflops_per_gpu, "fits": fres.fits,
                                    "plan_cpu_s": cpu_s, "search_wall_s": prov.get("search_s")},
                        "ratio_planner_over_hand": ratio})
    lines.append("fits: the plan's peak memory within an H100's 80 GB less the planner's headroom; a hand layout "
                 "that does not fit could not run as priced (the planner only offers plans that fit).")
    if args.schedule != "dualpipev":
        lines.append("DualPipe (DeepSeek-V3's schedule) is not priced in this table: --schedule dualpipev prices the "
                     "hand pipelines with it (full recompute where the row has selective).")
    text = "\n".join(lines)
    print(text)
    if not args.only:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "moe_layouts.txt").write_text(text + "\n")
        (RESULTS / "moe_layouts.json").write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
