"""Pipeline parallelism through ``torch.distributed.pipelining``.

Stages are cut from the layer list: the model's forward is traced with ``torch.fx`` keeping
each layer's top-level modules (the blocks, the embeddings, the head) as opaque calls; every
traced node is given the stage of the layer that owns it (plain functions between modules
take the latest stage among their inputs), and ``torch.fx.passes.split_module`` cuts the graph
into one ``GraphModule`` per stage.  Each stage module keeps the model's own module names
("blocks.3.attn.qkv"), so tensor parallelism, recompute, FSDP and checkpoints address
parameters by the same FQNs as in the unsplit model.  The "pre" layer (embeddings) lands on
the first stage and the "post" layer (final norm, head) on the last; the loss runs on the last
stage through the schedule's ``loss_fn``.

Where ``torch.fx`` cannot trace the forward (Hugging Face models), the stages are cut from the
``torch.export`` graph of the forward on a meta micro-batch instead (the graph capture uses):
each ATen op belongs to the layer of the innermost module it ran in (its ``nn_module_stack``),
parameters and buffers keep their FQNs, and the model's output structure (a ``ModelOutput``)
is rebuilt from the last stage's tensors for the loss.  Such a stage calls none of the model's
modules, so module-level transformations apply to it as a whole (``parallelize``).  A value
needed by the next stage besides the hidden state (rotary tables, an attention mask) is sent
along with it.

A stage receives only what the previous stage sends, so a value made on one stage and read
two or more stages later is relayed by the stages between (``_relay_across_stages``); a forward
whose stages need a non-tensor value from another stage cannot be pipelined, and the runtime
says so.

Schedules: GPipe (Huang et al. 2019), 1F1B (Narayanan et al. 2021, PipeDream-Flush),
interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2), and the ones that split each backward into
its input and weight gradients (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): interleaved
zero bubble (ZB1P over looped chunks), ZB-V and DualPipeV (DeepSeek-V3 technical report 2024,
Sec. 3.2.1, cut in a V) -- torch's own classes, with ``scale_grads=True`` so gradients are
averaged over the micro-batches.  Stage i runs on pp rank i % pp, or for zbv and dualpipev on
rank i for i < pp and 2 pp - 1 - i after (the V: ``core.rules.stage_rank``, torch's
``generate_stage_to_rank_mapping(style="v")``), so pp rank 0 holds the first and the last stage.
At the end of a step the
schedule merges the last stage's outputs of the micro-batches into the batch's
(``merge_microbatch_outputs``): tensors are joined along the batch dim, as torch's default
merge does, but a 0-d tensor -- a Hugging Face MoE model's router loss, a loss the forward
returns -- has no batch dim to join along (torch's merge crashed on it: "zero-dimensional
tensor cannot be concatenated") and is averaged instead.

Profiler regions: the schedules label their actions inconsistently (1F1B not at all; GPipe's
"Forward i" and the interleaved runtime's "PP:0F3" also hold the wait for the received
activation), so each stage labels its own compute -- ``autopar.forward`` around a micro-batch's
forward (and the loss on the last stage), ``autopar.backward`` around its backward -- the names
the non-pipelined loop uses (``autopar.runtime.profile_breakdown``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.microbatch import merge_chunks
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.profiler import record_function

from autopar.core.errors import PlanFileError

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                    "interleaved-zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
                    "dualpipev": ScheduleDualPipeV}
#: the schedules that take a list of stages (several per rank), the others one stage
MULTI_STAGE = ("interleaved", "interleaved-zb", "zbv", "dualpipev")
FORWARD_REGION = "autopar.forward"
BACKWARD_REGION = "autopar.backward"


class LabelledStage(PipelineStage):
    """A ``PipelineStage`` whose forward and backward compute run inside profiler regions.

    The regions cover only this stage's compute for one micro-batch: the schedule waits for
    received activations and gradients before calling these methods, and sends after them.
    """

    # entered around each micro-batch's forward (``forward_with``); none by default
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def forward_one_chunk(self, *args, **kwargs):
        with record_function(FORWARD_REGION), self.forward_context():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with record_function(BACKWARD_REGION):
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with record_function(BACKWARD_REGION):
            return super().backward_weight_one_chunk(*args, **kwargs)


def labelled_loss(loss_fn: Callable) -> Callable:
    """The last stage's loss, counted as forward (as in the non-pipelined loop)."""
    def loss(output, target, **kwargs):
        with record_function(FORWARD_REGION):
            return loss_fn(output, target, **kwargs)
    return loss


class _LayerLeafTracer(fx.Tracer):
    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


@dataclass
class StageSplit:
    """The stage modules, the function that restores the model's output structure from the last
    stage's output, and how the forward was cut: ``"fx"`` (stage modules call the model's own
    modules) or ``"export"`` (stage modules run ATen ops of the ``torch.export`` graph: the
    layers' modules hold the parameters but are not called)."""
    stages: list[nn.Module]
    restore_output: Callable
    cut_by: str


def split_into_stages(model: nn.Module, layer_paths: list[tuple[str, ...]], stage_of_layer: list[int],
                      num_stages: int, example_inputs: tuple | None = None,
                      device: torch.device | None = None) -> StageSplit:
    """One ``GraphModule`` per pipeline stage, cut from ``model``'s forward at layer boundaries.

    ``torch.fx`` first (the stages call the model's modules, so tensor parallelism, per-layer
    recompute and FSDP units apply inside them); where fx cannot trace the forward (Hugging
    Face models), the ``torch.export`` graph of the forward on ``example_inputs`` (meta tensors
    of one micro-batch), whose ops are given the layer of the module they ran in
    (``nn_module_stack``).  The last stage's output (a tensor or a tuple of tensors, what a stage
    can send) is turned back into the structure the forward returns (a dict, a tuple, a
    ``ModelOutput``) -- what the model file's ``loss_fn`` expects -- by ``restore_output``."""
    module_names = {n for n, _ in model.named_modules()}
    owner: dict[str, int] = {}          # module or attribute path -> layer
    for layer, paths in enumerate(layer_paths):
        for p in paths:
            owner[p] = layer
    leaves = {p for p in owner if p in module_names}
    out_spec, cut_by = None, "fx"
    try:
        gm = fx.GraphModule(model, _LayerLeafTracer(leaves).trace(model))
    except Exception as fx_error:  # noqa: BLE001 - fx raises many kinds; try export, then report both
        if example_inputs is None:
            raise PlanFileError(f"pipeline stages: the model's forward cannot be traced with torch.fx "
                                f"({type(fx_error).__name__}: {fx_error}). Plan with pp = 1 for this model.") from None
        try:
            gm, out_spec = _export_graph(model, example_inputs, device or torch.device("cpu"))
        except Exception as e:  # noqa: BLE001
            raise PlanFileError(
                f"pipeline stages: the model's forward can be traced neither with torch.fx "
                f"({type(fx_error).__name__}: {fx_error}) nor with torch.export ({type(e).__name__}: {e}), "
                f"so it cannot be cut into stages. Plan with pp = 1 for this model.") from None
        cut_by = "export"
    stage_of = _assign_stages(gm.graph, owner, stage_of_layer)
    _relay_across_stages(gm, stage_of)
    split = split_module(gm, model, lambda node: stage_of[node.name], keep_original_order=True)
    _attrs_into_stages(split)
    stages = [_restore_names(stage, model, fresh=cut_by == "export") for stage in _check_chain(split, num_stages)]
    for stage in stages[:-1]:
        _contiguous_outputs(stage)
    restore = _output_structure(split)
    if out_spec is not None:
        flat = restore
        restore = lambda output: tree_unflatten(list(flat(output)), out_spec)  # noqa: E731
    return StageSplit(stages, restore, cut_by)


def _export_graph(model: nn.Module, example_inputs: tuple, device: torch.device) -> tuple[fx.GraphModule, object]:
    """The forward as one flat ATen graph (``torch.export`` on the meta model), made runnable on
    ``device``: the export's input guards and tensor-metadata assertions (which name the meta
    device of the trace) are dropped and the ``device=meta`` arguments of factory ops (arange,
    new_ones, to) become ``device``."""
    from autopar.runtime.expert_calls import export_with_expert_calls

    # torch.export.export, routed experts kept as module calls (runtime/expert_calls.py)
    ep, gm = export_with_expert_calls(model, example_inputs)
    for g in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        for node in list(g.graph.nodes):
            if (node.op == "call_module" and str(node.target).startswith("_guards")) or (
                    node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default):
                if not node.users:
                    g.graph.erase_node(node)
                continue
            node.args = fx.node.map_aggregate(node.args, lambda a: _on(a, device))
            node.kwargs = fx.node.map_aggregate(node.kwargs, lambda a: _on(a, device))
        g.recompile()
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    return gm, ep.call_spec.out_spec


def _on(arg, device: torch.device):
    return device if isinstance(arg, torch.device) and arg.type == "meta" else arg


def _contiguous_outputs(stage: fx.GraphModule) -> None:
    """A stage sends its outputs as they are; an expanded or transposed view (an attention
    mask broadcast over heads) must be made contiguous first (gloo and NCCL send dense
    buffers)."""
    out = next(n for n in stage.graph.nodes if n.op == "output")
    with stage.graph.inserting_before(out):
        out.args = (fx.node.map_arg(out.args[0], lambda n: stage.graph.call_method("contiguous", (n,))),)
    stage.recompile()


def _output_structure(split: fx.GraphModule) -> Callable:
    """``restore(last_stage_output)`` -> the structure the split graph's output node builds."""
    last = [n for n in split.graph.nodes if n.op == "call_module"][-1]
    structure = next(n for n in split.graph.nodes if n.op == "output").args[0]

    def build(value, output):
        if isinstance(value, fx.Node):
            return output if value is last else output[value.args[1]]    # getitem(last, k)
        if isinstance(value, dict):
            return {k: build(v, output) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return tuple(build(v, output) for v in value)
        return value

    return lambda output: build(structure, output)


def _attrs_into_stages(split: fx.GraphModule) -> None:
    """``split_module`` passes a tensor attribute read by the forward itself (``self.pos``, not a
    module's) into the stage as an argument; make it the stage's own attribute instead, so a
    parameter is trained by the stage that uses it and stages receive only activations."""
    for call in [n for n in split.graph.nodes if n.op == "call_module"]:
        sub = getattr(split, call.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        kept = []
        for i, (arg, ph) in enumerate(zip(call.args, placeholders)):
            if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
                kept.append(arg)
                continue
            name = f"_attr_{i}_" + str(arg.target).replace(".", "_")
            setattr(sub, name, _get_attr(split, str(arg.target)))
            with sub.graph.inserting_after(placeholders[-1]):
                attr = sub.graph.get_attr(name)
            ph.replace_all_uses_with(attr)
            sub.graph.erase_node(ph)
        if len(kept) != len(call.args):
            call.args = tuple(kept)
            sub.recompile()
    for node in [n for n in split.graph.nodes if n.op == "get_attr" and not n.users]:
        split.graph.erase_node(node)
    split.recompile()


def _layer_of(path: str, owner: dict[str, int]) -> int | None:
    while path:
        if path in owner:
            return owner[path]
        path = path.rpartition(".")[0]
    return None


def _assign_stages(graph: fx.Graph, owner: dict[str, int], stage_of_layer: list[int]) -> dict[str, int]:
    stage: dict[str, int] = {}
    unplaced: list[fx.Node] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = _layer_of(str(node.target), owner) if node.op in ("call_module", "get_attr") else None
        module_stack = node.meta.get("nn_module_stack") if node.op == "call_function" else None
        if module_stack:                 # an export graph's op: the layer of the innermost module
            layer = _layer_of(str(list(module_stack.values())[-1][0]), owner)
        # attributes (parameters, buffers) become each using stage's own (_attrs_into_stages):
        # they do not order the stages
        inputs = [stage[a.name] for a in node.all_input_nodes if a.name in stage and a.op != "get_attr"]
        if layer is not None:
            stage[node.name] = max([stage_of_layer[layer], *inputs])
        elif inputs:
            stage[node.name] = max(inputs)
        elif any(a.op == "placeholder" for a in node.all_input_nodes):
            stage[node.name] = 0
        else:
            unplaced.append(node)          # constants: placed with their first consumer
    for node in reversed(unplaced):
        users = [stage[u.name] for u in node.users if u.name in stage]
        stage[node.name] = min(users) if users else 0
    return stage


def _relay(value):
    """Hand a value on unchanged: a stage between the one that makes a value and the one that
    reads it passes it through (``_relay_across_stages``)."""
    return value


def _relay_across_stages(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    """A value made on stage s and read on stage t > s + 1 (transformers 5's rotary tables and
    attention mask, made once before the first block and read by every block) is handed on by
    every stage in between: a ``_relay`` node on each of stages s + 1 .. t - 1, so that each
    stage receives only what the previous one sends (``PipelineStage`` receives from its
    neighbour alone).  The relayed tensors cost one extra send per boundary they cross."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op in ("output", "get_attr") or node.name not in stage_of:
            continue
        s = stage_of[node.name]
        far = [u for u in node.users if u.op != "output" and stage_of.get(u.name, s) > s + 1]
        if not far:
            continue
        relays: dict[int, fx.Node] = {}
        prev = node
        for k in range(s + 1, max(stage_of[u.name] for u in far)):
            with graph.inserting_after(prev):
                prev = graph.call_function(_relay, (prev,))
            stage_of[prev.name] = k
            relays[k] = prev
        for user in far:
            user.replace_input_with(node, relays[stage_of[user.name] - 1])
    gm.recompile()


def _check_chain(split: fx.GraphModule, num_stages: int) -> list[nn.Module]:
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    if len(calls) != num_stages:
        raise PlanFileError(f"pipeline stages: cutting the forward gave {len(calls)} pieces for {num_stages} stages.")
    placeholders = [n for n in split.graph.nodes if n.op == "placeholder"]
    prev_outputs: list[fx.Node] = placeholders
    for i, call in enumerate(calls):
        srcs = [a.args[0] if a.op == "call_function" and a.args and isinstance(a.args[0], fx.Node)
                and a.args[0].op == "call_module" else a for a in call.args]
        ok = all(isinstance(a, fx.Node) for a in call.args) and not call.kwargs
        if i == 0:
            ok = ok and list(call.args) == placeholders
        else:
            ok = ok and all(s is calls[i - 1] for s in srcs) and _in_order(call.args, calls[i - 1])
        if not ok:
            raise PlanFileError(
                f"pipeline stages: stage {i} needs values that the previous stage does not send "
                f"(the forward passes something other than one chain of activations between layers). "
                f"Plan with pp = 1 for this model, or move the stage boundary.")
        prev_outputs = [call]
    if [a for n in split.graph.nodes if n.op == "output" for a in n.all_input_nodes
            if a is not calls[-1] and not (a.op == "call_function" and calls[-1] in a.all_input_nodes)]:
        raise PlanFileError("pipeline stages: the model's output is not produced by the last stage alone; "
                            "plan with pp = 1 for this model.")
    return [getattr(split, c.target) for c in calls]


def _restore_names(stage: fx.GraphModule, model: nn.Module, fresh: bool = False) -> fx.GraphModule:
    """``split_module`` flattens names ("blocks.0" -> "blocks_0"); put the model's own back.

    ``fresh``: the stage gets parameters and buffers of its own (same shapes, still on meta;
    shared ones stay shared): an export-cut stage does not hold the model's modules, and
    materialisation swaps each parameter in place, which needs it held by this stage alone."""
    by_id = {id(m): n for n, m in model.named_modules()}
    by_id.update({id(t): n for n, t in model.named_parameters(remove_duplicate=False)})
    by_id.update({id(t): n for n, t in model.named_buffers(remove_duplicate=False)})
    graph = stage.graph
    attrs: dict[str, object] = {}
    copies: dict[int, torch.Tensor] = {}
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            obj = stage.get_submodule(node.target) if node.op == "call_module" else _get_attr(stage, node.target)
            name = by_id.get(id(obj))
            if name is None:
                if isinstance(obj, fx.GraphModule):          # a higher-order op's body (export)
                    name = str(node.target)
                else:
                    raise PlanFileError(f"pipeline stages: cannot find {node.target!r} in the model after the split.")
            if fresh and isinstance(obj, torch.Tensor):
                if id(obj) not in copies:
                    copies[id(obj)] = (nn.Parameter(torch.empty_like(obj), requires_grad=obj.requires_grad)
                                       if isinstance(obj, nn.Parameter) else torch.empty_like(obj))
                obj = copies[id(obj)]
            node.target = name
            attrs[name] = obj
    out = fx.GraphModule(attrs, graph, class_name="Stage")
    # a buffer the model registered with persistent=False (a rotary embedding's inv_freq) stays
    # out of the stage's state dict, as it is out of the whole model's: a checkpoint saved by
    # any other layout holds no entry for it
    transient = {f"{m}.{b}" if m else b for m, mod in model.named_modules() for b in mod._non_persistent_buffers_set}
    for name, obj in attrs.items():       # a plain tensor attribute is a buffer (moved and filled)
        if isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
            parent, _, leaf = name.rpartition(".")
            holder = out.get_submodule(parent) if parent else out
            if leaf not in holder._buffers:
                holder.__dict__.pop(leaf, None)
                holder.register_buffer(leaf, obj, persistent=name not in transient)
            elif name in transient:
                holder._non_persistent_buffers_set.add(leaf)
    return out


def _get_attr(module: nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _in_order(args, prev_call: fx.Node) -> bool:
    """The next stage's arguments are the previous stage's outputs in their order."""
    if len(args) == 1 and args[0] is prev_call:
        return True
    idx = [a.args[1] for a in args if a.op == "call_function" and len(a.args) == 2]
    return idx == list(range(len(args)))


def merge_microbatch_outputs(chunks: list):
    """The last stage's outputs of the micro-batches (one per micro-batch, same structure) as
    the batch's: tensors with a batch dim joined along dim 0 (torch's ``merge_chunks`` with its
    default spec, DTensors included); a 0-d tensor -- a mean over its micro-batch's samples,
    such as a router's auxiliary loss -- averaged over the equal micro-batches, the mean over
    the batch; any other value taken from the first micro-batch."""
    flat = [tree_flatten(c) for c in chunks]
    leaves, spec = flat[0]
    batched = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.dim() > 0]
    joined = merge_chunks([[f[0][i] for i in batched] for f in flat], None) if batched else []
    out = list(leaves)
    for i, value in zip(batched, joined):
        out[i] = value
    for i, v in enumerate(leaves):
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            out[i] = sum(f[0][i] for f in flat) / len(flat)
    return tree_unflatten(out, spec)


def _merging(cls: type) -> type:
    """The schedule class with ``merge_microbatch_outputs`` as its merge of the outputs.  (torch's
    own hook, ``output_merge_spec``, is a spec per output leaf given before the first step,
    when the last stage's outputs are not known yet.)"""
    return type(cls.__name__, (cls,), {"_merge_outputs": lambda self, chunks: merge_microbatch_outputs(chunks)})


def runnable_schedule(schedule: str, num_microbatches: int, num_stages: int) -> str:
    """The schedule torch runs for the plan's: 1F1B with fewer micro-batches than stages runs
    as GPipe.

    ``Schedule1F1B`` refuses m < p.  PipeDream-Flush's warm-up runs min(m, p - s) forwards on
    stage s before its first backward (Narayanan et al. 2021, Sec. 2.2), so with m < p every
    stage but the last m - 1 runs GPipe's fill-drain order exactly; the last m - 1 stages run
    theirs with at most p - s instead of m micro-batches in flight.  The critical path, hence
    the bubble (p - 1) / (m + p - 1), and the gradients are the same.
    """
    if schedule == "1f1b" and num_microbatches < num_stages:
        return "gpipe"
    return schedule


def forward_with(stages: list[PipelineStage], context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run every micro-batch forward of ``stages`` inside ``context()`` -- context parallelism's
    attention mode (runtime/apply_cp.py).  Only the forward of the schedule's actions: the
    stages' metadata inference (on meta tensors, at the first step), the sends and receives,
    the loss and the backward stay outside it (a recomputing layer enters the mode itself in
    backward, runtime/recompute.py)."""
    for stage in stages:
        stage.forward_context = context


def build_schedule(stage_modules: dict[int, nn.Module], num_stages: int, pp_mesh: DeviceMesh,
                   device: torch.device, schedule: str, num_microbatches: int,
                   loss_fn: Callable, restore_output: Callable = lambda out: out,
                   forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                   overlap_experts: bool = False) -> tuple[object, list[PipelineStage]]:
    """``PipelineStage`` per local stage and the plan's schedule over them; the last stage's
    output goes through ``restore_output`` (``split_into_stages``) before ``loss_fn``;
    ``forward_context``: see ``forward_with``.  ``overlap_experts`` (expert parallelism under
    dualpipev): the schedule's forward-backward pairs run with their all-to-alls overlapped
    (runtime/dualpipe_overlap.py; the counts as ``schedule.overlapped_pairs``)."""
    group = pp_mesh.get_group()
    stages = [LabelledStage(mod, index, num_stages, device, group=group)
              for index, mod in sorted(stage_modules.items())]
    if forward_context is not None:
        forward_with(stages, forward_context)
    cls = _merging(SCHEDULE_CLASSES[runnable_schedule(schedule, num_microbatches, num_stages)])
    user_loss = loss_fn
    loss_fn = labelled_loss(lambda output, target: user_loss(restore_output(output), target))
    if schedule in MULTI_STAGE:
        built = cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
        if overlap_experts and schedule == "dualpipev":
            from autopar.runtime.dualpipe_overlap import overlap_pairs

            built.overlapped_pairs = overlap_pairs(built)
        return built, stages
    if len(stages) != 1:
        raise PlanFileError(f"pipeline schedule {schedule!r} runs one stage per pp rank; use one of "
                            f"{', '.join(MULTI_STAGE)}.")
    return cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True), stages
