"""The learning-rate schedule: the learning rate of each step, a pure function of the step.

With ``lr`` the peak, ``W`` the warm-up steps, ``T`` the run's total steps (``--steps``) and
``min_lr`` the floor, step ``t`` (counted from 0 over the whole run, resumes included) uses

* ``lr * (t + 1) / W`` for ``t < W`` (linear warm-up, GPT-3's; Brown et al. 2020, Appendix B);
* then ``constant``: ``lr``;
* ``cosine``: ``min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (t - W) / max(1, T - W)))``
  (SGDR's cosine annealing without restarts, Loshchilov & Hutter 2017, Eq. 5; nanoGPT and
  torchtitan decay to a floor the same way);
* ``linear``: ``lr - (lr - min_lr) * (t - W) / max(1, T - W)``.

The runtime sets the value on every optimizer's parameter groups before each step
(``set_group_values``), so the schedule's only state is the step number, which a checkpoint already
holds (torch's ``LambdaLR`` would compute the same values, but keeps a step counter of its own per
optimizer, one more state to save and restore under every layout, pipeline stages and ZeRO-1's
partitions included); ``LrSchedule.record`` is what the checkpoint's manifest keeps of its settings, and
``check_resume`` decides whether a resumed run may go on with the settings it was given.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from autopar.core.errors import UserError

LR_SCHEDULES = ("constant", "linear", "cosine")
#: the checkpoint manifest's key for the schedule's settings (runtime/checkpointing.py ``extra``)
MANIFEST_KEY = "lr_schedule"


def lr_at(step: int, *, lr: float, schedule: str = "constant", warmup: int = 0, min_lr: float = 0.0,
          steps: int = 1) -> float:
    """The learning rate of step ``step`` (0-based) of a ``steps``-step run (module docstring)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"learning-rate schedule {schedule!r}: one of {', '.join(LR_SCHEDULES)}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    progress = (step - warmup) / max(1, steps - warmup)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress


@dataclass(frozen=True)
class LrSchedule:
    """One run's schedule: ``lr_at`` with these settings."""
    lr: float
    schedule: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0
    steps: int = 1

    def __post_init__(self):
        if self.schedule not in LR_SCHEDULES:
            raise UserError(f"--lr-schedule {self.schedule!r} is not a schedule; use one of {', '.join(LR_SCHEDULES)}.")
        if self.warmup < 0:
            raise UserError(f"--lr-warmup is {self.warmup}; it must not be negative.")
        if not 0.0 <= self.min_lr <= self.lr:
            raise UserError(f"--min-lr is {self.min_lr}; it must lie between 0 and --lr ({self.lr}).")

    def at(self, step: int) -> float:
        return lr_at(step, lr=self.lr, schedule=self.schedule, warmup=self.warmup, min_lr=self.min_lr,
                     steps=self.steps)

    def record(self) -> dict:
        """The settings that shape the curve (``steps`` only where the curve depends on it)."""
        out = asdict(self)
        if self.schedule == "constant":
            out.pop("steps")
            out.pop("min_lr")
        return out

    def check_resume(self, saved: dict | None, where: str) -> None:
        """Refuse to resume a checkpoint (``where``) whose schedule was another: the steps after
        the checkpoint would follow another curve than the one before it.  A checkpoint without a
        record (written before schedules existed) ran at a constant ``--lr``."""
        mine = self.record()
        if saved is None:
            if self.schedule == "constant" and self.warmup == 0:
                return
            saved = {"schedule": "constant", "warmup": 0}
        if saved == mine:
            return
        changed = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        flags = {"lr": "--lr", "schedule": "--lr-schedule", "warmup": "--lr-warmup", "min_lr": "--min-lr",
                 "steps": "--steps"}
        was = ", ".join(f"{flags[k]} {saved[k]}" for k in changed if saved.get(k) is not None)
        now = ", ".join(f"{flags[k]} {mine[k]}" for k in changed if mine.get(k) is not None)
        why = (" (a linear or cosine schedule decays over --steps, so another --steps is another curve)"
               if "steps" in changed else "")
        raise UserError(
            f"{where} was trained with the learning-rate schedule {saved.get('schedule')} ({was or 'its defaults'}), "
            f"and this run asks for {mine['schedule']} ({now or 'the defaults'}){why}: resuming would switch curves "
            f"mid-run. Resume with the checkpoint's settings, or start afresh with a new --checkpoint-dir.")


def set_group_values(optimizers, **values) -> None:
    """Put ``values`` (``lr=...``, ``betas=...``, ``weight_decay=...``) on every parameter group
    of every optimizer; a ZeroRedundancyOptimizer copies its groups onto its local optimizer at
    each step (torch.distributed.optim.ZeroRedundancyOptimizer.step calls ``_sync_param_groups``)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group.update(values)
