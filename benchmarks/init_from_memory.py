"""Peak host memory of a rank while its model is materialised: ``--init-from`` vs the built-in inits.

A GPT (examples/gpt.py, 8 layers, hidden 512, vocabulary 8192: 34 M parameters, 134 MB in
fp32) under ZeRO-3 over 4 gloo ranks on this CPU host, so a rank's share of the weights is a
quarter of the full model.  For each init source one ``torchrun`` of 4 ranks builds the model
as ``autopar run`` does (``parallelize.build_parallel_model``: meta model, FSDP2, materialise)
and each rank measures its own peak resident set size during that call:

    peak increase = VmHWM after the build - VmRSS before it

with the peak reset just before (``echo 5 > /proc/self/clear_refs`` resets VmHWM to the
current RSS; Linux's Documentation/filesystems/proc.rst, "clear_refs").  VmHWM counts every
resident page of the process, the pages of a memory-mapped weights file it touched included
(RssFile), so a rank that read the whole file would show it.  The sources:

* ``host`` -- the model file's init on the CPU (the default ``auto`` picks it for a model this
  size): every rank builds the full model;
* ``per-module`` -- one module at a time, never the full model;
* ``init-from`` -- a safetensors file of the same model, each rank reading its slices.

Figures are compared with the full model's parameter bytes and with the rank's own shard (the
local tensors of its parameters after the build).  The output is printed and saved to
benchmarks/results/init_from_memory.txt.

    python benchmarks/init_from_memory.py            # ~1 min on 2 CPU cores
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
ARGS = {"layers": 8, "hidden": 512, "heads": 8, "seq": 64, "vocab": 8192, "dropout": 0.0}
RANKS = 4
MODES = ("host", "per-module", "init-from")
RESULT = ROOT / "benchmarks" / "results" / "init_from_memory.txt"
MIB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(spec_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from autopar.runtime.mesh import init_distributed, launched_world_size, shutdown
    from autopar.runtime.options import RunOptions
    from autopar.runtime.parallelize import build_parallel_model
    from autopar.runtime.plan_check import check_plan

    spec = json.loads(Path(spec_path).read_text())
    checked = check_plan(Path(spec["plan"]), launched_world_size())
    ctx = init_distributed(checked.plan.mesh)
    opts = RunOptions(plan_path=Path(spec["plan"]), init="per-module" if spec["mode"] == "per-module" else "host",
                      init_from=Path(spec["weights"]) if spec["mode"] == "init-from" else None)
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")          # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    pm = build_parallel_model(checked, ctx, opts, checked.model_file.loss)
    peak = _status_kib("VmHWM")
    shard = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                for part in pm.parts for p in part.parameters())
    full = spec["full_bytes"]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"rank": ctx.rank, "peak_increase_bytes": (peak - before) * 1024,
                                  "shard_bytes": shard, "full_bytes": full, "init_mode": pm.init_mode})
    if ctx.rank == 0:
        Path(spec["out"]).write_text(json.dumps(rows))
    shutdown()


def main() -> None:
    import torch
    from safetensors.torch import save_file

    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan
    from autopar.runtime.ports import free_port

    sys.path.insert(0, str(ROOT / "tests"))
    from plain_loop import load

    with tempfile.TemporaryDirectory(prefix="init_from_memory-") as d:
        tmp = Path(d)
        torch.manual_seed(0)
        model = load(GPT).build_model(**ARGS)
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / "gpt.safetensors")
        del model
        g = capture_model_file(str(GPT), dict(ARGS), 1)
        plan = uniform_plan(model=ModelRef(file=str(GPT), args=dict(ARGS), name="gpt", fingerprint=g.fingerprint),
                            num_layers=len(g.layers), dp=RANKS, micro_batch=1, zero=3)
        save_plan(plan, tmp / "plan.json")
        results = {}
        for mode in MODES:
            spec = {"plan": str(tmp / "plan.json"), "weights": str(tmp / "gpt.safetensors"), "mode": mode,
                    "out": str(tmp / f"{mode}.json"), "full_bytes": full_bytes}
            (tmp / f"{mode}.spec.json").write_text(json.dumps(spec))
            env = dict(os.environ, OMP_NUM_THREADS="1")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                   __file__, "--worker", str(tmp / f"{mode}.spec.json")]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise SystemExit(f"{mode}: torchrun failed\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            results[mode] = json.loads((tmp / f"{mode}.json").read_text())
    lines = [f"init_from_memory: examples/gpt.py {ARGS}, ZeRO-3 over {RANKS} gloo ranks (CPU), fp32",
             f"full model parameters: {full_bytes / MIB:.1f} MiB; peak = a rank's VmHWM increase while "
             f"build_parallel_model runs (clear_refs reset)", "",
             f"{'source':<11} {'rank':>4} {'peak MiB':>9} {'shard MiB':>9} {'peak/full':>9} {'peak/shard':>10}"]
    for mode, rows in results.items():
        for r in sorted(rows, key=lambda r: r["rank"]):
            lines.append(f"{mode:<11} {r['rank']:>4} {r['peak_increase_bytes'] / MIB:>9.1f} "
                         f"{r['shard_bytes'] / MIB:>9.1f} {r['peak_increase_bytes'] / r['full_bytes']:>9.2f} "
                         f"{r['peak_increase_bytes'] / r['shard_bytes']:>10.2f}")
    worst = {m: max(r["peak_increase_bytes"] for r in rows) for m, rows in results.items()}
    lines += ["", "largest rank peak: " + ", ".join(f"{m} {b / MIB:.1f} MiB" for m, b in worst.items()),
              f"init-from vs host: {worst['init-from'] / worst['host']:.2f}x the host init's peak"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        sys.stdout.flush()
        os._exit(0)
    main()
