"""Overhead of autopar's runtime over a plain hand-written FSDP2 training loop.

    python benchmarks/runtime_overhead.py [--steps 20] [--rounds 3] [--layers 4 --hidden 256 ...]

Starts one ``torchrun`` with 2 ranks (gloo on CPU, NCCL on CUDA).  In that process group both
trainers run the same ZeRO-3 data-parallel training of examples/gpt.py -- same model, same
global batch drawn per step, same AdamW -- alternating for ``--rounds`` rounds so both see the
same machine load:

* autopar: a dp=2, zero=3 plan through ``autopar.runtime.train.run`` (what ``autopar run`` does);
* hand-written: ``fully_shard`` on the embeddings, every block, the final norm + head and the
  root (the units the plan gives), and a forward/backward/step loop.

Each prints the median step time after warm-up; the script prints the best round of each and
the ratio autopar / hand-written (target <= 1.03).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
WARMUP_STEPS = 3


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def model_args(a: argparse.Namespace) -> dict:
    return {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq, "vocab": a.vocab,
            "dropout": 0.0}


# ------------------------------------------------------------------ hand-written trainer
def hand_written(plan_path: Path, steps: int) -> float:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from autopar.core.modelfile import load_model_file

    plan = json.loads(plan_path.read_text())
    args, global_batch = plan["model"]["args"], plan["global_batch"]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mf = load_model_file(GPT)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = mf.build(**args)
    # the same FSDP units a plan gives: embeddings, each block, final norm + head, then the root
    fully_shard([model.tok_emb, model.pos_emb], mesh=mesh, reshard_after_forward=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard([model.ln_f, model.head], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    assert not list(model.buffers()), "this loop initialises parameters only"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rows, rank = global_batch // dist.get_world_size(), dist.get_rank()
    times = []
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.manual_seed(1000 + step)
        (idx,), target = mf.make_batch(global_batch, **args)
        idx, target = idx[rank * rows:(rank + 1) * rows].to(device), target[rank * rows:(rank + 1) * rows].to(device)
        loss = mf.loss(model(idx), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())      # autopar logs the global loss every step; so does this loop
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP_STEPS:])


def worker(spec_path: Path) -> None:
    import torch.distributed as dist

    from autopar.runtime.mesh import shutdown
    from autopar.runtime.options import RunOptions
    from autopar.runtime.train import run

    spec = json.loads(spec_path.read_text())
    plan, steps = Path(spec["plan"]), spec["steps"]
    results = {"autopar": [], "hand": []}
    for r in range(spec["rounds"]):
        m = run(RunOptions(plan_path=plan, steps=steps, warmup_steps=WARMUP_STEPS, log_every=steps,
                           measured_path=plan.with_name(f"measured.{r}.json")))
        results["autopar"].append(m["step_time_s"])
        results["hand"].append(hand_written(plan, steps))
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    shutdown()


def main() -> int:
    a = parse()
    if a.worker is not None:
        worker(a.worker)
        sys.stdout.flush()
        os._exit(0)
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    graph = capture_model_file(str(GPT), model_args(a), a.micro_batch)
    with tempfile.TemporaryDirectory() as d:
        plan_path = Path(d) / "plan.json"
        save_plan(uniform_plan(model=ModelRef(str(GPT), model_args(a), "gpt", graph.fingerprint),
                               num_layers=len(graph.layers), dp=2, micro_batch=a.micro_batch, zero=3), plan_path)
        spec = Path(d) / "spec.json"
        out = Path(d) / "out.json"
        spec.write_text(json.dumps({"plan": str(plan_path), "steps": a.steps, "rounds": a.rounds, "out": str(out)}))
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", str(Path(__file__).resolve()), "--worker", str(spec)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        rc = subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL)
        if rc:
            print(f"torchrun failed with exit code {rc}", file=sys.stderr)
            return rc
        res = json.loads(out.read_text())
    best_autopar, best_hand = min(res["autopar"]), min(res["hand"])
    print(f"model: gpt {model_args(a)}, FSDP2 ZeRO-3 over 2 ranks, global batch {2 * a.micro_batch}, "
          f"{a.steps} steps x {a.rounds} rounds (median after {WARMUP_STEPS} warm-up steps; best round)")
    print(f"  autopar runtime     step_time_s {best_autopar:.4f}   rounds {[round(x, 4) for x in res['autopar']]}")
    print(f"  hand-written loop   step_time_s {best_hand:.4f}   rounds {[round(x, 4) for x in res['hand']]}")
    print(f"  ratio autopar / hand-written = {best_autopar / best_hand:.3f}  (target <= 1.03)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
