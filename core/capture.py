"""Capture a model's forward on the meta device into an ``OpGraph``.

Strategy (docs/design.md, "Contracts"), fastest first:

1. ``torch.fx.symbolic_trace`` (torch.nn modules such as Linear stay ``call_module`` leaves)
   then a shape-propagating run of the graph on meta tensors.
2. If that fails (Hugging Face ``transformers`` models, ``.item()``, ...): ``torch.export``
   on meta (ATen level; nodes map to their owning module through ``nn_module_stack``).
3. If both fail: symbolic tracing again with the submodules that defeated the tracer kept
   opaque (kind ``"leaf"``, costed from their parameters and shapes); a leaf that cannot run
   on meta is run once on CPU on zeros to learn its output shape.  ``graph.leaf_modules``
   and ``graph.notes`` say which.

The paths live in ``trace_fx`` and ``trace_export`` and fill a ``trace_walk.Walk``; each
traced node becomes an ``OpFacts`` costed by ``autopar.core.op_costs``; ops are grouped
into layers by ``autopar.core.layers``.  This module holds the public entry points, the
loss recording and the assembly of the ``OpGraph``.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from autopar.core.errors import ModelFileError
from autopar.core.graph import OpGraph, OpNode
from autopar.core.layers import assign_layers, build_layers, find_blocks
from autopar.core.modelfile import ModelFile, check_batch_rows, load_model_file, user_code
from autopar.core.op_costs import canonical, cost
from autopar.core.trace_export import trace_export
from autopar.core.trace_fx import leaf_fallback, trace_symbolic
from autopar.core.trace_walk import (ParamIndex, Val, Walk, call_attrs, dtype_name, tensor_slots,
                                     nbytes, order_operands, short_error)

LOSS_TARGET = "target"              # value name of the loss target in the graph
LOSS_NOT_CAPTURED = "loss not captured"   # the note a capture whose loss failed on meta carries


# torch's tracers log each failed attempt with its traceback (kilobytes per try); the capture's
# own error names what failed
_NOISY_LOGGERS = ("torch._subclasses.fake_tensor", "torch._dynamo", "torch._export", "torch.export",
                  "torch.fx.experimental.symbolic_shapes", "torch._functorch")


@contextlib.contextmanager
def _torch_logs_quiet():
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# ============================================================================ public API
def capture_model_file(path: str | Path, model_args: dict[str, Any] | None = None,
                       batch_size: int = 8) -> OpGraph:
    """Load a model file, build the model and a batch on meta, and capture the forward.

    A forward or loss that fails here and also in one plain CPU step (``core.model_check``) is
    the model file's own error (``ModelFileError``); one that fails only on meta is a note."""
    model_args = dict(model_args or {})
    t0 = time.perf_counter()
    mf = load_model_file(path)
    key = (str(mf.path), hashlib.sha1(Path(mf.path).read_bytes()).hexdigest(), repr(sorted(model_args.items())))
    return capture_loaded(mf, model_args, batch_size, t0, reuse=key)


#: (model file path, its content's SHA-1, model args) -> the model built on meta by the last capture
#: of that file: a capture at another batch size (the planner prices its plans at their micro-batches,
#: simulator/plan_price.py) reuses the module and, where it was traced with torch.fx, its trace
#: (core/trace_fx.trace_symbolic); the graph is that of a fresh build and trace
_BUILT: dict[tuple, torch.nn.Module] = {}
_BUILT_ENTRIES = 2


def capture_loaded(mf: ModelFile, model_args: dict[str, Any] | None = None, batch_size: int = 8,
                   t0: float | None = None, reuse: tuple | None = None) -> OpGraph:
    """``capture_model_file`` of a model file already loaded (or of functions made into one:
    runtime/api.py).  ``reuse``: a key under which the module built is kept, and taken from
    when it is there (``_BUILT``)."""
    model_args = dict(model_args or {})
    t0 = time.perf_counter() if t0 is None else t0
    torch.manual_seed(0)
    with torch.device("meta"):
        module = _BUILT.get(reuse) if reuse is not None else None
        if module is None:
            module = mf.build(**model_args)
        inputs, target = mf.make_batch(batch_size, **model_args)
    check_batch_rows(inputs, target, batch_size, mf.path)
    build_s = time.perf_counter() - t0
    size = model_args.get("size")
    name = size if isinstance(size, str) else mf.name
    try:
        with user_code(mf.path, "tracing the model's forward and loss"), _torch_logs_quiet():
            graph = capture(module, inputs, model_name=name, model_file=str(mf.path),
                            model_args=model_args, batch_size=batch_size,
                            loss_fn=mf.loss, target=target)
    except ModelFileError as e:
        # a forward that fails on its own batch in plain PyTorch (real tensors: data-dependent
        # control flow runs there) is the model file's error, not the tracer's
        from autopar.core.model_check import MAX_PARAM_BYTES, own_failure
        from autopar.core.trace_fx import traced_path_advice

        own = own_failure(mf, model_args, batch_size)
        if own is not None:
            raise own from None
        shape = getattr(e, "traced_shape_error", None)
        ran = sum(p.numel() * 4 for p in module.parameters()) <= MAX_PARAM_BYTES   # own_failure ran a CPU step
        if shape is not None and ran:
            raise ModelFileError(f"{shape[0]}. {traced_path_advice(shape[1])}") from None
        raise
    if any(n.startswith(LOSS_NOT_CAPTURED) for n in graph.notes):
        # the loss failed on meta: if it fails on real tensors too (a target of another shape,
        # a loss_fn that raises), the model file cannot train -- its error, exit 2
        from autopar.core.model_check import own_failure

        own = own_failure(mf, model_args, batch_size)
        if own is not None:
            raise own
    if reuse is not None:
        if reuse not in _BUILT and len(_BUILT) >= _BUILT_ENTRIES:
            _BUILT.clear()
        _BUILT[reuse] = module
    graph.notes.insert(0, f"build_model + make_batch on meta: {build_s:.2f} s")
    graph.capture_s += build_s
    return graph


def capture(module: torch.nn.Module, inputs: Any, *, model_name: str, model_file: str = "",
            model_args: dict[str, Any] | None = None, batch_size: int | None = None,
            loss_fn: Callable | None = None, target: Any = None) -> OpGraph:
    """Trace ``module(*inputs)`` (meta tensors) into an OpGraph; see the module docstring.

    With ``loss_fn`` and ``target`` the loss is recorded too (its ops join the last layer).
    """
    t0 = time.perf_counter()
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    module.train()
    where = model_file or type(module).__name__
    notes: list[str] = []
    params = ParamIndex(module)

    try:
        walk, method = trace_symbolic(module, inputs, params, leaves=()), "symbolic_trace"
    except Exception as sym_err:
        sym_failed_in = getattr(sym_err, "_autopar_failed_path", None)
        try:
            walk, method = trace_export(module, inputs, params), "export"
            notes.append(f"fx.symbolic_trace failed ({short_error(sym_err)}); captured with torch.export")
        except Exception as exp_err:
            walk = leaf_fallback(module, inputs, params, sym_failed_in, sym_err, exp_err, where)
            method = "leaf_fallback"
            notes.append(f"fx.symbolic_trace failed ({short_error(sym_err)}) and torch.export failed "
                         f"({short_error(exp_err)}); traced with {', '.join(walk.leaves)} kept opaque "
                         f"(costed from parameters and shapes)")
    trace_s = time.perf_counter() - t0

    if loss_fn is not None and target is not None:
        try:
            _record_loss(walk, loss_fn, target)
        except Exception as e:
            notes.append(f"{LOSS_NOT_CAPTURED} ({short_error(e)})")

    t1 = time.perf_counter()
    graph = _assemble(walk, module, params, model_name=model_name, model_file=model_file,
                      model_args=dict(model_args or {}),
                      batch_size=batch_size if batch_size is not None else _batch_of(inputs))
    graph.capture_method = method
    graph.leaf_modules = tuple(walk.leaves)
    graph.leaf_routing = {k: tuple(tuple(c) for c in v) for k, v in walk.routing.items()}
    graph.notes = notes + walk.notes + graph.notes
    graph.notes.append(f"trace + shapes ({method}): {trace_s:.2f} s; "
                       f"costs + layers: {time.perf_counter() - t1:.2f} s")
    graph.capture_s = time.perf_counter() - t0
    return graph


# ============================================================================ loss
def _record_loss(walk: Walk, loss_fn: Callable, target: Any) -> None:
    """Run the loss on the forward's meta output under a dispatch recorder; add its ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if walk.output_value is None or not isinstance(target, torch.Tensor):
        raise ValueError("no forward output or target to run the loss on")
    from torch.utils._pytree import tree_leaves

    known: dict[int, Val] = {}
    out_tensors = [t for t in tree_leaves(walk.output_value) if isinstance(t, torch.Tensor)]
    if len(out_tensors) != len(walk.graph_outputs):
        raise ValueError("the forward's output does not match the traced graph's outputs")
    for t, v in zip(out_tensors, walk.graph_outputs):
        known[id(t)] = v
    tv = Val(ref=LOSS_TARGET, producer=f"input:{LOSS_TARGET}", shape=tuple(target.shape), dtype=target.dtype,
              role="act", requires_grad=False, key="input:target")
    known[id(target)] = tv
    walk.graph_inputs.append(tv)
    keep_alive: list[Any] = []
    counter = [0]

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            name = f"loss_{func._overloadpacket.__name__.strip('_')}_{counter[0]}"
            counter[0] += 1
            ins = [known[id(a)] for a in _flat_args((args, kwargs)) if id(a) in known]
            canon = canonical(func._overloadpacket.__name__)
            if canon == "cast" and isinstance(result, torch.Tensor) and ins and ins[0].dtype == result.dtype:
                canon = "view"
            walk.add_op(name, canon, str(func), "loss", order_operands(canon, ins), result,
                        call_attrs(canon, args, kwargs))
            v = walk.vals.get(name)
            for t, tv_ in zip(tensor_slots(result), (v,) if isinstance(v, Val) else (v or ())):
                if t is not None and tv_ is not None:
                    known[id(t)] = tv_
            keep_alive.append(result)
            return result

    with torch.no_grad(), Recorder():
        loss = loss_fn(walk.output_value, target)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise ValueError(f"the loss is {type(loss).__name__}, not a one-element Tensor")


def _flat_args(obj: Any) -> list[Any]:
    out: list[Any] = []
    fx.node.map_aggregate(obj, lambda a: out.append(a) or a)
    return [a for a in out if isinstance(a, torch.Tensor)]


# ============================================================================ assembly
def _assemble(walk: Walk, module: torch.nn.Module, params: ParamIndex, *, model_name: str,
              model_file: str, model_args: dict, batch_size: int) -> OpGraph:
    blocks = find_blocks(module, [op.module_path for op in walk.ops])
    layer_of, names = assign_layers([op.module_path for op in walk.ops], blocks)
    counted: dict[str, int] = {}           # canonical parameter name -> the layer whose op counted it
    saved_keys: set[str] = set()
    tied_by_layer: dict[int, dict[str, tuple[str, int, int]]] = {}
    ops: list[OpNode] = []
    act_reads: dict[str, list[tuple[str, int]]] = {}
    act_outputs: dict[str, tuple[str, int]] = {v.ref: (v.producer, nbytes(v)) for v in walk.graph_inputs}
    for op, layer in zip(walk.ops, layer_of):
        c = cost(op.facts)
        numel = frozen = tied = tied_frozen = 0
        frozen_names = []
        for fqn in op.params:
            canon = params.canonical.get(fqn, fqn)
            p = params.by_name.get(fqn)
            size = p.numel() if p is not None else 0
            is_frozen = p is not None and not p.requires_grad
            if is_frozen:
                frozen_names.append(fqn)
            if canon not in counted:
                counted[canon] = layer
                numel += size
                frozen += size if is_frozen else 0
            elif counted[canon] != layer and canon not in tied_by_layer.setdefault(layer, {}):
                # a weight tied across layers (or a module reused by two): counted once, where first
                # used; a pipeline stage that holds this layer but not that one keeps its own copy
                # (named once per layer, at the layer's first op that uses it)
                tied += size
                tied_frozen += size if is_frozen else 0
                tied_by_layer[layer][canon] = (canon, counted[canon], size)
        saved = 0
        for key, size_bytes in c.saved:
            if key not in saved_keys:
                saved_keys.add(key)
                saved += size_bytes
        out_bytes = sum(nbytes(o) for o in op.outs)
        ops.append(OpNode(
            name=op.facts.name, kind=c.kind, target=op.target, module_path=op.module_path,
            layer=layer, inputs=tuple(dict.fromkeys(v.producer for v in op.ins if v.producer)),
            input_shapes=tuple(v.shape for v in op.ins), output_shape=op.outs[0].shape,
            dtype=dtype_name(op.outs[0].dtype), fwd_flops=c.fwd_flops, bwd_flops=c.bwd_flops,
            bytes_moved=c.bytes_moved, params=tuple(op.params), param_numel=numel,
            frozen_params=tuple(frozen_names), frozen_numel=frozen, tied_numel=tied, tied_frozen_numel=tied_frozen,
            saved_bytes=saved, output_bytes=out_bytes, copy_bytes=c.copy_bytes, causal=c.causal,
            requires_grad=op.facts.requires_grad))
        # the loss target is handed to the last stage directly: it crosses no layer boundary
        act_reads[op.facts.name] = [(v.ref, nbytes(v)) for v in op.ins
                                    if v.role == "act" and v.ref != LOSS_TARGET]
        for o in op.outs:
            if o.role == "act":
                act_outputs[o.ref] = (op.facts.name, nbytes(o))
    param_shapes = {n: tuple(p.shape) for n, p in params.by_name.items()}
    layers, sequential = build_layers(ops, names, blocks, act_reads, act_outputs,
                                      [v.ref for v in walk.graph_outputs], param_shapes)
    if tied_by_layer:
        layers = [replace(l, tied_params=tuple(tied_by_layer[l.index].values())) if tied_by_layer.get(l.index) else l
                  for l in layers]
    graph = OpGraph(model_name=model_name, model_file=model_file, model_args=model_args,
                    batch_size=batch_size, ops=ops, layers=layers, params_total=params.total,
                    param_dtype=params.dtype, seq_len=_seq_len(walk.graph_inputs),
                    sequential_layers=sequential)
    unused = params.total - sum(o.param_numel for o in ops)
    if unused:
        graph.notes.append(f"{unused:,} parameter elements are not used by the forward")
    if blocks is None:
        graph.notes.append("no repeated blocks (a ModuleList/Sequential of >= 2 same-class "
                           "modules) found; the whole model is one layer")
    unknown = sorted({o.target for o in ops if o.kind == "other" and o.fwd_flops})
    if unknown:
        graph.notes.append(f"ops without a cost rule (1 FLOP per output element): {', '.join(unknown[:8])}")
    return graph

def _seq_len(inputs: list[Val]) -> int | None:
    for v in inputs:
        if not v.dtype.is_floating_point and len(v.shape) == 2:
            return v.shape[1]
    return None


def _batch_of(inputs: tuple) -> int:
    return int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
