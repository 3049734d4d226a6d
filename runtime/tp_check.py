"""Refuse, before any process starts, a tensor-parallel split that the tp degree does not divide.

DTensor accepts uneven shards, so an indivisible split is not refused when it is applied; it
breaks later, inside the model's forward on every rank (a ``view`` with a head size that no
longer fits), as a multi-rank traceback.  Here the model is built on the meta device (no
memory) and each module the plan splits is checked against the dims the style shards
(Megatron-LM's column / row split; Shoeybi et al. 2019, Sec. 3):

* ``colwise``: an ``nn.Linear``'s ``out_features`` (weight dim 0), a ``Conv1D``'s output
  features (weight dim 1), an ``nn.Embedding``'s ``embedding_dim``;
* ``rowwise``: an ``nn.Linear``'s ``in_features`` (weight dim 1), a ``Conv1D``'s input features
  (weight dim 0), an ``nn.Embedding``'s ``num_embeddings``;
* ``expert``: a stacked-experts module's ``num_experts`` (runtime/expert_tp.py);
* ``colwise:<k>`` (a fused projection split per part, runtime/fused_tp.py): the output
  features divide into k parts, and each part's features by tp;
* the split module's parent (the attention block): every head count the runtime divides by
  tp (``apply_tp``'s own list of attributes), and, where the parent names its head size
  (``head_dim`` / ``head_size``), each rank's share of the split features must hold whole heads.

Module names are resolved with the runtime's own ``resolve_tp_styles``, so a name the runtime
would refuse is refused here first.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.core.errors import PlanFileError
from autopar.core.plan import tp_style_parts

_HEAD_SIZE_ATTRS = ("head_dim", "head_size", "d_head")


def _split_dim(module: nn.Module, style: str) -> tuple[str, int]:
    from autopar.runtime.apply_tp import is_conv1d

    if style == "expert":            # stacked [experts, ...] parameters, split by expert
        return ("num_experts", module.num_experts)
    if is_conv1d(module):            # weight [in, out]
        return ("output features", module.weight.shape[1]) if style == "colwise" else \
            ("input features", module.weight.shape[0])
    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if style == "colwise" else ("in_features", module.in_features)
    return ("embedding_dim", module.embedding_dim) if style == "colwise" else ("num_embeddings",
                                                                               module.num_embeddings)


def check_tp_divisibility(checked) -> None:
    """``checked``: a ``CheckedPlan`` with tp > 1."""
    from autopar.runtime.apply_tp import _HEAD_COUNT_ATTRS, resolve_tp_styles

    plan, tp = checked.plan, checked.plan.mesh.tp
    if tp == 1:
        return
    with torch.device("meta"):
        model = checked.model_file.build(**dict(plan.model.args))
    for layer in checked.layers:
        styles = layer.plan.tp_styles
        if not styles:
            continue
        where = f"plan file {checked.plan_path}, layer {layer.name}"
        for fqn, style in resolve_tp_styles(model, layer.name, styles, where).items():
            module = model.get_submodule(fqn)
            base, parts = tp_style_parts(style)
            dim_name, size = _split_dim(module, base)
            if parts > 1:                    # a fused projection: each of its parts is split
                if size % parts:
                    raise PlanFileError(
                        f"{where}: {fqn} is split {style}, in {parts} equal parts, but its {dim_name} = {size} do "
                        f"not divide into {parts}. Give the number of parts the model cuts its output into "
                        f"('autopar inspect' shows the split the planner finds), or leave {fqn} unsplit.")
                dim_name, size = f"{dim_name} per part", size // parts
            if size % tp:
                raise PlanFileError(
                    f"{where}: {fqn} is split {style} over tp = {tp} ranks, but its {dim_name} = {size} does not "
                    f"divide by {tp}. Plan a tp degree that divides {size} (and the model's head count), or "
                    f"leave {fqn} unsplit.")
            if style == "expert":
                continue                     # no heads: the experts' parent is the MoE block
            parent_name = fqn.rpartition(".")[0]
            parent = model.get_submodule(parent_name) if parent_name else model
            for attr in _HEAD_COUNT_ATTRS:
                heads = parent.__dict__.get(attr)
                if isinstance(heads, int) and not isinstance(heads, bool) and heads % tp:
                    raise PlanFileError(
                        f"{where}: {parent_name or 'the model'}.{attr} = {heads} heads do not divide over tp = "
                        f"{tp} ranks. Plan a tp degree that divides the head count.")
            for attr in _HEAD_SIZE_ATTRS:
                head = parent.__dict__.get(attr)
                if isinstance(head, int) and not isinstance(head, bool) and head > 0 and (size // tp) % head:
                    raise PlanFileError(
                        f"{where}: {fqn} is split {style} over tp = {tp} ranks, so each rank holds {size // tp} of "
                        f"its {size} {dim_name}, which is not a whole number of heads of {parent_name}.{attr} = "
                        f"{head}. Plan a tp degree that divides the head count.")
