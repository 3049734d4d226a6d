"""Capture path 2: ``torch.export`` on meta (ATen level), for models fx cannot trace.

Nodes map to their owning module through ``node.meta["nn_module_stack"]``; parameters are
the placeholders the export signature names PARAMETER.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autopar.core.op_costs import canonical
from autopar.core.trace_walk import (ParamIndex, Val, Walk, aten_rnn_attrs, call_attrs, order_operands,
                                     owner_path, param_val)


def trace_export(module: torch.nn.Module, inputs: tuple, params: ParamIndex) -> Walk:
    from autopar.core.quiet_export import quiet_export

    ep = quiet_export(module, inputs, strict=False)
    from torch.export.graph_signature import InputKind

    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    walk = Walk()
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            spec = specs.get(n.name)
            if spec is not None and spec.kind == InputKind.PARAMETER:
                walk.vals[n.name] = param_val(spec.target, val, params)
            elif spec is not None and spec.kind == InputKind.USER_INPUT and isinstance(val, torch.Tensor):
                v = Val(ref=n.name, producer=f"input:{n.name}", shape=tuple(int(d) for d in val.shape),
                         dtype=val.dtype, role="act", requires_grad=False, key=f"input:{n.name}")
                walk.vals[n.name] = v
                walk.graph_inputs.append(v)
            elif isinstance(val, torch.Tensor):
                walk.vals[n.name] = Val(ref=n.name, producer="", shape=tuple(int(d) for d in val.shape),
                                         dtype=val.dtype, role="const", requires_grad=False,
                                         key=f"const:{getattr(spec, 'target', n.name)}")
            continue
        if n.op == "output":
            walk.graph_outputs = walk.tensors_in(n.args)
            walk.output_value = _export_output(ep, n, walk)
            continue
        if n.op != "call_function":
            continue
        if n.target is operator.getitem and isinstance(walk.vals.get(getattr(n.args[0], "name", None)), tuple):
            walk.vals[n.name] = walk.vals[n.args[0].name][n.args[1]]
            continue
        packet = getattr(n.target, "_overloadpacket", None)
        name = packet.__name__ if packet is not None else getattr(n.target, "__name__", str(n.target))
        canon = canonical(name)
        ins = walk.tensors_in((n.args, n.kwargs))
        if canon == "cast" and isinstance(val, torch.Tensor) and ins and ins[0].dtype == val.dtype:
            canon = "view"
        ins = order_operands(canon, ins)
        attrs = aten_rnn_attrs(name, n.args, ins) if canon == "rnn" else call_attrs(canon, n.args, n.kwargs)
        walk.add_op(n.name, canon, str(n.target), owner_path(n), ins, val, attrs)
    return walk


def _export_output(ep, out_node: fx.Node, walk: Walk) -> Any:
    """The forward's output structure (e.g. a transformers ModelOutput) with meta tensors."""
    from torch.utils._pytree import tree_unflatten

    leaves = []
    for a in out_node.args[0]:
        v = walk.vals.get(a.name) if isinstance(a, fx.Node) else None
        leaves.append(torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, Val) else a)
    try:
        return tree_unflatten(leaves, ep.call_spec.out_spec)
    except Exception:
        return None
