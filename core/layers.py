"""Group captured ops into layers: the repeated blocks of the module tree, plus "pre"/"post".

A layer is the unit of pipeline stages, recompute and FSDP wrapping (docs/design.md, "Contracts").
The blocks are the children of module containers (``nn.ModuleList`` / ``nn.Sequential``)
holding runs of same-class children (at least two; or a ModuleList of one, for a 1-layer
model): first the run that covers the most parameters (so a transformer's ``blocks`` wins
over a ``Sequential`` of Linears inside each block), then every other run that is neither
inside a chosen block nor holds one (a T5 encoder's and decoder's blocks, a ResNet's stages,
the towers of a two-input model), in the order the forward first runs them.  Ops before the
first block form "pre", ops after the last one "post"; an op between two blocks that belongs
to neither (root-level glue) joins the block that ran just before it.  The modules a
pre/post layer names never hold a block (see ``top_module``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch.nn as nn

from autopar.core.graph import Layer, OpNode


@dataclass(frozen=True)
class BlockRun:
    """The blocks of a model: one or more runs of same-class children, in forward order."""
    paths: tuple[str, ...]         # paths of the blocks ("blocks.0", ..., or "encoder.block.0", ...)
    kinds: tuple[str, ...]         # class name of each block
    containers: tuple[str, ...]    # the ModuleList / Sequential of each run ("blocks", "encoder.block")


def _runs(root: nn.Module) -> list[tuple[tuple[int, int, int, int], str, str, tuple[str, ...]]]:
    """Every run of same-class children of a ModuleList/Sequential: (score, container, class, paths).

    A run of >= 2 ranks first; a ModuleList holding a single block (a 1-layer model) is the
    fallback so that its block still becomes a layer.  Then more parameters, more children,
    shallower."""
    out = []
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
            single_list = len(children) == 1 and isinstance(mod, nn.ModuleList)
            if len(run) >= 2 or single_list:
                numel = sum(p.numel() for _, child in run for p in child.parameters())
                depth = path.count(".") + (1 if path else 0)
                prefix = f"{path}." if path else ""
                out.append(((int(len(run) >= 2), numel, len(run), -depth), path, cls.__name__,
                            tuple(prefix + name for name, _ in run)))
            start = end + 1
    return out


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def find_blocks(root: nn.Module, module_paths: list[str] | None = None) -> BlockRun | None:
    """The repeated blocks: the best run of same-class children (see ``_runs``), plus every other
    run of >= 2 parameter-holding children that neither lies inside a chosen block nor holds
    one -- an encoder's and a decoder's blocks, a CNN's stages, each tower of a two-input
    model -- so that each becomes layers of its own instead of being folded into pre/post.

    ``module_paths`` (the owning module of every traced op, in forward order) orders the runs
    by when they first run; without it they keep the module tree's order.
    """
    runs = sorted(_runs(root), key=lambda r: r[0], reverse=True)
    if not runs:
        return None
    chosen = [runs[0]]
    if runs[0][0][0]:
        for run in runs[1:]:
            score, container, _, paths = run
            if not score[0] or score[1] == 0:
                continue
            clash = any(_inside(container, b) or any(_inside(b, p) for p in paths)
                        for _, _, _, taken in chosen for b in taken)
            if not clash:
                chosen.append(run)
    tree_order = {name: i for i, (name, _) in enumerate(root.named_modules())}

    def first_use(run) -> tuple[int, int]:
        paths = run[3]
        if module_paths:
            for i, mp in enumerate(module_paths):
                if any(_inside(mp, p) for p in paths):
                    return (0, i)
            return (1, tree_order.get(paths[0], 0))
        return (0, tree_order.get(paths[0], 0))

    chosen.sort(key=first_use)
    return BlockRun(paths=tuple(p for r in chosen for p in r[3]),
                    kinds=tuple(r[2] for r in chosen for _ in r[3]),
                    containers=tuple(r[1] for r in chosen))


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
    names = ([("pre", "pre")] if has_pre else []) + list(zip(blocks.paths, blocks.kinds)) \
        + ([("post", "post")] if has_post else [])
    return out, names


def top_module(path: str, blocks: BlockRun | None) -> str:
    """The outermost module on ``path`` that holds no block: the unit a pre/post layer names.

    A module that holds blocks (Hugging Face's ``model``/``bert``, a T5 ``encoder``) is not a
    unit of the pre/post layer: wrapping it would wrap the blocks too.  "" when every
    prefix holds a block (an op owned by such a parent module itself)."""
    if blocks is None:
        return path.split(".")[0] if path else ""
    parts = path.split(".") if path else []
    holders = blocks.paths + blocks.containers
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if not any(_inside(b, prefix) for b in holders):
            return prefix
    return ""


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
    layers = []
    for i, (name, kind) in enumerate(names):
        members = by_layer[i]
        if blocks is not None and name in blocks.paths:
            paths = (name,)
        else:
            paths = tuple(p for p in dict.fromkeys(top_module(o.module_path, blocks) for o in members
                                                   if o.module_path) if p)
        layers.append(Layer(
            index=i, name=name, kind=kind, module_paths=paths, ops=tuple(o.name for o in members),
            param_numel=sum(o.param_numel for o in members),
            frozen_numel=sum(o.frozen_numel for o in members),
            fwd_flops=sum(o.fwd_flops for o in members),
            bwd_flops=sum(o.bwd_flops for o in members),
            saved_bytes=sum(o.saved_bytes for o in members),
            input_bytes=sum(value_bytes[r] for r in consumers[i]),
            output_bytes=sum(value_bytes[r] for r in produced_out[i]),
            signature=_signature(members, param_shapes)))
    return layers, sequential


def _signature(ops: list[OpNode], param_shapes: dict[str, tuple[int, ...]]) -> str:
    """Hash of op kinds, targets, shapes, parameter shapes, which parameters are frozen and which
    an earlier layer holds (tied) -- not names."""
    h = hashlib.sha256()
    for o in ops:
        h.update(repr((o.kind, o.target, o.input_shapes, o.output_shape, o.dtype,
                       tuple(param_shapes.get(p, ()) for p in o.params))
                      + (("causal",) if o.causal else ())
                      + (("frozen", tuple(o.params.index(p) for p in o.frozen_params)) if o.frozen_params else ())
                      + (("tied", o.tied_numel, o.tied_frozen_numel) if o.tied_numel else ())
                      ).encode())
    return h.hexdigest()[:16]
