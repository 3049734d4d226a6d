"""The Python API: a plan applied to a model inside the user's own training loop.

    job = autopar.prepare("plan.json", lr=3e-4, lr_schedule="cosine", lr_warmup=100, steps=2000,
                          grad_clip=1.0)
    for step in range(job.steps_done, 2000):
        inputs, target = my_global_batch(step)            # the plan's global batch, every rank
        loss = job.step(job.local_rows(inputs), job.local_rows(target))
        if step % 100 == 0:
            print(job.global_loss(loss), job.lr, float(job.grad_norm))
    job.save("ck")
    job.close()

started with ``torchrun --nproc-per-node <the plan's world size> my_script.py``.  ``prepare``
checks the plan against the model (runtime/plan_check.py: the graph fingerprint of the model as
captured must be the one the plan was made for), joins the process group (or uses the one the
script started), builds this rank's part of the model exactly as ``autopar run`` does
(runtime/parallelize.py) with AdamW (``betas``, ``weight_decay``) and the learning-rate
schedule, and returns a ``PreparedJob``.  ``PreparedJob.step`` is the trainer's own step
(runtime/train.py ``step_on_rows``): micro-batches or the pipeline schedule, the context-parallel
share of the tokens, the gradient synchronisation, clipping, the schedule's learning rate, the
optimizer step, then ``zero_grad``.

The model: the plan's model file (default), another model file (``model_file=``), or functions
of the script (``build_model=``, with ``make_batch=`` -- the plan's model file's when not given
-- and optionally ``loss_fn=``): the same contract as a model file (README, "Model files"), where
``make_batch`` is used only on the meta device, to capture the forward and cut pipeline stages.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from autopar.core.errors import UserError
from autopar.core.modelfile import LOSS_FUNCTION, ModelFile, load_model_file
from autopar.runtime.options import RunOptions


def _model_file(plan_path: Path, model_file, build_model, make_batch, loss_fn) -> ModelFile | None:
    """The model to run as a ``ModelFile``; None: the plan's model file, as it is."""
    if build_model is None and make_batch is None and loss_fn is None:
        return load_model_file(model_file) if model_file is not None else None
    base = None
    if model_file is not None or build_model is None or make_batch is None:
        from autopar.core.plan import load_plan
        from autopar.runtime.plan_check import resolve_model_path

        path = model_file if model_file is not None else resolve_model_path(load_plan(plan_path), plan_path)
        try:
            base = load_model_file(path)
        except UserError as e:
            if build_model is not None and make_batch is None:
                raise UserError(f"prepare(build_model=...) without make_batch=...: autopar takes make_batch from the "
                                f"plan's model file, which cannot be used ({e}). Pass make_batch=fn, where "
                                f"fn(batch_size, **model_args) returns (inputs, target) as a model file's "
                                f"make_batch does.") from None
            raise
    fns = {k: v for k, v in vars(base.module).items() if not k.startswith("__")} if base is not None else {}
    name = "functions"
    for key, fn in (("build_model", build_model), ("make_batch", make_batch), (LOSS_FUNCTION, loss_fn)):
        if fn is None:
            continue
        if not callable(fn):
            raise UserError(f"prepare({key}=...) got a {type(fn).__name__}; pass a function.")
        fns[key] = fn
        name = getattr(fn, "__name__", name)
    module = types.ModuleType(f"autopar_api_model_{name}")
    module.__dict__.update(fns)
    source = build_model or make_batch or loss_fn
    try:
        path = Path(inspect.getsourcefile(source) or "<functions>")
    except TypeError:
        path = Path("<functions>")
    return ModelFile(path=base.path if base is not None and build_model is None else path, module=module)


def _options(plan: str | Path, run_options: dict) -> RunOptions:
    fields = {f.name for f in dataclasses.fields(RunOptions)} - {"plan_path"}
    unknown = sorted(set(run_options) - fields)
    if unknown:
        raise UserError(f"prepare() got {', '.join(unknown)}, which {'is not a' if len(unknown) == 1 else 'are not'} "
                        f"run option{'s' if len(unknown) > 1 else ''}. It takes: {', '.join(sorted(fields))} "
                        f"(the fields of autopar.runtime.options.RunOptions).")
    if run_options.get("lr_schedule", "constant") != "constant" and "steps" not in run_options:
        raise UserError("prepare(lr_schedule=...) decays over the run's steps: pass steps=T (the total number of "
                        "optimizer steps the loop will run).")
    opts = RunOptions(plan_path=Path(plan), **run_options)
    opts.schedule()                         # a bad --min-lr or schedule: refused here
    return opts


class PreparedJob:
    """This rank's share of a plan, ready for the user's loop (module docstring)."""

    def __init__(self, opts: RunOptions, checked, ctx, pm, control, owns_group: bool):
        self.opts, self.checked, self.ctx, self.pm, self.control = opts, checked, ctx, pm, control
        self.plan = checked.plan
        self._owns_group = owns_group
        self.steps_done = 0
        #: rows per rank per step: micro-batch x micro-batches
        self.rows = self.plan.micro_batch * self.plan.pipeline.num_microbatches
        from autopar.runtime.checkpointing import CheckpointIdentity

        # a model file (not functions of the script) is recorded for ``autopar export``
        self._identity = CheckpointIdentity.of_plan(self.plan, checked.graph,
                                                    getattr(checked.model_file.module, "__file__", None))

    # ------------------------------------------------------------------ what the loop reads
    @property
    def parts(self) -> list[torch.nn.Module]:
        """This rank's model parts: the whole (parallelised) model, or its pipeline stages."""
        return self.pm.parts

    @property
    def model(self) -> torch.nn.Module | None:
        """The module when this rank holds one part (no pipeline, or one stage), else None."""
        return self.pm.parts[0] if len(self.pm.parts) == 1 else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.pm.optimizers

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def data_rank(self) -> int:
        """This rank's index in the batch split (its rows: ``local_rows``)."""
        return self.ctx.dp_rank

    @property
    def data_ranks(self) -> int:
        """How many ways the global batch is split."""
        return self.plan.global_batch // self.rows

    @property
    def lr(self) -> float:
        """The learning rate of the last step (before any: the one the next step will use)."""
        return self.control.last_lr if self.control.last_lr is not None else self.control.schedule.at(self.steps_done)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last step, before clipping (0-d tensor on the device)."""
        return self.control.last_grad_norm

    def local_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch tensor (dim 0 = the plan's global batch), on the device."""
        if t.shape[0] != self.plan.global_batch:
            raise UserError(f"local_rows: the tensor has {t.shape[0]} rows, but the plan's global batch is "
                            f"{self.plan.global_batch}. Give every rank the whole global batch of a step.")
        r = self.data_rank
        return t[r * self.rows:(r + 1) * self.rows].to(self.device)

    # ------------------------------------------------------------------ the step
    def step(self, inputs, target) -> torch.Tensor:
        """One optimizer step on this rank's rows (``local_rows`` of the global batch); returns
        this rank's loss (0 off the last pipeline stage: ``global_loss`` gives the global mean)."""
        from autopar.runtime.train import step_on_rows, zero_grad

        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        bad = [t.shape[0] for t in (*inputs, target) if t.shape[0] != self.rows]
        if bad:
            raise UserError(f"step: a tensor has {bad[0]} rows, but this rank takes {self.rows} rows per step "
                            f"(micro-batch {self.plan.micro_batch} x {self.plan.pipeline.num_microbatches} "
                            f"micro-batch(es)). Pass job.local_rows(global_batch_tensor).")
        inputs = tuple(t.to(self.device) for t in inputs)
        loss = step_on_rows(self.pm, self.checked, self.ctx, inputs, target.to(self.device), self.control,
                            self.steps_done)
        if self.control.last_grad_norm is None:          # not clipped: the norm, for the loop to read
            self.control.last_grad_norm = self.control.norm()
        zero_grad(self.pm)
        self.steps_done += 1
        return loss

    def global_loss(self, loss: torch.Tensor) -> float:
        """The mean loss over the global batch of the step whose local loss is ``loss`` (every rank
        calls it: one all-reduce)."""
        from autopar.runtime.train import global_losses

        return global_losses([loss], self.pm, self.ctx, self.plan.mesh.grad_degree)[0]

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> Path:
        """A checkpoint of the state after ``steps_done`` steps (runtime/checkpointing.py: DCP with a
        verified manifest; every rank calls it).  ``autopar run`` and ``resume`` read it."""
        from autopar.runtime import checkpointing

        return checkpointing.save_checkpoint(Path(directory), self.steps_done, self.pm.parts, self.pm.optimizers,
                                             self._identity, [], keep=self.opts.keep_checkpoints,
                                             names=self.pm.state_names, records=self.control.record())

    def resume(self, directory: str | Path) -> int:
        """Load the newest checkpoint under ``directory`` (any layout's) and return the steps it
        had done (0: nothing to resume); the next ``step`` is that step of the schedule."""
        from autopar.runtime import checkpointing

        resumed = checkpointing.resume(
            Path(directory), self.pm.parts, self.pm.optimizers, self._identity, self.opts.steps,
            names=self.pm.state_names,
            check_records=lambda path, _step, records: self.control.check_schedule(records, f"checkpoint {path}"))
        if resumed is None:
            return 0
        self.control.apply_hyperparameters()
        self.steps_done = resumed.step
        return resumed.step

    def close(self) -> None:
        """Wait for every rank; leave the process group if ``prepare`` started it."""
        dist.barrier()
        if self._owns_group:
            from autopar.runtime.mesh import shutdown

            shutdown()


def prepare(plan: str | Path, *, model_file: str | Path | None = None, build_model: Callable | None = None,
            make_batch: Callable | None = None, loss_fn: Callable | None = None, **run_options) -> PreparedJob:
    """Apply ``plan`` to this rank's part of the model (module docstring).  ``run_options``:
    fields of ``RunOptions`` (``lr``, ``lr_schedule``, ``lr_warmup``, ``min_lr``, ``steps``,
    ``grad_clip``, ``weight_decay``, ``betas``, ``seed``, ``init``, ...).  Call it on every rank."""
    from autopar.runtime.mesh import init_distributed, launched_world_size
    from autopar.runtime.optimizer_control import OptimizerControl
    from autopar.runtime.parallelize import build_parallel_model
    from autopar.runtime.plan_check import check_plan
    from autopar.runtime.rank_errors import set_model_file, set_place

    opts = _options(plan, run_options)
    mf = _model_file(opts.plan_path, model_file, build_model, make_batch, loss_fn)
    checked = check_plan(opts.plan_path, launched_world_size(), mf)
    set_model_file(checked.model_file.path)
    owns_group = not dist.is_initialized()
    ctx = init_distributed(checked.plan.mesh)
    set_place(ctx.dp_rank, ctx.pp_rank, ctx.tp_rank)
    torch.manual_seed(opts.seed)
    pm = build_parallel_model(checked, ctx, opts, checked.model_file.loss)
    control = OptimizerControl(pm, opts, ctx.device)
    return PreparedJob(opts, checked, ctx, pm, control, owns_group)
