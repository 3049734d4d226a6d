"""The runtime's command-line options, shared by ``python -m autopar.runtime`` and ``autopar run``.

``RunOptions`` is the narrow, typed config the trainer receives (docs/design.md, "Conventions":
no global job object); ``add_run_arguments`` declares the flags once for both entry points.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

# AdamW defaults.  beta2 = 0.95 and weight decay 0.1 are the GPT-3 training settings
# (Brown et al. 2020, Appendix B); the learning rate is a small-model value and is a flag.
DEFAULT_LR = 1e-3
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.1
DEFAULT_SEED = 1234
DEFAULT_WARMUP_STEPS = 2     # steps left out of the step-time median (allocator and caches warm up)
INIT_MODES = ("auto", "host", "per-module")
PROGRESS_MODES = ("auto", "on", "off")    # auto: on when stdout is a terminal


@dataclass(frozen=True)
class RunOptions:
    plan_path: Path
    steps: int = 10
    lr: float = DEFAULT_LR
    seed: int = DEFAULT_SEED
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0                 # 0: only at the end of the run (when a dir is given)
    profile: bool = False
    measured_path: Path | None = None         # default: measured.json beside the plan
    init: str = "auto"                        # see autopar.runtime.materialize
    log_every: int = 1
    keep_checkpoints: int = 3                 # newest complete checkpoints kept (autopar.runtime.checkpointing)
    # what the log line's figures are also written to, and the progress line (runtime/metrics.py)
    metrics_path: Path | None = None          # --metrics: one JSON object per logged step (jsonl)
    tensorboard_dir: Path | None = None       # --tensorboard (default: runtime/metrics.tensorboard_folder)
    progress: str = "auto"                    # --progress: PROGRESS_MODES
    # weights43: initial weights from a file (autopar.runtime.weights_in)
    init_from: Path | None = None

    @property
    def measured_file(self) -> Path:
        return self.measured_path or self.plan_path.with_name("measured.json")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.core import cli_types as T

    parser.add_argument("plan", metavar="PLAN_JSON", help="a plan written by 'autopar plan'")
    parser.add_argument("--steps", type=T.positive, default=10, help="optimizer steps to run (default: 10)")
    parser.add_argument("--lr", type=T.positive_number, default=DEFAULT_LR, help=f"AdamW learning rate (default: {DEFAULT_LR})")
    parser.add_argument("--seed", type=T.seed, default=DEFAULT_SEED,
                        help="seed of the initial weights and of the batches (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=T.non_negative, default=DEFAULT_WARMUP_STEPS,
                        help="steps left out of the median step time (default: %(default)s)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="save torch.distributed.checkpoint checkpoints here and resume from the latest")
    parser.add_argument("--checkpoint-every", type=T.non_negative, default=0, metavar="K",
                        help="checkpoint every K steps (default: only at the end of the run)")
    parser.add_argument("--profile", action="store_true",
                        help="record a torch.profiler trace and a forward/backward/communication/optimizer breakdown")
    parser.add_argument("--measured", type=Path, default=None, metavar="PATH",
                        help="where to write the measurements (default: measured.json beside the plan)")
    parser.add_argument("--init", choices=INIT_MODES, default="auto",
                        help="initial weights: 'host' builds the full model on the CPU with the model file's "
                             "own init; 'per-module' never builds it whole (reset_parameters seeded per module); "
                             "'auto' picks host when the model fits in host memory (default)")
    # weights43
    parser.add_argument("--init-from", type=Path, default=None, metavar="PATH",
                        help="start from these weights instead of the model file's init: a safetensors file, a "
                             "save_pretrained folder (sharded with an index or not), or a torch state dict "
                             "(.pt/.bin); each rank reads only its own slices")
    parser.add_argument("--log-every", type=T.positive, default=1, help="print loss and step time every N steps")
    parser.add_argument("--keep-checkpoints", type=T.positive, default=3, metavar="N",
                        help="keep the newest N checkpoints under --checkpoint-dir, deleting older ones after "
                             "each save (default: %(default)s)")
    parser.add_argument("--metrics", type=Path, default=None, metavar="PATH.jsonl",
                        help="also write every logged step's figures (loss, lr, grad norm, tokens/s, MFU, memory) "
                             "to this file, one JSON object per line")
    parser.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                        help="write TensorBoard event files here (needs the tensorboard package; default: "
                             "<metrics stem>_tb beside --metrics when tensorboard is installed)")
    parser.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                        help="a progress line with an ETA, updated in place (default: auto, on when stdout is "
                             "a terminal)")


def options_from_args(args: argparse.Namespace) -> RunOptions:
    from autopar.core.errors import UserError

    for name in ("steps", "log_every", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} is {getattr(args, name)}; it must be a positive integer.")
    if args.checkpoint_every < 0 or args.warmup_steps < 0:
        raise UserError("--checkpoint-every and --warmup-steps must not be negative.")
    return RunOptions(plan_path=Path(args.plan), steps=args.steps, lr=args.lr, seed=args.seed,
                      warmup_steps=args.warmup_steps, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, profile=args.profile,
                      measured_path=args.measured, init=args.init, log_every=args.log_every,
                      keep_checkpoints=args.keep_checkpoints,
                      metrics_path=args.metrics, tensorboard_dir=args.tensorboard, progress=args.progress,
                      init_from=args.init_from)
