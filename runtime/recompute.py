"""Activation recompute per layer through the checkpoint wrappers.

* ``full``: ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``) around the
  layer's module: only the layer input is kept and its forward reruns inside backward
  (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").
* ``selective``: the same wrapper with a ``context_fn`` from
  ``create_selective_checkpoint_contexts``: the outputs of the matmul-class ops (mm, addmm,
  bmm, baddbmm, scaled-dot-product attention) are saved, every other op (norms, activations,
  softmax, dropout, elementwise) is recomputed -- the op-level policy of torchtitan, close to
  Korthikanti et al. 2022 Sec. 5 (keep the expensive, recompute the cheap).

A layer made of several top-level modules (the "pre" and "post" layers) wraps each of them.

``recompute_context``: a context manager factory entered around each recomputation (the
checkpoint's ``context_fn`` pair: forward context, recompute context).  Context parallelism
passes its attention mode (runtime/apply_cp.py): the forward runs under it, and the rerun in
backward must too, or it would attend over the rank's own tokens only.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def _with_recompute_context(context_fn: Callable | None, extra: Callable[[], ContextManager]) -> Callable:
    """A ``context_fn`` whose recompute context also enters ``extra()``."""
    def both():
        fwd, rec = context_fn() if context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext())

        @contextlib.contextmanager
        def recompute():
            # extra() first, as in the forward (the caller's mode outside the checkpoint's): its
            # own set-up ops must not run under selective recompute's replay, which refuses
            # ops the forward did not record
            with extra(), rec:
                yield
        return fwd, recompute()
    return both


def wrap_for_recompute(child: nn.Module, mode: str,
                       recompute_context: Callable[[], ContextManager] | None = None) -> nn.Module:
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode {mode!r}")
    context_fn = _selective_context if mode == "selective" else None
    if recompute_context is not None:
        context_fn = _with_recompute_context(context_fn, recompute_context)
    if context_fn is None:
        return checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)
    return checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True,
                              context_fn=context_fn)


def apply_recompute(module: nn.Module, layer_modules: list[tuple[list[str], str]],
                    recompute_context: Callable[[], ContextManager] | None = None) -> None:
    """Wrap, inside ``module``, each listed module path with its layer's recompute mode.

    ``layer_modules``: (module paths of one layer present in ``module``, "none"|"selective"|"full").
    """
    for paths, mode in layer_modules:
        if mode == "none":
            continue
        for path in paths:
            parent_path, _, child_name = path.rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            setattr(parent, child_name, wrap_for_recompute(getattr(parent, child_name), mode, recompute_context))
