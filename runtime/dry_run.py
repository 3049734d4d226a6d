"""The runtime's dry run: one plan applied and run on fake ranks, in this process.

``dry_run`` runs the runtime's own transformations -- ``apply_pp.split_into_stages``,
``parallelize.parallelize_part`` (tensor and sequence parallelism, recompute wrappers, FSDP2 /
replicate units), ``materialize`` -- on the model built on the meta device, inside a *fake*
process group (``torch.testing._internal.distributed.fake_pg``: collectives return at once,
any world size in one process), and then one forward and backward of a micro-batch -- on real
zero-filled CPU tensors for a small model, else under ``FakeTensorMode`` (tensors with shapes,
dtypes and devices but no storage: nothing is allocated or computed) -- under a pipeline, with
the schedule's merge of the last stage's outputs over micro-batches.  What raises there would
raise on the real ranks; the first error comes back as one line of text.

The planner's runtime check (planner/runtime_check.py) decides which plans to try and calls
only this module (``dry_run``, and ``meta_template`` for the model it probes); this module
imports only core/ and the runtime.
"""
from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import torch

from autopar.core.dtypes import dtype_bytes
from autopar.core.graph import OpGraph
from autopar.core.plan import Plan, tp_style_parts



# Models whose fp32 parameters fit in this many bytes run on real zero-filled CPU tensors
# (a micro-batch of 2 costs milliseconds; FakeTensorMode costs ~0.4 ms of Python per op and
# cannot run data-dependent ops such as a routed MoE's ``nonzero`` in every context); larger
# ones run under FakeTensorMode (no storage at all).
REAL_TENSOR_BYTES = 256 << 20


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A process group of ``world_size`` fake ranks in this process, which is ``rank``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise AssertionError("the dry run needs its own process group; one is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    first = text.split(". ")[0]
    first = first if len(first) < 220 else first[:217] + "..."
    return f"{type(e).__name__}: {first}"



def dry_run(plan: Plan, graph: OpGraph, model_file, *, layer_names: tuple[str, ...] | None = None,
            module_paths: tuple[tuple[str, ...], ...] | None = None,
            drop: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> str | None:
    """None when the runtime builds ``plan`` and runs a forward and backward of it on fake
    ranks; else the error it raised, in one line.

    ``layer_names`` / ``module_paths``: per layer of ``plan``, its name and modules in the model
    that runs (default: ``graph``'s layers).  ``drop``: (container path, child indices) deleted
    from the model after building it (``meta_template``), for a plan of a model with fewer
    repeated blocks; ``layer_names`` and ``module_paths`` then name the kept blocks as renumbered."""
    import logging
    import warnings

    if layer_names is None:
        layer_names = tuple(layer.name for layer in graph.layers)
    if module_paths is None:
        module_paths = tuple(tuple(layer.module_paths) for layer in graph.layers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny ops: threads only contend (10x slower on a busy host)
    # DTensor's sharding propagation logs the shape errors it meets on fake tensors; the
    # verdict below carries the one that matters
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # the runtime's own warnings reach the user at run time
            _run(plan, graph, model_file, layer_names, module_paths, drop)
    except Exception as e:  # noqa: BLE001 - whatever the runtime raises is the verdict
        return _short(e)
    finally:
        torch.set_num_threads(threads)
        quiet.setLevel(level)
    return None


_TEMPLATES: dict[tuple, torch.nn.Module] = {}


def meta_template(model_file, args: dict, drop: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> torch.nn.Module:
    """The model on meta with the ``drop`` children deleted from their ``ModuleList`` /
    ``Sequential`` (which renumbers the kept ones), built once per model and ``drop`` (each
    dry run works on a deep copy: the runtime's transformations change the module they get)."""
    from autopar.runtime.materialize import build_meta_model

    key = (str(model_file.path), repr(sorted(args.items())), drop)
    if key not in _TEMPLATES:
        if len(_TEMPLATES) >= 4:
            _TEMPLATES.clear()
        model = build_meta_model(model_file, args)
        for container, children in drop:
            holder = model.get_submodule(container)
            for idx in sorted(children, reverse=True):
                del holder[idx]
        _TEMPLATES[key] = model
    return _TEMPLATES[key]


def _run(plan: Plan, graph: OpGraph, model_file, layer_names, module_paths, drop) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime import apply_pp
    from autopar.runtime.mesh import RankContext
    from autopar.runtime.parallelize import build_stage_parts
    from autopar.runtime.plan_check import CheckedPlan, LayerSpec

    args = dict(plan.model.args)
    layers = tuple(LayerSpec(index=i, name=name, module_paths=paths, plan=plan.layers[i])
                   for i, (name, paths) in enumerate(zip(layer_names, module_paths)))
    checked = CheckedPlan(plan=plan, plan_path=Path("plan.json"), model_file=model_file, graph=graph,
                          layers=layers)
    device = torch.device("cpu")
    template = meta_template(model_file, args, drop)
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in _named_tensors(template)}
    real = sum(math.prod(s) * dtype_bytes("float32") for s, _ in shapes.values()) <= REAL_TENSOR_BYTES   # fp32 template
    m = plan.mesh
    # the last rank: it holds the smallest shard of an uneven split (a 1-wide Linear split in
    # two leaves it nothing), where rank 0 would run
    rank = m.world_size - 1
    with fake_world(m.world_size, rank):
        mesh = init_device_mesh("cpu", m.shape, mesh_dim_names=m.axis_names)
        ctx = RankContext.build(m, rank, local_rank=0, device=device, mesh=mesh)
        meta = copy.deepcopy(template)
        _check_even_splits(meta, plan)

        def zeros(fqn: str) -> torch.Tensor:
            shape, dtype = shapes[fqn]
            return torch.zeros(shape, dtype=dtype)

        fake_mode = None
        if not real:
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            fake_mode = _fake_mode_class()(allow_non_fake_inputs=True, shape_env=ShapeEnv())

        @contextlib.contextmanager
        def fake_tensors():   # one mode for the parameters and the forward that reads them
            if fake_mode is None:
                yield
                return
            with fake_mode:
                yield

        # steps 2-6b exactly as training runs them (runtime/parallelize.build_stage_parts), every stage
        built = build_stage_parts(checked, ctx, meta, zeros, lambda i: True, around_materialize=fake_tensors,
                                  swap_params=fake_mode is None)
        parts = [built.parts[i] for i in sorted(built.parts)]
        with fake_tensors():
            # DDP (ZeRO-0/1 without tp/pp) wraps the module unchanged; its constructor's
            # coalesced broadcast needs a real process group, so it is not run here
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                inputs, target = model_file.make_batch(plan.micro_batch, **args)
            if plan.mesh.cp > 1:
                # the rank's tokens under context parallelism's attention, as training runs
                # them (runtime/train.py; under a pipeline every stage's forward, its first
                # stage given the extra arguments positionally): a recomputed layer enters the
                # same mode in backward
                cp = built.cp
                inputs = tuple(cp.slice(x) for x in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
                target = cp.slice(target)
                kwargs = cp.forward_kwargs(inputs, device)
                if plan.mesh.pp > 1:
                    inputs, kwargs = cp.stage_args(inputs, device), {}
                with cp.mode():
                    out = parts[0](*inputs, **kwargs)
                    for part in parts[1:]:
                        out = _call(part, out if isinstance(out, tuple) else (out,))
            else:
                out = _call(parts[0], inputs)
                for part in parts[1:]:
                    out = _call(part, out if isinstance(out, tuple) else (out,))
            if plan.mesh.pp > 1:
                # the schedule merges the last stage's outputs of the micro-batches at the end of
                # every step (a 0-d output once crashed torch's merge there): merge two
                apply_pp.merge_microbatch_outputs([out, out])
            if built.restore_output is not None:
                out = built.restore_output(out)
            loss = model_file.loss(out, target)
            loss.backward()


_FAKE_MODE_CLASS: type | None = None


def _fake_mode_class() -> type:
    """``FakeTensorMode`` that also answers ``aten._grouped_mm`` on float32 / float16 operands as
    the kernels do: an output of the operands' dtype.  Its meta function (torch 2.13,
    torch/_meta_registrations.py ``_meta_grouped_mm_common``) still refuses any dtype but
    bfloat16, while the CPU kernel and the CUDA one (aten/src/ATen/native/cuda/GroupedBlas.cpp:
    a CUTLASS path for bf16 on sm90/sm100, ``_grouped_mm_fallback`` -- a loop of mm over the
    groups -- otherwise) run them; transformers 5's grouped experts call it on the weights'
    dtype.  The shape comes from the meta function on bfloat16 copies.  (In the mode itself, not
    in a mode stacked on it: a second Python mode costs every op of the dry run a dispatch.)"""
    global _FAKE_MODE_CLASS
    if _FAKE_MODE_CLASS is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        class GroupedMMAnyDtype(FakeTensorMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._grouped_mm.default and args[0].dtype in (torch.float32, torch.float16):
                    kwargs = kwargs or {}
                    a, b, *rest = args
                    kwargs = {k: v for k, v in kwargs.items() if k != "out_dtype"}
                    with self:
                        return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).to(a.dtype)
                return super().__torch_dispatch__(func, types, args, kwargs)

        _FAKE_MODE_CLASS = GroupedMMAnyDtype
    return _FAKE_MODE_CLASS


def _check_even_splits(model, plan: Plan) -> None:
    """Every split dimension divides by the tp degree.

    Megatron's column and row splits partition a weight evenly over the tensor-parallel ranks
    (Shoeybi et al. 2019, Sec. 3), which is what the simulator prices (each rank 1/tp of the
    work).  DTensor would shard unevenly (a 1-wide Linear split in two leaves one rank
    nothing), on which the collectives of a real process group fail: refuse such a split."""
    from autopar.runtime.apply_tp import is_conv1d

    tp = plan.mesh.tp
    if tp == 1:
        return
    for lp in plan.layers:
        for fqn, style in lp.tp:
            if style == "expert":        # stacked experts split by expert (runtime/expert_tp.py)
                experts = getattr(model.get_submodule(fqn), "num_experts", 0)
                if not isinstance(experts, int) or experts % tp:
                    raise ValueError(f"{fqn} holds {experts} experts, which do not divide over tp = {tp}")
                continue
            try:
                weight = model.get_submodule(fqn).weight
            except AttributeError:
                continue
            # Linear: colwise dim 0; Embedding and Conv1D (weight [in, out]): colwise dim 1
            transposed = isinstance(model.get_submodule(fqn), torch.nn.Embedding) or is_conv1d(model.get_submodule(fqn))
            base, parts = tp_style_parts(style)
            dim = 0 if (base == "colwise") != transposed else 1
            size = int(weight.shape[dim]) // parts     # a fused projection: each part is split
            if size % tp:
                raise ValueError(f"{fqn} ({type(model.get_submodule(fqn)).__name__} {tuple(weight.shape)}) split "
                                 f"{style} has {size} along the split, which does not divide over tp = {tp}")


def _call(part, inputs):
    if isinstance(inputs, dict):
        return part(**inputs)
    return part(*inputs) if isinstance(inputs, (tuple, list)) else part(inputs)


def _named_tensors(module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
