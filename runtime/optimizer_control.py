"""What the runtime does around each optimizer step: the step's learning rate, the global
gradient norm and clipping, AdamW's betas and weight decay.

``OptimizerControl`` is shared by the trainer (runtime/train.py) and the Python API
(runtime/api.py): ``before(step)`` puts the schedule's learning rate of that step on every
optimizer's parameter groups (runtime/lr_schedule.py); ``clip()`` runs after the gradients are
final (synchronised, tied copies summed) and before ``optimizer.step()``: with ``--grad-clip``
it computes the global norm and scales the gradients (runtime/grad_norm.py).  ``last_lr`` and
``last_grad_norm`` (the norm before clipping, a 0-d tensor on the device, or None where it has
not been reduced yet) are what the log reads.
"""
from __future__ import annotations

import torch

from autopar.runtime.grad_norm import GradNorm
from autopar.runtime.lr_schedule import MANIFEST_KEY, LrSchedule, set_group_values
from autopar.runtime.options import RunOptions


class OptimizerControl:
    def __init__(self, pm, opts: RunOptions, device: torch.device):
        self.pm = pm
        self.schedule: LrSchedule = opts.schedule()
        self.grad_clip = opts.grad_clip
        self.hyper = {"betas": tuple(opts.betas), "weight_decay": opts.weight_decay}
        self.norm = GradNorm.build(pm.parts, pm.state_names, device)
        self.last_lr: float | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.apply_hyperparameters()

    def apply_hyperparameters(self) -> None:
        """Betas and weight decay on every group (again after a resume: a loaded optimizer state
        carries the saving run's)."""
        set_group_values(self.pm.optimizers, **self.hyper)

    def record(self) -> dict:
        """The checkpoint manifest's record (``lr_schedule`` key: runtime/checkpointing.py ``records``)."""
        return {MANIFEST_KEY: self.schedule.record()}

    def check_schedule(self, records: dict, where: str) -> None:
        """Before a checkpoint is read: refuse one trained on another schedule (its manifest's
        ``lr_schedule`` record; ``LrSchedule.check_resume``)."""
        self.schedule.check_resume(records.get(MANIFEST_KEY), where)

    def before(self, step: int) -> float:
        lr = self.schedule.at(step)
        set_group_values(self.pm.optimizers, lr=lr)
        self.last_lr, self.last_grad_norm = lr, None
        return lr

    def clip(self) -> None:
        if self.grad_clip is not None:
            self.last_grad_norm = self.norm(self.grad_clip)
