"""The training loop: batches, steps, loss logging, evaluation, checkpoints, measurements.

A step's batch comes from ``self.batches`` (runtime/batches.py): the model file's
``make_batch(global_batch)`` under a seed derived from the run seed and the step, of which
every rank keeps its data-parallel slice, rows ``[d * micro_batch * num_microbatches, (d + 1) * ...)``;
or those rows of a token file (``--data``, read by each rank for itself, a step ahead); or the
model file's ``batches()`` generator.  With ``--val-data`` the model is evaluated every
``--eval-every`` steps and at the end (``Trainer.evaluate``, runtime/evaluate.py).  The loss of every micro-batch is
the model file's loss (a mean over its samples) divided by the number of micro-batches, and
the data-parallel gradient reduction averages over the dp ranks, so every layout computes
the gradient of the mean loss over the global batch -- what a single-process loop over the
global batch computes (the parity tests' ``tests/plain_loop.py``).  The logged loss is that global mean.

Per step the clock holds only the step's own work -- the batch is drawn before it starts --: no ``.item()``, no collective of its own
but, with ``--grad-clip``, the global gradient norm's one all-reduce (on CUDA the step clock
synchronises the device at both ends of the step).  The step's learning rate is the schedule's
(runtime/lr_schedule.py, set by ``optimizer_control``).  The losses stay on the device and are
reduced over the ranks in one all-reduce when they are logged (every ``--log-every`` steps),
before a checkpoint and at the end (``Trainer.flush_losses``); without clipping, the logged
step's gradient norm is taken outside the clock (this rank's sum of squares after the step) and
reduced in that same all-reduce (``Trainer.last_grad_norm``).  The log line and its other outputs
(``--metrics``, TensorBoard, the progress line) are ``autopar.runtime.metrics``'s, read after the
clock stops.  ``Trainer`` holds a run's state between steps so a caller (the
overhead benchmark) can interleave its steps with other work; ``run`` is setup, the steps and
the report.  Between steps (outside the clock) ``run`` makes one small all-reduce: whether any
rank was sent SIGTERM / SIGINT / SIGHUP (``autopar.runtime.stop_signals``); if so every rank
stops after that same step, checkpointed where ``--checkpoint-dir`` is given (``Trainer.stop``).
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from autopar.core.measured import Measured
from autopar.core.plan import write_text_atomic
from autopar.runtime import checkpoint_lock, checkpointing, data_check, loss_guard, stop_signals
from autopar.runtime.batches import (ModelFileBatches, SyntheticBatches, TokenBatches, synthetic_global_batch,  # noqa: F401
                                     local_slice, step_seed)
from autopar.runtime.evaluate import Evaluator, eval_mode, local_eval_loss
from autopar.runtime.measure import MemoryProbe, StepClock, gather_per_rank, measured_report
from autopar.runtime.mesh import RankContext, init_distributed, launched_world_size
from autopar.runtime.metrics import Metrics
from autopar.runtime.model_state import gather_model_state_bytes, model_state_bytes
from autopar.runtime.optimizer_control import OptimizerControl
from autopar.runtime.options import RunOptions
from autopar.runtime.parallelize import ParallelModel, build_parallel_model
from autopar.runtime.plan_check import CheckedPlan, check_plan
from autopar.runtime.profile_breakdown import STEP_REGION, start_profiler, stop_profiler
from autopar.runtime.rank_errors import set_model_file, set_place

# Testing hook: "RANK:STEP" makes that rank exit abruptly after finishing STEP, on the first
# attempt only (TORCHELASTIC_RESTART_COUNT == 0) -- how the tests kill a rank mid-run.
FAULT_ENV = "AUTOPAR_FAULT_AT"


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


def train_step(pm: ParallelModel, checked: CheckedPlan, ctx: RankContext, inputs, target,
               control: OptimizerControl | None = None) -> torch.Tensor:
    """Forward, backward and optimizer step; returns this rank's mean loss over its samples (0 off
    the last stage).  ``control``: clips the gradients (``--grad-clip``) once they are final, before
    the optimizer steps.  The gradients are left in place: the caller clears them (``zero_grad``)."""
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
        if control is not None:
            control.clip()
        for opt in pm.optimizers:
            opt.step()
        if pm.after_optimizer_step is not None:     # the float8 weights' scales (runtime/apply_fp8.py)
            pm.after_optimizer_step()
    return local_loss


def step_on_rows(pm: ParallelModel, checked: CheckedPlan, ctx: RankContext, inputs, target,
                 control: OptimizerControl, step: int) -> torch.Tensor:
    """One optimizer step (step number ``step``) on this rank's rows of the global batch, on the
    device: the schedule's learning rate, context parallelism's share of the tokens, then
    ``train_step``.  The trainer and the Python API (runtime/api.py) both step through it."""
    control.before(step)
    inputs, target = rank_tokens(pm, inputs, target)
    return train_step(pm, checked, ctx, inputs, target, control)


def rank_tokens(pm: ParallelModel, inputs, target):
    """This cp rank's tokens of its rows (runtime/apply_cp.py); the rows unchanged without cp."""
    if pm.cp is None:
        return inputs, target
    return tuple(pm.cp.slice(x) for x in inputs), pm.cp.slice(target) if target is not None else None


def zero_grad(pm: ParallelModel) -> None:
    for opt in pm.optimizers:
        opt.zero_grad(set_to_none=True)


def global_losses(local_losses: list[torch.Tensor], pm: ParallelModel, ctx: RankContext, dp: int) -> list[float]:
    """The global-batch mean of each step: the last stage's tp-rank-0 losses, averaged over
    ``dp`` ranks (one all-reduce for all the steps given); the caller passes dp x cp, since the
    cp ranks each hold the mean over an equal share of the tokens."""
    return losses_and_sums(local_losses, pm, ctx, dp)[0]


def losses_and_sums(local_losses: list[torch.Tensor], pm: ParallelModel, ctx: RankContext, dp: int,
                    sums: list[torch.Tensor] = ()) -> tuple[list[float], list[float]]:
    """``global_losses`` and, in the same all-reduce, ``sums``: further 0-d values summed over
    every rank (the gradients' squares, runtime/grad_norm.py)."""
    if not local_losses and not sums:
        return [], []
    values = [l.detach().float().reshape(()).to(ctx.device) for l in local_losses]
    if not (pm.has_last_stage and ctx.tp_rank == 0):
        values = [torch.zeros_like(v) for v in values]
    values = torch.stack(values + [x.float().reshape(()).to(ctx.device) for x in sums])
    dist.all_reduce(values)
    out = values.tolist()
    return [v / dp for v in out[:len(local_losses)]], out[len(local_losses):]


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        r, s = (int(x) for x in spec.split(":"))
        if r == rank and s == step:
            print(f"[autopar] rank {rank}: {FAULT_ENV} -- exiting abruptly after step {step}",
                  file=sys.stderr, flush=True)
            os._exit(17)


def check_data_on_ranks(opts: RunOptions, checked: CheckedPlan, ctx: RankContext) -> None:
    """The token files' checks on the ranks (runtime/data_check.py): each rank checks the files
    and their length; rank 0 alone scans the ids against the vocabulary and every rank raises
    its verdict alike (one broadcast), before any model is built."""
    train, val = data_check.data_files(opts)
    if train is None and val is None:
        return
    data_check.check_files(opts)
    data_check.check_for_plan(opts, checked, scan=False)
    verdict: list = [None]
    if ctx.rank == 0:
        try:
            data_check.check_for_plan(opts, checked, scan=True)
        except data_check.DataFileError as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise data_check.DataFileError(verdict[0])


def check_data_record(saved: dict | None, now: dict, path: Path, opts: RunOptions) -> None:
    """Refuse a resume whose data differ from the checkpoint's (a checkpoint without a record,
    from an older autopar, is not checked): it would not read the batches an uninterrupted run reads."""
    if saved is None:
        return
    keys = ("source", "file", "shuffle_seed")
    if all(saved.get(k) == now.get(k) for k in keys):
        return

    def describe(r: dict) -> str:
        if r.get("source") != "tokens":
            return {"make_batch": "the model file's make_batch batches",
                    "batches()": "the model file's batches()"}.get(r.get("source"), str(r.get("source")))
        f = r.get("file") or {}
        shuffle = f"--shuffle {r['shuffle_seed']}" if r.get("shuffle_seed") is not None else "no --shuffle"
        return f"token file {f.get('path')} ({f.get('bytes')} bytes, {f.get('dtype')}, {shuffle})"

    raise checkpointing.CheckpointError(
        f"checkpoint {path} was trained on {describe(saved)}, but this run reads {describe(now)}: resumed, it "
        f"would not read the batches an uninterrupted run reads. Resume with the data options of the run that "
        f"wrote it (--data, --data-dtype, --shuffle), or start afresh with a new --checkpoint-dir (to train these "
        f"weights on other data, export them with 'autopar export' and start a new run from them with "
        f"--init-from).")


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
        self.batches, self.evaluator, self.val_losses = None, None, []
        check_data_on_ranks(opts, self.checked, ctx)     # before the model is built: nothing trains on bad data
        torch.manual_seed(opts.seed)
        self.pm = pm = build_parallel_model(self.checked, ctx, opts, self.checked.model_file.loss)
        self.control = OptimizerControl(pm, opts, ctx.device)
        self.last_lr: float | None = None
        self.last_grad_norm: torch.Tensor | None = None   # global norm before clipping (runtime/grad_norm.py)
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
        self.identity = checkpointing.CheckpointIdentity.of_plan(plan, self.checked.graph,
                                                                  self.checked.model_file.path)
        if opts.checkpoint_dir is not None:
            resumed = checkpointing.resume(
                opts.checkpoint_dir, pm.parts, pm.optimizers, self.identity, opts.steps, names=pm.state_names,
                check_records=self._check_records)
            if resumed is not None:
                self.control.apply_hyperparameters()     # the loaded optimizer state carried the saving run's
                self.first_step, self.losses = resumed.step, resumed.losses
                records = resumed.records or {}
                self.val_losses = [(int(a), float(b)) for a, b in records.get("val_losses", [])]
                self.log(f"resumed from {resumed.path} (step {self.first_step}, checksums verified)")
                if pm.powersgd is not None:
                    self._resume_powersgd(resumed)
        self.rows = plan.micro_batch * plan.pipeline.num_microbatches
        self.batches = self._batch_source()
        if opts.val_data_path is not None and opts.eval_every > 0:
            _, val = data_check.data_files(opts)
            self.evaluator = Evaluator(self._token_rows(val, shuffle=None, prefetch=False), opts.eval_batches)
        self.clock, self.prof, self.profiled = StepClock(ctx.device), None, 0
        self.pending: list[torch.Tensor] = []       # local losses not yet reduced over the ranks
        self.pending_squares: list[torch.Tensor] = []   # the last unclipped step's gradient squares (grad_norm)
        self.state_bytes: dict | None = None        # model_state_bytes of the last step
        self.saved: dict[int, Path] = {}            # step -> checkpoint folder saved by this run
        self.metrics = Metrics.for_trainer(self)    # the log line, --metrics, TensorBoard, progress

    def _token_rows(self, file, shuffle, prefetch: bool) -> TokenBatches:
        """This rank's rows of a token file: inputs on a pipeline's first stage, targets on its last."""
        plan, pm = self.plan, self.pm
        return TokenBatches(file, self.checked.graph.seq_len, plan.global_batch, self.ctx.dp_rank, self.rows,
                            self.ctx.device, shuffle=shuffle, inputs=pm.has_first_stage,
                            targets=pm.has_last_stage, prefetch=prefetch)

    def _batch_source(self):
        """``--data``, else the model file's ``batches()``, else ``make_batch`` (runtime/batches.py)."""
        opts, ctx = self.opts, self.ctx
        train, _ = data_check.data_files(opts)
        if train is not None:
            return self._token_rows(train, opts.shuffle_seed, prefetch=True)
        if self.checked.model_file.has_batches:
            return ModelFileBatches(self.checked, opts.seed, ctx.dp_rank, self.plan.mesh.batch_degree, self.rows,
                                    self.first_step, ctx.device)
        return SyntheticBatches(self.checked, opts.seed, ctx.dp_rank, self.rows, ctx.device)

    def data_record(self, done: int) -> dict:
        """The data position a checkpoint after step ``done`` records (runtime/checkpointing.py)."""
        opts = self.opts
        train, _ = data_check.data_files(opts)
        if train is not None:
            return {"source": "tokens", "file": train.identity(), "shuffle_seed": opts.shuffle_seed,
                    "step": done, "samples_read": done * self.plan.global_batch}
        if self.checked.model_file.has_batches:
            return {"source": "batches()", "step": done}
        return {"source": "make_batch", "step": done}

    def close_data(self) -> None:
        for source in (self.batches, self.evaluator):
            if source is not None:
                source.close()

    def _resume_powersgd(self, resumed) -> None:
        """PowerSGD's hook state from the checkpoint's ``powersgd_rank<R>.pt`` where it was saved under
        this run's layout and compression (runtime/powersgd_state.py), else one line saying it restarts."""
        from autopar.runtime.powersgd_state import restart_reason

        hook, ident = self.pm.powersgd, self.identity
        f = resumed.path / checkpointing.powersgd_file(self.ctx.rank)
        reason = restart_reason(resumed.layout or {}, {"world_size": ident.world_size, "mesh": ident.mesh,
                                                       "zero": ident.zero},
                                (resumed.records or {}).get("powersgd"), hook.spec, f.is_file())
        if reason is None:
            hook.load_state_dict(torch.load(f, weights_only=True))
            self.log(f"{hook.spec}: error feedback, warm-start Q and step count restored from {resumed.path}")
        else:
            self.log(f"{hook.spec}: its state restarts ({reason}): zero error feedback, a new random Q, and plain "
                     f"all-reduce for the first steps, as a fresh run")

    def _check_records(self, path, step: int, records: dict) -> None:
        """Before a checkpoint is read: its data position (runtime/data_check.py) and its
        learning-rate schedule (runtime/lr_schedule.py) must be this run's."""
        check_data_record(records.get("data"), self.data_record(step), path, self.opts)
        self.control.check_schedule(records, f"checkpoint {path}")

    def _rank_tokens(self, inputs, target):
        return rank_tokens(self.pm, inputs, target)

    def evaluate(self, done: int) -> float:
        """The global mean validation loss over ``--eval-batches`` batches (runtime/evaluate.py),
        appended to ``val_losses`` and logged; every rank calls it."""
        pm, ctx = self.pm, self.ctx

        def loss_of_rows(inputs, target):
            inputs, target = self._rank_tokens(inputs, target)
            return local_eval_loss(pm, self.checked, ctx, inputs, target,
                                   lambda chunk: _cp_forward(pm, chunk, ctx.device),
                                   lambda: _autocast(pm, ctx.device))

        with eval_mode(pm.parts):
            local = self.evaluator.local_losses(loss_of_rows)
        values = global_losses(local, pm, ctx, self.plan.mesh.grad_degree)
        value = sum(values) / len(values)
        self.val_losses.append((done, value))
        self.log(f"eval step {done}: val_loss {value:.6f}")
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.record({"step": done, "val_loss": value})
        return value

    def log(self, msg: str) -> None:
        if self.ctx.is_logging_rank:
            if getattr(self, "metrics", None) is not None:
                self.metrics.end_line()             # a progress line gives way
            print(f"[autopar] {msg}", flush=True)

    def flush_losses(self) -> None:
        """Reduce the pending losses (and, without clipping, the last step's gradient squares, in
        the same all-reduce: ``last_grad_norm``) over the ranks."""
        new, squares = losses_and_sums(self.pending, self.pm, self.ctx, self.plan.mesh.grad_degree, self.pending_squares[-1:])
        loss_guard.check_losses(new, len(self.losses), self.opts.checkpoint_dir)   # same values on every rank
        if squares:
            self.last_grad_norm = torch.tensor(squares[0], device=self.ctx.device).sqrt()
        self.losses += new
        self.pending, self.pending_squares = [], []

    def step(self, step: int) -> None:
        opts, ctx = self.opts, self.ctx
        if opts.profile and step - self.first_step == opts.timing_warmup_steps:
            self.prof = start_profiler(ctx.device)
        done = step + 1
        # a synthetic batch is drawn before the clock starts, as a data loader's workers would
        # have it ready; the clock holds the step itself: the rows moved to the device, and with
        # --data any wait for the prefetch thread (runtime/batches.py)
        self.batches.prepare(step)
        self.clock.start()
        with record_function(STEP_REGION) if self.prof is not None else contextlib.nullcontext():
            inputs, target = self.batches.get(step)
            local_loss = step_on_rows(self.pm, self.checked, ctx, inputs, target, self.control, step)
        dt = self.clock.stop()
        if done == opts.steps:               # after the backward and the step, before zero_grad
            self.state_bytes = model_state_bytes(self.pm.parts, self.pm.optimizers)
        self.last_lr, self.last_grad_norm = self.control.last_lr, self.control.last_grad_norm
        if self.last_grad_norm is None:      # not clipped: this rank's squares, reduced with the losses
            self.pending_squares = [self.control.norm.local_squares()]
        zero_grad(self.pm)
        self.profiled += self.prof is not None
        self.pending.append(local_loss)
        checkpoint_now = opts.checkpoint_dir is not None and (
            (opts.checkpoint_every and done % opts.checkpoint_every == 0) or done == opts.steps)
        logged = done % opts.log_every == 0 or done == opts.steps
        if logged or checkpoint_now:
            self.flush_losses()
        self.metrics.after_step(self, done, dt, logged)     # the log line (runtime/metrics.py)
        if self.evaluator is not None and (done % opts.eval_every == 0 or done == opts.steps):
            self.evaluate(done)
        _maybe_fault(ctx.rank, done)
        if checkpoint_now:
            self.log(f"checkpoint {self.save(done)}")

    def save(self, done: int) -> Path:
        """Checkpoint the state after step ``done`` (every rank; refused where it is not finite)."""
        opts = self.opts
        loss_guard.check_state_finite(self.pm.parts, done, opts.checkpoint_dir, self.ctx.device)
        path = checkpointing.save_checkpoint(opts.checkpoint_dir, done, self.pm.parts, self.pm.optimizers,
                                             self.identity, self.losses, keep=opts.keep_checkpoints,
                                             names=self.pm.state_names,
                                             records={"data": self.data_record(done),
                                                      "val_losses": [list(x) for x in self.val_losses],
                                                      **self.control.record(),
                                                      **({"powersgd": self.pm.powersgd.spec}
                                                         if self.pm.powersgd is not None else {})},
                                             powersgd=(self.pm.powersgd.state_dict()
                                                       if self.pm.powersgd is not None else None))
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
            step_times_s=self.clock.times_s, warmup_steps=opts.timing_warmup_steps, global_batch=plan.global_batch,
            seq_len=self.checked.graph.seq_len, memory_per_rank_bytes=gather_per_rank(self.memory.peak_bytes()),
            memory_kind=self.memory.kind, losses=self.losses, fingerprint=plan.model.fingerprint,
            world_size=ctx.world_size, device=ctx.device, plan_file=str(opts.plan_path),
            first_step=self.first_step, breakdown=breakdown, trace_file=trace, init_mode=self.pm.init_mode,
            model_state_bytes_per_rank=state_per_rank, plan_identity=plan.identity,
            float8=self.float8_all_ranks(), val_losses=self.val_losses)
        pairs = getattr(self.pm.schedule, "overlapped_pairs", None)
        if pairs is not None:                    # DualPipeV's pairs (runtime/dualpipe_overlap.py)
            self.log(f"dualpipev: {pairs.pairs} forward-backward pairs ran in turns, handing over "
                     f"{pairs.handovers} times at expert all-to-alls in flight")
        if ctx.is_logging_rank:
            write_text_atomic(opts.measured_file, report.to_json_text())
            self.log(f"wrote {opts.measured_file}: step_time_s {report.step_time_s:.4f}, "
                     f"max_memory_bytes {report.max_memory_bytes}")
        self.metrics.close()
        dist.barrier()
        self.close_data()
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
        trainer.close_data()
        trainer.release_lock()
