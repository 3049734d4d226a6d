"""The training loop: batches, steps, loss logging, checkpoints, measurements.

Every rank draws the same global batch for a step (``make_batch(global_batch)`` under a seed
derived from the run seed and the step) and keeps its data-parallel slice, rows
``[d * micro_batch * num_microbatches, (d + 1) * ...)``.  The loss of every micro-batch is
the model file's loss (a mean over its samples) divided by the number of micro-batches, and
the data-parallel gradient reduction averages over the dp ranks, so every layout computes
the gradient of the mean loss over the global batch -- what a single-process loop over the
global batch computes (the parity tests' ``tests/plain_loop.py``).  The logged loss is that global mean.

Per step the clock holds only the step's own work -- the batch is drawn before it starts --: no ``.item()``, no collective of its own (on
CUDA the step clock synchronises the device at both ends of the step).  The losses stay on the device and are reduced over the ranks in one all-reduce when
they are logged (every ``--log-every`` steps), before a checkpoint and at the end
(``Trainer.flush_losses``).  ``Trainer`` holds a run's state between steps so a caller (the
overhead benchmark) can interleave its steps with other work; ``run`` is setup, the steps and
the report.  Between steps (outside the clock) ``run`` makes one small all-reduce: whether any
rank was sent SIGTERM / SIGINT / SIGHUP (``autopar.runtime.stop_signals``); if so every rank
stops after that same step, checkpointed where ``--checkpoint-dir`` is given (``Trainer.stop``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from autopar.core.measured import Measured
from autopar.core.plan import write_text_atomic
from autopar.runtime import checkpoint_lock, checkpointing, loss_guard, stop_signals
from autopar.runtime.batch_check import check_batch
from autopar.runtime.measure import MemoryProbe, StepClock, gather_per_rank, measured_report
from autopar.runtime.mesh import RankContext, init_distributed, launched_world_size
from autopar.runtime.model_state import gather_model_state_bytes, model_state_bytes
from autopar.runtime.options import RunOptions
from autopar.runtime.parallelize import ParallelModel, build_parallel_model
from autopar.runtime.plan_check import CheckedPlan, check_plan
from autopar.runtime.profile_breakdown import STEP_REGION, start_profiler, stop_profiler
from autopar.runtime.rank_errors import set_model_file, set_place

# Testing hook: "RANK:STEP" makes that rank exit abruptly after finishing STEP, on the first
# attempt only (TORCHELASTIC_RESTART_COUNT == 0) -- how the tests kill a rank mid-run.
FAULT_ENV = "AUTOPAR_FAULT_AT"


def step_seed(seed: int, step: int) -> int:
    return int.from_bytes(hashlib.sha256(f"batch:{seed}:{step}".encode()).digest()[:8], "little") >> 1


def global_batch(checked: CheckedPlan, seed: int, step: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(step_seed(seed, step))
        batch = checked.model_file.make_batch(checked.plan.global_batch, **dict(checked.plan.model.args))
    check_batch(*batch, checked.plan.global_batch, checked.model_file.path)
    return batch


def local_slice(t: torch.Tensor, dp_rank: int, rows: int, device: torch.device) -> torch.Tensor:
    return t[dp_rank * rows:(dp_rank + 1) * rows].to(device)


def _grad_sync(part, sync: bool, pm: ParallelModel):
    """Gradient accumulation over micro-batches without a pipeline.

    Sharded data parallelism (FSDP2, ZeRO-2/3) reduce-scatters every micro-batch and accumulates
    into the sharded gradient: skipping the sync (``set_requires_gradient_sync(False)``) would keep
    each unit's unsharded gradient until the last micro-batch, upcast to the reduce dtype
    (torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.to_accumulated_grad_if_needed) --
    the whole model's gradients in fp32, which ZeRO-2/3 exists to avoid.  The simulator prices one
    reduce-scatter per micro-batch here (simulator/pipeline_fsdp.py).  Replicated data parallelism
    (DDP, FSDP2's replicate) holds whole gradients anyway and syncs on the last micro-batch only."""
    if pm.uses_fsdp:
        if pm.dp_kind != "fsdp":
            part.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if pm.uses_ddp and not sync:
        return part.no_sync()
    return contextlib.nullcontext()


def _autocast(pm: ParallelModel, device: torch.device):
    if pm.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=pm.autocast_dtype)


def _cp_forward(pm: ParallelModel, inputs, device: torch.device):
    """Context parallelism's forward mode (runtime/apply_cp.py) and extra keyword arguments."""
    if pm.cp is None:
        return contextlib.nullcontext(), {}
    return pm.cp.mode(), pm.cp.forward_kwargs(tuple(inputs), device)


def train_step(pm: ParallelModel, checked: CheckedPlan, ctx: RankContext, inputs, target) -> torch.Tensor:
    """Forward, backward and optimizer step; returns this rank's mean loss over its samples (0 off
    the last stage).  The gradients are left in place: the caller clears them (``zero_grad``)."""
    nmb = checked.plan.pipeline.num_microbatches
    loss_fn = checked.model_file.loss
    if pm.schedule is not None:
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if pm.has_last_stage else {}
        if pm.cp is not None and pm.has_first_stage:   # position ids etc. as the first stage's inputs
            inputs = pm.cp.stage_args(tuple(inputs), ctx.device)
        with _autocast(pm, ctx.device):        # each stage's forward under cp's mode (build_schedule)
            pm.schedule.step(*(inputs if pm.has_first_stage else ()), **kwargs)
        local_loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros(())
    elif nmb == 1:
        part = pm.parts[0]
        cp_mode, cp_kwargs = _cp_forward(pm, inputs, ctx.device)
        with record_function("autopar.forward"), _autocast(pm, ctx.device), cp_mode:
            loss = loss_fn(part(*inputs, **cp_kwargs), target)
        with record_function("autopar.backward"):
            loss.backward()
        local_loss = loss.detach()
    else:
        part = pm.parts[0]
        in_chunks = [x.chunk(nmb) for x in inputs]
        tgt_chunks = target.chunk(nmb)
        mb_losses = []
        for i in range(nmb):
            with _grad_sync(part, i == nmb - 1, pm):
                cp_mode, cp_kwargs = _cp_forward(pm, [c[i] for c in in_chunks], ctx.device)
                with record_function("autopar.forward"), _autocast(pm, ctx.device), cp_mode:
                    loss = loss_fn(part(*(c[i] for c in in_chunks), **cp_kwargs), tgt_chunks[i]) / nmb
                with record_function("autopar.backward"):
                    loss.backward()
            mb_losses.append(loss.detach())
        local_loss = torch.stack(mb_losses).sum()
    if pm.tied_grad_sum is not None:
        pm.tied_grad_sum(pm.parts)
    with record_function("autopar.optimizer"):
        for opt in pm.optimizers:
            opt.step()
        if pm.after_optimizer_step is not None:     # the float8 weights' scales (runtime/apply_fp8.py)
            pm.after_optimizer_step()
    return local_loss


def zero_grad(pm: ParallelModel) -> None:
    for opt in pm.optimizers:
        opt.zero_grad(set_to_none=True)


def global_losses(local_losses: list[torch.Tensor], pm: ParallelModel, ctx: RankContext, dp: int) -> list[float]:
    """The global-batch mean of each step: the last stage's tp-rank-0 losses, averaged over
    ``dp`` ranks (one all-reduce for all the steps given); the caller passes dp x cp, since the
    cp ranks each hold the mean over an equal share of the tokens."""
    if not local_losses:
        return []
    values = torch.stack([l.detach().float().reshape(()).to(ctx.device) for l in local_losses])
    if not (pm.has_last_stage and ctx.tp_rank == 0):
        values = torch.zeros_like(values)
    dist.all_reduce(values)
    return [v / dp for v in values.tolist()]


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        r, s = (int(x) for x in spec.split(":"))
        if r == rank and s == step:
            print(f"[autopar] rank {rank}: {FAULT_ENV} -- exiting abruptly after step {step}",
                  file=sys.stderr, flush=True)
            os._exit(17)


class Trainer:
    """One run of a plan: setup in the constructor, then ``step(i)`` for i in
    ``range(first_step, opts.steps)``, then ``finish()`` for the measured report."""

    def __init__(self, opts: RunOptions):
        self.opts = opts
        self.checked = check_plan(opts.plan_path, launched_world_size())
        plan = self.plan = self.checked.plan
        set_model_file(self.checked.model_file.path)
        self.ctx = ctx = init_distributed(plan.mesh)
        set_place(ctx.dp_rank, ctx.pp_rank, ctx.tp_rank)
        self.locked = False
        if opts.checkpoint_dir is not None:       # one run per checkpoint folder (checkpoint_lock)
            taken_over = checkpoint_lock.acquire_on_rank0(opts.checkpoint_dir, opts.plan_path)
            self.locked = True
            if taken_over:
                self.log(f"note: {taken_over}")
        try:
            self._setup(opts)
        except BaseException:
            self.release_lock()
            raise

    def release_lock(self) -> None:
        if self.locked:
            checkpoint_lock.release(self.opts.checkpoint_dir)
            self.locked = False

    def _setup(self, opts: RunOptions) -> None:
        plan, ctx = self.plan, self.ctx
        self.memory = MemoryProbe(ctx.device)
        self.memory.start()
        torch.manual_seed(opts.seed)
        self.pm = pm = build_parallel_model(self.checked, ctx, opts, self.checked.model_file.loss)
        ep = f" ep={plan.mesh.ep}" if plan.mesh.ep > 1 else ""
        self.log(f"plan {opts.plan_path}: mesh {plan.mesh.describe('{name}={size}', ' ')}{ep}, "
                 f"zero {plan.zero} ({pm.dp_kind}), "
                 f"{len(plan.pipeline.stages)} stage(s) {plan.pipeline.schedule}, {plan.pipeline.num_microbatches} "
                 f"micro-batch(es), init {pm.init_mode}, device {ctx.device.type}")
        for note in pm.notes:
            self.log(f"note: {note}")
        for warning in pm.warnings:
            self.log(f"warning: {warning}")
        self.first_step, self.losses = 0, []
        self.identity = checkpointing.CheckpointIdentity.of_plan(plan, self.checked.graph)
        if opts.checkpoint_dir is not None:
            resumed = checkpointing.resume(opts.checkpoint_dir, pm.parts, pm.optimizers, self.identity, opts.steps,
                                           names=pm.state_names)
            if resumed is not None:
                self.first_step, self.losses = resumed.step, resumed.losses
                self.log(f"resumed from {resumed.path} (step {self.first_step}, checksums verified)")
        self.rows = plan.micro_batch * plan.pipeline.num_microbatches
        self.clock, self.prof, self.profiled = StepClock(ctx.device), None, 0
        self.pending: list[torch.Tensor] = []       # local losses not yet reduced over the ranks
        self.state_bytes: dict | None = None        # model_state_bytes of the last step
        self.saved: dict[int, Path] = {}            # step -> checkpoint folder saved by this run

    def log(self, msg: str) -> None:
        if self.ctx.is_logging_rank:
            print(f"[autopar] {msg}", flush=True)

    def flush_losses(self) -> None:
        new = global_losses(self.pending, self.pm, self.ctx, self.plan.mesh.dp * self.plan.mesh.cp)
        loss_guard.check_losses(new, len(self.losses), self.opts.checkpoint_dir)   # same values on every rank
        self.losses += new
        self.pending = []

    def step(self, step: int) -> None:
        opts, ctx = self.opts, self.ctx
        if opts.profile and step - self.first_step == opts.warmup_steps:
            self.prof = start_profiler(ctx.device)
        done = step + 1
        # the synthetic batch is drawn before the clock starts, as a data loader's workers would
        # have it ready; the clock holds the step itself (its slice moved to the device included)
        inputs, target = global_batch(self.checked, opts.seed, step)
        self.clock.start()
        with record_function(STEP_REGION) if self.prof is not None else contextlib.nullcontext():
            inputs = tuple(local_slice(x, ctx.dp_rank, self.rows, ctx.device) for x in inputs)
            target = local_slice(target, ctx.dp_rank, self.rows, ctx.device)
            if self.pm.cp is not None:                 # this cp rank's tokens (runtime/apply_cp.py)
                inputs, target = tuple(self.pm.cp.slice(x) for x in inputs), self.pm.cp.slice(target)
            local_loss = train_step(self.pm, self.checked, ctx, inputs, target)
        dt = self.clock.stop()
        if done == opts.steps:               # after the backward and the step, before zero_grad
            self.state_bytes = model_state_bytes(self.pm.parts, self.pm.optimizers)
        zero_grad(self.pm)
        self.profiled += self.prof is not None
        self.pending.append(local_loss)
        checkpoint_now = opts.checkpoint_dir is not None and (
            (opts.checkpoint_every and done % opts.checkpoint_every == 0) or done == opts.steps)
        if done % opts.log_every == 0 or done == opts.steps or checkpoint_now:
            self.flush_losses()
            if done % opts.log_every == 0 or done == opts.steps:
                self.log(f"step {done}/{opts.steps} loss {self.losses[-1]:.6f} step_time {dt * 1e3:.1f} ms")
        _maybe_fault(ctx.rank, done)
        if checkpoint_now:
            self.log(f"checkpoint {self.save(done)}")

    def save(self, done: int) -> Path:
        """Checkpoint the state after step ``done`` (every rank; refused where it is not finite)."""
        opts = self.opts
        loss_guard.check_state_finite(self.pm.parts, done, opts.checkpoint_dir, self.ctx.device)
        path = checkpointing.save_checkpoint(opts.checkpoint_dir, done, self.pm.parts, self.pm.optimizers,
                                             self.identity, self.losses, keep=opts.keep_checkpoints,
                                             names=self.pm.state_names)
        self.saved[done] = path
        return path

    def stop(self, done: int, signum: int) -> None:
        """Every rank, after step ``done``, on a signal all ranks agreed on: save a checkpoint where
        a folder is given (unless this step just saved one) and raise ``RunStopped`` saying how to resume."""
        opts = self.opts
        name = stop_signals.signal_name(signum)
        plan = str(opts.plan_path)
        if opts.checkpoint_dir is None:
            raise stop_signals.RunStopped(signum, (
                f"stopped by {name} after step {done}/{opts.steps}. Nothing was saved: the run has no "
                f"--checkpoint-dir, so a rerun starts from step 0. To make a run resumable, start it with "
                f"--checkpoint-dir DIR (and --checkpoint-every K to save every K steps)."))
        path = self.saved.get(done)               # the same answer on every rank (no file system look)
        if path is None:
            self.flush_losses()
            path = self.save(done)
        raise stop_signals.RunStopped(signum, (
            f"stopped by {name} after step {done}/{opts.steps}; checkpoint {path} is complete. Resume with: "
            f"autopar run {plan} --steps {opts.steps} --checkpoint-dir {opts.checkpoint_dir} (and the other "
            f"options of this run)."))

    def float8_all_ranks(self) -> dict | None:
        """The float8 conversion (runtime/apply_fp8.py) of every rank's parts, merged: under a
        pipeline each rank converts its own stages' linears."""
        if not self.plan.uses_fp8:
            return None
        from autopar.runtime.apply_fp8 import Float8Record

        mine = self.pm.float8.to_dict() if self.pm.float8 is not None else None
        rows: list = [None] * self.ctx.world_size
        dist.all_gather_object(rows, mine)
        out = Float8Record(recipe=self.plan.fp8_recipe)
        for row in rows:
            if row is not None:
                out.merge(Float8Record.from_dict(row))
        return out.to_dict()

    def finish(self) -> Measured:
        opts, ctx, plan = self.opts, self.ctx, self.plan
        self.flush_losses()
        breakdown, trace = None, None
        if self.prof is not None:
            trace_path = opts.measured_file.with_name(f"{opts.measured_file.stem}.trace.rank{ctx.rank}.json")
            breakdown = stop_profiler(self.prof, self.profiled, trace_path)
            trace = str(trace_path.with_name(f"{opts.measured_file.stem}.trace.rank0.json"))
        if self.state_bytes is None:                 # no step ran (resumed at the end): measure at rest
            self.state_bytes = model_state_bytes(self.pm.parts, self.pm.optimizers)
        state_per_rank = gather_model_state_bytes(self.state_bytes)
        report = measured_report(
            step_times_s=self.clock.times_s, warmup_steps=opts.warmup_steps, global_batch=plan.global_batch,
            seq_len=self.checked.graph.seq_len, memory_per_rank_bytes=gather_per_rank(self.memory.peak_bytes()),
            memory_kind=self.memory.kind, losses=self.losses, fingerprint=plan.model.fingerprint,
            world_size=ctx.world_size, device=ctx.device, plan_file=str(opts.plan_path),
            first_step=self.first_step, breakdown=breakdown, trace_file=trace, init_mode=self.pm.init_mode,
            model_state_bytes_per_rank=state_per_rank, plan_identity=plan.identity,
            float8=self.float8_all_ranks())
        if ctx.is_logging_rank:
            write_text_atomic(opts.measured_file, report.to_json_text())
            self.log(f"wrote {opts.measured_file}: step_time_s {report.step_time_s:.4f}, "
                     f"max_memory_bytes {report.max_memory_bytes}")
        dist.barrier()
        self.release_lock()
        return report


def run(opts: RunOptions) -> Measured:
    trainer = Trainer(opts)
    stop_signals.in_loop(True)                 # a signal now stops the run after the step in flight
    try:
        for step in range(trainer.first_step, opts.steps):
            trainer.step(step)
            signum = stop_signals.agreed_signal(trainer.ctx.device)   # one all-reduce, outside the clock
            if signum and step + 1 < opts.steps:
                trainer.stop(step + 1, signum)
        return trainer.finish()
    finally:
        stop_signals.in_loop(False)
        trainer.release_lock()
