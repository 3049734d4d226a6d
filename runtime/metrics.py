"""The training log's figures per step and where they go: the log line, a jsonl file, TensorBoard,
a progress line.

Every logged step (each ``--log-every`` steps and the last) the logging rank prints::

    step 4/10 loss 3.912345 step_time 12.3 ms lr 1.000e-03 grad_norm 0.8123 tokens/s 5203 mfu 1.25% peak_mem 85.2 MiB

* ``step_time``: that step's time on the step clock (runtime/measure.StepClock).
* ``lr``: the learning rate the step used (``Trainer.last_lr``; the constant ``--lr`` where the
  Trainer sets none); ``grad_norm``: the global gradient norm before clipping
  (``Trainer.last_grad_norm``, a device tensor read here, on logged steps only, outside the
  step clock), ``n/a`` where the Trainer has none.
* ``tokens/s`` = global batch x sequence length / step time (``samples/s`` = global batch / step
  time where the model has no sequence dim), the same rule as measured.json's ``tokens_per_s``
  (runtime/measure.py) applied to one step.
* ``mfu`` = model FLOPs per step / (step time x world size x peak FLOP/s of one device), the
  simulator's rule (simulator/evaluator.py, ``StepWork.mfu``) after PaLM (Chowdhery et al. 2022,
  Appendix B): model FLOPs per step = ``OpGraph.flops_per_sample`` (the captured forward and
  backward FLOPs, no recompute) x global batch.  The peak is the plan's cluster's device profile
  at the plan's precision and the clock it holds (core/clocks.py), the first rank's device as in
  the simulator, and only when that profile is of the device kind the run is on (a GPU profile
  for CUDA, a CPU profile such as local-cpu's measured peak for the CPU); otherwise ``n/a``.
  The run's first log line says which peak, or why none.
* ``peak_mem``: the logging rank's peak memory so far in the run (runtime/measure.MemoryProbe:
  CUDA's allocator peak, or on the CPU the growth of the peak resident set size), in steady
  training the peak of every step.

``--metrics PATH.jsonl`` writes the same figures as one JSON object per logged step
(``STEP_KEYS``), and any other record (an evaluation's validation loss) given to
``Metrics.record``; each line is written whole and flushed, so a crash leaves whole lines.  A run
resumed from step s keeps the file's records up to step s and appends.  ``--tensorboard DIR``
writes each record's numbers as TensorBoard scalars (torch.utils.tensorboard, which needs the
``tensorboard`` package); ``tensorboard_folder`` picks the default.  ``--progress`` draws a
progress line with an ETA (the median step time so far x the steps left), rewritten in place
with a carriage return and ended before every log message.  Only the logging rank does any of it.
"""
from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TextIO

from autopar.core.units import fmt_bytes

#: the keys of a step's record in the --metrics file, in order
STEP_KEYS = ("step", "loss", "step_time_s", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "mfu",
             "peak_memory_bytes")


@dataclass(frozen=True)
class StepFigures:
    """What one logged step measured (module docstring); None: not known for this run."""
    step: int
    loss: float
    step_time_s: float
    lr: float | None
    grad_norm: float | None
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float | None
    peak_memory_bytes: int

    def to_json(self) -> dict:
        row = asdict(self)
        assert tuple(row) == STEP_KEYS
        return row


def throughput(global_batch: int, seq_len: int | None, step_time_s: float) -> tuple[float, float | None]:
    """(samples/s, tokens/s) of one step: global batch (x sequence length) / step time."""
    samples = global_batch / step_time_s if step_time_s > 0 else 0.0
    return samples, (samples * seq_len if seq_len else None)


def mfu(model_flops_per_step: float, step_time_s: float, world_size: int, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation (module docstring): None without a peak or a step time."""
    if not peak_flops or step_time_s <= 0:
        return None
    return model_flops_per_step / (step_time_s * world_size * peak_flops)


def _na(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def format_line(f: StepFigures, steps: int) -> str:
    """The log line of a logged step (module docstring)."""
    rate = (f"tokens/s {f.tokens_per_s:.0f}" if f.tokens_per_s is not None else f"samples/s {f.samples_per_s:.1f}")
    mfu_text = "n/a" if f.mfu is None else f"{100 * f.mfu:.2f}%"
    return (f"step {f.step}/{steps} loss {f.loss:.6f} step_time {f.step_time_s * 1e3:.1f} ms "
            f"lr {_na(f.lr, '.3e')} grad_norm {_na(f.grad_norm, '.4f')} {rate} mfu {mfu_text} "
            f"peak_mem {fmt_bytes(f.peak_memory_bytes)}")


@dataclass(frozen=True)
class DevicePeak:
    """One device's peak FLOP/s for MFU, and what it is (or why there is none)."""
    flops_per_s: float | None
    note: str


def plan_device_peak(plan, plan_path: str | Path, device_type: str) -> DevicePeak:
    """The peak of the first rank's device in the plan's cluster, at the plan's precision, where
    that device is of the kind this run is on (module docstring)."""
    from autopar.core.clocks import peak_flops_at_clock
    from autopar.core.errors import UserError
    from autopar.core.plan_cluster import load_plan_cluster
    from autopar.core.profile_schema import load_profile
    from autopar.core.units import fmt_flop_rate

    try:
        cluster = load_plan_cluster(plan, plan_path)
        profile = load_profile(cluster.group_of(0).gpu)
    except (UserError, OSError) as e:
        if not (plan.cluster or plan.provenance.get("cluster_ref") or plan.provenance.get("cluster_file")):
            return DevicePeak(None, "mfu n/a: the plan names no cluster, so no device peak is known")
        return DevicePeak(None, f"mfu n/a: the plan's cluster {plan.cluster or ''} or its device profile does not "
                                f"load here, so no device peak is known ({str(e)[:120]})")
    kind, want = profile.get("device", "gpu"), ("cpu" if device_type == "cpu" else "gpu")
    name = profile.get("name", cluster.group_of(0).gpu)
    if kind != want:
        return DevicePeak(None, f"mfu n/a: the plan's cluster {cluster.name} has {name} devices ({kind}), "
                                f"this run is on {device_type}")
    peak = peak_flops_at_clock(profile).get(plan.precision)
    if not peak:
        return DevicePeak(None, f"mfu n/a: profile {name} has no {plan.precision} peak")
    return DevicePeak(peak, f"mfu against profile {name}'s {plan.precision} peak, {fmt_flop_rate(peak)} per device "
                            f"(cluster {cluster.name})")


def eta_s(times_s: list[float], done: int, steps: int) -> float:
    """Seconds left: the median step time so far x the steps left."""
    return statistics.median(times_s) * (steps - done) if times_s else 0.0


def fmt_duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_text(done: int, steps: int, loss: float | None, times_s: list[float]) -> str:
    """The progress line after step ``done`` of ``steps``; ``loss``: the last logged one."""
    median = statistics.median(times_s) if times_s else 0.0
    loss_text = "" if loss is None else f" loss {loss:.4f}"
    return (f"step {done}/{steps} ({100 * done / steps:.0f}%){loss_text} {median * 1e3:.1f} ms/step "
            f"ETA {fmt_duration(eta_s(times_s, done, steps))}")


class Progress:
    """A line rewritten in place (carriage return, padded over the last one) on ``out``."""

    def __init__(self, out: TextIO | None = None):
        self._out = out
        self.width = 0

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    def show(self, text: str) -> None:
        self.out.write("\r" + text.ljust(self.width))
        self.out.flush()
        self.width = len(text)

    def clear(self) -> None:
        """Blank the line and return to its start, so the next message takes its place."""
        if self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.out.flush()
            self.width = 0


def progress_wanted(mode: str, out: TextIO | None = None) -> bool:
    """--progress: on, off, or auto (on when ``out``, default stdout, is a terminal)."""
    if mode == "auto":
        stream = out or sys.stdout
        return bool(getattr(stream, "isatty", lambda: False)())
    return mode == "on"


def _json_number(v):
    """A non-finite float as its text ("nan", "inf"): JSON has no such numbers."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def kept_records(path: Path, first_step: int) -> list[str]:
    """The lines of an earlier --metrics file a run resumed after ``first_step`` keeps: whole JSON
    objects whose step is at most ``first_step`` (a torn last line and later steps are dropped)."""
    kept = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= first_step:
            kept.append(line)
    return kept


class JsonlWriter:
    """--metrics: one JSON object per line, each written whole and flushed."""

    def __init__(self, path: Path, first_step: int = 0):
        from autopar.core.output_file import write_text_atomic

        self.path = Path(path)
        kept = kept_records(self.path, first_step) if first_step > 0 and self.path.is_file() else []
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        self._f = open(self.path, "a")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps({k: _json_number(v) for k, v in row.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def tensorboard_folder(metrics_path: Path | None, tensorboard_dir: Path | None) -> Path | None:
    """--tensorboard DIR, else ``<metrics stem>_tb`` beside --metrics when tensorboard is
    installed, else None."""
    if tensorboard_dir is not None:
        return Path(tensorboard_dir)
    if metrics_path is not None and tensorboard_available():
        return Path(metrics_path).with_name(Path(metrics_path).stem + "_tb")
    return None


class TensorBoardWriter:
    """Each record's numbers as scalars at its ``step`` (torch.utils.tensorboard.SummaryWriter).
    A resumed run purges the events after its first step (SummaryWriter's ``purge_step``)."""

    def __init__(self, folder: Path, first_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder)
        self._w = SummaryWriter(log_dir=str(folder), purge_step=first_step + 1 if first_step else None)

    def write(self, row: dict) -> None:
        step = row.get("step")
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class Metrics:
    """The logging rank's outputs of a run's figures (module docstring); a ``Metrics`` with
    ``active=False`` (the other ranks) does nothing."""

    def __init__(self, *, steps: int, global_batch: int, seq_len: int | None, model_flops_per_step: float,
                 world_size: int, peak: DevicePeak, default_lr: float | None, log: Callable[[str], None],
                 active: bool = True, jsonl: JsonlWriter | None = None, tensorboard: TensorBoardWriter | None = None,
                 progress: Progress | None = None):
        self.steps, self.global_batch, self.seq_len = steps, global_batch, seq_len
        self.model_flops_per_step, self.world_size, self.peak = model_flops_per_step, world_size, peak
        self.default_lr, self.log, self.active = default_lr, log, active
        self.jsonl, self.tensorboard, self.progress = jsonl, tensorboard, progress
        self.times_s: list[float] = []
        self.last_loss: float | None = None

    @classmethod
    def for_trainer(cls, trainer) -> "Metrics":
        """The Trainer's: its plan, options and rank (called in ``Trainer._setup``, after a resume)."""
        opts, plan, ctx, graph = trainer.opts, trainer.plan, trainer.ctx, trainer.checked.graph
        active = ctx.is_logging_rank
        common = dict(steps=opts.steps, global_batch=plan.global_batch, seq_len=graph.seq_len,
                      model_flops_per_step=graph.flops_per_sample * plan.global_batch, world_size=ctx.world_size,
                      default_lr=opts.lr, log=trainer.log, active=active)
        if not active:
            return cls(peak=DevicePeak(None, ""), **common)
        first = trainer.first_step
        folder = tensorboard_folder(opts.metrics_path, opts.tensorboard_dir)
        out = cls(peak=plan_device_peak(plan, opts.plan_path, ctx.device.type), **common,
                  jsonl=JsonlWriter(opts.metrics_path, first) if opts.metrics_path is not None else None,
                  tensorboard=TensorBoardWriter(folder, first) if folder is not None else None,
                  progress=Progress() if progress_wanted(opts.progress) else None)
        trainer.log(out.peak.note)
        if opts.metrics_path is not None:
            tb = (f"TensorBoard events in {folder}" if folder is not None else
                  "no TensorBoard events (the tensorboard package is not installed)")
            trainer.log(f"metrics: writing {opts.metrics_path}, {tb}")
        elif folder is not None:
            trainer.log(f"metrics: writing TensorBoard events in {folder}")
        return out

    def figures(self, done: int, loss: float, step_time_s: float, lr, grad_norm, peak_memory_bytes: int) -> StepFigures:
        samples, tokens = throughput(self.global_batch, self.seq_len, step_time_s)
        if lr is None:
            lr = self.default_lr
        if grad_norm is not None and not isinstance(grad_norm, (int, float)):
            # a plain device tensor, read now, outside the step clock, on this rank alone: a DTensor's
            # read could be a collective the other ranks never join
            assert not hasattr(grad_norm, "placements"), "last_grad_norm must be a plain tensor, not a DTensor"
            grad_norm = grad_norm.item()
        return StepFigures(step=done, loss=loss, step_time_s=step_time_s, lr=None if lr is None else float(lr),
                           grad_norm=None if grad_norm is None else float(grad_norm), samples_per_s=samples,
                           tokens_per_s=tokens, mfu=mfu(self.model_flops_per_step, step_time_s, self.world_size,
                                                        self.peak.flops_per_s),
                           peak_memory_bytes=int(peak_memory_bytes))

    def after_step(self, trainer, done: int, step_time_s: float, logged: bool) -> None:
        """After step ``done`` (outside the step clock): on a logged step the log line and its
        record (the Trainer's losses are reduced by then); the progress line every step."""
        if not self.active:
            return
        self.times_s.append(step_time_s)
        if logged:
            self.last_loss = trainer.losses[-1]
            f = self.figures(done, self.last_loss, step_time_s, getattr(trainer, "last_lr", None),
                             getattr(trainer, "last_grad_norm", None), trainer.memory.peak_bytes())
            self.log(format_line(f, self.steps))
            self._write(f.to_json())
        if self.progress is not None and done < self.steps:
            self.progress.show(progress_text(done, self.steps, self.last_loss, self.times_s))

    def record(self, row: dict) -> None:
        """Another record (e.g. ``{"step": 200, "val_loss": 2.71}``) to the jsonl and TensorBoard."""
        if self.active:
            self._write(dict(row))

    def _write(self, row: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(row)
        if self.tensorboard is not None:
            self.tensorboard.write(row)

    def end_line(self) -> None:
        """Before any other message: the progress line gives way to it (redrawn after the next step)."""
        if self.progress is not None:
            self.progress.clear()

    def close(self) -> None:
        self.end_line()
        for w in (self.jsonl, self.tensorboard):
            if w is not None:
                w.close()
        self.jsonl = self.tensorboard = None
