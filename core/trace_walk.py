"""The values and ops a trace walk collects, shared by the fx and torch.export paths.

A ``Walk`` records, node by node, what each tensor value is (an activation that depends on
the batch, a parameter, or a constant), whether it requires grad, and its deduplication key
(views collapse onto their base); each op becomes a ``TracedOp`` holding the ``OpFacts`` that
``autopar.core.op_costs`` prices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.core.dtypes import DTYPE_BYTES
from autopar.core.op_costs import OpFacts, TensorFacts


class ParamIndex:
    """Parameter names -> tensor identity, so tied weights are counted once."""

    def __init__(self, module: torch.nn.Module):
        self.by_name: dict[str, torch.nn.Parameter] = dict(module.named_parameters(remove_duplicate=False))
        canonical_by_id: dict[int, str] = {}
        for name, p in module.named_parameters():
            canonical_by_id[id(p)] = name
        self.canonical = {n: canonical_by_id[id(p)] for n, p in self.by_name.items()}
        self.total = sum(p.numel() for p in module.parameters())
        dtypes = {p.dtype for p in module.parameters()}
        self.dtype = dtype_name(next(iter(dtypes))) if len(dtypes) == 1 else \
            ("mixed" if dtypes else "float32")


# ============================================================================ the walk
@dataclass
class Val:
    """What the walk knows about one tensor value."""
    ref: str                       # value id: producing node name (+ "#i" for tuple outputs)
    producer: str                  # op name for OpNode.inputs ("input:x" for graph inputs; "" none)
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str                      # "act", "param", "const"
    requires_grad: bool
    key: str                       # deduplication key (views collapse onto their base)
    fqn: str = ""                  # parameter name when role == "param"

    def facts(self) -> TensorFacts:
        return TensorFacts(key=self.key, shape=self.shape, itemsize=itemsize(self.dtype),
                           role=self.role, requires_grad=self.requires_grad,
                           is_float=self.dtype.is_floating_point or self.dtype.is_complex)


@dataclass
class TracedOp:
    facts: OpFacts
    target: str
    module_path: str
    ins: list[Val]
    outs: list[Val]
    params: list[str]


@dataclass
class Walk:
    ops: list[TracedOp] = field(default_factory=list)
    vals: dict[str, Any] = field(default_factory=dict)     # fx node name -> Val | tuple | None
    graph_inputs: list[Val] = field(default_factory=list)
    graph_outputs: list[Val] = field(default_factory=list)
    output_value: Any = None                               # the forward's result (meta tensors)
    leaves: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    routing: dict[str, list[tuple[int, int]]] = field(default_factory=dict)   # leaf -> its topk (k, n)

    # ---------------------------------------------------------------- values
    def tensors_in(self, obj: Any) -> list[Val]:
        found: list[Val] = []

        def visit(a):
            if isinstance(a, fx.Node):
                v = self.vals.get(a.name)
                if isinstance(v, Val):
                    found.append(v)
            return a

        fx.node.map_aggregate(obj, visit)
        return found

    def add_op(self, name: str, canon: str, target: str, module_path: str, ins: list[Val],
               result: Any, attrs: dict | None = None, extra_params: list[Val] = ()) -> None:
        """Record one op whose (meta) result is ``result``; skip non-tensor results."""
        ins = list(ins) + list(extra_params)
        slots = tensor_slots(result)
        tensors = [t for t in slots if t is not None]
        if not tensors:
            self.vals[name] = None
            return
        act = any(v.role == "act" for v in ins) and canon != "create"
        grad = canon not in ("create", "compare", "argmax") and any(v.requires_grad for v in ins)
        single = len(tensors) == 1 and isinstance(result, torch.Tensor)
        outs = []
        by_slot: list[Val | None] = []
        for i, t in enumerate(slots):
            if t is None:                  # e.g. nn.MultiheadAttention's (output, None)
                by_slot.append(None)
                continue
            ref = name if single else f"{name}#{i}"
            shape, dtype = tuple(int(d) for d in t.shape), t.dtype
            key = ref
            base = ins[0] if ins else None
            passthrough = canon == "view" or (canon == "dropout" and not dropout_active(attrs))
            if single and passthrough and base is not None and base.dtype == dtype \
                    and math.prod(base.shape) == math.prod(shape):
                key = base.key
            role = "act" if act else "const"
            fqn = ""
            if not act and base is not None and base.role == "param" and canon in ("view", "cast") \
                    and len(ins) == 1:
                role, fqn = "param", base.fqn
            is_float = dtype.is_floating_point or dtype.is_complex
            outs.append(Val(ref=ref, producer=name, shape=shape, dtype=dtype, role=role,
                             requires_grad=grad and is_float, key=key, fqn=fqn))
            by_slot.append(outs[-1])
        # a tuple result keeps its positions (getitem indexes it), None where no tensor is
        self.vals[name] = outs[0] if single else tuple(by_slot)
        param_names = list(dict.fromkeys(v.fqn for v in ins if v.role == "param" and v.fqn))
        if all(o.role == "param" for o in outs):
            param_names = []                 # a view of a weight: its consumer owns the weight
        if canon == "create" and UNINITIALIZED.intersection(str(target).split(".")):
            attrs = {**(attrs or {}), "uninitialized": True}      # an allocation: no kernel writes it
        facts = OpFacts(name=name, canon=canon, inputs=[v.facts() for v in ins],
                        outputs=[o.facts() for o in outs], attrs=dict(attrs or {}))
        self.ops.append(TracedOp(facts=facts, target=target, module_path=module_path, ins=ins,
                            outs=outs, params=param_names))


def tensor_slots(result: Any) -> list[torch.Tensor | None]:
    """The tensors of an op's result by position: ``[t]`` for a tensor; for a tuple/list of
    tensors and ``None`` (``nn.MultiheadAttention`` returns ``(output, None)`` without
    attention weights) one slot per element, ``None`` kept; ``[]`` for anything else."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)) and \
            all(r is None or isinstance(r, torch.Tensor) for r in result):
        return list(result)
    return []


def flatten_tensors(result: Any) -> list[torch.Tensor]:
    """The tensors of an op's result (see ``tensor_slots``), ``None`` slots dropped."""
    return [t for t in tensor_slots(result) if t is not None]


def dropout_active(attrs: dict | None) -> bool:
    attrs = attrs or {}
    return float(attrs.get("p", 0.0)) > 0.0 and bool(attrs.get("train", True))


def owner_path(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]
    return path if isinstance(path, str) else ""


def attr_val(name: str, fqn: str, res: Any, params: ParamIndex) -> Val | None:
    if not isinstance(res, torch.Tensor):
        return None
    if fqn in params.by_name:
        return param_val(fqn, res, params)
    return Val(ref=name, producer="", shape=tuple(res.shape), dtype=res.dtype, role="const",
                requires_grad=False, key=f"const:{fqn}")


def param_val(fqn: str, p: torch.Tensor, params: ParamIndex) -> Val:
    canon = params.canonical.get(fqn, fqn)
    return Val(ref=f"param:{canon}", producer="", shape=tuple(p.shape), dtype=p.dtype, role="param",
                requires_grad=bool(p.requires_grad), key=f"param:{canon}", fqn=fqn)


def order_operands(canon: str, ins: list[Val]) -> list[Val]:
    if canon == "embedding":      # (indices, weight) whatever the call's order
        return sorted(ins, key=lambda v: v.dtype.is_floating_point)
    return ins


#: the traced names of allocations: their memory is not written (``torch.empty`` and kin)
UNINITIALIZED = frozenset({"empty", "new_empty", "empty_like", "empty_strided"})


def module_attrs(mod: torch.nn.Module, canon: str) -> dict[str, Any]:
    if canon == "dropout":
        return {"p": float(getattr(mod, "p", 0.0)), "train": mod.training}
    if canon in ("layer_norm", "rms_norm"):
        shape = getattr(mod, "normalized_shape", None)
        return {"normalized_numel": math.prod(shape)} if shape else {}
    if canon == "group_norm":
        return {"groups": getattr(mod, "num_groups", 1)}
    if canon == "rnn":
        return {"mode": str(getattr(mod, "mode", "LSTM")), "input_size": int(getattr(mod, "input_size", 0)),
                "hidden_size": int(getattr(mod, "hidden_size", 0)), "num_layers": int(getattr(mod, "num_layers", 1)),
                "bidirectional": bool(getattr(mod, "bidirectional", False)),
                "batch_first": bool(getattr(mod, "batch_first", False)),
                "proj_size": int(getattr(mod, "proj_size", 0) or 0), "bias": bool(getattr(mod, "bias", True))}
    if canon == "mha":
        return {"batch_first": bool(getattr(mod, "batch_first", False)),
                "num_heads": int(getattr(mod, "num_heads", 1)), "embed_dim": int(getattr(mod, "embed_dim", 0))}
    return {}


#: aten's recurrent ops (torch.export) by name
ATEN_RNN_MODES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN_TANH", "rnn_relu": "RNN_RELU"}


def aten_rnn_attrs(name: str, args: tuple, ins: list[Val]) -> dict[str, Any]:
    """``module_attrs`` of an ``nn.LSTM``/``GRU``/``RNN`` from the aten op it exports to:
    ``aten.lstm.input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    batch_first)`` (gru, rnn_tanh, rnn_relu alike; ``hx`` is [h_0, c_0] for an LSTM, h_0
    otherwise).  The sizes come from the operands: the input's last dim, the cell state's
    (LSTM) or h_0's last dim for the hidden size, h_0's for an LSTM's projection."""
    def flag(i: int, default):
        return args[i] if len(args) > i and isinstance(args[i], (bool, int)) else default

    mode = ATEN_RNN_MODES.get(name.strip("_"), "LSTM")
    states = [v for v in ins[1:] if v.role != "param"]
    hidden = states[-1].shape[-1] if states and states[-1].shape else 0
    proj = states[0].shape[-1] if mode == "LSTM" and len(states) > 1 and states[0].shape[-1] != hidden else 0
    return {"mode": mode, "input_size": int(ins[0].shape[-1]) if ins and ins[0].shape else 0,
            "hidden_size": int(hidden), "num_layers": int(flag(4, 1)), "bidirectional": bool(flag(7, False)),
            "batch_first": bool(flag(8, False)), "proj_size": int(proj), "bias": bool(flag(3, True))}


def call_attrs(canon: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    if canon == "baddbmm":
        # beta is keyword-only in torch.baddbmm, Tensor.baddbmm and aten.baddbmm
        beta = kwargs.get("beta", 1)
        return {"beta": float(beta)} if isinstance(beta, (int, float)) else {}
    if canon == "einsum":
        eq = kwargs.get("equation", args[0] if args else None)
        return {"equation": eq} if isinstance(eq, str) else {}
    if canon == "dropout":
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        return {"p": float(p) if isinstance(p, (int, float)) else 0.5, "train": bool(train)}
    if canon in ("layer_norm", "rms_norm"):
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
        if isinstance(shape, int):
            return {"normalized_numel": shape}
        if isinstance(shape, (tuple, list)) and all(isinstance(s, int) for s in shape):
            return {"normalized_numel": math.prod(shape)}
    if canon == "group_norm":
        groups = kwargs.get("num_groups", args[1] if len(args) > 1 else 1)
        return {"groups": groups if isinstance(groups, int) else 1}
    if canon == "sdpa":
        # only the keyword is read: the functional and the aten overloads put is_causal at
        # different positions; a causal mask passed positionally is priced as the full square
        return {"causal": kwargs.get("is_causal") is True}
    return {}


def class_name(cls: type) -> str:
    mod = cls.__module__ or ""
    if mod.startswith("torch.nn"):
        return f"torch.nn.{cls.__name__}"
    if mod.startswith("autopar_model_"):          # the model file: its path must not leak in
        return cls.__qualname__
    return f"{mod}.{cls.__qualname__}"


def fn_module(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or ""
    if mod.startswith("autopar_model_"):          # defined in the model file: no path in names
        return ""
    if mod.startswith("torch.nn.functional"):
        return "F."
    if mod in ("_operator", "operator"):
        return "operator."
    if mod.startswith("torch") or getattr(fn, "__self__", None) is torch or mod == "":
        return "torch."
    return f"{mod}."




def nbytes(v: Val) -> int:
    return math.prod(v.shape) * itemsize(v.dtype)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element: core/dtypes.py's table, else torch's own answer for a rarer dtype."""
    name = dtype_name(dtype)
    return DTYPE_BYTES[name] if name in DTYPE_BYTES else torch.empty((), dtype=dtype, device="meta").element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def short_error(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) < 160 else text[:157] + "..."
    return f"{type(e).__name__}: {text}"
