"""``autopar plan``: search for the fastest plan that fits the cluster and write plan.json.

    autopar plan examples/gpt.py --model-arg size=gpt3-175b --cluster h100-128x8 \\
        --global-batch 1536 -o plan.json

The work is ``autopar.plan(...)`` (planner/plan_api.py); this module declares the flags, calls
it with them, and prints what it returns (planner/plan_report.py).
"""
from __future__ import annotations

import argparse
import json
import sys

from autopar.core.plan import OFFLOAD, SCHEDULES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.core.cluster import add_cluster_arguments
    from autopar.core.modelfile import add_model_arguments

    from autopar.core import cli_types as T

    add_model_arguments(parser)
    add_cluster_arguments(parser)
    parser.add_argument("--global-batch", type=T.global_batch, required=True, metavar="N", help="samples per training step")
    parser.add_argument("--algo", choices=("auto", "ilp", "mcmc"), default="auto",
                        help="auto: ILP + stage DP, then MCMC refinement (default); ilp: the first only; "
                             "mcmc: Metropolis-Hastings alone")
    parser.add_argument("--seed", type=T.seed, default=0, help="seed of the search (default 0): same seed, same plan")
    parser.add_argument("--time-budget", type=T.positive_number, default=40.0, metavar="SECONDS",
                        help="wall-clock budget of the search (default 40)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16", "fp8"), default=None,
                        help="training precision (default bf16 on GPU clusters, with float8 linears where the "
                             "planner finds them faster on fp8-capable GPUs with torchao; fp32 on CPU/gloo "
                             "clusters). bf16: no float8; fp8: bf16 with every layer's linears in float8 where "
                             "they can be (planner/float8_choice.py)")
    parser.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise",
                        help="torchao's float8 scaling for the fp8 layers (default tensorwise: one scale per "
                             "tensor, fp8 all-gather under FSDP2; rowwise: one per row)")
    parser.add_argument("--profile", default=None,
                        help="profile name or JSON for every GPU (default: each group's GPU type)")
    parser.add_argument("--top-k", type=T.non_negative, default=3, metavar="K", help="runner-up plans to show (default 3)")
    parser.add_argument("-o", "--output", default="plan.json", metavar="PATH", help="plan file to write (default plan.json)")
    parser.add_argument("--json", action="store_true", help="print the plan and its runner-ups as JSON")
    from autopar.planner.headroom import DEFAULT_MEMORY_HEADROOM

    fix = parser.add_argument_group("fixed knobs", "fix any of these; the search chooses the rest")
    from autopar.core.parallel_dims import AXIS_BY_NAME, DEGREE_NAMES

    for name in DEGREE_NAMES:                         # one flag per parallel axis: --dp, --tp, --pp
        fix.add_argument(f"--{name}", type=T.positive, default=None, metavar="N", help=AXIS_BY_NAME[name].help)
    fix.add_argument("--ep", type=T.positive, default=None, metavar="N",
                     help="expert-parallel degree: the routed experts split over N of the dp x cp ranks")
    fix.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3),
                     help="ZeRO stage on every layer (0 DDP, 1 optimizer, 2 + gradients, 3 + parameters/FSDP)")
    fix.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                     help="activation recompute on every layer")
    fix.add_argument("--offload", choices=OFFLOAD, default=None,
                     help="CPU offload of parameters, gradients and optimizer state on every layer (cpu needs ZeRO-2/3); "
                          "nvme: the same with AdamW's moments on the cluster file's nvme tier; nvme+grads, "
                          "nvme+params, nvme+params+grads: the sharded gradients and/or parameters there too")
    fix.add_argument("--micro-batch", type=T.positive, default=None, metavar="N", help="samples per micro-batch")
    fix.add_argument("--schedule", choices=SCHEDULES, default=None,
                     help="pipeline schedule (needs pp > 1): gpipe, 1f1b, interleaved (1F1B), or the split-backward "
                          "ones, interleaved-zb (zero bubble), zbv (ZB-V) and dualpipev (DeepSeek's DualPipeV)")
    parser.add_argument("--memory-headroom", type=T.number(0.0, 1.0, lo_open=False, hi_open=True, what="a fraction"), default=DEFAULT_MEMORY_HEADROOM, metavar="FRACTION",
                        help=f"fraction of each device's memory a plan leaves free for allocator fragmentation "
                             f"and workspaces (default {DEFAULT_MEMORY_HEADROOM:.3f}: the mean fragmentation GMLake, "
                             f"Guo et al. 2024, measured for PyTorch's allocator on LLM training, 9.2 of 80 GB)")
    trial = parser.add_argument_group("trial steps", "measure the shortlist before choosing (planner/trial_steps.py)")
    trial.add_argument("--trial-steps", type=int, default=None, metavar="N",
                       help="run the winner and the runner-ups within its validation band for N steps each with "
                            "'autopar run' (one node; several: print the commands), keep the fastest measured, "
                            "and refit the profile to all trials into <plan>.calibrated-profile.json")
    trial.add_argument("--trial-plans", type=int, default=None, metavar="K",
                       help="with --trial-steps: try at least K plans, filling the band up with the next fastest "
                            "runner-ups (default 3; at most --top-k + 1)")
    trial.add_argument("--trial-breakdown", action="store_true",
                       help="with --trial-steps: run the trials with the runtime's --profile, so the calibration "
                            "also fits each trial's forward, backward, communication and optimizer times (the "
                            "profiler slows every trial's steps a little)")
    fix.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="regional torch.compile of every block: on, off, or (default) chosen by the planner "
                          "(planner/compile_choice.py)")
    parser.add_argument("--grad-clip", action="store_true",
                        help="price the plans as runs that clip gradients by their global norm (autopar run "
                             "--grad-clip C; the threshold does not change the cost); recorded in the plan")
    fix.add_argument("--grad-compression", type=T.grad_compression, default=None, metavar="none|bf16|fp16|powersgd:R",
                     help="how the data-parallel gradient reduce is compressed (default: the plan's own 16-bit type "
                          "on the wire where that shortens the step by more than 5%%, else none; "
                          "planner/compression_choice.py). powersgd:R: rank-R PowerSGD with error feedback (changes "
                          "the training; DDP plans only)")
    parser.add_argument("--allow-lossy-compression", action="store_true",
                        help="let the planner choose PowerSGD (ranks 1, 2, 4) where it is fastest; it changes the "
                             "training (Vogels et al. 2019)")
    parser.add_argument("--no-runtime-check", action="store_true",
                        help="skip applying the runtime's transformations on fake ranks: the plan may then use "
                             "kinds the runtime cannot run for this model")


def main(args: argparse.Namespace) -> int:
    from autopar.core.modelfile import parse_model_args
    from autopar.planner.plan_report import console as rich_console, print_outcome, progress_bar

    console = None if args.json else rich_console()
    with progress_bar(console) as progress:
        out = _plan(args, parse_model_args(args.model_args), progress)
    if args.json:
        json.dump(out.to_dict(), sys.stdout, indent=2, default=float)
        print()
        return 0
    print_outcome(console, out)
    return 0


def _plan(args: argparse.Namespace, model_args: dict, progress):
    """``autopar.plan`` called with the verb's flags (planner/plan_api.py)."""
    import contextlib

    from autopar.core.errors import paragraph
    from autopar.core.parallel_dims import DEGREE_NAMES
    from autopar.planner.plan_api import plan
    from autopar.planner.trial_steps import say_to

    stream = sys.stderr if args.json else sys.stdout       # --json keeps stdout for the JSON
    # the trials print a multi-node plan's commands (autopar run) on stdout
    trials = contextlib.redirect_stdout(stream) if args.trial_steps is not None else contextlib.nullcontext()
    with trials:
        return plan(args.model_file, args.cluster, args.global_batch, model_args=model_args,
                    batch_size=args.batch_size, nodes=args.nodes, algo=args.algo, seed=args.seed,
                    time_budget=args.time_budget, precision=args.precision, fp8_recipe=args.fp8_recipe,
                    profile=args.profile, top_k=args.top_k,
                    degrees={name: getattr(args, name) for name in DEGREE_NAMES},   # --dp, --tp, --pp
                    ep=args.ep, zero=args.zero, recompute=args.recompute, offload=args.offload,
                    micro_batch=args.micro_batch, schedule=args.schedule, compile=args.compile,
                    memory_headroom=args.memory_headroom, grad_clip=args.grad_clip,
                    grad_compression=args.grad_compression, allow_lossy_compression=args.allow_lossy_compression,
                    runtime_check=not args.no_runtime_check, trial_steps=args.trial_steps,
                    trial_plans=args.trial_plans, trial_breakdown=args.trial_breakdown, output=args.output,
                    progress=progress, say=say_to(stream),
                    warn=lambda text: print(paragraph(text), file=sys.stderr))
