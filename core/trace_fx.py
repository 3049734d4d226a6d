"""Capture paths 1 and 3: ``torch.fx.symbolic_trace`` plus a shape-propagating meta run.

``trace_symbolic`` traces with torch.nn modules (and any chosen submodules) kept as
``call_module`` leaves, runs the graph on meta tensors (memoising repeated ops, so 96
identical blocks cost about one), and walks it into a ``Walk``.  ``leaf_fallback`` retries
with the submodules that defeated the tracer kept opaque; such a leaf that cannot run on
meta is run once on CPU on zeros to learn its output shape.
"""
from __future__ import annotations

import operator
import weakref
from typing import Any

import torch
import torch.fx as fx

from autopar.core.errors import ModelFileError
from autopar.core.copies import copied_bytes
from autopar.core.op_costs import canonical
from autopar.core.trace_walk import (ParamIndex, Val, Walk, attr_val, call_attrs, class_name,
                                     flatten_tensors, fn_module, module_attrs, order_operands,
                                     owner_path, param_val, short_error)

MAX_LEAF_RETRIES = 16
CPU_LEAF_LIMIT_BYTES = 2 << 30      # a leaf run for real on CPU must fit in 2 GiB


class _Tracer(fx.Tracer):
    """fx tracer that keeps chosen submodules opaque and remembers where tracing failed."""

    def __init__(self, leaves: tuple[str, ...] = ()):
        super().__init__()
        self.leaf_paths = set(leaves)
        self.failed_path: str | None = None

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return qualname in self.leaf_paths or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_path is None:          # the innermost module sees the error first
                self.failed_path = self.path_of_module(m)
            raise


class _MetaRunner(fx.Interpreter):
    """Runs the traced graph on meta tensors and keeps every node's result."""

    def __init__(self, gm: fx.GraphModule, leaves: set[str], walk: Walk):
        super().__init__(gm, garbage_collect_values=False)
        self.leaves, self.walk = leaves, walk
        self.results: dict[str, Any] = {}
        self.memo: dict[Any, Any] = {}
        self.failed_node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        key = None
        if n.op in ("call_function", "call_method", "call_module"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            key = self._memo_key(n, args, kwargs)
            if key is not None and key in self.memo:
                self.results[n.name] = self.memo[key]
                return self.memo[key]
        try:
            result = super().run_node(n)
        except Exception:
            if self.failed_node is None:
                self.failed_node = n
            raise
        if key is not None:
            self.memo[key] = result
        self.results[n.name] = result
        return result

    def _memo_key(self, n: fx.Node, args: tuple, kwargs: dict) -> Any:
        """Same op on same shapes -> same meta result: repeated blocks are computed once.

        Meta tensors carry no data, so reusing a result only shares shape, dtype and strides.
        Opaque (leaf) modules and ops whose arguments are not plain values are not memoised.
        """
        if n.op == "call_module":
            if n.target in self.leaves:
                return None
            mod = self.module.get_submodule(n.target)
            if not type(mod).__module__.startswith("torch.nn"):
                return None
            target: Any = (type(mod), repr(mod), mod.training,
                           tuple((k, tuple(p.shape), p.dtype) for k, p in mod.named_parameters()))
        else:
            target = n.target
        try:
            key = (n.op, target, _shape_key(args), _shape_key(kwargs))
            hash(key)
        except TypeError:
            return None
        return key

    def call_module(self, target, args, kwargs):
        if target not in self.leaves:
            return super().call_module(target, args, kwargs)
        with _TopkRecorder() as routing:
            try:
                out = super().call_module(target, args, kwargs)
            except Exception:
                out = _run_leaf_on_cpu(self.module.get_submodule(target), target, args, kwargs, self.walk)
        if routing.calls:
            self.walk.routing[target] = routing.calls
        return out


class _TopkRecorder:
    """Records the ``(k, size of the dim chosen from)`` of every ``topk`` an opaque module runs:
    the routing step of a top-k mixture of experts (see ``routed_expert_numel``)."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        calls = self.calls

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func._overloadpacket is torch.ops.aten.topk and args and isinstance(args[0], torch.Tensor):
                    k = args[1] if len(args) > 1 else kwargs.get("k")
                    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
                    if isinstance(k, int) and args[0].dim():
                        calls.append((int(k), int(args[0].shape[dim])))
                return func(*args, **kwargs)

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def routed_expert_numel(mod: torch.nn.Module, routing: list[tuple[int, int]]) -> int:
    """Parameter elements an opaque module uses per token when it routes tokens to experts.

    A top-k mixture of experts sends each token to k of its n experts (Shazeer et al. 2017,
    "Outrageously Large Neural Networks", Sec. 2.1: the gate keeps the top k of n and the
    other experts are not computed; Fedus et al. 2022, Switch Transformer, k = 1): per token
    it runs k experts' parameters, not n.  The experts are a ``ModuleList`` of n modules of
    one class inside the module, and the routing is a ``topk(k)`` over a dimension of size n
    that the module ran; the experts' parameters then count k/n (the expected share each
    expert computes with balanced routing, the load the auxiliary balancing loss of both
    papers aims for).  Returns all parameter elements when no such pair exists (the module
    is dense: every parameter works on every token).
    """
    total = sum(p.numel() for p in mod.parameters())
    for _, sub in mod.named_modules():
        if not isinstance(sub, torch.nn.ModuleList) or len(sub) < 2:
            continue
        if len({type(c) for c in sub}) != 1:
            continue
        n = len(sub)
        ks = [k for k, size in routing if size == n and 0 < k < n]
        if ks:
            expert_numel = sum(p.numel() for p in sub.parameters())
            return int(round(total - expert_numel + expert_numel * ks[0] / n))
    return total


def _shape_key(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, tuple(obj.stride()), obj.device.type)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_shape_key(o) for o in obj))
    if isinstance(obj, dict):
        return ("D", tuple((k, _shape_key(v)) for k, v in obj.items()))
    if obj is None or isinstance(obj, (int, float, bool, str, slice, torch.dtype, torch.device,
                                       torch.memory_format, torch.layout, type(Ellipsis))):
        return (type(obj).__name__, obj if not isinstance(obj, slice) else (obj.start, obj.stop, obj.step))
    raise TypeError("not memoisable")


#: module -> (leaves, its fx GraphModule) of a trace whose meta run succeeded: the graph does not
#: depend on the inputs (fx traces with proxies, which carry no shapes), so a module captured again
#: at another batch size (core/capture.capture_model_file keeps the module built) runs the same
#: graph on its new inputs without tracing it again
_TRACED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[str, ...], fx.GraphModule]]" = \
    weakref.WeakKeyDictionary()


def trace_symbolic(module: torch.nn.Module, inputs: tuple, params: ParamIndex,
              leaves: tuple[str, ...]) -> Walk:
    hit = _TRACED.get(module)
    if hit is not None and hit[0] == leaves:
        gm = hit[1]
    else:
        tracer = _Tracer(leaves)
        try:
            graph = tracer.trace(module)
        except Exception as e:
            e._autopar_failed_path = tracer.failed_path      # type: ignore[attr-defined]
            raise
        gm = fx.GraphModule(module, graph)
    walk = Walk(leaves=list(leaves))
    runner = _MetaRunner(gm, set(leaves), walk)
    try:
        with torch.no_grad():
            walk.output_value = runner.run(*inputs)
    except Exception as e:
        n = runner.failed_node
        e._autopar_failed_path = (n.target if n is not None and n.op == "call_module" else  # type: ignore[attr-defined]
                                  _innermost_module(n) if n is not None else None)
        raise
    _TRACED[module] = (leaves, gm)
    _walk_symbolic(gm, module, runner.results, params, walk, set(leaves))
    return walk


def _innermost_module(n: fx.Node) -> str | None:
    stack = n.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else None


def _walk_symbolic(gm: fx.GraphModule, root: torch.nn.Module, results: dict[str, Any],
                   params: ParamIndex, walk: Walk, leaves: set[str]) -> None:
    for n in gm.graph.nodes:
        res = results.get(n.name)
        if n.op == "placeholder":
            if isinstance(res, torch.Tensor):
                v = Val(ref=n.name, producer=f"input:{n.name}", shape=tuple(res.shape),
                         dtype=res.dtype, role="act", requires_grad=False, key=f"input:{n.name}")
                walk.vals[n.name] = v
                walk.graph_inputs.append(v)
            continue
        if n.op == "get_attr":
            walk.vals[n.name] = attr_val(n.name, str(n.target), res, params)
            continue
        if n.op == "output":
            walk.graph_outputs = walk.tensors_in(n.args)
            continue
        ins = walk.tensors_in((n.args, n.kwargs))
        if n.op == "call_module":
            mod = root.get_submodule(n.target)
            cls = type(mod)
            canon = "leaf" if n.target in leaves else canonical(cls.__name__)
            if canon == "other":
                canon = "leaf"                        # an nn module we have no rule for
            prm = [param_val(f"{n.target}.{pn}", p, params) for pn, p in mod.named_parameters()]
            attrs = module_attrs(mod, canon)
            attrs["param_numel"] = sum(p.numel() for _, p in mod.named_parameters())
            if n.target in walk.routing:
                attrs["param_numel"] = routed_expert_numel(mod, walk.routing[n.target])
            if canon == "embedding":
                ins = ins[:1]
            if canon == "rnn":
                _add_rnn(walk, n.name, class_name(cls), n.target, ins, res, attrs, prm)
                continue
            walk.add_op(n.name, canon, class_name(cls), n.target, ins, res, attrs, prm)
            continue
        if n.op == "call_function" and n.target is operator.getitem and \
                isinstance(walk.vals.get(getattr(n.args[0], "name", None)), tuple):
            walk.vals[n.name] = walk.vals[n.args[0].name][n.args[1]]    # element of a tuple
            continue
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        canon = canonical(name)
        if canon == "cast" and isinstance(res, torch.Tensor) and ins and ins[0].dtype == res.dtype:
            canon = "view"                             # .to()/.float() on the same dtype: no copy
        ins = order_operands(canon, ins)
        target = f"Tensor.{name}" if n.op == "call_method" else f"{fn_module(n.target)}{name}"
        attrs = call_attrs(canon, n.args, n.kwargs)
        copied = copied_bytes(name, n.args, n.kwargs, results)
        if copied:
            attrs["copy_bytes"] = copied           # strides made it copy (core/copies.py)
        walk.add_op(n.name, canon, target, owner_path(n), ins, res, attrs)


def _add_rnn(walk: Walk, name: str, target: str, path: str, ins: list[Val], res: Any, attrs: dict,
             prm: list[Val]) -> None:
    """A recurrent module returns ``(output, h_n)`` (GRU, RNN) or ``(output, (h_n, c_n))`` (LSTM):
    the op is recorded on its tensors, flattened, and the value keeps the nested structure for
    the ``getitem``s that unpack it.  The initial state, when passed, is an input like ``x``."""
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.Tensor)):
        walk.add_op(name, "rnn", target, path, ins, res, attrs, prm)       # (a PackedSequence: unpriced)
        return
    state = res[1]
    nested = isinstance(state, tuple)
    flat = [res[0], *(state if nested else (state,))]
    walk.add_op(name, "rnn", target, path, ins, flat, attrs, prm)
    vals = walk.vals.get(name)
    if isinstance(vals, tuple) and nested:
        walk.vals[name] = (vals[0], tuple(vals[1:]))


def leaf_fallback(module, inputs, params, first_failed, sym_err, exp_err, where) -> Walk:
    leaves: list[str] = []
    failed, err = first_failed, sym_err
    for _ in range(MAX_LEAF_RETRIES):
        if not failed or failed in leaves:
            break
        leaves.append(failed)
        try:
            return trace_symbolic(module, inputs, params, leaves=tuple(leaves))
        except Exception as e:
            failed, err = getattr(e, "_autopar_failed_path", None), e
    culprit = f" in module '{failed}'" if failed else " in the model's own forward"
    head = (f"{where}: the module returned by build_model cannot be traced{culprit}: "
            f"fx.symbolic_trace: {short_error(sym_err)}; torch.export: {short_error(exp_err)}"
            + (f"; with {', '.join(leaves)} kept opaque: {short_error(err)}" if leaves else ""))
    shape = _shape_error(exp_err)
    head = head.rstrip(".")
    error = ModelFileError(f"{head}. {traced_path_advice(exp_err) if shape and _runs_eagerly(module, inputs) else ADVICE}")
    error.traced_shape_error = (head, exp_err) if shape else None     # capture_model_file words it once the
    raise error from None                                              # forward is seen to run on real tensors


ADVICE = "Move data-dependent Python control flow (if/for on tensor values, .item()) into a submodule, or make " \
         "the forward traceable."


def traced_path_advice(exp_err: BaseException) -> str:
    """What to do when the forward runs untraced but torch.export's trace of it has shapes that
    do not agree: the model takes another code path when traced."""
    return (f"The forward runs untraced on this batch, but torch.export follows another code path, whose shapes "
            f"do not agree ({type(exp_err).__name__} above): the model branches on being traced. "
            f"transformers, for one, builds an explicit attention mask when traced and then repeats the key/value "
            f"heads num_attention_heads / num_key_value_heads times, so a config whose attention computes keys for "
            f"every head (DeepSeek-V3's multi-head latent attention) needs num_key_value_heads = "
            f"num_attention_heads. Check the model's config, or run torch.export.export(model, inputs) yourself "
            f"to see the failing line.")


#: torch's words for operands whose shapes do not fit (broadcast, matmul, view, cat)
_SHAPE_WORDS = ("broadcast", "must match the size", "shapes cannot be multiplied", "is invalid for input of size",
                "Sizes of tensors must match", "must have same reduction dim")


def _shape_error(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(w in str(e) for w in _SHAPE_WORDS)


def _runs_eagerly(module, inputs) -> bool:
    """Whether the forward runs, untraced, on the (meta) inputs the tracers got."""
    try:
        with torch.no_grad():
            module(*inputs)
        return True
    except Exception:
        return False


def _run_leaf_on_cpu(mod: torch.nn.Module, path: str, args, kwargs, walk: Walk):
    """Learn an opaque module's output shape by running a CPU copy on zeros."""
    import copy

    numel = sum(p.numel() * p.element_size() for p in mod.parameters())
    numel += sum(t.numel() * t.element_size() for t in flatten_tensors(list(args)))
    if numel > CPU_LEAF_LIMIT_BYTES:
        raise ModelFileError(
            f"module '{path}' cannot be traced and is too large ({numel / 2**30:.1f} GiB) to run on "
            f"CPU to learn its output shape; make its forward traceable.")
    cpu_mod = copy.deepcopy(mod).to_empty(device="cpu")
    with torch.no_grad():
        for p in cpu_mod.parameters():
            p.zero_()

    def to_cpu(a):
        return torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a

    out = cpu_mod(*fx.node.map_aggregate(args, to_cpu), **fx.node.map_aggregate(kwargs, to_cpu))
    walk.notes.append(f"leaf '{path}' could not run on meta; its output shape came from a CPU run on zeros")
    return fx.node.map_aggregate(
        out, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t)
