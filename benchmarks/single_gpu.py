"""Simulated against measured for one-device plans: precision, recompute and offload on one GPU.

    python benchmarks/single_gpu.py --profile h100-sxm --cluster h100-16x8 \
        --save benchmarks/results/single_gpu_h100.json

For a GPT of examples/gpt.py (``--model-arg``, default ``size=gpt3-350m`` on a GPU) and each
configuration below -- no recompute, full and selective recompute, and FSDP with CPU offload
(ZeRO-3 over one rank, parameters, gradients and optimizer state in host memory), without and
with full recompute -- it builds the one-rank plan, prices it with the simulator on the given
profile (``report.resimulate.simulate_figures``, what ``autopar report`` re-prices with), runs it
with ``python -m torch.distributed.run --nproc-per-node 1 -m autopar.runtime plan.json`` and
prints simulated and measured step time and peak memory with their errors.  Runs go in rounds,
every plan once per round, and the fastest median step of each plan is kept.

On a GPU the plans train in bf16 and the measured memory is the caching allocator's peak of live
tensors (runtime/measure.py); on this CPU (no CUDA) they train in fp32 on the local-cpu profile,
which is how the test suite runs the script (tests/integration/test_single_gpu_benchmark.py).

This is the second step of what a lent GPU is for (DEVELOPERS.md): first ``autopar profile -o
profiles/<gpu>.json`` measures the GPU's op table into the bundled profile, then this script
records how well that profile prices plans on it, into benchmarks/results/.  The cluster only
gives the device's memory and host link (a one-rank plan crosses no other link).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy_local_cpu as acc  # noqa: E402  (the CPU benchmark's runner, rounds and error helpers)

REPO = Path(__file__).resolve().parent.parent
MODEL_FILE = REPO / "examples" / "gpt.py"
#: the default model: on a GPU a 350M GPT at 2048 tokens (fits one 80 GB GPU without recompute at
#: micro-batch 8 with fused attention); on a CPU the accuracy benchmark's tiny GPT
GPU_MODEL = {"size": "gpt3-350m"}
CPU_MODEL = dict(acc.MODEL_ARGS)


@dataclass(frozen=True)
class Config:
    name: str
    recompute: str = "none"
    offload: bool = False


CONFIGS = [
    Config("plain"),
    Config("recompute full", recompute="full"),
    Config("recompute selective", recompute="selective"),
    Config("offload", offload=True),
    Config("offload recompute full", recompute="full", offload=True),
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None,
                    help="profile name or file to price with (default: h100-sxm with CUDA, local-cpu without)")
    ap.add_argument("--cluster", default=None,
                    help="cluster whose first node group gives the device's memory and host link "
                         "(default: h100-16x8 with CUDA, local-cpu without)")
    ap.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                    help=f"an argument of examples/gpt.py (default: {GPU_MODEL} on a GPU, {CPU_MODEL} on a CPU)")
    ap.add_argument("--micro-batch", type=int, default=None, help="samples per step (default: 8 on a GPU, 4 on a CPU)")
    ap.add_argument("--precision", default=None, choices=("bf16", "fp16", "fp32"),
                    help="training precision (default: bf16 on a GPU, fp32 on a CPU: bf16 on a CPU is ~9x slower)")
    ap.add_argument("--steps", type=int, default=10, help="training steps per run (2 warm-up steps left out)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per plan; the fastest median step time is kept")
    ap.add_argument("--only", default=None, help="comma-separated config names to run (default: all)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--out", default=None, help="directory for plans and measurements (default: a temp dir)")
    ap.add_argument("--save", default=None, help="write the figures as JSON here (e.g. benchmarks/results/...)")
    return ap.parse_args(argv)


def _plan(graph, cluster, cfg: Config, micro_batch: int, precision: str):
    from autopar.simulator.configure import config_plan

    return config_plan(graph, degrees={"dp": 1, "tp": 1, "pp": 1}, micro_batch=micro_batch, global_batch=micro_batch,
                       schedule="1f1b", virtual_stages=1, zero=3 if cfg.offload else 0, recompute=cfg.recompute,
                       offload="cpu" if cfg.offload else "none", precision=precision, sequence_parallel=False,
                       cluster_name=cluster.name)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from autopar.core.capture import capture_model_file
    from autopar.core.cluster_file import load_cluster
    from autopar.core.modelfile import parse_model_args
    from autopar.core.plan import save_plan
    from autopar.report.resimulate import PlanContext, load_profile_dict, simulate_figures

    on_gpu = torch.cuda.is_available()
    profile_name = args.profile or ("h100-sxm" if on_gpu else "local-cpu")
    cluster = load_cluster(args.cluster or ("h100-16x8" if on_gpu else "local-cpu"))
    precision = args.precision or ("bf16" if on_gpu else "fp32")
    micro_batch = args.micro_batch or (8 if on_gpu else acc.MICRO_BATCH)
    model = {**(GPU_MODEL if on_gpu else CPU_MODEL), **parse_model_args(args.model_arg)}
    graph = capture_model_file(MODEL_FILE, model, batch_size=micro_batch)
    ctx = PlanContext(graph=graph, cluster=cluster, profile=load_profile_dict(profile_name), profile_name=profile_name)
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    out = Path(args.out or tempfile.mkdtemp(prefix="autopar-single-gpu-"))
    configs = [c for c in CONFIGS if args.only is None or c.name in args.only.split(",")]
    print(f"model gpt.py {model}, micro-batch {micro_batch}, {precision}; device {device}; profile {profile_name}; "
          f"cluster {cluster.name}; {len(configs)} plans; runs in {out}", flush=True)

    staged = []
    for cfg in configs:
        run_dir = out / cfg.name.replace(" ", "_")
        plan = _plan(graph, cluster, cfg, micro_batch, precision)
        sim, _ = simulate_figures(ctx, plan, timeline=False)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_plan(plan.with_predicted(dict(sim), profile=profile_name, cluster_file=cluster.source), run_dir / "plan.json")
        staged.append({"cfg": cfg, "sim": sim, "dir": run_dir, "measured": None})
    acc.run_in_rounds(staged, args.repeats, lambda st: acc._run(st["dir"] / "plan.json", 1, args.steps, args.timeout))

    rows = []
    print(f"{'plan':<24} {'sim step':>10} {'meas step':>10} {'error':>8} {'sim mem':>10} {'meas mem':>10} {'error':>8}")
    for st in staged:
        cfg, sim, m = st["cfg"], st["sim"], st["measured"]
        if m is None:
            print(f"{cfg.name:<24} the run failed (see {st['dir']}/run.log)", flush=True)
            rows.append({"name": cfg.name, "failed": True, "log": str(st["dir"] / "run.log")})
            continue
        row = {"name": cfg.name, "recompute": cfg.recompute, "offload": cfg.offload,
               "sim_step_s": sim["step_time_s"], "meas_step_s": m.step_time_s,
               "step_error": acc._err(sim["step_time_s"], m.step_time_s),
               "sim_mem_bytes": sim["max_memory_bytes"], "meas_mem_bytes": m.max_memory_bytes,
               "mem_error": acc._err(sim["max_memory_bytes"], m.max_memory_bytes) if m.max_memory_bytes else None}
        rows.append(row)
        mem_err = f"{row['mem_error']:+8.1%}" if row["mem_error"] is not None else f"{'-':>8}"
        print(f"{cfg.name:<24} {row['sim_step_s'] * 1e3:8.1f}ms {row['meas_step_s'] * 1e3:8.1f}ms "
              f"{row['step_error']:+8.1%} {row['sim_mem_bytes'] / 2**30:7.2f}GiB {row['meas_mem_bytes'] / 2**30:7.2f}GiB "
              f"{mem_err}", flush=True)
    print("error = simulated / measured - 1")
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps({
            "command": " ".join(["python", *sys.argv]), "device": device, "torch": torch.__version__,
            "model": model, "micro_batch": micro_batch, "precision": precision, "profile": profile_name,
            "cluster": cluster.name, "steps": args.steps, "repeats": args.repeats, "plans": rows}, indent=1) + "\n")
        print(f"wrote {args.save}")
    return 0 if rows and not any(r.get("failed") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
