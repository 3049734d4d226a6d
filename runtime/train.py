"""The training loop: batches, steps, loss logging, checkpoints, measurements.

Every rank draws the same global batch for a step (``make_batch(global_batch)`` under a seed
derived from the run seed and the step) and keeps its data-parallel slice, rows
``[d * micro_batch * num_microbatches, (d + 1) * ...)``.  The loss of every micro-batch is
the model file's loss (a mean over its samples) divided by the number of micro-batches, and
the data-parallel gradient reduction averages over the dp ranks, so every layout computes
the gradient of the mean loss over the global batch -- the single-process reference's
(``autopar.runtime.reference``).  The logged loss is that global mean.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import record_function

from autopar.core.plan import write_text_atomic
from autopar.runtime import checkpointing
from autopar.runtime.measure import MemoryProbe, StepClock, gather_per_rank, measured_report
from autopar.runtime.mesh import RankContext, init_distributed, launched_world_size
from autopar.runtime.options import RunOptions
from autopar.runtime.parallelize import ParallelModel, build_parallel_model
from autopar.runtime.plan_check import CheckedPlan, check_plan
from autopar.runtime.profile_breakdown import start_profiler, stop_profiler

# Testing hook: "RANK:STEP" makes that rank exit abruptly after finishing STEP, on the first
# attempt only (TORCHELASTIC_RESTART_COUNT == 0) -- how the tests kill a rank mid-run.
FAULT_ENV = "AUTOPAR_FAULT_AT"


def step_seed(seed: int, step: int) -> int:
    return int.from_bytes(hashlib.sha256(f"batch:{seed}:{step}".encode()).digest()[:8], "little") >> 1


def global_batch(checked: CheckedPlan, seed: int, step: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(step_seed(seed, step))
        return checked.model_file.make_batch(checked.plan.global_batch, **dict(checked.plan.model.args))


def local_slice(t: torch.Tensor, dp_rank: int, rows: int, device: torch.device) -> torch.Tensor:
    return t[dp_rank * rows:(dp_rank + 1) * rows].to(device)


def _grad_sync(part, sync: bool, pm: ParallelModel):
    if pm.uses_fsdp:
        part.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if pm.uses_ddp and not sync:
        return part.no_sync()
    return contextlib.nullcontext()


def _autocast(pm: ParallelModel, device: torch.device):
    if pm.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=pm.autocast_dtype)


def train_step(pm: ParallelModel, checked: CheckedPlan, ctx: RankContext, inputs, target) -> torch.Tensor:
    """One optimizer step; returns this rank's mean loss over its samples (0 off the last stage)."""
    nmb = checked.plan.pipeline.num_microbatches
    loss_fn = checked.model_file.loss
    if pm.schedule is not None:
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if pm.has_last_stage else {}
        with _autocast(pm, ctx.device):
            pm.schedule.step(*(inputs if pm.has_first_stage else ()), **kwargs)
        local_loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros(())
    else:
        part = pm.parts[0]
        in_chunks = [x.chunk(nmb) for x in inputs]
        tgt_chunks = target.chunk(nmb)
        local_loss = torch.zeros((), device=ctx.device)
        for i in range(nmb):
            with _grad_sync(part, i == nmb - 1, pm):
                with record_function("autopar.forward"), _autocast(pm, ctx.device):
                    loss = loss_fn(part(*(c[i] for c in in_chunks)), tgt_chunks[i]) / nmb
                with record_function("autopar.backward"):
                    loss.backward()
            local_loss += loss.detach().float()
    with record_function("autopar.optimizer"):
        for opt in pm.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return local_loss


def global_loss(local_loss: torch.Tensor, pm: ParallelModel, ctx: RankContext, dp: int) -> float:
    """The global-batch mean: the last stage's tp-rank-0 losses, averaged over dp."""
    value = local_loss.detach().float().reshape(()).to(ctx.device)
    if not (pm.has_last_stage and ctx.tp_rank == 0):
        value = torch.zeros((), device=ctx.device)
    dist.all_reduce(value)
    return float(value) / dp


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        r, s = (int(x) for x in spec.split(":"))
        if r == rank and s == step:
            print(f"[autopar] rank {rank}: {FAULT_ENV} -- exiting abruptly after step {step}",
                  file=sys.stderr, flush=True)
            os._exit(17)


def run(opts: RunOptions) -> dict:
    checked = check_plan(opts.plan_path, launched_world_size())
    plan = checked.plan
    ctx = init_distributed(plan.mesh)
    log = (lambda msg: print(f"[autopar] {msg}", flush=True)) if ctx.is_logging_rank else (lambda msg: None)
    memory = MemoryProbe(ctx.device)
    memory.start()
    torch.manual_seed(opts.seed)
    pm = build_parallel_model(checked, ctx, opts, checked.model_file.loss)
    log(f"plan {opts.plan_path}: mesh dp={plan.mesh.dp} pp={plan.mesh.pp} tp={plan.mesh.tp}, "
        f"zero {plan.zero} ({pm.dp_kind}), "
        f"{len(plan.pipeline.stages)} stage(s) {plan.pipeline.schedule}, {plan.pipeline.num_microbatches} "
        f"micro-batch(es), init {pm.init_mode}, device {ctx.device.type}")
    first_step, losses = 0, []
    if opts.checkpoint_dir is not None:
        found = checkpointing.latest_checkpoint(opts.checkpoint_dir)
        if found is not None:
            first_step, path = found
            checkpointing.load_checkpoint(path, pm.parts, pm.optimizers)
            losses = list(json.loads((opts.checkpoint_dir / checkpointing.LATEST).read_text()).get("losses", []))
            log(f"resumed from {path} (step {first_step})")
    rows = plan.micro_batch * plan.pipeline.num_microbatches
    clock, prof, profiled = StepClock(ctx.device), None, 0
    for step in range(first_step, opts.steps):
        if opts.profile and step - first_step == opts.warmup_steps:
            prof = start_profiler(ctx.device)
        clock.start()
        inputs, target = global_batch(checked, opts.seed, step)
        inputs = tuple(local_slice(x, ctx.dp_rank, rows, ctx.device) for x in inputs)
        target = local_slice(target, ctx.dp_rank, rows, ctx.device)
        local_loss = train_step(pm, checked, ctx, inputs, target)
        dt = clock.stop()
        profiled += prof is not None
        losses.append(global_loss(local_loss, pm, ctx, plan.mesh.dp))
        if (step + 1) % opts.log_every == 0 or step + 1 == opts.steps:
            log(f"step {step + 1}/{opts.steps} loss {losses[-1]:.6f} step_time {dt * 1e3:.1f} ms")
        _maybe_fault(ctx.rank, step + 1)
        done = step + 1
        if opts.checkpoint_dir is not None and ((opts.checkpoint_every and done % opts.checkpoint_every == 0)
                                                or done == opts.steps):
            path = checkpointing.save_checkpoint(opts.checkpoint_dir, done, pm.parts, pm.optimizers,
                                                 extra={"losses": losses})
            log(f"checkpoint {path}")
    breakdown, trace = None, None
    if prof is not None:
        trace_path = opts.measured_file.with_name(f"{opts.measured_file.stem}.trace.rank{ctx.rank}.json")
        breakdown = stop_profiler(prof, profiled, trace_path)
        trace = str(trace_path.with_name(f"{opts.measured_file.stem}.trace.rank0.json"))
    report = measured_report(
        step_times_s=clock.times_s, warmup_steps=opts.warmup_steps, global_batch=plan.global_batch,
        seq_len=checked.graph.seq_len, memory_per_rank_bytes=gather_per_rank(memory.peak_bytes()),
        memory_kind=memory.kind, losses=losses, fingerprint=plan.model.fingerprint, world_size=ctx.world_size,
        device=ctx.device, plan_file=str(opts.plan_path), first_step=first_step, breakdown=breakdown,
        trace_file=trace, init_mode=pm.init_mode)
    if ctx.is_logging_rank:
        write_text_atomic(opts.measured_file, json.dumps(report, indent=2) + "\n")
        log(f"wrote {opts.measured_file}: step_time_s {report['step_time_s']:.4f}, "
            f"max_memory_bytes {report['max_memory_bytes']}")
    dist.barrier()
    return report

