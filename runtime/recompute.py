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
"""
from __future__ import annotations


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


def wrap_for_recompute(child: nn.Module, mode: str) -> nn.Module:
    if mode == "full":
        return checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)
    if mode == "selective":
        return checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True,
                                  context_fn=_selective_context)
    raise ValueError(f"recompute mode {mode!r}")


def apply_recompute(module: nn.Module, layer_modules: list[tuple[list[str], str]]) -> None:
    """Wrap, inside ``module``, each listed module path with its layer's recompute mode.

    ``layer_modules``: (module paths of one layer present in ``module``, "none"|"selective"|"full").
    """
    for paths, mode in layer_modules:
        if mode == "none":
            continue
        for path in paths:
            parent_path, _, child_name = path.rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            setattr(parent, child_name, wrap_for_recompute(getattr(parent, child_name), mode))
