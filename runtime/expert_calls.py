"""Routed experts kept as module calls in a pipeline stage cut from the ``torch.export`` graph.

A forward that ``torch.fx`` cannot trace (Hugging Face models) is cut into stages from its
``torch.export`` graph (runtime/apply_pp.py), whose ATen ops call no module: the experts'
gathers and matmuls would be inlined, and expert parallelism (runtime/apply_ep.py), which
replaces the experts module's forward by the token exchange, would have nothing to replace.
Inlining also freezes what the experts' code chose on the meta device of the trace (transformers
5's grouped experts count tokens per expert with ``histc`` on int32 off the CPU, which the CPU
refuses at run time).

So during the export every experts module that is called on the tokens of one rank and returns
a tensor of its first argument's shape -- the ``stacked`` form (``experts(hidden, top_k_index,
top_k_weights)`` -> ``[T, h]``) and the ``grouped`` form (``experts(x, num_tokens_per_expert)``
-> ``[rows, h]``) of core/experts.py -- runs as one opaque op, ``autopar::experts_call(path,
tensors)`` (a ``torch.library`` custom op whose meta function returns an empty tensor like the
first argument; the experts' own code is not traced).  After the export each such op becomes a
``call_module`` of the experts module at ``path`` with the same tensors (the module given fresh
meta tensors: ``_fresh_tensors``), so the stage holding its layer calls the model's own experts
module, as an fx-cut stage calls its blocks, and expert parallelism (or nothing) applies to it.
The ``list`` form is called expert by expert from the block's own code and is not kept
(``apply_ep.stages_hold_experts`` refuses ep with pp for it).
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.core.experts import GROUPED, STACKED, expert_sites

_OP = "autopar::experts_call"


@torch.library.custom_op(_OP, mutates_args=())
def _experts_call(path: str, args: list[torch.Tensor]) -> torch.Tensor:
    raise RuntimeError(f"{_OP} stands for the experts module {path!r} during torch.export only "
                       f"(runtime/expert_calls.py); it is replaced by a call of the module before the stage runs")


@_experts_call.register_fake
def _(path: str, args: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(args[0])


def _leading_tensors(params: list[str], path: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The call's arguments as the forward's first parameters ``params`` in order, all tensors."""
    bound = dict(zip(params, args))
    bound.update(kwargs)
    names = params[:len(bound)]
    if set(bound) != set(names) or not all(isinstance(bound[n], torch.Tensor) for n in names):
        raise TypeError(f"the experts module {path} is called with {sorted(bound)}, not with tensors for its "
                        f"first parameters {params[:len(bound)]}: it cannot be kept as one call in the export graph")
    return [bound[n] for n in names]


@contextlib.contextmanager
def opaque_experts(model: nn.Module):
    """Inside: each stacked / grouped experts module of ``model`` calls ``autopar::experts_call``
    instead of its own code (module docstring).  Yields the paths it replaced."""
    sites = [s for s in expert_sites(model) if s.form in (STACKED, GROUPED)]
    patched = []
    for site in sites:
        module = model.get_submodule(site.path)
        params = list(inspect.signature(module.forward).parameters)      # the module's own forward

        def forward(*args, _path=site.path, _params=params, **kwargs):
            return _experts_call(_path, _leading_tensors(_params, _path, args, kwargs))

        had = "forward" in module.__dict__
        old = module.__dict__.get("forward")
        module.forward = forward
        patched.append((module, had, old))
    try:
        yield [s.path for s in sites]
    finally:
        for module, had, old in patched:
            if had:
                module.forward = old
            else:
                del module.forward


def export_with_expert_calls(model: nn.Module, example_inputs: tuple):
    """(``torch.export.export`` of ``model`` on ``example_inputs``, its graph module) with each
    stacked / grouped experts call a ``call_module`` of the experts module (module docstring).
    Where the model calls its experts inside a nested graph (the body of a higher-order op such
    as a checkpointed region), which cannot call a module of the stage, the export is taken again
    with the experts' code inlined, as without this module (expert parallelism then refuses the
    pipeline: ``apply_ep.stages_hold_experts``)."""
    from autopar.core.quiet_export import quiet_export

    with opaque_experts(model):
        exported = quiet_export(model, tuple(example_inputs), strict=False)
    gm = exported.module()
    op = torch.ops.autopar.experts_call.default
    if any(sub is not gm and isinstance(sub, fx.GraphModule) and
           any(n.op == "call_function" and n.target is op for n in sub.graph.nodes) for sub in gm.modules()):
        exported = quiet_export(model, tuple(example_inputs), strict=False)
        return exported, exported.module()
    _calls_into_modules(gm, model)
    return exported, gm


def _calls_into_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    """Each ``autopar::experts_call(path, tensors)`` node of ``gm`` becomes a ``call_module`` of
    ``model``'s module at ``path`` on those tensors, the module installed in ``gm`` at the same
    path (its ``nn_module_stack`` kept: it is the layer's)."""
    op = torch.ops.autopar.experts_call.default
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not op:
            continue
        path, tensors = node.args
        _install(gm, path, _fresh_tensors(model.get_submodule(path)))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(path, tuple(tensors))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    gm.recompile()


def _fresh_tensors(module: nn.Module) -> nn.Module:
    """``module`` with new parameters and buffers of the same shapes (still on meta): the export
    leaves weak references on the ones it traced, and materialisation (``to_empty``) cannot swap
    a tensor that has one -- as apply_pp._restore_names gives an export-cut stage its own."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.empty_like(b)
    return module


def _install(root: nn.Module, path: str, module: nn.Module) -> None:
    holder = root
    parts = path.split(".")
    for part in parts[:-1]:
        if not hasattr(holder, part):
            holder.add_module(part, nn.Module())
        holder = getattr(holder, part)
    setattr(holder, parts[-1], module)
