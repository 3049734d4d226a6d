"""Load what a plan refers to and refuse a plan that does not fit the model or the launch.

Checks, each a ``PlanFileError`` (exit code 2) naming the field and what to do:
malformed plan (``load_plan`` validates every field), model file missing, world size of
the launch different from the plan's mesh, graph fingerprint of the model file (captured with
the plan's model arguments) different from the one the plan was made for, and a layer count
that differs from the captured graph's, and a tensor-parallel split whose dims (or head
counts) the tp degree does not divide (``autopar.runtime.tp_check``), float8 layers on a
machine without fp8 support (``autopar.runtime.fp8_check``), and expert parallelism of a model
without recognised experts or whose expert count ep does not divide (``autopar.runtime.apply_ep``),
and a model file that cannot train by itself (``check_model_trains``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autopar.core.errors import PlanFileError
from autopar.core.graph import OpGraph
from autopar.core.modelfile import ModelFile, load_model_file
from autopar.core.plan import LayerPlan, Plan, load_plan


@dataclass(frozen=True)
class LayerSpec:
    """One layer as the runtime needs it: its name, its top-level modules and its plan."""
    index: int
    name: str                         # "pre", "blocks.3", "post"
    module_paths: tuple[str, ...]
    plan: LayerPlan


@dataclass(frozen=True)
class CheckedPlan:
    plan: Plan
    plan_path: Path
    model_file: ModelFile
    graph: OpGraph
    layers: tuple[LayerSpec, ...]


def layer_specs(plan: Plan, graph: OpGraph) -> tuple[LayerSpec, ...]:
    """Each captured layer with its module paths and the plan's choices for it."""
    return tuple(LayerSpec(index=i, name=g.name, module_paths=tuple(g.module_paths), plan=plan.layers[i])
                 for i, g in enumerate(graph.layers))


def resolve_model_path(plan: Plan, plan_path: Path) -> Path:
    """The plan's model file as given, else relative to the plan file's folder."""
    given = Path(plan.model.file).expanduser()
    if given.is_absolute() or given.is_file():
        return given
    beside = plan_path.parent / given
    return beside if beside.is_file() else given


def check_plan(plan_path: Path, world_size: int | None, model_file: ModelFile | None = None) -> CheckedPlan:
    """Everything that can be checked before any process group exists.  ``model_file``: the
    model to run in place of the plan's model file (the Python API's ``build_model`` function,
    runtime/api.py); its capture must give the fingerprint the plan was made for."""
    plan = load_plan(plan_path)
    if world_size is not None and world_size != plan.world_size:
        m = plan.mesh
        raise PlanFileError(
            f"plan file {plan_path} is for {plan.world_size} ranks (mesh {m.describe('{name}={size}', layout_order=True)}) "
            f"but this launch has {world_size}. Start it with 'torchrun --nproc-per-node {plan.world_size} "
            f"-m autopar.runtime {plan_path}' (or nodes x processes per node = {plan.world_size}), "
            f"or plan again for {world_size} ranks.")
    if model_file is None:
        model_file = load_model_file(resolve_model_path(plan, plan_path))
    model_path = model_file.path
    from autopar.core.capture import capture_loaded

    graph = capture_loaded(model_file, dict(plan.model.args), plan.micro_batch)
    if plan.model.fingerprint not in graph.fingerprints:      # the second: plans written before views left it
        raise PlanFileError(
            f"plan file {plan_path} was made for a model whose graph fingerprint is {plan.model.fingerprint}, "
            f"but {model_path} with model args {dict(plan.model.args)} captures to {graph.fingerprint}: the "
            f"model file or its arguments changed since planning. Plan again with 'autopar plan {model_path} ...'.")
    try:
        plan.validate(num_layers=len(graph.layers))
    except PlanFileError as e:
        raise PlanFileError(f"plan file {plan_path}: {e}") from None
    if plan.mesh.pp > 1 and not graph.sequential_layers:
        raise PlanFileError(
            f"plan file {plan_path} has pp = {plan.mesh.pp}, but the captured forward of {model_path} does not "
            f"pass one activation from layer to layer, so it cannot be cut into pipeline stages. "
            f"Plan with pp = 1 for this model.")
    check_model_trains(plan, model_file, graph)
    from autopar.runtime.fp8_check import check_fp8

    check_fp8(plan, plan_path)
    checked = CheckedPlan(plan=plan, plan_path=plan_path, model_file=model_file, graph=graph,
                          layers=layer_specs(plan, graph))
    if plan.mesh.cp > 1:
        from autopar.runtime.apply_cp import check_cp_plan

        check_cp_plan(checked)
    if plan.mesh.ep > 1:
        from autopar.runtime.apply_ep import check_ep_plan

        check_ep_plan(checked)
    if plan.mesh.tp > 1:
        from autopar.runtime.tp_check import check_tp_divisibility

        check_tp_divisibility(checked)
    if plan.mesh.tp > 1:
        _check_fused_styles(plan, plan_path, graph)
    if plan.mesh.tp > 1 and plan.mesh.sequence_parallel:
        from autopar.core.sharding import sequence_mixing_outside_pairs

        for i, lp in enumerate(plan.layers):
            mixing = sequence_mixing_outside_pairs(graph, i, dict(lp.tp), plan.mesh.tp)
            if mixing:
                raise PlanFileError(
                    f"plan file {plan_path}, layer {graph.layers[i].name}: sequence parallelism would run "
                    f"{', '.join(mixing[:3])}, which mixes sequence positions, outside the column/row pairs its tp "
                    f"styles split, on one rank's shard of the sequence: the run would train another model. "
                    f"Plan with sequence_parallel off, or split that attention's projections too.")
    return checked


def check_model_trains(plan: Plan, model_file: ModelFile, graph: OpGraph) -> None:
    """The model file's own mistakes, named as the plan-time check names them
    (``autopar.core.model_check``): a model without parameters, always; and -- when the plan
    was made with ``--no-runtime-check``, so that check never ran -- one plain CPU step of it
    (a batch on meta, a forward that fails on its own batch such as mixed dtypes, a loss that
    does not fit).  ``autopar run`` runs this before it starts any process, and every rank runs
    it again before the process group exists, so the error is one paragraph with exit code 2."""
    from autopar.core import model_check

    if graph.params_total == 0:
        import torch

        with torch.device("meta"):
            model = model_file.build(**dict(plan.model.args))
        raise model_check.no_parameters_error(model_file.path, type(model).__name__)
    if str(plan.provenance.get("runtime_check", "")).startswith("skipped"):
        own = model_check.own_failure(model_file, dict(plan.model.args), plan.micro_batch)
        if own is not None:
            raise own


def _check_fused_styles(plan: Plan, plan_path: Path, graph: OpGraph) -> None:
    """A column split of a fused projection must name the parts the model cuts its output into
    (``colwise:<k>``, core/sharding.fused_cuts): an even ``colwise`` would hand rank 0 all of q
    and part of k, and ``colwise:<k>`` on a projection that is not cut in k would pair this
    rank's rows of each part with the wrong rows of the row-wise projection -- both run and
    train another model."""
    from autopar.core.plan import tp_style_parts
    from autopar.core.sharding import fused_cuts

    for i, lp in enumerate(plan.layers):
        colwise = {m: tp_style_parts(s)[1] for m, s in lp.tp if tp_style_parts(s)[0] == "colwise"}
        if not colwise:
            continue
        cuts = fused_cuts(graph, i)
        for module, parts in sorted(colwise.items()):
            name = module if module in cuts else f"{graph.layers[i].name}.{module}"
            want = cuts.get(name, 1)
            if parts == want:
                continue
            where = f"plan file {plan_path}, layer {graph.layers[i].name}: tp splits {module} {dict(lp.tp)[module]}"
            if want == 0:
                raise PlanFileError(f"{where}, but its output is cut into parts (q, k, v) of unequal widths or by "
                                    f"ops autopar does not follow, so no column split of it is exact. Leave it "
                                    f"(and its row-wise partner) unsplit.")
            if want > 1:
                raise PlanFileError(f"{where}, but the model cuts its output into {want} equal parts (a fused "
                                    f"projection): an even split would mix them across ranks. Split it "
                                    f"'colwise:{want}' (each rank holds its share of every part).")
            raise PlanFileError(f"{where}, but the model does not cut its output into {parts} parts. Split it "
                                f"'colwise'.")
