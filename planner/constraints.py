"""The knobs a user fixes on ``autopar plan`` and the kinds the runtime runs, as limits on the search.

``constrain`` turns ``--dp/--tp/--pp/--cp/--ep/--zero/--recompute/--offload/--micro-batch/--schedule``
and an ``Executable`` (what ``runtime_check`` saw the runtime run) into ``PlanOptions`` the
search honours everywhere (its meshes, settings, layer choices and every candidate it
prices), and refuses -- ``UserError``, exit code 2 -- a fixed knob the model, the cluster or
the runtime cannot take, saying why.
"""
from __future__ import annotations

from dataclasses import replace

from autopar.core.cluster import Cluster
from autopar.core.errors import UserError
from autopar.core.graph import OpGraph
from autopar.core.parallel_dims import DEGREE_NAMES
from autopar.core.plan import OFFLOAD, Mesh
from autopar.core.rules import nvme_states, offload_allowed, tp_cap, zero1_shards, zero_family_of
from autopar.core.sharding import megatron_styles, tp_refusals
from autopar.planner.space import mesh_candidates


def _reason(ex, *kinds: str) -> str:
    for x in ex.left_out if ex is not None else ():
        if x.kind in kinds:
            return x.reason
    return "the runtime check left it out"


def nothing_to_split(graph: OpGraph, tp: int, ex) -> UserError:
    """The refusal of ``--tp`` > 1 for a model none of whose layers has a split: such a plan
    would hold a tp mesh and run the whole model on every rank of it."""
    why = _reason(ex, "tensor parallel") if ex is not None and any(x.kind == "tensor parallel" for x in ex.left_out) \
        else ("no layer has a Megatron column/row pair of Linear (or Conv1D) modules, a vocabulary embedding or a "
              "Linear head feeding the loss")
    return UserError(f"--tp {tp}: model {graph.model_name or graph.model_file} has nothing tensor parallelism can "
                     f"split: {why}. Every tp rank would compute the whole model; use --tp 1 or leave --tp out.")


def candidate_meshes(options, cluster: Cluster, num_layers: int, graph: OpGraph | None = None) -> list[Mesh]:
    """The meshes the search may use: the cluster's, cut by the fixed axes and what runs.
    Without the runtime check's verdict, a tp degree the split analysis refuses for some
    layer (a head count or width it does not divide: ``refused_tp_degrees``) is cut too, as
    the check would have left it out."""
    meshes = [m for m in cluster_meshes(options, cluster, num_layers, graph) if mesh_allowed(m, options)]
    if graph is not None and options.executable is None:
        refused = refused_tp_degrees(graph, {m.tp for m in meshes if m.tp > 1})
        meshes = [m for m in meshes if m.tp not in refused]
    return meshes


def refused_tp_degrees(graph: OpGraph, degrees) -> set[int]:
    """The degrees among ``degrees`` at which some layer's Megatron split does not apply
    (core/sharding.tp_refusals); one layer of each structure is asked."""
    out, seen = set(), set()
    for i, layer in enumerate(graph.layers):
        if layer.signature in seen:
            continue
        seen.add(layer.signature)
        styles = megatron_styles(graph, i)
        out |= {d for d in degrees if d not in out and styles and tp_refusals(graph, i, styles, d)}
    return out


def model_degrees(graph: OpGraph | None, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(cp degrees, ep degrees) the model takes (core/cp_support.cp_degrees,
    simulator/ep_cost.ep_degrees); (1,), (1,) without a graph."""
    if graph is None:
        return (1,), (1,)
    from autopar.core.cp_support import cp_degrees
    from autopar.simulator.api import ep_degrees

    return cp_degrees(graph, world), ep_degrees(graph, world)


def cluster_meshes(options, cluster: Cluster, num_layers: int, graph: OpGraph | None = None) -> list[Mesh]:
    """Every mesh the cluster admits for these options (core/rules.py: tp_admitted, pp_admitted,
    dp_admitted; the tp cap ``tp_cap``) and the model's cp and ep degrees, before the fixed axes
    and the runtime's verdict."""
    o = options
    cps, eps = model_degrees(graph, cluster.world_size)
    return mesh_candidates(cluster.world_size, gpus_per_node=cluster.gpus_per_node, num_layers=num_layers,
                           global_batch=o.global_batch, max_tp=tp_cap(cluster.gpus_per_node, o.max_tp, o.tp_inside_node),
                           tp_inside_node=o.tp_inside_node, sequence_parallel=o.sequence_parallel,
                           cp_choices=cps, ep_choices=eps, mesh_class=getattr(o, "mesh_class", Mesh))


def mesh_allowed(m: Mesh, o) -> bool:
    ex = o.executable
    if any(v != m.size(k) for k, v in fixed_degrees(o).items()):
        return False
    if getattr(o, "ep", None) is not None and m.ep != o.ep:
        return False
    if o.micro_batch is not None and (o.global_batch // m.batch_degree) % o.micro_batch:
        return False
    if o.fixed_schedule is not None and m.pp == 1:
        return False
    if ex is not None:
        if m.tp > 1 and m.tp not in ex.tp_degrees:
            return False
        if m.sequence_parallel and not ex.sequence_parallel:
            return False
        if m.pp > 1 and not ex.pipeline:
            return False
        # (``Executable.ep``: whether ep = 2 ran on fake ranks, where the runtime check probes it)
        if m.ep > 1 and not getattr(ex, "ep", True):
            return False
        if m.ep > 1 and m.pp > 1 and not getattr(ex, "ep_pipeline", True):
            return False
    return True


def fixed_degrees(options) -> dict[str, int]:
    """Axis name -> the degree the user fixed (``--dp 2``), in field order: ``PlanOptions.degrees``,
    an axis it does not name chosen by the search; a name that is no declared axis is refused."""
    unknown = sorted(set(options.degrees) - set(DEGREE_NAMES))
    if unknown:
        raise UserError(f"PlanOptions.degrees names {unknown}, which are not parallel axes; the axes are "
                        f"{', '.join(DEGREE_NAMES)} (core/parallel_dims.py).")
    return {k: options.degrees[k] for k in DEGREE_NAMES if k in options.degrees}


def constrain(options, graph: OpGraph, cluster: Cluster):
    """``options`` with the fixed knobs and the runtime's verdict applied; UserError if one cannot be had."""
    o, ex = options, options.executable
    world = cluster.world_size
    fixed = fixed_degrees(o)
    dp, tp, pp, cp = (fixed.get(k) for k in ("dp", "tp", "pp", "cp"))     # None: the search chooses
    for k, v in fixed.items():
        if v < 1 or world % v:
            raise UserError(f"--{k} {v}: the cluster has {world} devices, which {v} does not divide.")
    prod = 1
    for v in fixed.values():
        prod *= v
    if world % prod or (len(fixed) == len(DEGREE_NAMES) and prod != world):
        raise UserError(f"{' x '.join(f'{k} {v}' for k, v in fixed.items())} = {prod} does not fit the cluster's "
                        f"{world} devices ({' x '.join(DEGREE_NAMES)} must equal {world}).")
    if tp and tp > 1 and (ex is not None and not any(ex.splittable) or
                          ex is None and not any(megatron_styles(graph, i) for i in range(len(graph.layers)))):
        raise nothing_to_split(graph, tp, ex)
    if tp and tp > 1 and ex is None:
        # without the runtime check, the analysis's own refusals (a head count or width --tp does
        # not divide: core/sharding.tp_refusals), which the check would have left out
        refused = [why for i in range(len(graph.layers)) for why in tp_refusals(graph, i, megatron_styles(graph, i), tp)]
        if refused:
            raise UserError(f"--tp {tp}: tensor parallelism cannot split this model over {tp} ranks: "
                            f"{refused[0]}. Use a tp degree that divides it, --tp 1, or leave --tp out.")
    if tp and tp > 1 and ex is not None and tp not in ex.tp_degrees:
        other = "".join(f"--tp {d}, " for d in ex.tp_degrees)
        raise UserError(f"--tp {tp}: the runtime cannot split this model over {tp} ranks: "
                        f"{_reason(ex, f'tp={tp}', 'tensor parallel').rstrip('.')}. Use {other}--tp 1 or leave "
                        f"--tp out.")
    if pp and pp > 1:
        if pp > len(graph.layers):
            raise UserError(f"--pp {pp}: the model has {len(graph.layers)} layers, fewer than {pp} stages.")
        if ex is not None and not ex.pipeline:
            raise UserError(f"--pp {pp}: the runtime cannot cut this model into pipeline stages: "
                            f"{_reason(ex, 'pipeline')}. Use --pp 1 or leave --pp out.")
    if cp and cp > 1:
        from autopar.core.cp_support import cp_refusal

        reason = cp_refusal(graph, cp)
        if reason:
            raise UserError(f"--cp {cp}: {graph.model_file} cannot take context parallelism: {reason}. "
                            f"Use --cp 1 or leave --cp out.")
    if getattr(o, "ep", None) is not None:
        from autopar.simulator.api import ep_refusal

        reason = ep_refusal(graph, o.ep)
        if reason:
            raise UserError(f"--ep {o.ep}: {graph.model_file} cannot take expert parallelism: {reason}. "
                            f"Use --ep 1 or leave --ep out.")
        if world % o.ep:
            raise UserError(f"--ep {o.ep}: the cluster has {world} devices, which {o.ep} does not divide.")
        if o.ep > 1 and ex is not None and not getattr(ex, "ep", True):
            raise UserError(f"--ep {o.ep}: the runtime cannot split this model's experts: "
                            f"{_reason(ex, 'expert parallel', 'ep=2')}. Use --ep 1 or leave --ep out.")
        if o.ep > 1 and (pp or 1) > 1 and ex is not None and ex.ep and ex.pipeline and \
                not getattr(ex, "ep_pipeline", True):
            raise UserError(f"--ep {o.ep} with --pp {pp}: the runtime cannot split this model's experts inside "
                            f"pipeline stages: {_reason(ex, 'expert parallel with pipeline')}. "
                            f"Use --pp 1 or --ep 1, or leave one of them out.")
        lent = Mesh(dp=dp, cp=cp or 1, ep=o.ep) if dp is not None else None
        if lent is not None and any(p[0] == "mesh.ep" for p in lent.problems()):     # the ep rule
            raise UserError(f"--ep {o.ep}: expert parallelism borrows its ranks from dp x cp = {lent.grad_degree}, "
                            f"which {o.ep} does not divide; choose an ep that divides dp x cp, or leave --dp out.")
    if o.fixed_schedule is not None and pp == 1:
        raise UserError(f"--schedule {o.fixed_schedule} is a pipeline schedule; it needs --pp > 1.")
    changes: dict = {}
    if o.zero is not None:
        if o.zero not in (0, 1, 2, 3):
            raise UserError(f"--zero {o.zero}: the ZeRO stage is 0, 1, 2 or 3.")
        if o.zero >= 2 and ex is not None and not ex.fsdp:
            raise UserError(f"--zero {o.zero}: the runtime cannot shard this model with FSDP: "
                            f"{_reason(ex, 'ZeRO-2/3 (FSDP)')}. Use --zero 0 or 1.")
        if o.zero == 1 and dp is not None and not zero1_shards(dp):
            raise UserError("--zero 1 shards the optimizer over data-parallel ranks; it needs --dp > 1.")
        changes["zero_families"] = (zero_family_of(o.zero),)
    if o.offload is not None:
        if o.offload not in OFFLOAD:
            raise UserError(f"--offload {o.offload}: it is one of {', '.join(OFFLOAD)}.")
        if o.offload != "none":
            if o.zero is not None and not offload_allowed(o.zero):
                raise UserError(f"--offload {o.offload} goes through FSDP; it needs --zero 2 or 3.")
            if ex is not None and not ex.offload:
                raise UserError(f"--offload {o.offload}: the runtime cannot offload this model: "
                                f"{_reason(ex, 'offload')}.")
            if nvme_states(o.offload):
                missing = cluster.nvme_missing()
                if missing:
                    raise UserError(f"--offload {o.offload}: {missing}.")
            changes["zero_families"] = ("fsdp",)
            changes["offload_tier"] = o.offload
        else:
            changes["allow_offload"] = False
    recompute = tuple(o.recompute)
    if ex is not None:
        kept = tuple(r for r in recompute if r in ex.recompute)
        if not kept:
            raise UserError(f"--recompute {recompute[0]}: the runtime cannot wrap this model's layers for "
                            f"recompute: {_reason(ex, f'recompute {recompute[0]}')}.")
        changes["recompute"] = kept
        if not ex.fsdp:
            changes["zero_families"] = tuple(f for f in changes.get("zero_families", o.zero_families) if f != "fsdp")
        if not ex.offload:
            changes["allow_offload"] = False
    if o.micro_batch is not None and (o.micro_batch < 1 or o.global_batch % o.micro_batch):
        raise UserError(f"--micro-batch {o.micro_batch} does not divide --global-batch {o.global_batch}.")
    out = replace(o, **changes)
    if not candidate_meshes(out, cluster, len(graph.layers), graph):
        told = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                         (*fixed.items(), ("ep", getattr(o, "ep", None)), ("micro_batch", o.micro_batch),
                          ("schedule", o.fixed_schedule)) if v is not None)
        raise UserError(f"no mesh of {world} devices ({cluster.gpus_per_node} per node) with a global batch of "
                        f"{o.global_batch} satisfies {told or 'the constraints'} and what the runtime runs for this "
                        f"model (a data-parallel degree must divide the global batch, tp stays inside a node)."
                        + (" Left out: " + "; ".join(f"{x.kind} ({x.reason})" for x in ex.left_out) if ex and
                           ex.left_out else ""))
    return out
