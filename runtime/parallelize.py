"""Turn a checked plan into this rank's model parts, optimizers and pipeline schedule.

The order (one place, the same for every plan; torchtitan's order):

1. build the model on the meta device (no memory);
2. pipeline: cut it into stage modules at the plan's layer boundaries and keep this rank's
   stages (stage i on pp rank i % pp) -- ``apply_pp.split_into_stages``;
2b. float8: the linears of the ``precision: fp8`` layers become torchao's ``Float8Linear``
   -- ``apply_fp8`` (first, as torchtitan converts before parallelising: every later step wraps
   the converted modules; the FSDP2 float8 all-gather is set here for step 5);
3. tensor (+ sequence) parallelism on each local stage -- ``apply_tp.apply_tp``;
3b. expert parallelism (``mesh.ep`` > 1): each rank keeps E/ep of every layer's routed experts
   and exchanges tokens by all-to-all -- ``apply_ep.apply_ep`` (after TP, which leaves the
   experts to it; before recompute, so the recomputed forward exchanges again, and before
   FSDP2, which shards the experts over the ranks holding the same ones -- step 5); under a
   pipeline on each stage, for the experts it calls (``apply_ep.stages_hold_experts``);
4. recompute wrappers per layer -- ``recompute.apply_recompute`` (after TP so the recomputed
   forward is the parallel one);
4b. with ``plan.compile``: ``torch.compile`` of each block's forward -- ``apply_compile`` (after
   TP and recompute so both are inside the compiled region, before FSDP2/DDP whose hooks stay
   outside it);
5. FSDP2 per layer + root for ZeRO-2/3 (the experts of step 3b first, as their own units over
   the ranks that hold the same experts: ``apply_ep.shard_expert_weights``) (+ CPU offload, mixed precision) -- ``apply_dp.apply_fsdp``
   (still on meta: every rank only ever allocates its shards); with tensor parallelism, ZeRO-0
   runs as ``replicate`` here and ZeRO-1 as FSDP2 without reshard, and the same under pipelining
   (``apply_dp.data_parallel_kind``);
6. materialise: ``to_empty`` on the device, values from the init source -- ``materialize``;
6b. tensor parallelism without FSDP2: the post-accumulate hooks that keep a row-wise
   embedding's gradient sharded -- ``apply_tp.keep_embedding_grads_sharded`` (on the
   materialised parameters, whose hooks ``to_empty`` would drop);
7. DDP for ZeRO-0/1 over the dp axis -- ``apply_dp.apply_ddp`` (needs real parameters), with the
   plan's gradient compression as a communication hook (FSDP2 takes it as ``reduce_dtype``, step 5);
8. AdamW per part (ZeroRedundancyOptimizer for ZeRO-1) and the pipeline schedule.

Mixed precision without FSDP (DDP, ZeRO-1, TP alone) runs the forward under ``torch.autocast``
with fp32 master weights (FSDP2's ``MixedPrecisionPolicy`` is FSDP-only).
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from autopar.core.errors import PlanFileError
from autopar.core.plan import Plan
from autopar.runtime.apply_compile import apply_compile
from autopar.runtime.apply_cp import ContextParallel
from autopar.runtime.apply_dp import (LOW_PRECISION, apply_ddp, apply_fsdp, apply_replicate, build_optimizer,
                                      data_parallel_kind)
from autopar.runtime.apply_ep import apply_ep, build_expert_parallel, shard_expert_weights, stages_hold_experts
from autopar.runtime.apply_fp8 import Float8Record
from autopar.runtime.apply_pp import build_schedule, runnable_schedule, split_into_stages
from autopar.runtime.apply_tp import apply_tp, keep_embedding_grads_sharded, resolve_tp_styles
from autopar.runtime.materialize import build_meta_model, choose_source, materialize
from autopar.runtime.mesh import RankContext
from autopar.runtime.options import ADAM_EPS, RunOptions
from autopar.runtime.nvme_tier import NvmeStates, attach_nvme_tier
from autopar.runtime.plan_check import CheckedPlan, LayerSpec
from autopar.runtime.recompute import apply_recompute, wrap_for_recompute
from autopar.runtime.state_names import StateNames
from autopar.runtime.ties import TieGroup, TiedGradSum, find_ties, retie, untie_across_stages


@dataclass
class ParallelModel:
    parts: list[nn.Module]                       # this rank's stage modules (or the whole model)
    stage_indices: list[int]
    optimizers: list[torch.optim.Optimizer]
    schedule: object | None                      # a pipelining schedule when pp > 1
    init_mode: str
    uses_fsdp: bool
    uses_ddp: bool
    autocast_dtype: torch.dtype | None
    dp_kind: str = "ddp"
    num_stages: int = 1
    has_first_stage: bool = True
    has_last_stage: bool = True
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # sums the gradients of tied parameters copied onto several pipeline stages (runtime.ties)
    tied_grad_sum: Callable[[list[nn.Module]], None] | None = None
    # the checkpoint's key of every state-dict entry of the parts (runtime.state_names)
    state_names: StateNames = field(default_factory=StateNames)
    # the sequence split and attention of context parallelism (runtime.apply_cp); None when cp = 1
    cp: ContextParallel | None = None
    # the float8 conversion (runtime.apply_fp8) of this rank's parts; None when no layer is fp8
    float8: Float8Record | None = None
    # called after every optimizer step (the FSDP2 float8 all-gather's scales); None when not needed
    after_optimizer_step: Callable[[], None] | None = None
    # the optimizer states on the NVMe tier (runtime.nvme_tier), one per part that has any
    nvme: list[NvmeStates] = field(default_factory=list)
    # PowerSGD's hook and state (runtime.powersgd_state), which checkpoints keep; None without it
    powersgd: object | None = None


def stage_of_layers(plan: Plan) -> list[int]:
    out = [0] * len(plan.layers)
    for s in plan.pipeline.stages:
        for layer in s.layers:
            out[layer] = s.index
    return out


def _modules_of(part: nn.Module, layer: LayerSpec) -> list[str]:
    names = {n for n, _ in part.named_modules()}
    return [p for p in layer.module_paths if p and p in names]


def _with_params(part: nn.Module, paths: list[str]) -> list[str]:
    return [p for p in paths if any(True for _ in part.get_submodule(p).parameters())]


def layer_module_paths(part: nn.Module, held: list[LayerSpec]) -> list[list[str]]:
    """Each held layer's modules inside ``part`` that are units of their own: a module that
    contains another listed module (a parent such as ``model`` or ``encoder`` that capture
    lists with the embeddings) is left out -- wrapping it would wrap its blocks twice (FSDP2
    refuses overlapping units) --, and a module listed by two layers belongs to the first."""
    per_layer = [_modules_of(part, layer) for layer in held]
    every = {p for paths in per_layer for p in paths}
    claimed: set[str] = set()
    out = []
    for paths in per_layer:
        own = [p for p in paths if p not in claimed and not any(q.startswith(p + ".") for q in every)]
        claimed.update(own)
        out.append(own)
    return out


def _untie_units(part: nn.Module, units: list[list[str]], ties: list[TieGroup]) -> list[list[str]]:
    """Leave out of each FSDP unit the modules holding a tied parameter whose other names lie
    outside the unit: FSDP2 manages a shared parameter in one group only, so the root unit
    (which holds every module left out of the units) takes it."""
    def names_under(path: str) -> set[str]:
        return {f"{path}.{n}" for n, _ in part.get_submodule(path).named_parameters(remove_duplicate=False)}

    out = []
    for paths in units:
        inside = set().union(*(names_under(p) for p in paths)) if paths else set()
        split = {n for g in ties if inside & set(g) and not set(g) <= inside for n in g}
        out.append([p for p in paths if not names_under(p) & split])
    return out


def parallelize_part(part: nn.Module, held: list[LayerSpec], checked: CheckedPlan, ctx: RankContext,
                     dp_kind: str, ties: list[TieGroup] = (), float8: list[Float8Record] | None = None,
                     cp: ContextParallel | None = None) -> nn.Module:
    """Steps 2b-5 on one stage module (or the whole model); returns it still on meta.  The
    float8 conversion's record is appended to ``float8`` when given; ``cp``: the model's context
    parallelism, whose mode a recomputed layer's rerun enters (made from ``part`` if not given)."""
    plan = checked.plan
    ties = list(ties)
    unit_paths = layer_module_paths(part, held)
    styles = []
    if plan.mesh.tp > 1:
        for layer in held:
            mods = _modules_of(part, layer)
            path = mods[0] if len(layer.module_paths) == 1 and mods else ""
            where = f"plan file {checked.plan_path}: layers[{layer.index}].tp"
            styles.append((path, resolve_tp_styles(part, layer.name, layer.plan.tp_styles, where)))
    # 2b. float8 linears (before every step that wraps modules)
    if plan.uses_fp8:
        from autopar.runtime.apply_fp8 import apply_fp8

        record = apply_fp8(part, [(paths, plan.layer_precision(layer.index), layer.plan.offload)
                                  for paths, layer in zip(unit_paths, held)],
                           plan.fp8_recipe, fsdp=dp_kind == "fsdp", compile=plan.compile,
                           tp_split={f: s for _, split in styles for f, s in split.items()}, tp=plan.mesh.tp)
        retie(part, ties)             # a converted module is a new module: re-point tied weights
        if float8 is not None:
            float8.append(record)
    # 3. tensor / sequence parallelism
    if plan.mesh.tp > 1:
        apply_tp(part, ctx.get_mesh("tp"), styles, plan.mesh.sequence_parallel)
        retie(part, ties)             # parallelize_module gives each module its own parameter
    # 3b. expert parallelism
    experts = None
    if plan.mesh.ep > 1:
        experts = apply_ep(part, build_expert_parallel(ctx.get_mesh("grad"), plan.mesh.ep,
                                                       plan.mesh.ep_group(ctx.rank)),
                           plan, f"plan file {checked.plan_path}")
    # 4. recompute (under context parallelism the rerun in backward enters its attention mode too)
    recomputes = [(paths, layer.plan.recompute) for paths, layer in zip(unit_paths, held)]
    rerun_under, rerun_groups = None, ()
    if plan.mesh.cp > 1 and any(mode != "none" for _, mode in recomputes):
        cp_rerun = cp or ContextParallel(ctx, plan.mesh.cp, checked.graph.seq_len, part)
        # ... and a selective one gathers K/V again rather than keep them (runtime/recompute.py)
        rerun_under, rerun_groups = cp_rerun.rerun_mode, (cp_rerun.group.group_name,)
    apply_recompute(part, recomputes, rerun_under, rerun_groups)
    # 4b. regional compile of the blocks (not "pre"/"post")
    if plan.compile:
        apply_compile(part, [paths for paths, layer in zip(unit_paths, held) if layer.name not in ("pre", "post")])
    # 5. FSDP2 (ZeRO-2/3), or replicate (DDP of a TP model)
    fsdp_paths = _untie_units(part, [_with_params(part, paths) for paths in unit_paths], ties)
    units = [(paths, layer.plan.zero, layer.plan.offload) for paths, layer in zip(fsdp_paths, held)]
    units = [u for u in units if u[0]]
    if experts is not None:
        def layer_of(module: nn.Module) -> tuple[int, str]:
            for paths, layer in zip(unit_paths, held):
                if any(m is module for p in paths for m in part.get_submodule(p).modules()):
                    return layer.plan.zero, layer.plan.offload
            return held[0].plan.zero, held[0].plan.offload
        shard_expert_weights(part, experts, dp_kind, layer_of, plan.precision, ctx.device)
    if dp_kind == "fsdp":
        root = held[0].plan
        apply_fsdp(part, ctx.get_mesh("grad"), units, root_zero=root.zero, root_offload=root.offload,
                   precision=plan.precision, device=ctx.device, grad_compression=plan.grad_compression)
    elif dp_kind == "replicate":
        apply_replicate(part, ctx.get_mesh("grad"), [u[0] for u in units], plan.precision,
                        plan.grad_compression)
    return part


def batch_norm_warnings(model: nn.Module, dp: int, num_microbatches: int, micro_batch: int) -> list[str]:
    """BatchNorm normalises by the statistics of the batch its forward sees: under data
    parallelism or micro-batching that is one micro-batch on one rank, not the global batch,
    so training differs from one process over the global batch (and the running statistics
    differ between ranks; DDP copies rank 0's at each forward)."""
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms or dp * num_microbatches == 1:
        return []
    return [f"the model has {len(norms)} BatchNorm module(s) ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}): "
            f"with dp = {dp} and {num_microbatches} micro-batch(es) their batch statistics are computed per rank "
            f"and per micro-batch ({micro_batch} samples), not over the global batch of "
            f"{dp * num_microbatches * micro_batch}. Convert them to nn.SyncBatchNorm in build_model (GPUs) for "
            f"statistics over the data-parallel ranks, or use a normalisation that does not mix samples "
            f"(GroupNorm, LayerNorm)."]


def parallelize_export_stage(part: nn.Module, held: list[LayerSpec], checked: CheckedPlan, ctx: RankContext,
                             dp_kind: str, cp: ContextParallel | None = None) -> nn.Module:
    """Steps 3-5 on a pipeline stage cut from the ``torch.export`` graph (``apply_pp``): its ops
    call no module of the model, so module-level transformations apply to the stage as a whole
    -- recompute wraps the stage (its rerun under ``cp``'s mode where given), FSDP2 shards it as
    one unit -- and tensor parallelism, which replaces ``nn.Linear`` modules' forwards, cannot
    apply.  The routed experts are the exception (runtime/expert_calls.py): the stage calls their
    modules, so expert parallelism splits them and FSDP2 / replicate takes them as units of their
    own, as on an fx-cut stage."""
    plan = checked.plan
    if plan.mesh.tp > 1:
        raise PlanFileError(
            f"plan file {checked.plan_path}: tp = {plan.mesh.tp} with pp = {plan.mesh.pp}, but torch.fx cannot trace "
            f"this model's forward, so its pipeline stages are cut from the torch.export graph, whose ops call no "
            f"nn.Linear module that tensor parallelism could split. Plan tp = 1 with pp > 1 for this model, or pp = 1.")
    # expert parallelism: the stage calls its experts modules (runtime/expert_calls.py)
    experts = None
    if plan.mesh.ep > 1:
        experts = apply_ep(part, build_expert_parallel(ctx.get_mesh("grad"), plan.mesh.ep,
                                                       plan.mesh.ep_group(ctx.rank)),
                           plan, f"plan file {checked.plan_path}")
    modes = {layer.plan.recompute for layer in held} - {"none"}
    if modes:
        # under cp the rerun enters its attention mode and a selective one gathers K/V again
        # rather than keep them (runtime/recompute.py ``rerun_groups``)
        part = wrap_for_recompute(part, "full" if "full" in modes else modes.pop(),
                                  cp.rerun_mode if cp is not None else None,
                                  (cp.group.group_name,) if cp is not None else ())
    if experts is not None:
        root = held[0].plan
        shard_expert_weights(part, experts, dp_kind, lambda _m: (root.zero, root.offload), plan.precision,
                             ctx.device)
    if dp_kind == "fsdp":
        root = held[0].plan
        apply_fsdp(part, ctx.get_mesh("grad"), [], root_zero=root.zero, root_offload=root.offload,
                   precision=plan.precision, device=ctx.device, grad_compression=plan.grad_compression)
    elif dp_kind == "replicate":
        apply_replicate(part, ctx.get_mesh("grad"), [], plan.precision, plan.grad_compression)
    return part


@dataclass
class StageParts:
    """Steps 1-6 of one rank's build (module docstring): the selected stage modules, parallelised
    and materialised, and what the later steps need of the split."""
    parts: dict[int, nn.Module]                  # stage index -> module (or {0: the whole model})
    meta: nn.Module                              # the model as built on meta (step 1)
    dp_kind: str
    restore_output: Callable | None = None       # the model's output structure from the last stage's
    cut_by: str = "none"                         # "fx", "export" or "none" (no pipeline)
    cross_stage_ties: list = field(default_factory=list)
    ties: list[TieGroup] = field(default_factory=list)   # on the model as built (ties.find_ties)
    float8: Float8Record | None = None                   # the float8 conversion of the kept parts
    cp: ContextParallel | None = None                    # context parallelism (cp > 1; runtime.apply_cp)


def build_stage_parts(checked: CheckedPlan, ctx: RankContext, meta: nn.Module, source: Callable,
                      keep_stage: Callable[[int], bool],
                      around_materialize: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                      swap_params: bool = True) -> StageParts:
    """Steps 2-6b on the meta model ``meta``: cut the pipeline stages, keep those ``keep_stage``
    selects, and apply tensor parallelism, recompute and FSDP2 / replicate to each before it is
    materialised from ``source`` (an FQN -> full tensor function) inside ``around_materialize()``
    (``swap_params``: see ``materialize``), then hook its tp gradients (6b).  Training keeps this rank's
    stages; the dry run (runtime/dry_run.py) keeps every stage, so a plan
    it accepts is built by exactly these steps."""
    plan = checked.plan
    args = dict(plan.model.args)
    ties = find_ties(meta)
    stage_of = stage_of_layers(plan)
    num_stages = len(plan.pipeline.stages)
    out = StageParts(parts={}, meta=meta, dp_kind=data_parallel_kind(plan.zero, plan.mesh), ties=ties)
    if plan.mesh.cp > 1:
        out.cp = ContextParallel(ctx, plan.mesh.cp, checked.graph.seq_len, meta)
    if plan.mesh.pp > 1:                                                            # 2
        with torch.device("meta"):
            example, _ = checked.model_file.make_batch(plan.micro_batch, **args)
        if out.cp is not None:      # the stages are cut from a forward on the rank's tokens
            example = out.cp.stage_args(tuple(out.cp.slice(x) for x in example), torch.device("meta"))
        split = split_into_stages(meta, [l.module_paths for l in checked.layers], stage_of, num_stages,
                                  example_inputs=example, device=ctx.device)
        out.restore_output, out.cut_by = split.restore_output, split.cut_by
        if out.cp is not None:
            out.cp.traced_masks = split.cut_by == "export"
        out.cross_stage_ties = untie_across_stages(split.stages, ties)
        if plan.mesh.ep > 1:
            stages_hold_experts(meta, split.stages, plan.mesh.ep, split.cut_by, f"plan file {checked.plan_path}")
        local = {i: split.stages[i] for i in range(num_stages) if keep_stage(i)}
    else:
        local = {0: meta}
    records: list[Float8Record] = []
    for index, part in sorted(local.items()):
        held = [l for l in checked.layers if stage_of[l.index] == index]
        if out.cut_by == "export":
            if any(plan.layer_precision(l.index) == "fp8" for l in held):
                raise PlanFileError(
                    f"plan file {checked.plan_path}: layers with precision fp8 under pp = {plan.mesh.pp}, but torch.fx "
                    f"cannot trace this model's forward, so its pipeline stages are cut from the torch.export graph, "
                    f"whose ops call no nn.Linear module that float8 could convert. Plan --precision bf16 for "
                    f"pp > 1 with this model, or pp = 1.")
            part = parallelize_export_stage(part, held, checked, ctx, out.dp_kind, out.cp)
        else:
            part = parallelize_part(part, held, checked, ctx, out.dp_kind, ties, records, out.cp)   # 2b-5
        with around_materialize():
            materialize(part, ctx.device, source, ties, swap=swap_params)           # 6
        if plan.mesh.tp > 1 and out.dp_kind not in ("fsdp", "replicate"):
            keep_embedding_grads_sharded(part)   # 6b; FSDP2 shards TP gradients itself
        out.parts[index] = part
    if records:
        out.float8 = Float8Record(recipe=plan.fp8_recipe)
        for r in records:
            out.float8.merge(r)
    return out


def build_parallel_model(checked: CheckedPlan, ctx: RankContext, opts: RunOptions,
                         loss_fn: Callable) -> ParallelModel:
    plan = checked.plan
    args = dict(plan.model.args)
    meta = build_meta_model(checked.model_file, args)                               # 1
    init_mode, source = choose_source(opts.init, checked.model_file, args, opts.seed, meta, opts.init_from)
    num_stages = len(plan.pipeline.stages)
    built = build_stage_parts(checked, ctx, meta, source,                           # 2-6b
                              lambda i: plan.pipeline.stage_rank(i, plan.mesh.pp) == ctx.pp_rank)
    source_notes = list(getattr(source, "notes", ()))
    if getattr(source, "full_reads", None):
        source_notes.append(f"--init-from: {len(source.full_reads)} entries had no one-block slice on this rank and "
                            f"were read whole ({', '.join(source.full_reads[:3])})")
    del source
    local, dp_kind = built.parts, built.dp_kind
    parts, dp_mesh = [], ctx.get_mesh("grad")
    use_ddp = dp_kind in ("ddp", "zero1")
    powersgd = None
    for index, part in sorted(local.items()):
        if use_ddp:
            part, hook = apply_ddp(part, dp_mesh, ctx.device, plan.grad_compression)      # 7
            powersgd = hook or powersgd
        parts.append(part)
    optimizers = [build_optimizer(list(p.parameters()), 1 if dp_kind == "zero1" else 0, dp_mesh, opts.lr,
                                  tuple(opts.betas), ADAM_EPS, opts.weight_decay) for p in parts]  # 8
    # the NVMe tier: AdamW's moments (and the parameters and gradients an offload "nvme+..." names)
    # of NVMe-offloaded units in files (runtime/nvme_tier.py)
    nvme = attach_nvme_tier(parts, optimizers, opts.nvme_path, f"plan file {checked.plan_path}")
    schedule, tied_grad_sum = None, None
    if built.cross_stage_ties:
        tied_grad_sum = TiedGradSum.build(built.cross_stage_ties, lambda s: plan.pipeline.stage_rank(s, plan.mesh.pp),
                                          TiedGradSum.pp_rows(ctx.mesh.mesh, tuple(ctx.mesh.mesh_dim_names)),
                                          ctx.rank, ctx.get_mesh("pp").get_group())
    if plan.mesh.pp > 1:
        if built.cp is not None:
            built.cp.stage_forward_ran = False      # until the schedule's first stage forward
        schedule, _ = build_schedule(dict(zip(sorted(local), parts)), num_stages, ctx.get_mesh("pp"), ctx.device,
                                     plan.pipeline.schedule, plan.pipeline.num_microbatches, loss_fn,
                                     built.restore_output, built.cp.stage_forward if built.cp is not None else None,
                                     overlap_experts=plan.mesh.ep > 1)
    notes = source_notes
    if nvme:
        held = [(sum(getattr(t, f) for t in nvme), what) for f, what in
                (("state_bytes", "AdamW moments"), ("param_bytes", "parameters"), ("grad_bytes", "gradients"))]
        notes.append("NVMe tier: " + ", ".join(f"{b / 1e6:.2f} MB of {what}" for b, what in held if b)
                     + f" on this rank in files under {opts.nvme_path} (removed at exit)")
    if plan.grad_compression != "none":
        from autopar.runtime.apply_dp import compression_note

        notes.append(compression_note(plan.grad_compression, dp_kind))
    if built.cut_by == "export":
        notes.append("torch.fx cannot trace this model's forward: its pipeline stages are cut from the torch.export "
                     "graph, so recompute and ZeRO-2/3 units apply per stage, not per layer"
                     + ("; its stages call no block module, so compile is not applied (they run eager)"
                        if plan.compile else ""))
    runs_as = runnable_schedule(plan.pipeline.schedule, plan.pipeline.num_microbatches, num_stages)
    if plan.mesh.pp > 1 and runs_as != plan.pipeline.schedule:
        notes.append(f"schedule {plan.pipeline.schedule} with {plan.pipeline.num_microbatches} micro-batches for "
                     f"{num_stages} stages runs as {runs_as} (torch's Schedule1F1B needs at least one micro-batch "
                     f"per stage; the order differs only on the last stages, the bubble is the same)")
    warnings = batch_norm_warnings(meta, plan.mesh.batch_degree, plan.pipeline.num_microbatches, plan.micro_batch)
    after_step = None
    if built.float8 is not None:
        notes.append(built.float8.summary())
        if built.float8.fsdp_float8_all_gather:
            from autopar.runtime.apply_fp8 import after_optimizer_step

            after_step = after_optimizer_step(parts)
    low = LOW_PRECISION.get(plan.precision)
    return ParallelModel(cp=built.cp, notes=notes, warnings=warnings, parts=parts, stage_indices=sorted(local), optimizers=optimizers, schedule=schedule,
                         init_mode=init_mode, uses_fsdp=dp_kind in ("fsdp", "replicate"), uses_ddp=use_ddp,
                         autocast_dtype=None if dp_kind in ("fsdp", "replicate") else low, dp_kind=dp_kind,
                         num_stages=num_stages, tied_grad_sum=tied_grad_sum,
                         state_names=StateNames.build(built.ties, built.cross_stage_ties, sorted(local)),
                         has_first_stage=0 in local, has_last_stage=(num_stages - 1) in local,
                         float8=built.float8, after_optimizer_step=after_step, nvme=nvme, powersgd=powersgd)
