"""``autopar.plan(model, cluster, global_batch, ...)``: search for the fastest plan that fits the
cluster, as a Python function (``autopar plan`` prints what it returns).

    import autopar
    out = autopar.plan("examples/gpt.py", "dgx-a100-1x8", 32, model_args={"size": "gpt2-small"},
                       output="plan.json")
    print(out.plan.mesh.describe(), out.plan.predicted["step_time_s"])

The steps, each a function below:

1. ``_options``   -- the search's options from the arguments (precision, fixed knobs, schedules);
2. ``_capture``   -- the model on the meta device, less the micro-batch sizes it cannot take;
3. ``_kinds``     -- what the runtime runs for this model, applied on fake ranks (planner/runtime_check.py);
4. ``_choose``    -- the search, then compile, float8 and the gradient compression on its plans,
   the validation order, and the first plan the runtime runs whole;
5. ``_provenance`` -- what plan.json records of how it was made;
6. ``written_figures.price_written`` -- every kept plan priced as ``autopar simulate plan.json``
   prices it;
7. ``trial_steps.trial_shortlist`` -- optionally, the shortlist measured (``trial_steps``);
8. ``_final_plan`` -- the plan as written, with the layers tp leaves whole noted.

Nothing is printed: ``progress(phase, done, total)`` follows the search, ``say(text, end=)`` the
trials and ``warn(text)`` takes advice (a profile measured on another machine; default: the
``autopar`` logger).  Bad input raises ``UserError``; no plan fits: ``NoFeasiblePlanError`` (exit 3).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from autopar.core.errors import UserError
from autopar.core.rules import SPLIT_BACKWARD_SCHEDULES, split_backward_problem
from autopar.planner.headroom import DEFAULT_MEMORY_HEADROOM


@dataclass
class PlanOutcome:
    """What ``plan`` found: the plan (as written to ``output``), the search result (its best is
    ``plan``; runner-ups priced the same way), and what the summary shows of how it was chosen."""
    plan: Any                            # core.plan.Plan
    result: Any                          # planner.search.SearchResult
    graph: Any                           # the captured model (core.graph.OpGraph)
    cluster: Any
    output: str | None                   # the plan file written (None: not written)
    command: str | None                  # the torchrun line that runs it (None: no file to name)
    capture_s: float
    headroom: float
    compile_choice: Any                  # planner.compile_choice.CompileChoice
    float8_choice: Any                   # planner.float8_choice.Float8Choice
    compression_choice: Any              # planner.compression_choice's choice of the gradient compression
    validation: tuple                    # (family errors, too close to call, why the order) per plan
    left_out: list = field(default_factory=list)
    whole: list = field(default_factory=list)     # planner.whole_layers.WholeLayer
    trial: Any = None                    # planner.trial_steps.TrialOutcome, with trial_steps=

    def to_dict(self) -> dict:
        """``autopar plan --json``'s object."""
        from autopar.planner.candidate import describe_difference

        best = self.result.best
        errors, close, why = self.validation
        out = {"plan": self.plan.to_dict(), "output": str(self.output), "torchrun": self.command,
               "capture_s": round(self.capture_s, 3),
               "runner_ups": [{"predicted": dict(ev.plan.predicted), "mesh": ev.plan.to_dict()["mesh"],
                               "difference": describe_difference(best.candidate, ev.candidate)}
                              for ev in self.result.runner_ups]}
        out["compile"] = self.compile_choice.summary()
        out["float8"] = self.float8_choice.summary()
        out["grad_compression"] = self.compression_choice.summary()
        out["validation"] = {"why": why, "plans": [  # best first, then the runner-ups
            {"family_error": e.__dict__ if e else None, "too_close_to_call": c} for e, c in zip(errors, close)]}
        if self.trial is not None:
            out["trial_steps"] = self.plan.provenance["trial_steps"]
        return out


@dataclass
class _Job:
    """The inputs every step reads: the request as given and what was loaded from it."""
    model_file: str
    cluster_arg: str | None              # the cluster file or name given; None: a Cluster object
    nodes: int | None
    cluster: Any
    cost_models: dict
    options: Any = None                  # planner.search.PlanOptions
    fp8_flag: str | None = None          # "bf16" / "fp8" when the precision was given as one of them
    recipe: str = "tensorwise"
    compile: bool | None = None
    grad_compression: Any = None         # the fixed gradient compression (core.cli_types.grad_compression), or None
    allow_lossy: bool = False            # the planner may choose PowerSGD
    graph: Any = None
    executable: Any = None               # planner.runtime_check.Executable; None: not checked
    left_out: list = field(default_factory=list)


def plan(model: str | Path, cluster, global_batch: int, *, model_args: Mapping | None = None,
         batch_size: int = 8, nodes: int | None = None, algo: str = "auto", seed: int = 0,
         time_budget: float = 40.0, precision: str | None = None, fp8_recipe: str = "tensorwise",
         profile: str | None = None, top_k: int = 3, degrees: Mapping[str, int | None] | None = None,
         ep: int | None = None, zero: int | None = None, recompute: str | None = None, offload: str | None = None,
         micro_batch: int | None = None, schedule: str | None = None, compile: bool | None = None,
         memory_headroom: float = DEFAULT_MEMORY_HEADROOM, grad_clip: bool = False, grad_compression=None,
         allow_lossy_compression: bool = False, runtime_check: bool = True,
         trial_steps: int | None = None, trial_plans: int | None = None, trial_breakdown: bool = False,
         output: str | Path | None = None, progress: Callable[[str, int, int], None] | None = None,
         say: Callable[..., None] | None = None, warn: Callable[[str], None] | None = None) -> PlanOutcome:
    """The fastest plan found for the model file ``model`` (built with ``model_args``, captured
    at ``batch_size``) on ``cluster`` (a cluster file, a bundled cluster's name or a
    ``core.cluster.Cluster``; ``nodes``: rescaled) at ``global_batch`` samples per step.  The knobs given (``degrees``: axis name ->
    degree, ``ep``, ``zero``, ``recompute``, ``offload``, ``micro_batch``, ``schedule``,
    ``compile``) are fixed, the search chooses the rest; the arguments are ``autopar plan``'s
    flags (docs/planner.md).  ``output``: write plan.json there (checked writable first)."""
    from autopar.core.cluster import Cluster, load_cluster
    from autopar.core.output_file import check_not_read, check_writable
    from autopar.core.plan import save_plan
    from autopar.simulator.api import CostModel

    _import_search()                                  # its import is not counted as capture time
    t0 = time.perf_counter()
    given = isinstance(cluster, Cluster)              # a Cluster object: none to load, none to record
    if output is not None:
        check_writable(output, "-o")                  # before the search, not after it
        check_not_read(output, "-o", {"model file": model, "cluster file": None if given else cluster})
    elif trial_steps is not None:
        raise UserError("trial_steps writes each trial's plan beside the plan file; give output= too.")
    trial_plans = _check_trial_args(trial_steps, trial_plans, trial_breakdown, top_k, output)
    if given:
        the_cluster = cluster if nodes is None else cluster.scaled(nodes)
    else:
        the_cluster = load_cluster(str(cluster), nodes=nodes)
    cost_models = {g.gpu: CostModel.from_profile(profile or g.gpu) for g in the_cluster.groups}
    if grad_clip:                # every plan priced as a clipped run (simulator/optimizer_step.py)
        cost_models = {k: cm.for_code(replace(cm.code, grad_clip=True)) for k, cm in cost_models.items()}
    _note_other_machine(the_cluster, profile, warn or logging.getLogger("autopar").warning)
    job = _Job(str(model), None if given else str(cluster), nodes, the_cluster, cost_models, recipe=fp8_recipe,
               compile=compile, grad_compression=grad_compression, allow_lossy=allow_lossy_compression)
    _options(job, global_batch=global_batch, algo=algo, seed=seed, time_budget=time_budget, precision=precision,
             top_k=top_k, degrees=degrees or {}, ep=ep, zero=zero, recompute=recompute, offload=offload,
             micro_batch=micro_batch, schedule=schedule, memory_headroom=memory_headroom)
    _capture(job, dict(model_args or {}), batch_size)
    capture_s = time.perf_counter() - t0
    _kinds(job, runtime_check)
    result, compile_choice, float8_choice, compression_choice, validation = _choose(job, progress)
    provenance = _provenance(job, result, compile_choice, float8_choice, compression_choice)
    from autopar.planner.written_figures import price_written

    result, compile_choice, float8_choice, graphs = price_written(result, compile_choice, float8_choice, job.graph,
                                                                  job.cluster, job.cost_models,
                                                                  job.options.memory_headroom)
    provenance["compile_choice"] = compile_choice.to_dict()
    provenance["float8_choice"] = float8_choice.to_dict()
    trial = None
    if trial_steps is not None:
        result, validation, trial = _trial(job, result, validation, trial_steps, trial_plans, trial_breakdown,
                                           provenance, output, profile, say)
    the_plan, whole = _final_plan(job, result, provenance, graphs, grad_clip, trial, trial_steps)
    result.best = replace(result.best, plan=the_plan)
    command = None
    if output is not None:
        from autopar.core.output_file import is_special

        save_plan(the_plan, output)
        # a device (-o /dev/null) keeps nothing to run: no command names it
        command = None if is_special(output) else torchrun_hint(job.cluster, str(output), the_plan.world_size)
    return PlanOutcome(the_plan, result, job.graph, job.cluster, None if output is None else str(output), command,
                       capture_s, job.options.memory_headroom, compile_choice, float8_choice, compression_choice,
                       validation, job.left_out, whole, trial)


def _import_search() -> None:
    """Import the capture and the search (numpy, the simulator, the solvers) before the clock
    that times the capture starts."""
    import autopar.core.capture  # noqa: F401
    import autopar.planner.search  # noqa: F401


def _options(job: _Job, *, global_batch, algo, seed, time_budget, precision, top_k, degrees, ep, zero, recompute,
             offload, micro_batch, schedule, memory_headroom) -> None:
    """The search's options (``job.options``): the precision (``fp8``: a bf16 plan whose layers
    train their linears in float8), the fixed knobs, and the schedules those knobs leave."""
    from autopar.core.parallel_dims import DEGREE_NAMES
    from autopar.planner.search import PlanOptions

    # --precision fp8 is a bf16 plan whose layers train their linears in float8
    job.fp8_flag = precision if precision in ("bf16", "fp8") else None
    precision = "bf16" if precision == "fp8" else (precision or ("fp32" if job.cluster.backend == "gloo" else "bf16"))
    if top_k < 0:
        raise UserError(f"--top-k is {top_k}; it must be 0 or more.")
    unknown = sorted(set(degrees) - set(DEGREE_NAMES))
    if unknown:
        raise UserError(f"degrees names {', '.join(map(repr, unknown))}, which is not a parallel axis; the axes are "
                        f"{', '.join(DEGREE_NAMES)}.")
    options = PlanOptions(global_batch=global_batch, algo=algo, seed=seed, time_budget_s=time_budget,
                          precision=precision, top_k=top_k,
                          degrees={n: v for n in DEGREE_NAMES if (v := degrees.get(n)) is not None},   # --dp, --tp
                          ep=ep, zero=zero, offload=offload, micro_batch=micro_batch, fixed_schedule=schedule,
                          memory_headroom=memory_headroom)
    if recompute is not None:
        options = replace(options, recompute=(recompute,))
    if schedule is not None:
        options = replace(options, schedules=(schedule,))
        problem = split_backward_problem(schedule, recompute or "none", zero or 0, offload or "none", bool(job.compile))
        if problem:
            raise UserError(f"--schedule {schedule} with the knobs given cannot run: {problem}.")
    elif job.compile:       # torch's split-backward classes refuse compiled stages (core/rules.py)
        options = replace(options, schedules=tuple(s for s in options.schedules if s not in SPLIT_BACKWARD_SCHEDULES))
    options.check()
    from autopar.planner.compression_choice import constrain_for

    job.options = constrain_for(job.grad_compression, options)


def _capture(job: _Job, model_args: dict, batch_size: int) -> None:
    """The model captured on the meta device (``job.graph``); the micro-batch sizes it cannot
    take leave the search, noted as left out."""
    from autopar.core.capture import capture_model_file
    from autopar.core.modelfile import load_model_file
    from autopar.planner.micro_batches import refuse_micro_batches

    job.graph = capture_model_file(job.model_file, model_args, batch_size)
    job.options, notes = refuse_micro_batches(job.options, job.graph, load_model_file(job.model_file))
    job.left_out += notes


def _kinds(job: _Job, runtime_check: bool) -> None:
    """``job.executable``: what the runtime runs for this model (float8 linears too where they
    can train here and were not refused), unless ``runtime_check`` is off; the options then
    hold only what the runtime runs and the fixed knobs (planner/constraints.py)."""
    from autopar.planner.constraints import constrain
    from autopar.planner.float8_choice import fp8_unavailable

    float8_why_not = fp8_unavailable(job.cluster, job.cost_models, job.options.precision)
    if job.fp8_flag == "fp8" and float8_why_not is not None:
        raise UserError(f"--precision fp8 asks for float8 linears, but {float8_why_not}. Plan with --precision "
                        f"bf16, or on a cluster of Hopper-class GPUs with torchao installed.")
    if runtime_check:
        from autopar.planner.runnable import check_kinds

        job.executable = check_kinds(job.graph, job.model_file, job.cluster, job.options,
                                     float8=float8_why_not is None and job.fp8_flag != "bf16")
        job.left_out += list(job.executable.left_out)
    job.options = constrain(replace(job.options, executable=job.executable), job.graph, job.cluster)


def _choose(job: _Job, progress):
    """The search, then compile, float8 and the gradient compression decided on its plans, the
    validation order (planner/confidence.py) and the first plan the runtime runs whole; returns
    the result, the three choices and (family errors, too close to call, why the order)."""
    from autopar.planner import confidence
    from autopar.planner.compile_choice import choose_compile
    from autopar.planner.compression_choice import choose_compression
    from autopar.planner.float8_choice import choose_float8
    from autopar.planner.parallel_notes import axis_notes
    from autopar.planner.search import search

    graph, cluster, cms, options = job.graph, job.cluster, job.cost_models, job.options
    result = search(graph, cluster, cms, options, progress=progress)
    result, compile_choice = choose_compile(result, graph, cluster, cms, job.compile, options.memory_headroom)
    result, float8_choice = choose_float8(result, graph, cluster, cms, job.fp8_flag, options.precision,
                                          job.executable, options.memory_headroom, recipe=job.recipe)
    result, compression_choice = choose_compression(result, graph, cluster, cms, job.grad_compression,
                                                    job.allow_lossy, options.memory_headroom)
    # each plan's family validation error; a better-validated plan within the band goes first
    # (planner/confidence.py), and the runtime check then takes the first plan it can run
    result, _, _, why = confidence.apply(result, cluster)
    preferred = result.best
    if job.executable is not None:
        from autopar.planner.runnable import runnable_result

        result, refused = runnable_result(result, graph, job.model_file)
        job.left_out += refused
    job.left_out += axis_notes(graph, result, options)
    _, errors, close, _ = confidence.apply(result, cluster, reorder=False)
    if result.best is not preferred:
        why = "the better-validated plan was refused by the runtime check (see left out)"
    return result, compile_choice, float8_choice, compression_choice, (errors, close, why)


def _provenance(job: _Job, result, compile_choice, float8_choice, compression_choice) -> dict:
    """What plan.json records of how it was made: the cluster to load again (autopar report /
    simulate re-price the plan with it), the headroom, the runtime check and what it applied on
    the meta model, what was left out, the compile and float8 choices."""
    best = result.best.plan
    compile_note = ""
    float8_record = None
    if job.executable is not None and (best.compile or best.uses_fp8):
        from autopar.core.modelfile import load_model_file
        from autopar.runtime.meta_apply import compile_blocks, float8_conversion

        if best.compile:
            blocks = compile_blocks(best, job.graph, load_model_file(job.model_file))
            compile_note = f"; compile wrapper applied to {len(blocks)} blocks on the meta model (no compiled forward)"
        if best.uses_fp8:
            float8_record = float8_conversion(best, job.graph, load_model_file(job.model_file))
            compile_note += f"; {float8_record.summary()} (torchao's conversion on the meta model)"
    ref = job.cluster_arg
    if ref is not None and Path(ref).is_file():
        ref = str(Path(ref).resolve())
    ex = job.executable
    provenance = dict(cluster_ref=ref, cluster_nodes=job.nodes, memory_headroom=job.options.memory_headroom,
                      runtime_check="skipped (--no-runtime-check)" if ex is None else
                      f"kinds applied on fake ranks in {ex.check_s:.1f} s; the plan itself too" + compile_note,
                      left_out=[x.to_dict() for x in job.left_out], compile_choice=compile_choice.to_dict(),
                      float8_choice=float8_choice.to_dict(), grad_compression_choice=compression_choice.to_dict())
    if float8_record is not None:
        provenance["float8_conversion"] = float8_record.to_dict()
    # the best plan carries it before it is priced as written (written_figures.price_written)
    result.best = replace(result.best, plan=best.with_predicted(best.predicted, **provenance))
    return provenance


def _trial(job: _Job, result, validation, steps: int, min_plans: int, breakdown: bool, provenance: dict, output,
           profile, say):
    """Run the shortlist (planner/trial_steps.py) and put the kept plan first; returns the result,
    its validation marks in the new order and the TrialOutcome."""
    from autopar.planner import confidence
    from autopar.planner.trial_steps import say_to, trial_shortlist

    errors, _, why = validation
    outcome = trial_shortlist(result, errors, job.cluster, steps=steps, output=output, min_plans=min_plans,
                              provenance=provenance, profile=profile, say=say or say_to(),
                              breakdown=breakdown)
    kept = outcome.kept.evaluated
    if kept is not result.best:
        others = [ev for ev in [result.best] + list(result.runner_ups) if ev is not kept]
        result = replace(result, best=kept, runner_ups=others)
    _, errors, close, _ = confidence.apply(result, job.cluster, reorder=False)
    if outcome.kept.index != 1:
        why = (f"trial {outcome.kept.index} measured the fastest step of the trials "
               f"({1e3 * outcome.kept.measured_s:.1f} ms)")
    return result, (errors, close, why), outcome


def _final_plan(job: _Job, result, provenance: dict, graphs: dict, grad_clip: bool, trial, trial_steps):
    """The plan as written: its provenance, clipping, the trials, and the layers tp leaves whole
    (planner/whole_layers.py); returns it with those layers."""
    from autopar.planner.whole_layers import whole_layers
    from autopar.planner.written_figures import captured_for

    plan = result.best.plan.with_predicted(result.best.plan.predicted, **provenance)
    if grad_clip:
        plan = replace(plan, grad_clip=True)
    if trial is not None:
        from autopar.planner.trial_steps import trial_provenance

        plan = plan.with_predicted(plan.predicted, trial_steps=trial_provenance(trial, trial_steps))
    whole = whole_layers(plan, captured_for(plan, graphs), job.cluster, job.cost_models, job.executable, job.left_out,
                         fixed="tp" in job.options.degrees)
    if whole:
        plan = plan.with_predicted(plan.predicted, whole_layers=[w.to_dict() for w in whole])
    return plan, whole


def _note_other_machine(cluster, profile: str | None, warn: Callable[[str], None]) -> None:
    """On a CPU cluster, say so when its profile was measured on another kind of machine
    (core/host_match.py): the op rows are that processor's speed."""
    if cluster.backend != "gloo":
        return
    from autopar.core.host_match import advice, mismatch, op_processes
    from autopar.profiles import load_profile

    for name in sorted({profile or g.gpu for g in cluster.groups}):
        prof = load_profile(name)
        diff = mismatch(prof)
        if diff:
            warn(advice(name, diff, op_processes(prof)))


def _check_trial_args(steps: int | None, plans: int | None, breakdown: bool, top_k: int, output) -> int:
    """The number of plans ``trial_steps`` tries (checked before the search), and its outputs writable."""
    if steps is None:
        if plans is not None or breakdown:
            raise UserError("--trial-plans and --trial-breakdown say how --trial-steps runs its trials; add "
                            "--trial-steps N, or drop them.")
        return 0
    if steps < 1:
        raise UserError(f"--trial-steps is {steps}; it must be a positive number of training steps.")
    from autopar.core.output_file import check_writable
    from autopar.planner.trial_steps import DEFAULT_TRIAL_PLANS, trial_paths

    k = DEFAULT_TRIAL_PLANS if plans is None else plans
    if k < 1:
        raise UserError(f"--trial-plans is {k}; it must be 1 or more.")
    if k > top_k + 1:
        raise UserError(f"--trial-plans is {k} but the search keeps only --top-k {top_k} runner-ups besides "
                        f"the winner; raise --top-k to {k - 1} or more.")
    folder, profile_out = trial_paths(output)
    check_writable(folder / "1" / "plan.json", "--trial-steps (trial folder)")
    check_writable(profile_out, "--trial-steps (calibrated profile)")
    return k


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
