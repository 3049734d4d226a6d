"""One GPU, three modes: eager bf16, compiled bf16, compiled float8 (issue 35's device check).

    python benchmarks/gpu_compile_fp8.py                 # one H100: 4-layer Llama 3 8B shape, 30 steps
    python benchmarks/gpu_compile_fp8.py --cpu --out DIR # tiny CPU mode (no float8), what the test runs

On the device machine (torch with CUDA, no torchao), install torchao from a wheel carried in
the repo's ignored ``.whl/`` folder first (never committed; device README, "a Python package
missing there"): here, ``echo /.whl/ >> .git/info/exclude; mkdir -p .whl; cp
torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl .whl/`` (or ``pip
download --no-deps torchao==0.18.0 -d .whl``); there, with ``.whl`` carried::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl && \
        PYTHONPATH=/tmp/site:$PYTHONPATH python benchmarks/gpu_compile_fp8.py

Without torchao the float8 mode is skipped with the reason recorded.

A Llama 3 8B-shaped model (examples/llama.py ``size=llama3-8b``: hidden 4096, 32 heads / 8 KV
heads, FFN 14336, vocabulary 128256, sequence 8192) cut to 4 blocks trains the same seeded
batches in each mode, with AdamW on fp32 master weights under bf16 autocast (the runtime's
mixed precision without FSDP):

* ``eager_bf16``     -- as autopar's runtime runs a plan with ``compile: false``;
* ``compiled_bf16``  -- each block's forward compiled (runtime/apply_compile.py, the runtime's own
                        step for ``compile: true``);
* ``compiled_fp8``   -- the runtime's float8 step (runtime/apply_fp8.py: the blocks' layers in fp8,
                        the embeddings and the output head in bf16; ``--fp8-recipe``, tensorwise
                        by default) and then compile, as the runtime runs a plan with fp8 blocks
                        and ``compile: true``; needs torchao (``autopar[fp8]``) and an fp8 device
                        (runtime/fp8_check.py); skipped, with the reason recorded, otherwise
                        (``--fp8-on-cpu`` runs it on the CPU, where torch 2.13's
                        ``torch._scaled_mm`` has a kernel: a check of the path, not a timing).

Recorded per mode (``benchmarks/results/gpu_compile_fp8.json``): the step times (median after
the warm-up steps, which hold the compile), the simulator's step for the same configuration
(compile off/on, and compiled with the blocks in fp8: simulator/float8.py), the loss curve, the
peak memory, and for float8 the conversion's record (which linears, which left in bf16 and
why).  Float8's loss at the last step is compared with bf16's (issue 35: within 1%).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "examples" / "llama.py"
GPU_ARGS = {"size": "llama3-8b", "layers": 4}
CPU_ARGS = {"size": "llama-tiny", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq": 32,
            "vocab": 256}
LR = 3e-4                        # AdamW (Loshchilov & Hutter 2019); Llama 3's peak rate is 3e-4 (8B, Table 3)
FP8_LOSS_TOLERANCE = 0.01        # issue 35: float8's loss within 1% of bf16's at the last step


def _model(args: dict, device: torch.device):
    from autopar.core.modelfile import load_model_file

    mf = load_model_file(LLAMA)
    torch.manual_seed(0)
    with torch.device(device):
        return mf, mf.build(**args)


def _blocks(model) -> list[str]:
    return [f"layers.{i}" for i in range(len(model.layers))]


def run_mode(mode: str, args: dict, device: torch.device, steps: int, micro_batch: int, backend: str,
             fp8_recipe: str = "tensorwise") -> dict:
    from autopar.runtime.apply_compile import apply_compile

    mf, model = _model(args, device)
    record = None
    if mode == "compiled_fp8":
        from autopar.runtime.apply_fp8 import apply_fp8

        # the runtime's step for a plan whose blocks are fp8 and whose other layers (embeddings,
        # norm and output head: torchtitan leaves the head in bf16 too) are bf16
        others = [name for name, _ in model.named_children() if name != "layers"]
        record = apply_fp8(model, [([p], "fp8", "none") for p in _blocks(model)] + [(others, "bf16", "none")],
                           fp8_recipe, fsdp=False, compile=True)
    if mode != "eager_bf16":
        apply_compile(model, [[p] for p in _blocks(model)], backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        inputs, target = mf.make_batch(micro_batch, **args)
        inputs, target = tuple(x.to(device) for x in inputs), target.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = mf.loss(model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    warm = min(2, steps - 1)
    out = {"mode": mode, "losses": losses, "step_times_s": times, "first_step_s": times[0],
           "step_time_s": statistics.median(times[warm:]),
           "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None}
    if record is not None:
        out["float8"] = record.to_dict()
    return out


def simulated(args: dict, micro_batch: int, cpu: bool, fp8_recipe: str = "tensorwise") -> dict:
    """The simulator's step for the same run (one device, bf16, no recompute), eager, compiled,
    and compiled with the blocks in fp8."""
    from dataclasses import replace

    from autopar.core.capture import capture_model_file
    from autopar.core.cluster_file import load_cluster
    from autopar.simulator.configure import config_plan
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.simulate import simulate_plan

    graph = capture_model_file(str(LLAMA), args, micro_batch)
    cluster = load_cluster("local-cpu" if cpu else "h100-16x8", nodes=1)
    cms = {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}
    plan = config_plan(graph, degrees={"dp": 1, "tp": 1, "pp": 1},
                       micro_batch=micro_batch, global_batch=micro_batch, schedule="1f1b",
                       virtual_stages=1, zero=0, recompute="none", offload="none", precision="bf16",
                       sequence_parallel=False, cluster_name=cluster.name)
    fp8 = replace(plan, compile=True, fp8_recipe=fp8_recipe,
                  layers=tuple(replace(lp, precision="fp8" if graph.layers[lp.layer].kind not in ("pre", "post") else "")
                               for lp in plan.layers))
    return {"eager_bf16": simulate_plan(graph, plan, cluster, cms).step_time_s,
            "compiled_bf16": simulate_plan(graph, replace(plan, compile=True), cluster, cms).step_time_s,
            "compiled_fp8": simulate_plan(graph, fp8, cluster, cms).step_time_s}


def fp8_unavailable(device: torch.device, on_cpu: bool = False) -> str | None:
    from autopar.runtime.apply_fp8 import INSTALL_HINT, torchao_available

    if device.type != "cuda" and not on_cpu:
        return "no CUDA device (the CPU has no fp8 matrix units)"
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return f"{torch.cuda.get_device_name()} has no fp8 tensor cores (compute capability < 8.9)"
    if not torchao_available():
        return f"torchao is not installed ({INSTALL_HINT})"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU (no float8)")
    ap.add_argument("--steps", type=int, default=None, help="steps per mode (default 30 on GPU, 3 on CPU)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (the runtime uses inductor)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for gpu_compile_fp8.json")
    ap.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise",
                    help="torchao's float8 recipe of the compiled_fp8 mode (default tensorwise)")
    ap.add_argument("--fp8-on-cpu", action="store_true",
                    help="with --cpu: run the float8 mode too (torch._scaled_mm's CPU kernel; a check of the path)")
    a = ap.parse_args(argv)
    cpu = a.cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    args = dict(CPU_ARGS if cpu else GPU_ARGS)
    steps = a.steps or (3 if cpu else 30)
    out = {"device": "cpu" if cpu else torch.cuda.get_device_name(), "model_args": args, "steps": steps,
           "micro_batch": a.micro_batch, "backend": a.backend, "torch": torch.__version__, "modes": {}}
    why_not = fp8_unavailable(device, on_cpu=a.fp8_on_cpu)
    for mode in ("eager_bf16", "compiled_bf16", "compiled_fp8"):
        if mode == "compiled_fp8" and why_not:
            out["modes"][mode] = {"skipped": why_not}
            continue
        out["modes"][mode] = run_mode(mode, args, device, steps, a.micro_batch, a.backend, a.fp8_recipe)
        print(f"{mode}: step {out['modes'][mode]['step_time_s']:.4f} s, loss {out['modes'][mode]['losses'][-1]:.4f}",
              flush=True)
    out["simulated_step_s"] = simulated(args, a.micro_batch, cpu, a.fp8_recipe)
    modes = out["modes"]
    if "losses" in modes["compiled_fp8"]:
        ref, got = modes["compiled_bf16"]["losses"][-1], modes["compiled_fp8"]["losses"][-1]
        out["fp8_last_loss_rel_diff"] = abs(got - ref) / abs(ref)
        out["fp8_within_1pct"] = out["fp8_last_loss_rel_diff"] <= FP8_LOSS_TOLERANCE
    path = Path(a.out) / "gpu_compile_fp8.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
