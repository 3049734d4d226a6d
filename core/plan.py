"""The plan: frozen, versioned, human-readable JSON (docs/design.md, "Contracts").

A plan says how to train one model on one cluster:

* ``Mesh``        -- the degree of each named parallel axis (``core.parallel_dims.ParallelDims``:
                     ranks = arange(world).view(dp, pp, tp), tp innermost so a tensor-parallel
                     group is a run of consecutive ranks inside a node), plus sequence
                     parallelism on the tp axis.
* ``Pipeline``    -- stages as layer ranges, the schedule and the micro-batch count (with
                     ``pp == 1`` the micro-batches are gradient-accumulation steps).
* ``LayerPlan``   -- per layer: tensor-parallel style per module (the SOAP parameter split,
                     mapped by the runtime onto DTensor ``ColwiseParallel`` / ``RowwiseParallel``),
                     data-parallel flavour (ZeRO stage), recompute and offload.
* ``predicted``   -- what the simulator said the plan costs; ``provenance`` -- where it came from.

Nothing here searches, simulates or touches torch.distributed: the plan is data.
Serialisation is JSON only (never pickle); ``save_plan`` writes atomically.
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from autopar.core.errors import PlanFileError
from autopar.core.grad_compression import SPEC_HELP, compression_problem
from autopar.core.jsonfile import read_json_object
from autopar.core.output_file import write_text_atomic  # noqa: F401 (also imported from here)
from autopar.core.parallel_dims import AXES, AXIS_NAMES, ParallelDims
from autopar.core.rules import (MULTI_CHUNK_SCHEDULES, NVME_OFFLOADS, V_SCHEDULES, offload_allowed,
                                schedule_microbatches_problem, split_backward_problem, stage_rank, zeros_mix)

PLAN_VERSION = 1
# gpipe, 1f1b and interleaved (1F1B) run each backward whole; interleaved-zb, zbv and dualpipev
# split it into input and weight gradients (core/rules.py, SPLIT_BACKWARD_SCHEDULES); zbv and
# dualpipev lay the 2 stages of each rank out in a V (rules.stage_rank)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
# Recompute: "full" keeps only each layer's input and reruns its forward inside backward
# (Chen et al. 2016; Megatron "full"); "selective" keeps the outputs of the matmul-class ops
# (linear, matmul, attention) and recomputes the cheap ones between them (norms, activations,
# softmax, dropout) -- the op-level policy torchtitan applies with
# torch.utils.checkpoint.create_selective_checkpoint_contexts.
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)          # 0 = DDP, 1 = ZeRO-1 (optimizer), 2 = + gradients, 3 = + parameters (FSDP)
# "cpu": parameters, gradients and optimizer state in host memory; "nvme": the same, with AdamW's
# moments in files (runtime/nvme_tier.py); "nvme+params", "nvme+grads", "nvme+params+grads": the
# sharded parameters and/or gradients in the files too (core/rules.py nvme_states)
OFFLOAD = ("none", "cpu", *NVME_OFFLOADS)
TP_STYLES = ("colwise", "rowwise", "expert")  # Megatron column / row split of a Linear's weight; a
#                                             mixture of experts' stacked experts split by expert
# "colwise:<k>": the column split of a fused projection whose output is k equal parts (GPT-2's
# c_attn: q | k | v, k = 3): each rank holds its share of every part (core/sharding._fused_parts,
# runtime/fused_tp.py)
_PARTS_STYLE = re.compile(r"colwise:([1-9][0-9]*)")


def tp_style_parts(style: str) -> tuple[str, int]:
    """(base style, number of equal output parts split separately): ("colwise", 3) for
    "colwise:3", (style, 1) for the plain styles."""
    m = _PARTS_STYLE.fullmatch(style)
    return ("colwise", int(m.group(1))) if m else (style, 1)


def parts_style(parts: int) -> str:
    """The style string of a column split per part (``parts`` > 1), "colwise" for one part."""
    return f"colwise:{parts}" if parts > 1 else "colwise"


@functools.lru_cache(maxsize=256)
def valid_tp_style(style: str) -> bool:
    """Whether ``style`` names a split (a plan's layers name the same few styles again and again:
    the answer is kept per string)."""
    base, parts = tp_style_parts(style)
    return style in TP_STYLES or (base == "colwise" and parts >= 2)
PRECISIONS = ("fp32", "bf16", "fp16")  # bf16/fp16 = mixed precision, fp32 master weights
# A layer's own precision ("" = the plan's): "fp8" trains its linears in float8 (torchao's
# Float8Linear: GEMM inputs cast to e4m3/e5m2 with per-tensor or per-row scales, output and
# master weights as the plan's bf16); only on top of a bf16 plan, only on devices with fp8
# tensor cores (compute capability 8.9 / Hopper and later).
LAYER_PRECISIONS = ("bf16", "fp8")
# How the fp8 layers scale their casts (torchao ``Float8LinearConfig.from_recipe_name``):
# "tensorwise" one scale per tensor (and, under FSDP2, the weights all-gathered in fp8);
# "rowwise" one scale per row (more accurate for outliers, all-gather in bf16).  Plan-level:
# torchao converts a model with one config.  Plans written before the key load as tensorwise.
FP8_RECIPES = ("tensorwise", "rowwise")


#: the plan's mesh: one degree per named parallel axis (core/parallel_dims.py)
Mesh = ParallelDims


@dataclass(frozen=True)
class Stage:
    index: int                 # position in the pipeline (0 .. num_stages-1)
    start: int                 # first layer (inclusive)
    end: int                   # last layer (exclusive)

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class Pipeline:
    schedule: str = "1f1b"
    num_microbatches: int = 1
    stages: tuple[Stage, ...] = ()

    def stage_rank(self, stage_index: int, pp: int) -> int:
        """pp coordinate that runs a stage: stage i on pp rank i % pp (looped), or in a V for zbv
        and dualpipev (rules.stage_rank)."""
        return stage_rank(self.schedule, stage_index, pp)

    def stages_per_rank(self, pp: int) -> int:
        return max(1, len(self.stages) // pp)


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    tp: tuple[tuple[str, str], ...] = ()   # (module qualified name, "colwise" | "rowwise" | "expert")
    zero: int = 0
    recompute: str = "none"
    offload: str = "none"
    precision: str = ""                    # "" = the plan's precision; "fp8": float8 linears

    @property
    def tp_styles(self) -> dict[str, str]:
        return dict(self.tp)


@dataclass(frozen=True)
class ModelRef:
    file: str
    args: Mapping[str, Any]
    name: str
    fingerprint: str


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    mesh: Mesh
    global_batch: int
    micro_batch: int                       # samples per micro-batch on one data-parallel rank
    pipeline: Pipeline
    layers: tuple[LayerPlan, ...]
    precision: str = "fp32"
    cluster: str = ""                      # cluster name, and the file it came from
    # regional torch.compile of every repeated block (runtime/apply_compile.py); plans written
    # before the key existed load as False
    compile: bool = False
    # the float8 recipe of the layers with precision fp8 (FP8_RECIPES); unused without them
    fp8_recipe: str = "tensorwise"
    # priced as a run that clips its gradients by their global norm (``--grad-clip``: the norm's
    # passes and all-reduce, simulator/optimizer_step.py); a pricing assumption, not part of what
    # the run does (the run's own --grad-clip decides): written only when true, left out of the identity
    grad_clip: bool = False
    # how the data-parallel gradient reduce is compressed (core/grad_compression.py: none, bf16,
    # fp16, powersgd:R); plans written before the key load as "none"
    grad_compression: str = "none"
    predicted: Mapping[str, Any] = field(default_factory=dict)
    provenance: Mapping[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def zero(self) -> int:
        """The largest ZeRO stage of any layer (decides DDP / ZeRO-1 / FSDP at run time)."""
        return max((lp.zero for lp in self.layers), default=0)

    def layer_precision(self, layer: int) -> str:
        """The precision layer ``layer`` trains in: its own, else the plan's."""
        return self.layers[layer].precision or self.precision

    @property
    def uses_fp8(self) -> bool:
        return any(lp.precision == "fp8" for lp in self.layers)

    def with_predicted(self, predicted: Mapping[str, Any], **provenance: Any) -> "Plan":
        return replace(self, predicted=dict(predicted), provenance={**self.provenance, **provenance})

    # -------------------------------------------------------------- checks
    def validate(self, num_layers: int | None = None) -> None:
        """Raise PlanFileError naming the field when the plan is inconsistent."""
        m = self.mesh
        from autopar.core.cluster import MAX_DEVICES

        if m.world_size > MAX_DEVICES:
            _bad("mesh", f"{' x '.join(AXIS_NAMES)} = {m.world_size} ranks", f"at most {MAX_DEVICES} ranks "
                                                                             f"(autopar's bound on a cluster)")
        for where, value, allowed in m.problems()[:1]:
            _bad(where, value, allowed)
        p = self.pipeline
        if p.schedule not in SCHEDULES:
            _bad("pipeline.schedule", p.schedule, f"one of {', '.join(SCHEDULES)}")
        if p.num_microbatches < 1:
            _bad("pipeline.num_microbatches", p.num_microbatches, "a positive integer")
        if self.micro_batch < 1:
            _bad("micro_batch", self.micro_batch, "a positive integer")
        if self.global_batch != m.batch_degree * self.micro_batch * p.num_microbatches:
            batch_axes = [a.name for a in AXES if a.splits == "batch"]
            _bad("global_batch", self.global_batch,
                 f"{' * '.join('mesh.' + n for n in batch_axes)} * micro_batch * pipeline.num_microbatches = "
                 f"{' * '.join(str(m.size(n)) for n in batch_axes)} * {self.micro_batch} * "
                 f"{p.num_microbatches} = {m.batch_degree * self.micro_batch * p.num_microbatches}")
        if not p.stages:
            _bad("pipeline.stages", [], "at least one stage")
        if len(p.stages) % m.pp:
            _bad("pipeline.stages", len(p.stages), f"a multiple of mesh.pp = {m.pp} stages")
        if len(p.stages) > m.pp and p.schedule not in MULTI_CHUNK_SCHEDULES:
            _bad("pipeline.schedule", p.schedule, f"one of {', '.join(MULTI_CHUNK_SCHEDULES)} for {len(p.stages)} "
                                                  f"stages on {m.pp} pipeline ranks")
        if m.pp > 1 or p.schedule in V_SCHEDULES:
            problem = schedule_microbatches_problem(p.schedule, p.num_microbatches, m.pp, len(p.stages))
            if problem:
                _bad("pipeline.stages" if "stages per" in problem else "pipeline.num_microbatches",
                     len(p.stages) if "stages per" in problem else p.num_microbatches, problem)
        if m.pp > 1:
            for lp in self.layers:
                problem = split_backward_problem(p.schedule, lp.recompute, lp.zero, lp.offload, self.compile)
                if problem:
                    _bad("pipeline.schedule", p.schedule, f"a schedule that runs layer {lp.layer}'s choices: {problem}")
        expected_start = 0
        for i, s in enumerate(p.stages):
            if s.index != i or s.start != expected_start or s.end <= s.start:
                _bad(f"pipeline.stages[{i}]", [s.start, s.end],
                     f"a non-empty layer range starting at layer {expected_start} (stages must be contiguous)")
            expected_start = s.end
        n = num_layers if num_layers is not None else len(self.layers)
        if expected_start != n:
            _bad("pipeline.stages", f"ends at layer {expected_start}", f"stages covering all {n} layers")
        if [lp.layer for lp in self.layers] != list(range(len(self.layers))):
            _bad("layers", "layer indices", "one entry per layer, in order 0, 1, 2, ...")
        if num_layers is not None and len(self.layers) != num_layers:
            _bad("layers", len(self.layers), f"{num_layers} entries (one per layer of the model)")
        zeros = {lp.zero for lp in self.layers}
        for lp in self.layers:
            where = f"layers[{lp.layer}]"
            if lp.zero not in ZERO_STAGES:
                _bad(f"{where}.zero", lp.zero, "0, 1, 2 or 3")
            if lp.recompute not in RECOMPUTE:
                _bad(f"{where}.recompute", lp.recompute, f"one of {', '.join(RECOMPUTE)}")
            if lp.offload not in OFFLOAD:
                _bad(f"{where}.offload", lp.offload, f"one of {', '.join(OFFLOAD)}")
            if lp.offload != "none" and not offload_allowed(lp.zero):
                _bad(f"{where}.offload", lp.offload, "'none' unless zero is 2 or 3 (offload runs through FSDP)")
            for mod, style in lp.tp:
                if not valid_tp_style(style):
                    _bad(f"{where}.tp[{mod!r}]", style, f"one of {', '.join(TP_STYLES)} or colwise:<parts> "
                                                        f"(parts >= 2)")
            if lp.precision and lp.precision not in LAYER_PRECISIONS:
                _bad(f"{where}.precision", lp.precision, f"one of {', '.join(LAYER_PRECISIONS)} (or absent: the "
                                                         f"plan's precision)")
            if lp.precision == "fp8" and self.precision != "bf16":
                _bad(f"{where}.precision", lp.precision, f"'bf16' or absent while the plan's precision is "
                                                         f"{self.precision!r} (float8 linears train on top of bf16)")
            if lp.precision == "bf16" and self.precision != "bf16":
                _bad(f"{where}.precision", lp.precision, f"absent or 'fp8' (the plan's precision is "
                                                         f"{self.precision!r})")
            if lp.tp and m.tp == 1:
                _bad(f"{where}.tp", dict(lp.tp), "empty when mesh.tp is 1")
        if not zeros_mix(zeros):
            _bad("layers[*].zero", sorted(zeros),
                 "one value for every layer when DDP (0) or ZeRO-1 (1) is used; only 2 and 3 may be mixed")
        if self.precision not in PRECISIONS:
            _bad("precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        if self.fp8_recipe not in FP8_RECIPES:
            _bad("fp8_recipe", self.fp8_recipe, f"one of {', '.join(FP8_RECIPES)}")
        problem = compression_problem(self.grad_compression, m, self.zero)
        if problem:
            _bad("grad_compression", self.grad_compression, SPEC_HELP if "not a gradient" in problem else
                 f"'none' for this plan: {problem}")

    # ------------------------------------------------------------ JSON form
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "model": {"file": self.model.file, "args": dict(self.model.args), "name": self.model.name,
                      "fingerprint": self.model.fingerprint},
            "cluster": self.cluster,
            "mesh": self.mesh.to_dict(),
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "precision": self.precision,
            "compile": self.compile,
            **({"fp8_recipe": self.fp8_recipe} if self.uses_fp8 else {}),
            **({"grad_clip": True} if self.grad_clip else {}),
            **({"grad_compression": self.grad_compression} if self.grad_compression != "none" else {}),
            "pipeline": {"schedule": self.pipeline.schedule,
                         "num_microbatches": self.pipeline.num_microbatches,
                         "stages": [{"index": s.index, "layers": [s.start, s.end]} for s in self.pipeline.stages]},
            "layers": [{"layer": lp.layer, "tp": dict(lp.tp), "zero": lp.zero,
                        "recompute": lp.recompute, "offload": lp.offload,
                        **({"precision": lp.precision} if lp.precision else {})} for lp in self.layers],
            "predicted": dict(self.predicted),
            "provenance": dict(self.provenance),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default) + "\n"

    @property
    def identity(self) -> str:
        """16 hex digits naming what a run of this plan does -- the model (fingerprint and
        arguments), the mesh, the batches, the precision, the stages and every layer's decisions
        -- and nothing else: the plan's predictions, provenance, cluster name and model path may
        change without changing the run.  measured.json records it (``plan_identity``) so a
        report never pairs a plan with another plan's measurements."""
        import hashlib

        d = self.to_dict()
        core = {"model": {"fingerprint": d["model"]["fingerprint"], "args": d["model"]["args"]},
                **{k: d[k] for k in ("mesh", "global_batch", "micro_batch", "precision", "pipeline", "layers")}}
        if self.uses_fp8:            # (plans without fp8 layers keep the identity they had)
            core["fp8_recipe"] = d["fp8_recipe"]
        if self.grad_compression != "none":   # (and plans without compression theirs)
            core["grad_compression"] = self.grad_compression
        text = json.dumps(core, sort_keys=True, default=_json_default)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "plan") -> "Plan":
        """The plan in ``d``; PlanFileError naming the first field that is missing or has the wrong type
        (integers must be JSON integers: ``2.7`` or ``"2"`` is refused, never truncated)."""
        try:
            version = d.get("version", -1)
            if version != PLAN_VERSION or isinstance(version, bool):
                _bad("version", d.get("version"), f"{PLAN_VERSION} (this autopar reads plan version {PLAN_VERSION})")
            md, me, pl = _obj(d, "model"), _obj(d, "mesh"), _obj(d, "pipeline")
            stages = _list(pl, "stages", "pipeline.")
            layers = _list(d, "layers", "")
            plan = cls(
                version=version,
                model=ModelRef(file=_text(md, "file", "model."), args=dict(_obj(md, "args", "model.", {})),
                               name=str(md.get("name", "")), fingerprint=_text(md, "fingerprint", "model.")),
                cluster=str(d.get("cluster", "")),
                mesh=Mesh.from_dict(me, lambda o, key, default: _int(o, key, "mesh.", default),
                                    lambda o, key: _flag(o, key, "mesh.")),
                global_batch=_int(d, "global_batch", ""),
                micro_batch=_int(d, "micro_batch", ""),
                precision=str(d.get("precision", "fp32")),
                compile=_flag(d, "compile", ""),
                fp8_recipe=str(d.get("fp8_recipe", "tensorwise")),
                grad_clip=_flag(d, "grad_clip", ""),
                grad_compression=str(d.get("grad_compression", "none")),
                pipeline=Pipeline(schedule=_text(pl, "schedule", "pipeline."),
                                  num_microbatches=_int(pl, "num_microbatches", "pipeline."),
                                  stages=tuple(_stage(s, i) for i, s in enumerate(stages))),
                layers=tuple(_layer(x, i) for i, x in enumerate(layers)),
                predicted=dict(_obj(d, "predicted", "", {})),
                provenance=dict(_obj(d, "provenance", "", {})),
            )
        except PlanFileError as e:
            raise PlanFileError(f"{source}: {e} Plans are written by 'autopar plan'; regenerate it rather than "
                                f"editing by hand.") from None
        except KeyError as e:
            raise PlanFileError(f"{source}: the plan lacks the field {e.args[0]!r}. Plans are written by "
                                f"'autopar plan'; regenerate it rather than editing by hand.") from None
        try:
            plan.validate()
        except PlanFileError as e:
            raise PlanFileError(f"{source}: {e}") from None
        return plan


#: the largest integer a plan field may hold (batch sizes, degrees, layer indices): 2^31 - 1
MAX_PLAN_INT = 2**31 - 1


def _obj(d: Mapping, key: str, prefix: str = "", default: Any = None) -> Mapping:
    value = d[key] if default is None else d.get(key, default)
    if not isinstance(value, Mapping):
        _bad(prefix + key, value, "a JSON object")
    return value


def _list(d: Mapping, key: str, prefix: str) -> list:
    value = d[key]
    if not isinstance(value, list):
        _bad(prefix + key, value, "a JSON list")
    return value


def _int(d: Mapping, key: str, prefix: str, default: int | None = None) -> int:
    value = d[key] if default is None else d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PLAN_INT:
        _bad(prefix + key, value, f"a whole number from 0 to {MAX_PLAN_INT} (a JSON integer)")
    return value


def _text(d: Mapping, key: str, prefix: str) -> str:
    value = d[key]
    if not isinstance(value, str):
        _bad(prefix + key, value, "a text")
    return value


def _flag(d: Mapping, key: str, prefix: str) -> bool:
    value = d.get(key, False)
    if not isinstance(value, bool):
        _bad(prefix + key, value, "true or false")
    return value


def _stage(s: Any, i: int) -> Stage:
    where = f"pipeline.stages[{i}]"
    if not isinstance(s, Mapping):
        _bad(where, s, 'an object {"index": i, "layers": [start, end]}')
    bounds = s.get("layers")
    if not isinstance(bounds, list) or len(bounds) != 2:
        _bad(f"{where}.layers", bounds, "a list of two layer indices [start, end)")
    start, end = (_int({f"layers[{j}]": b}, f"layers[{j}]", where + ".") for j, b in enumerate(bounds))
    return Stage(_int(s, "index", where + "."), start, end)


def _layer(x: Any, i: int) -> LayerPlan:
    where = f"layers[{i}]"
    if not isinstance(x, Mapping):
        _bad(where, x, "an object with the keys layer, tp, zero, recompute, offload")
    tp = _obj(x, "tp", where + ".", {})
    return LayerPlan(layer=_int(x, "layer", where + "."),
                     tp=tuple(sorted((str(k), str(v)) for k, v in tp.items())),
                     zero=_int(x, "zero", where + ".", 0), recompute=str(x.get("recompute", "none")),
                     offload=str(x.get("offload", "none")), precision=str(x.get("precision", "")))


def _bad(field_name: str, value: Any, allowed: str) -> None:
    raise PlanFileError(f"field {field_name} is {value!r}; it must be {allowed}.")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"cannot write {type(o).__name__} to a plan")


def load_plan(path: str | os.PathLike) -> Plan:
    p = Path(path)
    d = read_json_object(p, what="plan file", error=PlanFileError,
                         if_missing=f". Create one with 'autopar plan MODEL.py --cluster CLUSTER -o {p}'.",
                         if_invalid=". Plans are JSON written by 'autopar plan'.")
    from autopar.core.output_file import note_input

    note_input(p, "plan file")
    return Plan.from_dict(d, source=f"plan file {p}")


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write the plan atomically: a crash never leaves a half-written file behind."""
    write_text_atomic(path, plan.to_json())


def equal_bounds(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Stage boundaries ``(0, b1, ..., num_layers)`` of (nearly) equal layer counts, the larger
    stages first."""
    base, extra = divmod(num_layers, num_stages)
    out = [0]
    for i in range(num_stages):
        out.append(out[-1] + base + (1 if i < extra else 0))
    return tuple(out)


def uniform_plan(*, model: ModelRef, num_layers: int, micro_batch: int = 1, num_microbatches: int = 1, schedule: str = "1f1b",
                 virtual_stages: int = 1, tp_styles_per_layer: Mapping[int, Mapping[str, str]] | None = None,
                 sequence_parallel: bool = False, zero: int = 0, recompute: str = "none",
                 offload: str = "none", precision: str = "fp32", cluster: str = "",
                 stage_bounds: list[int] | None = None, compile: bool = False,
                 layer_precision: str = "", fp8_recipe: str = "tensorwise", mesh_class: type = Mesh,
                 grad_compression: str = "none", **degrees: int) -> Plan:
    """A Megatron-style plan: the same choice on every layer, stages of (nearly) equal size.

    ``degrees``: a degree per axis name (``dp=8, tp=4``; an axis not named is 1; ``ep`` too), of
    ``Mesh``'s axes or of ``mesh_class``'s (a ParallelDims that declares more).  The stages, the tensor
    split and the global batch follow what each axis splits (parallel_dims.Axis.splits).
    ``stage_bounds`` (``[0, b1, ..., num_layers]``) overrides the equal split.
    """
    known = [f.name for f in fields(mesh_class) if f.name != "sequence_parallel"]   # the axes, and ep
    unknown = sorted(set(degrees) - set(known))
    if unknown:
        raise TypeError(f"uniform_plan: no degree named {unknown}; the degrees are {known}")
    mesh = mesh_class(**degrees, sequence_parallel=sequence_parallel)
    num_stages = mesh.degree("layers") * virtual_stages
    if stage_bounds is None:
        stage_bounds = list(equal_bounds(num_layers, num_stages))
    stages = tuple(Stage(i, stage_bounds[i], stage_bounds[i + 1]) for i in range(len(stage_bounds) - 1))
    styles = tp_styles_per_layer or {}
    split = mesh.degree("tensors") > 1
    layers = tuple(LayerPlan(layer=i, tp=tuple(sorted(styles.get(i, {}).items())) if split else (),
                             zero=zero, recompute=recompute, offload=offload, precision=layer_precision)
                   for i in range(num_layers))
    return Plan(model=model, mesh=mesh, global_batch=mesh.batch_degree * micro_batch * num_microbatches,
                micro_batch=micro_batch,
                pipeline=Pipeline(schedule=schedule, num_microbatches=num_microbatches, stages=stages),
                layers=layers, precision=precision, cluster=cluster, compile=compile, fp8_recipe=fp8_recipe,
                grad_compression=grad_compression)
