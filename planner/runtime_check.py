"""Which plan kinds the runtime can apply to a model, found by applying them.

The planner must offer only plans its runtime runs.  Rather than predicting the runtime's
limits, this module decides which plans to try and has the runtime's dry run
(runtime/dry_run.py) apply each on fake ranks: the runtime's own transformations on the model
built on the meta device, inside a fake process group, then one forward and backward of a
micro-batch (under a pipeline, with the schedule's merge of the last stage's outputs over
micro-batches).  What raises there would raise on the real ranks: a column split of a
fused QKV projection followed by a ``view`` with global sizes, a column split of a 1-wide
Linear, a position bias under TP, stages whose layers do not pass one activation, FSDP units
nested in other units or tied parameters across units.

``find_executable`` checks each kind once on the smallest world that exercises it (2 ranks on
its axis) and, for tensor parallelism, each layer kind alone at every degree the cluster
admits; ``plan_runs`` checks one whole plan (the search's pick) the same way.  The verdict is
data (``Executable``) the search restricts itself to, with the reason for each kind it left out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.core.graph import OpGraph
from autopar.core.plan import Mesh, ModelRef, Pipeline, Plan, Stage, LayerPlan, tp_style_parts
from autopar.core.sharding import megatron_styles
from autopar.runtime.dry_run import dry_run, meta_template

CHECK_MICRO_BATCH = 2        # samples per checked micro-batch (BatchNorm refuses 1 on [1, C] inputs)


@dataclass(frozen=True)
class LeftOut:
    kind: str                 # "pipeline", "tensor parallel", "tp=4", "sequence parallel", "ZeRO-2/3 (FSDP)", ...
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "reason": self.reason}


@dataclass(frozen=True)
class Executable:
    """What the runtime was seen to run for one model."""
    splittable: tuple[bool, ...]                 # per layer: its tensor-parallel split runs
    tp_degrees: tuple[int, ...] = ()             # tp degrees > 1 that run
    sequence_parallel: bool = False
    pipeline: bool = False
    cuttable: frozenset[int] = frozenset()       # layer boundaries a pipeline stage may start at
    fsdp: bool = False
    offload: bool = False
    recompute: tuple[str, ...] = ("none",)
    float8: bool = False                         # a bf16 plan with every layer fp8 runs (torchao)
    # expert parallelism: ep = 2 runs (checked only for a model with routed experts); the expert
    # count of each routed-experts site (core/experts.py): an ep degree must divide every one
    ep: bool = False
    experts: tuple[int, ...] = ()
    # ... and under a pipeline: dp 2 x pp 2 with ep 2 runs (checked where both ep and pp run)
    ep_pipeline: bool = False
    left_out: tuple[LeftOut, ...] = ()
    check_s: float = 0.0
    whole_fused: frozenset[str] = frozenset()    # fused projections (module paths) left whole: the
    #                                              runtime could not run them split per part

    def styles(self, graph: OpGraph, layer: int) -> dict[str, str]:
        """The split of ``layer`` that runs: its Megatron styles, without the fused pairs the
        runtime could not run; {} for a layer whose split does not run."""
        return megatron_styles(graph, layer, fused=self.whole_fused) if self.splittable[layer] else {}

    def to_dict(self) -> dict[str, Any]:
        return {"left_out": [x.to_dict() for x in self.left_out], "tp_degrees": list(self.tp_degrees),
                "sequence_parallel": self.sequence_parallel, "pipeline": self.pipeline, "fsdp": self.fsdp,
                "offload": self.offload, "recompute": list(self.recompute), "float8": self.float8,
                "ep": self.ep, "experts": list(self.experts), "ep_pipeline": self.ep_pipeline,
                "tp_split_layers": [i for i, s in enumerate(self.splittable) if s],
                "check_s": round(self.check_s, 3)}


def plan_runs(plan: Plan, graph: OpGraph, model_file, view: "ModelView | None" = None) -> str | None:
    """None when the runtime builds ``plan`` and runs a forward and backward of it on fake
    ranks (the runtime's dry run, runtime/dry_run.py); else the error it raised, in one line.
    ``view``: run it on a model with fewer repeated blocks (``ModelView``) -- ``plan`` is then a
    plan of the view's layers."""
    view = view or ModelView.whole(graph)
    # compile is checked apart (runtime/meta_apply.compile_blocks: the wrapper is
    # applied, no compiled forward runs); the fake forward and backward run the plan eager
    return dry_run(replace(plan, compile=False), view.graph, model_file, layer_names=view.names,
                   module_paths=view.module_paths, drop=view.drop)


def whole_plan_error(plan: Plan, graph: OpGraph, model_file) -> str | None:
    """``plan_runs`` for a plan the search picked.  A deep model is checked on a view with two
    blocks of each kind, where blocks differ also by their choices and by whether a stage
    starts or ends at them; the view's stages are the picked plan's stages that hold a kept
    layer, in order."""
    plan = reduced_plan(plan)
    L = len(graph.layers)
    stage_of = [0] * L
    for st in plan.pipeline.stages:
        for i in st.layers:
            stage_of[i] = st.index
    starts = {st.start for st in plan.pipeline.stages} | {st.end - 1 for st in plan.pipeline.stages}
    # the split itself is in the view's key already (relative to each block's path)
    extra = [(lp.zero, lp.recompute, lp.offload, lp.precision, i in starts) for i, lp in enumerate(plan.layers)]
    styles = [dict(lp.tp) for lp in plan.layers]
    view = ModelView.reduced(graph, styles, extra)
    if len(view.keep) == L:
        return plan_runs(plan, graph, model_file)
    kept_stage = [stage_of[i] for i in view.keep]
    order = list(dict.fromkeys(kept_stage))
    new_stage = [order.index(s) for s in kept_stage]
    bounds = [0] + [j for j in range(1, len(new_stage)) if new_stage[j] != new_stage[j - 1]] + [len(new_stage)]
    stages = tuple(Stage(k, bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1))
    layers = tuple(replace(plan.layers[i], layer=j, tp=tuple((view.rename(k), v) for k, v in plan.layers[i].tp))
                   for j, i in enumerate(view.keep))
    small = replace(plan, layers=layers, pipeline=replace(plan.pipeline, stages=stages))
    return plan_runs(small, graph, model_file, view)


@dataclass(frozen=True)
class ModelView:
    """The model with at most two blocks of each kind per block run, and its layers.

    Identical blocks (same container, same structure) are transformed identically by the
    runtime, so checking two of them -- two, so that a boundary between identical blocks is
    among those checked -- says what checking all would.  The others are deleted from their
    ``ModuleList``/``Sequential`` after building (which renumbers the kept ones); a model
    whose forward depends on how many blocks it has is checked whole instead.
    """
    graph: OpGraph
    keep: tuple[int, ...]                      # layer indices of the full graph that remain
    names: tuple[str, ...]                     # per kept layer: its name in the view's model
    module_paths: tuple[tuple[str, ...], ...]
    drop: tuple[tuple[str, tuple[int, ...]], ...] = ()   # (container path, child indices to delete)
    renames: tuple[tuple[str, str], ...] = ()            # (full-model block path, view path)

    @staticmethod
    def whole(graph: OpGraph) -> "ModelView":
        return ModelView(graph, tuple(range(len(graph.layers))), tuple(l.name for l in graph.layers),
                         tuple(tuple(l.module_paths) for l in graph.layers))

    @staticmethod
    def reduced(graph: OpGraph, styles: list[dict[str, str]], extra: list | None = None) -> "ModelView":
        """Two blocks per (run, structure, split, ``extra[i]``): ``extra`` adds what else makes
        blocks differ (a plan's per-layer choices, where its stages start)."""
        seen: dict[tuple, int] = {}
        keep, dropped = [], {}
        for i, layer in enumerate(graph.layers):
            container, _, child = layer.name.rpartition(".")
            if layer.kind in ("pre", "post", "model") or not child.isdigit():
                keep.append(i)
                continue
            key = (container, layer.signature, tuple(sorted((k.removeprefix(layer.name + "."), v)
                                                            for k, v in styles[i].items())),
                   extra[i] if extra is not None else None)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= 2:
                keep.append(i)
            else:
                dropped.setdefault(container, []).append(int(child))
        if not dropped:
            return ModelView.whole(graph)
        renames = []
        for i in keep:
            container, _, child = graph.layers[i].name.rpartition(".")
            if container in dropped and child.isdigit():
                new = int(child) - sum(1 for d in dropped[container] if d < int(child))
                renames.append((graph.layers[i].name, f"{container}.{new}"))
        ren = dict(renames)
        names = tuple(ren.get(graph.layers[i].name, graph.layers[i].name) for i in keep)
        paths = tuple(tuple(ren.get(p, p) for p in graph.layers[i].module_paths) for i in keep)
        return ModelView(graph, tuple(keep), names, paths,
                         tuple((c, tuple(sorted(d))) for c, d in dropped.items()), tuple(renames))

    def rename(self, fqn: str) -> str:
        for old, new in self.renames:
            if fqn == old or fqn.startswith(old + "."):
                return new + fqn[len(old):]
        return fqn


# ============================================================================ kinds
@dataclass
class _Probe:
    """Builds plans of the view's layers from full-graph layer indices, and runs them (cached)."""
    graph: OpGraph
    view: ModelView
    model_file: Any
    styles: list[dict[str, str]]          # per full-graph layer
    precision: str
    micro_batch: int = CHECK_MICRO_BATCH
    runs: int = 0
    cache: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.view.keep)

    def plan(self, mesh: Mesh, *, bounds: tuple[int, ...] | None = None, split: set[int] = frozenset(),
             zero: int = 0, recompute: str = "none", offload: str = "none") -> Plan:
        """A plan of the view; ``bounds`` in view layers, ``split`` in full-graph layers."""
        L = self.num_layers
        bounds = bounds or (0, L)
        stages = tuple(Stage(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1))
        layers = []
        for j, i in enumerate(self.view.keep):
            tp = tuple(sorted((self.view.rename(k), v) for k, v in self.styles[i].items())) if i in split else ()
            layers.append(LayerPlan(layer=j, tp=tp, zero=zero, recompute=recompute, offload=offload))
        g = self.graph
        return Plan(model=ModelRef(g.model_file, dict(g.model_args), g.model_name, g.fingerprint), mesh=mesh,
                    global_batch=mesh.batch_degree * self.micro_batch, micro_batch=self.micro_batch,
                    pipeline=Pipeline(schedule="gpipe", num_microbatches=1, stages=stages), layers=tuple(layers),
                    precision=self.precision)

    def error(self, plan: Plan) -> str | None:
        key = (plan.mesh, plan.pipeline.stages, plan.layers, plan.precision)
        if key not in self.cache:
            self.runs += 1
            self.cache[key] = plan_runs(plan, self.graph, self.model_file, self.view)
        return self.cache[key]


def find_executable(graph: OpGraph, model_file, *, tp_degrees: tuple[int, ...] = (2,), precision: str = "fp32",
                    max_pipeline_probes: int = 16, float8: bool = False) -> Executable:
    """Try each plan kind on fake ranks; see the module docstring.

    ``float8``: also try a bf16 plan with every layer's linears in float8 (runtime/apply_fp8.py:
    torchao's conversion on the meta model, then the fake forward and backward), under FSDP2
    where it runs (the fp8 all-gather), else plain -- only where the planner may offer float8
    (planner/float8_choice.py).

    ``tp_degrees``: the tensor-parallel degrees the search may use (> 1).  A degree at which a
    layer kind's split fails while it runs at a smaller degree (e.g. heads that do not divide)
    is left out as a whole, so that the splits the search assigns hold at every degree it uses.
    """
    t0 = time.perf_counter()
    L = len(graph.layers)
    styles = [megatron_styles(graph, i) for i in range(L)]
    probe = _Probe(graph, ModelView.reduced(graph, styles), model_file, styles, precision)
    left: list[LeftOut] = []
    one = Mesh()
    base = probe.error(probe.plan(one))
    if base is not None and len(probe.view.keep) < L:      # the forward needs all its blocks
        probe = _Probe(graph, ModelView.whole(graph), model_file, styles, precision)
        base = probe.error(probe.plan(one))
    if base is not None:
        from autopar.core.model_check import own_failure

        own = own_failure(model_file, dict(graph.model_args), CHECK_MICRO_BATCH)
        if own is not None:                   # the model file fails by itself: say so, once
            raise own
        reason = (f"the runtime could not run the model on fake tensors to check it ({base}); only plain "
                  f"data parallelism is offered")
        left = [LeftOut(k, reason) for k in ("tensor parallel", "pipeline", "ZeRO-2/3 (FSDP)", "recompute")]
        return Executable(splittable=(False,) * L, left_out=tuple(left), check_s=time.perf_counter() - t0)

    recompute = ["none"]
    for mode in ("selective", "full"):
        err = probe.error(probe.plan(one, recompute=mode))
        if err is None:
            recompute.append(mode)
        else:
            left.append(LeftOut(f"recompute {mode}", err))

    fsdp_err = probe.error(probe.plan(Mesh(dp=2), zero=3))
    offload = False
    if fsdp_err is not None:
        left.append(LeftOut("ZeRO-2/3 (FSDP)", fsdp_err))
        left.append(LeftOut("offload", "offload runs through FSDP, which is left out"))
    else:
        off_err = probe.error(probe.plan(Mesh(dp=2), zero=3, offload="cpu"))
        offload = off_err is None
        if off_err is not None:
            left.append(LeftOut("offload", off_err))

    splittable, degrees, sp, whole_fused = _tensor_parallel(probe, tuple(sorted(d for d in tp_degrees if d > 1)),
                                                            left)
    pipeline, cuttable = _pipeline(probe, max_pipeline_probes, left)
    fp8_ok = False
    if float8:
        fp8_plan = probe.plan(Mesh(dp=2), zero=3) if fsdp_err is None else probe.plan(one)
        fp8_plan = replace(fp8_plan, precision="bf16",
                           layers=tuple(replace(lp, precision="fp8") for lp in fp8_plan.layers))
        fp8_err = probe.error(fp8_plan)
        fp8_ok = fp8_err is None
        if fp8_err is not None:
            left.append(LeftOut("float8", fp8_err))
    ep, experts = _expert_parallel(probe, left)
    ep_pipeline = ep and pipeline and _expert_pipeline(probe, cuttable, left)
    return Executable(splittable=tuple(splittable), tp_degrees=tuple(degrees), sequence_parallel=sp,
                      whole_fused=whole_fused,
                      pipeline=pipeline, cuttable=frozenset(cuttable), fsdp=fsdp_err is None, offload=offload,
                      recompute=tuple(recompute), float8=fp8_ok, ep=ep, experts=experts, ep_pipeline=ep_pipeline,
                      left_out=tuple(left),
                      check_s=time.perf_counter() - t0)


def _expert_parallel(probe: _Probe, left: list[LeftOut]) -> tuple[bool, tuple[int, ...]]:
    """(ep = 2 runs, the expert count of each routed-experts site).  A model without routed
    experts (core/experts.py) is not probed and nothing is left out for it: there is nothing to
    split."""
    from autopar.core.experts import expert_sites

    sites = expert_sites(meta_template(probe.model_file, dict(probe.graph.model_args), probe.view.drop))
    if not sites:
        return False, ()
    experts = tuple(s.num_experts for s in sites)
    err = probe.error(probe.plan(Mesh(dp=2, ep=2)))
    if err is not None:
        left.append(LeftOut("expert parallel", err))
    return err is None, experts


def _expert_pipeline(probe: _Probe, cuttable: set[int], left: list[LeftOut]) -> bool:
    """Whether ep 2 runs inside pipeline stages: dp 2 x pp 2 with ep 2, a stage starting at every
    layer boundary the pipeline check allowed (the runtime splits the experts each stage calls:
    runtime/apply_ep.py, runtime/expert_calls.py)."""
    V = probe.num_layers
    bounds = (0, *[j for j in range(1, V) if probe.view.keep[j] in cuttable], V)
    err = probe.error(probe.plan(Mesh(dp=2, pp=2, ep=2), bounds=bounds))
    if err is not None:
        left.append(LeftOut("expert parallel with pipeline", err))
    return err is None


def _tensor_parallel(probe: _Probe, degrees: tuple[int, ...], left: list[LeftOut]):
    """Per layer, whether its split runs at every kept degree; the kept degrees; SP or not."""
    from autopar.core.sharding import fused_projections, tp_refusals

    L = len(probe.graph.layers)
    fused = [m for i in range(L) for m in fused_projections(probe.graph, i)]
    if degrees and fused:
        left.append(LeftOut("tp of fused projections",
                            f"{', '.join(fused[:2])}{', ...' if len(fused) > 2 else ''} ({len(fused)} in all): each "
                            f"output is cut into parts (q, k, v) of unequal widths, or by ops the split analysis "
                            f"does not follow (core/sharding._fused_parts), so neither an even column split (rank 0 "
                            f"would get all of q and part of k: another model) nor a split per part applies; they "
                            f"stay whole"))
    candidates = [i for i in range(L) if probe.styles[i]]
    if not degrees:
        return [False] * L, [], False, frozenset()
    if not candidates:
        left.append(LeftOut("tensor parallel", "no layer has a Megatron column/row split of its Linear modules"))
        return [False] * L, [], False, frozenset()
    # one representative per layer kind (identical layers split identically)
    by_kind: dict[tuple, list[int]] = {}
    for i in candidates:
        rel = tuple(sorted((k.removeprefix(probe.graph.layers[i].name + "."), v) for k, v in probe.styles[i].items()))
        by_kind.setdefault((probe.graph.layers[i].signature, rel), []).append(i)
    ok_layers: set[int] | None = None
    kept: list[int] = []
    reasons: dict[str, str] = {}
    whole_fused: set[str] = set()
    for d in degrees:
        good = set()
        for members in by_kind.values():
            # a split dimension or head count d does not divide (core/sharding.tp_refusals): the
            # analysis says why, where the runtime would fail with a reshape's shape error
            refused = tp_refusals(probe.graph, members[0], probe.styles[members[0]], d)
            err = "; ".join(refused) if refused else probe.error(probe.plan(Mesh(tp=d), split={members[0]}))
            if err is not None and not refused:
                whole = _unfuse(probe, members, Mesh(tp=d), left, err)
                if whole:
                    whole_fused.update(whole)
                    err = probe.error(probe.plan(Mesh(tp=d), split={members[0]}))
            if err is None:
                good.update(members)
            else:
                reasons.setdefault(probe.graph.layers[members[0]].name, err)
        if ok_layers is None:
            if not good:
                break
            err = probe.error(probe.plan(Mesh(tp=d), split=good))
            if err is not None:
                left.append(LeftOut(f"tp={d}", f"every layer's split runs alone but not together: {err}"))
                break
            ok_layers = good
            kept.append(d)
        elif good >= ok_layers and probe.error(probe.plan(Mesh(tp=d), split=ok_layers)) is None:
            kept.append(d)
        else:
            lost = sorted(ok_layers - good)
            why = reasons.get(probe.graph.layers[lost[0]].name, "") if lost else \
                probe.error(probe.plan(Mesh(tp=d), split=ok_layers))
            left.append(LeftOut(f"tp={d}", f"layer {probe.graph.layers[lost[0]].name if lost else '(all)'}: {why}"))
    if not kept:
        why = "; ".join(f"{name}: {err}" for name, err in list(reasons.items())[:2])
        left.append(LeftOut("tensor parallel", f"no layer's split runs in the runtime ({why})"))
        return [False] * L, [], False, frozenset()
    for name, err in reasons.items():
        if not any(probe.graph.layers[i].name == name for i in ok_layers):
            left.append(LeftOut(f"tp split of {name}", err))
    splittable = [i in ok_layers for i in range(L)]
    sp_err = _sequence_mixing_error(probe, ok_layers, kept[0]) or \
        probe.error(probe.plan(Mesh(tp=kept[0], sequence_parallel=True), split=ok_layers))
    if sp_err is not None:
        left.append(LeftOut("sequence parallel", sp_err))
    return splittable, kept, sp_err is None, frozenset(whole_fused)


def _unfuse(probe: _Probe, members: list[int], mesh: Mesh, left: list[LeftOut], err: str) -> set[str]:
    """A layer kind whose split fails while it splits fused projections per part (nanoGPT's
    ``c_attn``: its forward views q/k/v with a width read from its input, the whole hidden
    size; Phi-3's attention reads its head count from the shared config): leave them whole
    -- each alone first, the first that lets the layer run (Phi-3's ``gate_up_proj`` runs
    split while its ``qkv_proj`` cannot), else all -- keeping the layer's other pairs, and say
    why.  Returns the module paths left whole in every member (empty when the kind splits no
    fused projection); ``probe.styles`` of the members are updated."""
    from autopar.core.sharding import megatron_styles

    first = probe.graph.layers[members[0]].name
    fused = sorted(k.removeprefix(first + ".") for k, v in probe.styles[members[0]].items()
                   if tp_style_parts(v)[1] > 1)
    if not fused:
        return set()
    tries = [[f] for f in fused] + ([fused] if len(fused) > 1 else [])
    for whole in tries:
        paths = {f"{probe.graph.layers[i].name}.{f}" for i in members for f in whole}
        for i in members:
            probe.styles[i] = megatron_styles(probe.graph, i, fused=paths)
        if probe.error(probe.plan(mesh, split={members[0]})) is None or whole is tries[-1]:
            kept = [f"{first}.{f}" for f in fused if f not in whole]
            still = f" ({', '.join(kept)} still split per part)" if kept else ""
            left.append(LeftOut(f"tp of fused projections in {first}",
                                f"{', '.join(f'{first}.{f}' for f in whole)} split per part (q, k, v) fails in the "
                                f"runtime ({err}); {'it stays' if len(whole) == 1 else 'they stay'} whole{still} "
                                f"and the layer's other pairs are split"))
            break
    return paths


def _sequence_mixing_error(probe: _Probe, layers: set[int], tp: int) -> str | None:
    """Sequence parallelism would run an attention outside the tensor-parallel pairs on a
    sequence shard (core/sharding.sequence_mixing_outside_pairs): it runs, but computes
    something else, which no crash check sees."""
    from autopar.core.sharding import sequence_mixing_outside_pairs

    for i in sorted(layers):
        ops = sequence_mixing_outside_pairs(probe.graph, i, probe.styles[i], tp)
        if ops:
            return (f"layer {probe.graph.layers[i].name}: {', '.join(ops[:3])} mixes sequence positions outside the "
                    f"column/row pairs that tensor parallelism splits, so on sequence shards it would see part of "
                    f"the sequence (the plan would run and train another model)")
    return None


def _pipeline(probe: _Probe, max_probes: int, left: list[LeftOut]) -> tuple[bool, set[int]]:
    """Whether stages can be cut, and at which layer boundaries."""
    g = probe.graph
    L = len(g.layers)
    if L < 2:
        left.append(LeftOut("pipeline", "the model has one layer: nothing to cut into stages"))
        return False, set()
    if not g.sequential_layers:
        # the runtime refuses pp > 1 for such a model (runtime/plan_check.check_plan)
        left.append(LeftOut("pipeline", "the captured forward does not pass one activation from layer to layer "
                                        "(several inputs, values reused across layers or extra arguments)"))
        return False, set()
    V = probe.num_layers
    every = tuple(range(V + 1))
    err = probe.error(probe.plan(Mesh(pp=2), bounds=every))
    if err is None:
        return True, set(range(1, L))
    cuttable = set()
    if V - 1 <= max_probes:         # which cuts fail; only the checked ones are offered
        for b in range(1, V):
            if probe.error(probe.plan(Mesh(pp=2), bounds=(0, b, V))) is None:
                cuttable.add(probe.view.keep[b])
    if not cuttable:
        left.append(LeftOut("pipeline", err))
        return False, set()
    left.append(LeftOut("pipeline cuts", f"stages may start only at layers {sorted(cuttable)}: elsewhere {err}"))
    return True, cuttable


MAX_CHECK_WORLD = 64     # larger plans are checked with 2 data-parallel ranks


def reduced_plan(plan: Plan) -> Plan:
    """``plan`` with at most 2 data-parallel ranks once its world exceeds MAX_CHECK_WORLD: the
    runtime transforms every dp replica alike (same tp splits, stage cuts and FSDP units; 2
    ranks shard as the many do), and a fake world of thousands of ranks costs seconds to build.
    Expert parallelism, borrowed from the dp x cp ranks, keeps the largest degree those ranks
    still hold (gcd(ep, 2 cp)): every ep group splits and exchanges alike, and that its degree
    divides each site's experts is checked apart (core/experts.expert_sites_refusal, the planner's space)."""
    import math

    m = plan.mesh
    if m.world_size <= MAX_CHECK_WORLD or m.dp <= 2:
        return plan
    mesh = replace(m, dp=2, ep=1)
    mesh = replace(mesh, ep=math.gcd(m.ep, mesh.grad_degree))
    return replace(plan, mesh=mesh, global_batch=2 * plan.micro_batch * plan.pipeline.num_microbatches)
