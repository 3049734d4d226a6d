"""Group captured ops into layers: the repeated blocks of the module tree, plus "pre"/"post".

A layer is the unit of pipeline stages, recompute and FSDP wrapping (docs/design.md, "Contracts").
The blocks are the children of the module container (``nn.ModuleList`` / ``nn.Sequential``)
holding the longest run of same-class children (at least two; or a ModuleList of one, for a
1-layer model), preferring the run that covers the most parameters (so a transformer's ``blocks`` wins over a ``Sequential`` of
Linears inside each block).  Ops before the first block form "pre", ops after the last one
"post"; an op between two blocks that belongs to neither (root-level glue) joins the block
that ran just before it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch.nn as nn

from autopar.core.graph import Layer, OpNode


@dataclass(frozen=True)
class BlockRun:
    container: str                 # path of the ModuleList / Sequential ("blocks", "transformer.h")
    paths: tuple[str, ...]         # paths of the repeated children, in order
    kind: str                      # their class name


def find_blocks(root: nn.Module) -> BlockRun | None:
    """The longest run of same-class children of a ModuleList/Sequential (>= 2), or None."""
    best: tuple[tuple[int, int, int, int], BlockRun] | None = None
    for path, mod in root.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.named_children())
        start = 0
        while start < len(children):
            cls = type(children[start][1])
            end = start
            while end + 1 < len(children) and type(children[end + 1][1]) is cls:
                end += 1
            run = children[start:end + 1]
            # a run of >= 2 ranks first; a ModuleList holding a single block (a 1-layer
            # model) is the fallback so that its block still becomes a layer
            single_list = len(children) == 1 and isinstance(mod, nn.ModuleList)
            if len(run) >= 2 or single_list:
                numel = sum(p.numel() for _, child in run for p in child.parameters())
                depth = path.count(".") + (1 if path else 0)
                score = (int(len(run) >= 2), numel, len(run), -depth)
                if best is None or score > best[0]:
                    prefix = f"{path}." if path else ""
                    best = (score, BlockRun(container=path, kind=cls.__name__,
                                            paths=tuple(prefix + name for name, _ in run)))
            start = end + 1
    return best[1] if best else None


def assign_layers(module_paths: list[str], blocks: BlockRun | None) -> tuple[list[int], list[tuple[str, str]]]:
    """Layer index of every op (given its owning module path) and (name, kind) per layer."""
    if blocks is None:
        return [0] * len(module_paths), [("model", "model")]
    block_of = {p: i for i, p in enumerate(blocks.paths)}

    def block_index(mp: str) -> int | None:
        # walk up the module path until a block path matches
        while True:
            if mp in block_of:
                return block_of[mp]
            if "." not in mp:
                return None
            mp = mp.rsplit(".", 1)[0]

    raw = [block_index(mp) for mp in module_paths]
    seen = [i for i, b in enumerate(raw) if b is not None]
    if not seen:
        return [0] * len(module_paths), [("model", "model")]
    first, last = seen[0], seen[-1]
    has_pre = first > 0
    has_post = last < len(raw) - 1
    offset = 1 if has_pre else 0
    out: list[int] = []
    current = 0
    for i, b in enumerate(raw):
        if b is not None:
            current = b
            out.append(b + offset)
        elif i < first:
            out.append(0)
        elif i > last:
            out.append(len(blocks.paths) + offset)
        else:
            out.append(current + offset)      # glue between blocks joins the block before it
    names = ([("pre", "pre")] if has_pre else []) + [(p, blocks.kind) for p in blocks.paths] \
        + ([("post", "post")] if has_post else [])
    return out, names


def build_layers(ops: list[OpNode], names: list[tuple[str, str]], blocks: BlockRun | None,
                 act_reads: dict[str, list[tuple[str, int]]], act_outputs: dict[str, tuple[str, int]],
                 graph_outputs: list[str], param_shapes: dict[str, tuple[int, ...]]
                 ) -> tuple[list[Layer], bool]:
    """Layers with totals, boundary bytes and signatures; and whether the layers are sequential.

    ``act_reads``: op name -> activation values it reads, as (value ref, bytes);
    ``act_outputs``: value ref -> (producing op name, bytes) for every activation value
    (graph inputs are produced by "input:<name>"); ``graph_outputs``: value refs returned.
    """
    num_layers = len(names)
    layer_of_op = {o.name: o.layer for o in ops}
    producer_layer = {ref: layer_of_op.get(op, -1) for ref, (op, _) in act_outputs.items()}
    value_bytes = {ref: nbytes for ref, (_, nbytes) in act_outputs.items()}

    # where each activation value is consumed (layer indices; graph output = num_layers)
    last_use: dict[str, int] = {}
    consumers: dict[int, set[str]] = {i: set() for i in range(num_layers)}
    for o in ops:
        for ref, _ in act_reads.get(o.name, ()):
            last_use[ref] = max(last_use.get(ref, -1), o.layer)
            if producer_layer.get(ref, -1) != o.layer:
                consumers[o.layer].add(ref)
    produced_out: dict[int, set[str]] = {i: set() for i in range(num_layers)}
    for ref in graph_outputs:
        if ref in producer_layer:
            last_use[ref] = num_layers
    for ref, layer in producer_layer.items():
        if layer >= 0 and last_use.get(ref, layer) > layer:
            produced_out[layer].add(ref)

    # a boundary between layer i and i+1 is crossed by values made at <= i and used at > i
    sequential = num_layers > 1
    for i in range(num_layers - 1):
        crossing = [r for r, lu in last_use.items() if producer_layer.get(r, -1) <= i < lu]
        if len(crossing) != 1:
            sequential = False
            break

    by_layer: dict[int, list[OpNode]] = {i: [] for i in range(num_layers)}
    for o in ops:
        by_layer[o.layer].append(o)
    depth = (blocks.container.count(".") + 2) if blocks and blocks.container else 1
    layers = []
    for i, (name, kind) in enumerate(names):
        members = by_layer[i]
        if blocks is not None and name in blocks.paths:
            paths = (name,)
        else:
            paths = tuple(dict.fromkeys(
                ".".join(o.module_path.split(".")[:depth]) for o in members if o.module_path))
        layers.append(Layer(
            index=i, name=name, kind=kind, module_paths=paths, ops=tuple(o.name for o in members),
            param_numel=sum(o.param_numel for o in members),
            fwd_flops=sum(o.fwd_flops for o in members),
            bwd_flops=sum(o.bwd_flops for o in members),
            saved_bytes=sum(o.saved_bytes for o in members),
            input_bytes=sum(value_bytes[r] for r in consumers[i]),
            output_bytes=sum(value_bytes[r] for r in produced_out[i]),
            signature=_signature(members, param_shapes)))
    return layers, sequential


def _signature(ops: list[OpNode], param_shapes: dict[str, tuple[int, ...]]) -> str:
    """Hash of op kinds, targets, shapes and parameter shapes -- not names."""
    h = hashlib.sha256()
    for o in ops:
        h.update(repr((o.kind, o.target, o.input_shapes, o.output_shape, o.dtype,
                       tuple(param_shapes.get(p, ()) for p in o.params))).encode())
    return h.hexdigest()[:16]
