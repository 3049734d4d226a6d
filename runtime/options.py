"""The runtime's command-line options, shared by ``python -m autopar.runtime`` and ``autopar run``.

``RunOptions`` is the narrow, typed config the trainer receives (docs/design.md, "Conventions":
no global job object); ``add_run_arguments`` declares the flags once for both entry points.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from autopar.runtime.lr_schedule import LR_SCHEDULES, LrSchedule

# AdamW defaults.  beta2 = 0.95 and weight decay 0.1 are the GPT-3 training settings
# (Brown et al. 2020, Appendix B); the learning rate is a small-model value and is a flag.
DEFAULT_LR = 1e-3
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.1
DEFAULT_SEED = 1234
DEFAULT_TIMING_WARMUP = 2    # steps left out of the step-time median (allocator and caches warm up)
INIT_MODES = ("auto", "host", "per-module")
PROGRESS_MODES = ("auto", "on", "off")    # auto: on when stdout is a terminal
# evaluation: global batches of the validation file per evaluation (nanoGPT's eval_iters is 200
# at its scale; 4 keeps an evaluation near the cost of a few training steps by default)
DEFAULT_EVAL_BATCHES = 4
DATA_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class RunOptions:
    plan_path: Path
    steps: int = 10
    lr: float = DEFAULT_LR
    seed: int = DEFAULT_SEED
    timing_warmup_steps: int = DEFAULT_TIMING_WARMUP
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
    # data and evaluation (autopar.runtime.token_data, autopar.runtime.batches, autopar.runtime.evaluate)
    data_path: Path | None = None             # --data: a token file; None: make_batch or the file's batches()
    data_dtype: str = "uint16"                # --data-dtype of --data and --val-data
    shuffle_seed: int | None = None           # --shuffle SEED: permute the samples once per pass
    val_data_path: Path | None = None         # --val-data: a token file evaluated every eval_every steps
    eval_every: int = 0                       # --eval-every K (0: never)
    eval_batches: int = DEFAULT_EVAL_BATCHES  # --eval-batches N: global batches per evaluation
    # optimizer: learning-rate schedule (runtime/lr_schedule.py), clipping (runtime/grad_norm.py), AdamW's settings
    lr_schedule: str = "constant"
    lr_warmup: int = 0
    min_lr: float = 0.0
    grad_clip: float | None = None            # None: no clipping (the norm is still computed and logged)
    weight_decay: float = WEIGHT_DECAY
    betas: tuple[float, float] = ADAM_BETAS
    nvme_path: Path | None = None             # --nvme-path: the folder of offload "nvme" layers' states (runtime/nvme_tier.py)

    @property
    def measured_file(self) -> Path:
        return self.measured_path or self.plan_path.with_name("measured.json")

    def schedule(self) -> LrSchedule:
        return LrSchedule(lr=self.lr, schedule=self.lr_schedule, warmup=self.lr_warmup, min_lr=self.min_lr,
                          steps=self.steps)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.core import cli_types as T

    parser.add_argument("plan", metavar="PLAN_JSON", help="a plan written by 'autopar plan'")
    parser.add_argument("--steps", type=T.positive, default=10, help="optimizer steps to run (default: 10)")
    parser.add_argument("--lr", type=T.positive_number, default=DEFAULT_LR, help=f"AdamW learning rate (default: {DEFAULT_LR})")
    parser.add_argument("--seed", type=T.seed, default=DEFAULT_SEED,
                        help="seed of the initial weights and of the batches (default: %(default)s)")
    parser.add_argument("--timing-warmup", dest="timing_warmup_steps", type=T.non_negative,
                        default=DEFAULT_TIMING_WARMUP, metavar="N",
                        help="steps left out of the median step time (default: %(default)s)")
    parser.add_argument("--warmup-steps", dest="warmup_steps_deprecated", type=T.non_negative, default=None,
                        help=argparse.SUPPRESS)
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
    g = parser.add_argument_group("data and evaluation (docs/runtime.md)")
    g.add_argument("--data", type=Path, default=None, metavar="FILE",
                   help="train on a token file: a flat little-endian array of token ids (nanoGPT's train.bin); "
                        "default: the model file's batches() if it has one, else make_batch's synthetic batches")
    g.add_argument("--data-dtype", choices=DATA_DTYPES, default="uint16",
                   help="dtype of the ids in --data and --val-data (default: %(default)s)")
    g.add_argument("--shuffle", type=T.seed, default=None, metavar="SEED",
                   help="permute the samples of --data once per pass, by a permutation drawn from SEED and the pass")
    g.add_argument("--val-data", type=Path, default=None, metavar="FILE",
                   help="a validation token file: its mean loss is logged every --eval-every steps and at the end")
    g.add_argument("--eval-every", type=T.non_negative, default=0, metavar="K",
                   help="evaluate on --val-data every K steps and at the end (default: 0, never)")
    g.add_argument("--eval-batches", type=T.positive, default=DEFAULT_EVAL_BATCHES, metavar="N",
                   help="global batches of --val-data per evaluation, read in order from its start "
                        "(default: %(default)s)")
    g = parser.add_argument_group("optimizer (AdamW)")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="learning rate after the warm-up: constant, or decaying linearly / by a cosine from --lr "
                        "to --min-lr at the last step (default: constant)")
    g.add_argument("--lr-warmup", type=T.non_negative, default=0, metavar="W",
                   help="steps of linear warm-up: step t < W uses lr * (t + 1) / W (default: 0)")
    g.add_argument("--min-lr", type=T.number(0.0, lo_open=False), default=0.0,
                   help="the learning rate a linear or cosine schedule reaches at the last step (default: 0)")
    g.add_argument("--grad-clip", type=T.positive_number, default=None, metavar="C",
                   help="clip the global gradient norm to C before each step, as "
                        "torch.nn.utils.clip_grad_norm_ on the whole model (default: no clipping)")
    g.add_argument("--weight-decay", type=T.number(0.0, lo_open=False), default=WEIGHT_DECAY,
                   help="AdamW's decoupled weight decay (default: %(default)s)")
    g.add_argument("--betas", type=_betas, default=ADAM_BETAS, metavar="B1,B2",
                   help=f"AdamW's betas (default: {ADAM_BETAS[0]},{ADAM_BETAS[1]})")
    parser.add_argument("--nvme-path", type=Path, default=None, metavar="DIR",
                        help="a folder on a local disk for the states of the plan's offload 'nvme...' layers: AdamW's "
                             "moments, and parameters and gradients where named (files removed at exit; "
                             "docs/runtime.md, NVMe tier)")


def _betas(text: str) -> tuple[float, float]:
    parts = str(text).split(",")
    try:
        values = tuple(float(x) for x in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or not all(0.0 <= b < 1.0 for b in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not two numbers B1,B2 in [0, 1) (e.g. 0.9,0.95).")
    return values


def timing_warmup(args: argparse.Namespace) -> int:
    """--timing-warmup, or the older --warmup-steps (with a note, once) when that is given."""
    old = getattr(args, "warmup_steps_deprecated", None)
    if old is None:
        return args.timing_warmup_steps
    import sys

    print("autopar: --warmup-steps is now --timing-warmup (steps left out of the median step time; "
          "--lr-warmup is the learning-rate warm-up); --warmup-steps still works.", file=sys.stderr, flush=True)
    args.warmup_steps_deprecated = None           # the note once, however often the args are read
    args.timing_warmup_steps = old
    return old


def options_from_args(args: argparse.Namespace) -> RunOptions:
    from autopar.core.errors import UserError

    for name in ("steps", "log_every", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} is {getattr(args, name)}; it must be a positive integer.")
    if args.eval_batches < 1:
        raise UserError(f"--eval-batches is {args.eval_batches}; it must be a positive integer.")
    warmup = timing_warmup(args)
    if args.checkpoint_every < 0 or warmup < 0 or args.eval_every < 0:
        raise UserError("--checkpoint-every, --timing-warmup and --eval-every must not be negative.")
    opts = RunOptions(plan_path=Path(args.plan), steps=args.steps, lr=args.lr, seed=args.seed,
                      timing_warmup_steps=warmup, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, profile=args.profile,
                      measured_path=args.measured, init=args.init, log_every=args.log_every,
                      keep_checkpoints=args.keep_checkpoints,
                      metrics_path=args.metrics, tensorboard_dir=args.tensorboard, progress=args.progress,
                      init_from=args.init_from,
                      data_path=args.data, data_dtype=args.data_dtype, shuffle_seed=args.shuffle,
                      val_data_path=args.val_data, eval_every=args.eval_every, eval_batches=args.eval_batches,
                      lr_schedule=args.lr_schedule, lr_warmup=args.lr_warmup, min_lr=args.min_lr,
                      grad_clip=args.grad_clip, weight_decay=args.weight_decay, betas=tuple(args.betas),
                      nvme_path=args.nvme_path)
    opts.schedule()                                   # a --min-lr above --lr: refused before any start
    return opts
