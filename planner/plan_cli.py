"""``autopar plan``: search for the fastest plan that fits the cluster and write plan.json.

    autopar plan examples/gpt.py --model-arg size=gpt3-175b --cluster h100-128x8 \\
        --global-batch 1536 -o plan.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from autopar.core.errors import UserError
from autopar.core.plan import SCHEDULES
from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES, split_backward_problem
from autopar.planner.constraints import constrain


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
    fix.add_argument("--offload", choices=("none", "cpu", "nvme"), default=None,
                     help="CPU offload of parameters, gradients and optimizer state on every layer (cpu needs ZeRO-2/3); "
                          "nvme: the same with AdamW's moments on the cluster file's nvme tier")
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
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.core.modelfile import parse_model_args
    from autopar.core.parallel_dims import DEGREE_NAMES
    from autopar.core.plan import save_plan
    from autopar.planner.search import PlanOptions, search
    from autopar.simulator.api import CostModel

    from autopar.core.output_file import check_writable

    t0 = time.perf_counter()
    check_writable(args.output, "-o")                 # before the search, not after it
    trial_plans = _check_trial_args(args)
    model_args = parse_model_args(args.model_args)
    cluster = load_cluster(args.cluster, nodes=args.nodes)
    cost_models = {g.gpu: CostModel.from_profile(args.profile or g.gpu) for g in cluster.groups}
    if args.grad_clip:                # every plan priced as a clipped run (simulator/optimizer_step.py)
        cost_models = {k: cm.for_code(replace(cm.code, grad_clip=True)) for k, cm in cost_models.items()}
    _note_other_machine(cluster, args.profile)
    # --precision fp8 is a bf16 plan whose layers train their linears in float8
    fp8_flag = args.precision if args.precision in ("bf16", "fp8") else None
    precision = "bf16" if args.precision == "fp8" else (args.precision or ("fp32" if cluster.backend == "gloo"
                                                                           else "bf16"))
    if args.top_k < 0:
        raise UserError(f"--top-k is {args.top_k}; it must be 0 or more.")
    options = PlanOptions(global_batch=args.global_batch, algo=args.algo, seed=args.seed,
                          time_budget_s=args.time_budget, precision=precision, top_k=args.top_k,
                          degrees={n: v for n in DEGREE_NAMES if (v := getattr(args, n)) is not None},   # --dp, --tp
                          ep=args.ep, zero=args.zero, offload=args.offload, micro_batch=args.micro_batch,
                          fixed_schedule=args.schedule, memory_headroom=args.memory_headroom)
    if args.recompute is not None:
        options = replace(options, recompute=(args.recompute,))
    if args.schedule is not None:
        options = replace(options, schedules=(args.schedule,))
        problem = split_backward_problem(args.schedule, args.recompute or "none", args.zero or 0,
                                         args.offload or "none", bool(args.compile))
        if problem:
            raise UserError(f"--schedule {args.schedule} with the knobs given cannot run: {problem}.")
    elif args.compile:       # torch's split-backward classes refuse compiled stages (core/rules.py)
        options = replace(options, schedules=tuple(s for s in options.schedules if s not in SPLIT_BACKWARD_SCHEDULES))
    options.check()
    from autopar.planner.compression_choice import constrain_for

    options = constrain_for(args.grad_compression, options)
    graph = capture_model_file(args.model_file, model_args, args.batch_size)
    from autopar.core.modelfile import load_model_file
    from autopar.planner.micro_batches import refuse_micro_batches

    options, batch_notes = refuse_micro_batches(options, graph, load_model_file(args.model_file))
    capture_s = time.perf_counter() - t0
    executable = None
    from autopar.planner.float8_choice import fp8_unavailable
    float8_why_not = fp8_unavailable(cluster, cost_models, precision)
    if fp8_flag == "fp8" and float8_why_not is not None:
        raise UserError(f"--precision fp8 asks for float8 linears, but {float8_why_not}. Plan with --precision "
                        f"bf16, or on a cluster of Hopper-class GPUs with torchao installed.")
    if not args.no_runtime_check:
        executable = check_kinds(graph, args.model_file, cluster, options,
                                 float8=float8_why_not is None and fp8_flag != "bf16")
    options = constrain(replace(options, executable=executable), graph, cluster)
    console = _console()
    if args.json or console is None:
        result = search(graph, cluster, cost_models, options)
    else:
        result = _search_with_progress(console, graph, cluster, cost_models, options)
    from autopar.planner.compile_choice import choose_compile
    result, compile_choice = choose_compile(result, graph, cluster, cost_models, args.compile,
                                            options.memory_headroom)
    from autopar.planner.float8_choice import choose_float8
    result, float8_choice = choose_float8(result, graph, cluster, cost_models, fp8_flag, precision, executable,
                                          options.memory_headroom, recipe=args.fp8_recipe)
    from autopar.planner.compression_choice import choose_compression
    result, compression_choice = choose_compression(result, graph, cluster, cost_models, args.grad_compression,
                                                    args.allow_lossy_compression, options.memory_headroom)
    # each plan's family validation error; a better-validated plan within the band goes first
    # (planner/confidence.py), and the runtime check then takes the first plan it can run
    from autopar.planner import confidence
    result, _, _, conf_why = confidence.apply(result, cluster)
    preferred = result.best
    left_out = batch_notes + (list(executable.left_out) if executable is not None else [])
    if executable is not None:
        result, refused = runnable_result(result, graph, args.model_file)
        left_out += refused
    from autopar.planner.parallel_notes import axis_notes

    left_out += axis_notes(graph, result, options)
    _, conf_errors, conf_close, _ = confidence.apply(result, cluster, reorder=False)
    if result.best is not preferred:
        conf_why = "the better-validated plan was refused by the runtime check (see left out)"
    compile_note = ""
    if result.best.plan.compile and executable is not None:
        from autopar.core.modelfile import load_model_file
        from autopar.runtime.meta_apply import compile_blocks

        blocks = compile_blocks(result.best.plan, graph, load_model_file(args.model_file))
        compile_note = f"; compile wrapper applied to {len(blocks)} blocks on the meta model (no compiled forward)"
    float8_record = None
    if result.best.plan.uses_fp8 and executable is not None:
        from autopar.core.modelfile import load_model_file
        from autopar.runtime.meta_apply import float8_conversion

        float8_record = float8_conversion(result.best.plan, graph, load_model_file(args.model_file))
        compile_note += f"; {float8_record.summary()} (torchao's conversion on the meta model)"
    # how to load this cluster again (autopar report / simulate re-price the plan with it)
    cluster_ref = str(Path(args.cluster).resolve()) if Path(args.cluster).is_file() else args.cluster
    provenance = dict(cluster_ref=cluster_ref, cluster_nodes=args.nodes, memory_headroom=options.memory_headroom,
                      runtime_check="skipped (--no-runtime-check)" if executable is None else
                      f"kinds applied on fake ranks in {executable.check_s:.1f} s; the plan itself too" + compile_note,
                      left_out=[x.to_dict() for x in left_out], compile_choice=compile_choice.to_dict(),
                      float8_choice=float8_choice.to_dict(), grad_compression_choice=compression_choice.to_dict())
    if float8_record is not None:
        provenance["float8_conversion"] = float8_record.to_dict()
    # plan.json's figures are those 'autopar simulate plan.json' gives (simulator/plan_price.py);
    # trials compare their measurements with these
    graphs = {graph.batch_size: graph}
    result.best = _priced(replace(result.best, plan=result.best.plan.with_predicted(result.best.plan.predicted,
                                                                                    **provenance)),
                          cluster, cost_models, graphs)
    result.runner_ups = [_priced(replace(ev, plan=ev.plan.with_predicted(ev.plan.predicted,
                                                                         memory_headroom=options.memory_headroom)),
                                 cluster, cost_models, graphs) for ev in result.runner_ups]
    compile_choice = _priced_choice(compile_choice, result.best.plan, cluster, cost_models, graphs)
    provenance["compile_choice"] = compile_choice.to_dict()
    float8_choice = _priced_float8(float8_choice, result.best.plan, cluster, cost_models, graphs)
    provenance["float8_choice"] = float8_choice.to_dict()
    outcome = None
    if args.trial_steps is not None:
        result, conf_errors, conf_close, outcome = _trial(result, conf_errors, cluster, args, trial_plans,
                                                          provenance)
        if outcome.kept.index != 1:
            conf_why = (f"trial {outcome.kept.index} measured the fastest step of the trials "
                        f"({1e3 * outcome.kept.measured_s:.1f} ms)")
    plan = result.best.plan.with_predicted(result.best.plan.predicted, **provenance)
    if args.grad_clip:
        plan = replace(plan, grad_clip=True)
    if outcome is not None:
        from autopar.planner.trial_steps import trial_provenance

        plan = plan.with_predicted(plan.predicted, trial_steps=trial_provenance(outcome, args.trial_steps))
    from autopar.planner.whole_layers import lines as whole_lines, whole_layers

    whole = whole_layers(plan, _plan_graph(plan, graphs), cluster, cost_models, executable, left_out,
                         fixed="tp" in options.degrees)
    if whole:
        plan = plan.with_predicted(plan.predicted, whole_layers=[w.to_dict() for w in whole])
    result.best = replace(result.best, plan=plan)
    save_plan(plan, args.output)
    from autopar.core.output_file import is_special

    # a device (-o /dev/null) keeps nothing to run: no command names it
    command = None if is_special(args.output) else torchrun_hint(cluster, args.output, plan.world_size)
    if args.json:
        out = {"plan": plan.to_dict(), "output": str(args.output), "torchrun": command,
               "capture_s": round(capture_s, 3),
               "runner_ups": [{"predicted": dict(ev.plan.predicted), "mesh": ev.plan.to_dict()["mesh"],
                               "difference": _difference(result.best, ev)} for ev in result.runner_ups]}
        out["compile"] = compile_choice.summary()
        out["float8"] = float8_choice.summary()
        out["grad_compression"] = compression_choice.summary()
        out["validation"] = {"why": conf_why, "plans": [  # best first, then the runner-ups
            {"family_error": e.__dict__ if e else None, "too_close_to_call": c} for e, c in zip(conf_errors, conf_close)]}
        if outcome is not None:
            out["trial_steps"] = plan.provenance["trial_steps"]
        json.dump(out, sys.stdout, indent=2, default=float)
        print()
        return 0
    from autopar.planner.plan_report import print_plan

    print_plan(console, graph, cluster, result, output=str(args.output), command=command, capture_s=capture_s,
               confidence=(conf_errors, conf_close, conf_why), left_out=left_out, headroom=options.memory_headroom,
               whole=whole_lines(whole, plan))
    (console.print if console is not None else print)(compile_choice.summary())
    if console is not None:          # (no markup: the install hint's [fp8] is text)
        console.print(float8_choice.summary(), markup=False)
    else:
        print(float8_choice.summary())
    (console.print if console is not None else print)(compression_choice.summary())
    if outcome is not None:
        from autopar.planner.trial_steps import summary_lines

        for line in summary_lines(outcome):
            console.print(line, markup=False, highlight=False)
    return 0


def _note_other_machine(cluster, profile: str | None) -> None:
    """On a CPU cluster, say so when its profile was measured on another kind of machine
    (core/host_match.py): the op rows are that processor's speed."""
    if cluster.backend != "gloo":
        return
    from autopar.core.errors import paragraph
    from autopar.core.host_match import advice, mismatch, op_processes
    from autopar.profiles import load_profile

    for name in sorted({profile or g.gpu for g in cluster.groups}):
        prof = load_profile(name)
        diff = mismatch(prof)
        if diff:
            print(paragraph(advice(name, diff, op_processes(prof))), file=sys.stderr)


def _check_trial_args(args) -> int:
    """The number of plans --trial-steps tries (checked before the search), and its outputs writable."""
    if args.trial_steps is None:
        if args.trial_plans is not None or args.trial_breakdown:
            raise UserError("--trial-plans and --trial-breakdown say how --trial-steps runs its trials; add "
                            "--trial-steps N, or drop them.")
        return 0
    if args.trial_steps < 1:
        raise UserError(f"--trial-steps is {args.trial_steps}; it must be a positive number of training steps.")
    from autopar.planner.trial_steps import DEFAULT_TRIAL_PLANS, trial_paths
    from autopar.core.output_file import check_writable

    k = DEFAULT_TRIAL_PLANS if args.trial_plans is None else args.trial_plans
    if k < 1:
        raise UserError(f"--trial-plans is {k}; it must be 1 or more.")
    if k > args.top_k + 1:
        raise UserError(f"--trial-plans is {k} but the search keeps only --top-k {args.top_k} runner-ups besides "
                        f"the winner; raise --top-k to {k - 1} or more.")
    folder, profile_out = trial_paths(args.output)
    check_writable(folder / "1" / "plan.json", "--trial-steps (trial folder)")
    check_writable(profile_out, "--trial-steps (calibrated profile)")
    return k


def _trial(result, conf_errors, cluster, args, trial_plans: int, provenance: dict):
    """Run the shortlist (planner/trial_steps.py) and put the kept plan first; returns the result,
    its validation marks in the new order and the TrialOutcome."""
    import contextlib

    from autopar.planner import confidence
    from autopar.planner.trial_steps import say_to, trial_shortlist

    stream = sys.stderr if args.json else sys.stdout       # --json keeps stdout for the JSON
    with contextlib.redirect_stdout(stream):               # a multi-node plan's commands (autopar run)
        outcome = trial_shortlist(result, conf_errors, cluster, steps=args.trial_steps, output=args.output,
                                  min_plans=trial_plans, provenance=provenance, profile=args.profile,
                                  say=say_to(stream), breakdown=args.trial_breakdown)
    kept = outcome.kept.evaluated
    if kept is not result.best:
        others = [ev for ev in [result.best] + list(result.runner_ups) if ev is not kept]
        result = replace(result, best=kept, runner_ups=others)
    _, errs, close, _ = confidence.apply(result, cluster, reorder=False)
    return result, errs, close, outcome


def check_kinds(graph, model_file: str, cluster, options, float8: bool = False):
    """What the runtime runs for this model (planner/runtime_check.py), at the tp degrees the
    cluster admits (``float8``: float8 linears too)."""
    from autopar.core.modelfile import load_model_file
    from autopar.planner.constraints import cluster_meshes
    from autopar.planner.runtime_check import find_executable

    meshes = cluster_meshes(options, cluster, len(graph.layers))
    degrees = tuple(sorted({m.tp for m in meshes if m.tp > 1} | ({options.degrees["tp"]} if options.degrees.get("tp", 1) > 1 else set())))
    return find_executable(graph, load_model_file(model_file), tp_degrees=degrees, precision=options.precision,
                           float8=float8)


MAX_PLAN_CHECKS = 12      # plans tried in order of predicted speed before giving up


def runnable_result(result, graph, model_file: str):
    """The search result with a best plan the runtime builds and runs (on fake ranks).

    The kinds were each checked alone; the pick combines them (a tp split with FSDP units and
    stage cuts), so it is checked whole.  A plan that fails gives way to the next fastest that
    fits; the failures are reported as left out.  Runner-ups are not checked."""
    from autopar.core.errors import UserError
    from autopar.core.modelfile import load_model_file
    from autopar.planner.runtime_check import LeftOut, whole_plan_error

    mf = load_model_file(model_file)
    refused: list[LeftOut] = []
    pool = [result.best] + list(result.runner_ups)
    for ev in pool[:MAX_PLAN_CHECKS]:
        err = whole_plan_error(ev.plan, graph, mf)
        if err is None:
            if ev is not result.best:
                result.runner_ups = [e for e in pool if e is not ev]
                result.best = ev
            return result, refused
        refused.append(LeftOut(f"plan {ev.plan.mesh.describe('{name}{size}', ' ')} zero{ev.plan.zero}", err))
    by_reason: dict[str, list[str]] = {}              # each distinct failure once, with its plans
    for x in refused:
        by_reason.setdefault(x.reason, []).append(x.kind)
    raise UserError("the runtime cannot run any of the fastest plans found for this model: "
                    + "; ".join(f"{', '.join(dict.fromkeys(kinds))}: {reason}" for reason, kinds in by_reason.items())
                    + ". Fix some knobs (--tp 1, --pp 1, --zero 0) to plan a simpler layout.")


def torchrun_hint(cluster, plan_path: str, world_size: int | None = None) -> str:
    """The torchrun line that runs the plan on every node it uses (c10d rendezvous across nodes).

    Ranks fill the cluster's devices in order, so a plan of ``world_size`` ranks uses the first
    nodes only."""
    world = cluster.world_size if world_size is None else world_size
    counts = cluster.ranks_per_node(world) or [world]
    nproc = counts[0] if len(set(counts)) == 1 else "GPUS_ON_THIS_NODE"
    parts = ["torchrun", f"--nproc-per-node {nproc}"]
    if len(counts) > 1:
        parts += [f"--nnodes {len(counts)}", "--rdzv-backend c10d", "--rdzv-endpoint HOST:PORT"]
    parts += ["-m autopar.runtime", plan_path]
    return " ".join(parts)


def _priced(ev, cluster, cost_models, graphs: dict):
    """``ev`` with the figures ``autopar simulate`` gives its plan: the model captured at the
    plan's micro-batch (``graphs``: by batch size, shared between plans) on the cluster less the
    plan's headroom (simulator/plan_price.py)."""
    from autopar.simulator.api import price_plan

    res = price_plan(ev.plan, cluster, cost_models, graph=_plan_graph(ev.plan, graphs))
    return replace(ev, plan=ev.plan.with_predicted(res.predicted_dict()), result=res)


def _plan_graph(plan, graphs: dict):
    """The model captured at ``plan``'s micro-batch, once per batch size (``graphs``)."""
    from autopar.simulator.api import plan_graph

    mb = plan.micro_batch
    if mb not in graphs:
        graphs[mb] = plan_graph(plan)
    return graphs[mb]


def _priced_choice(choice, plan, cluster, cost_models, graphs: dict):
    """The compile choice with both of its step times priced as plan.json's figures are
    (``_priced``): the chosen one is then the plan's predicted step."""
    from autopar.simulator.api import price_plan

    graph = _plan_graph(plan, graphs)
    eager = price_plan(replace(plan, compile=False), cluster, cost_models, graph=graph).step_time_s
    # a split-backward schedule cannot run compiled (compile_choice.choose_compile): its eager step
    refused = plan.mesh.pp > 1 and split_backward_problem(plan.pipeline.schedule, "none", 0, "none", True)
    compiled = eager if refused else price_plan(replace(plan, compile=True), cluster, cost_models,
                                                graph=graph).step_time_s
    return replace(choice, eager_step_s=eager, compiled_step_s=compiled)


def _priced_float8(choice, plan, cluster, cost_models, graphs: dict):
    """The float8 choice with both of its step times priced as plan.json's figures are
    (``_priced``): the plan as chosen and with every layer in bf16.  Its layers are the written
    plan's (the validation order or the runtime check may have kept another of the kept plans)."""
    layers = tuple(lp.layer for lp in plan.layers if lp.precision == "fp8")
    if layers != choice.layers:
        choice = replace(choice, layers=layers, why=choice.why if layers else
                         f"{choice.why} for the fastest plan; the plan kept after validation and the runtime check "
                         f"has none")
    if not choice.on:
        return choice
    from autopar.planner.float8_choice import with_fp8
    from autopar.simulator.api import price_plan

    graph = _plan_graph(plan, graphs)
    bf16, fp8 = (price_plan(p, cluster, cost_models, graph=graph).step_time_s for p in (with_fp8(plan, ()), plan))
    return replace(choice, bf16_step_s=bf16, fp8_step_s=fp8)


def _difference(best, ev) -> str:
    from autopar.planner.candidate import describe_difference

    return describe_difference(best.candidate, ev.candidate)


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(stderr=False)


def _search_with_progress(console, graph, cluster, cost_models, options):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from autopar.planner.search import search

    with Progress(TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=max(1, total))
            bar.update(tasks[phase], completed=min(done, total), total=max(1, total))

        return search(graph, cluster, cost_models, options, progress=progress)
