"""Copies of tied weights on later pipeline stages.

A weight used by two layers (an LM head tied to the token embedding: ``head.weight is
embed.weight``) is one parameter when both layers sit on one pipeline stage; the capture counts
it once, in the first layer that uses it (``Layer.tied_params`` names it in every later layer
that uses it).  The runtime gives every stage after the first that holds a user its own copy,
with its own gradient and optimizer state, and sums the copies' gradients over the stages
before each step (runtime/ties.py, ``untie_across_stages`` and ``TiedGradSum``; Megatron-LM's
embedding group does the same, Narayanan et al. 2021, Sec. 2).  So a model chunk holds a copy
of a tied weight used by its layer k when no layer before k in the chunk uses it -- the layer
that first used it (its owner) and every other earlier user lie before the chunk's first layer.

``uses(graph)`` lists each layer's tied uses with the last earlier user of the weight;
``held_share(uses, starts, num_layers)`` says, per layer, which share of its tied elements its
chunk holds a copy of, for chunks starting at ``starts``.  The simulator prices a copy's state
at the plan of the layer that uses it (layer_cost: ``tied_*`` columns) and multiplies by that share.
"""
from __future__ import annotations

import numpy as np


def uses(graph) -> list[tuple[int, int, float]]:
    """(layer k, the last layer before k that uses the same weight, that weight's share of k's tied
    elements) for every tied weight a layer uses; empty for a model without ties."""
    users: dict[str, list[int]] = {}
    for layer in graph.layers:
        for name, owner, _ in layer.tied_params:
            users.setdefault(name, [owner])
            users[name].append(layer.index)
    out = []
    for layer in graph.layers:
        total = float(sum(n for _, _, n in layer.tied_params))
        for name, _, numel in layer.tied_params:
            # (-1: no earlier user, the owner lying after it -- then the copy is priced here)
            prev = max((j for j in users[name] if j < layer.index), default=-1)
            out.append((layer.index, prev, numel / total if total else 0.0))
    return out


def held_share(tied_uses: list[tuple[int, int, float]], starts, num_layers: int) -> np.ndarray:
    """(layers,) the share of each layer's tied elements that its model chunk holds a copy of
    (chunks start at ``starts``, ascending): a use counts where its last earlier user lies
    before the chunk's first layer."""
    out = np.zeros(num_layers)
    if not tied_uses:
        return out
    starts = np.asarray(starts)
    chunk_start = starts[np.searchsorted(starts, np.arange(num_layers), side="right") - 1]
    for k, prev, share in tied_uses:
        if prev < chunk_start[k]:
            out[k] += share
    return out


def range_held_bytes(tied_uses: list[tuple[int, int, float]], tied_bytes: np.ndarray,
                     starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """(ranges, strategies) bytes of the copies a stage holding layers starts[r]..ends[r]-1 keeps,
    from ``tied_bytes`` (layers, strategies): each layer's copies' state under each strategy."""
    out = np.zeros((len(starts), tied_bytes.shape[1]))
    for k, prev, share in tied_uses:
        inside = (starts <= k) & (k < ends) & (prev < starts)
        if np.count_nonzero(inside):
            out[inside] += share * tied_bytes[k]
    return out
