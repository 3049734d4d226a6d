"""Tensor-parallel sharding of one layer: which Linear is split how, and what that costs.

Two pure graph analyses, shared by the simulator and the planner:

* ``megatron_styles(graph, layer_index)`` finds the column -> row pairs of Linear modules in a
  layer (Shoeybi et al. 2019, "Megatron-LM", Sec. 3: the first GEMM of the MLP and the QKV
  projection are split by columns, the GEMM that follows is split by rows, so a whole block
  needs one all-reduce in forward and one in backward).  A Linear whose input is reached from
  one or more earlier Linears only through element-wise, view, attention, matmul, softmax and
  dropout ops is "rowwise" and those earlier Linears are "colwise" (for SwiGLU: w1 and w3
  colwise, w2 rowwise).  A fused projection whose output is cut into k equal parts on the way
  (GPT-2's ``c_attn`` into q, k, v) is "colwise:<k>", split per part (``_fused_parts``), and
  priced like the unfused pair; one cut otherwise stays whole.  Outside such pairs: the largest embedding table is split by rows
  (vocabulary-parallel embedding, Megatron-LM Sec. 3) and a Linear that feeds the loss is split
  by columns with a vocabulary-parallel loss (Megatron-LM Sec. 3, "parallelize the output
  embedding GEMM ... fuse with the cross entropy loss").  A pair applies at a degree tp only
  where tp divides each column linear's split features and every head count its output is
  viewed into (``_head_counts``; ``tp_refusals`` says which does not): Megatron splits
  attention by heads.
* ``propagate(graph, layer_index, styles, tp, sequence_parallel)`` follows those styles
  through the layer: the divisor of each op's FLOPs, activations and parameters, and the
  tensor-parallel collectives (kind, bytes, forward or backward) the split implies.  Without
  sequence parallelism the collectives are all-reduces (Megatron's f and g operators); with
  it, all-gather / reduce-scatter pairs and the ops between regions run on 1/tp of the
  sequence (Korthikanti et al. 2022, "Reducing Activation Recomputation", Sec. 4.2.2).

A mixture of experts' stacked experts (transformers 5's ``MixtralExperts``: 3-D parameters
``[experts, ...]`` read whole by grouped matmuls, not Linear modules) are found by
``stacked_experts`` and given the style "expert": split by expert over the tp ranks, each rank
running its E/tp experts on the tokens routed to them, the partial outputs summed (the row-
parallel pattern of Megatron-LM, Sec. 3: all-reduce of the output forward, of the input
gradients backward; runtime/expert_tp.py).

Byte counts are at the graph's capture batch size and dtype; callers scale them.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.dtypes import DTYPE_BYTES, dtype_bytes
from autopar.core.graph import OpGraph, OpNode
from autopar.core.plan import parts_style, tp_style_parts

#: Ops that keep a tensor-parallel split on the hidden/head dimension when their input has it.
PASS_THROUGH_KINDS = frozenset({"elementwise", "view", "attention", "matmul", "softmax", "dropout"})
#: Ops that keep the split only when they work within one head: a norm or a reduction over the
#: last dim of a tensor viewed as [..., heads, head_dim] (Qwen3's and Gemma 3's per-head q/k
#: RMSNorm), where the last dim is smaller than the projection's output features.  Over the
#: whole feature dim (OLMo 2's q_norm) they would need every rank's features.
PER_HEAD_KINDS = frozenset({"reduction", "norm"})

@dataclass(frozen=True)
class TPCollective:
    kind: str        # "all_reduce" | "all_gather" | "reduce_scatter"
    bytes: float     # the full (unsharded) tensor, at capture batch size and dtype
    pass_: str       # "fwd" | "bwd"
    at: str          # op name it belongs to
    per_sample: bool = True   # its bytes grow with the batch (an activation); False: a parameter's gradient


@dataclass(frozen=True)
class TPLayout:
    """The effect of a tensor-parallel split on one layer (divisors are 1 or tp)."""
    tp: int
    sequence_parallel: bool
    compute_shard: dict[str, int]   # op -> divisor of its FLOPs and bytes moved
    saved_shard: dict[str, int]     # op -> divisor of the activations it keeps for backward
    output_shard: dict[str, int]    # op -> divisor of its output tensor
    param_shard: dict[str, int]     # op -> divisor of its parameters
    collectives: tuple[TPCollective, ...]


# ----------------------------------------------------------------------------- detection
def _layer_index(graph: OpGraph, layer_index: int) -> tuple[list[OpNode], dict[str, OpNode], dict[str, list[str]]]:
    ops = graph.layer_ops(layer_index)
    by_name = {o.name: o for o in ops}
    consumers: dict[str, list[str]] = {o.name: [] for o in ops}
    for o in ops:
        for src in o.inputs:
            if src in consumers:
                consumers[src].append(o.name)
    return ops, by_name, consumers


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _walk_back(op: OpNode, by_name: dict[str, OpNode], graph_kind: dict[str, str]) -> tuple[set[str], set[str], bool]:
    """From a Linear's data input, walk back through pass-through ops.

    Returns (linears reached, pass-through ops crossed, whether a full-size replicated
    activation joins the path).  Such a "leaf" is an op of another kind in this layer or an
    op of another layer (the residual stream) whose tensor is as large as the op reading it;
    smaller operands (rotary tables, masks broadcast over heads) and graph inputs do not
    break the split.  Attention is followed through q, k and v only (its mask is broadcast).
    """
    linears: set[str] = set()
    crossed: set[str] = set()
    hit_leaf = False
    # Each entry carries the op whose output a joining operand is measured against: the nearest
    # reader that is not a view.  A rotary table reaches the rotation through views of its own
    # (transformers 5 unsqueezes cos/sin inside the attention module), and a view's output is as
    # large as its input, so measuring against the view would take the table for the residual
    # stream and drop the attention pair.
    stack: list[tuple[str, OpNode, int, OpNode]] = [(op.inputs[0], op, 0, op)] if op.inputs else []
    seen: set[str] = set()
    while stack:
        name, reader, idx, joins = stack.pop()
        node = by_name.get(name)
        if node is not None and node.kind in PASS_THROUGH_KINDS | PER_HEAD_KINDS | {"linear"}:
            if name in seen:
                continue
            seen.add(name)
            if node.kind == "linear":
                linears.add(name)
                continue
            crossed.add(name)
            inputs = node.inputs[:3] if node.kind == "attention" else node.inputs
            ref = joins if node.kind == "view" else node
            stack.extend((src, node, i, ref) for i, src in enumerate(inputs))
            continue
        if name not in graph_kind or (node is None and graph_kind.get(name) == "other") or \
                (node is not None and node.kind == "other"):
            continue                                   # graph input, constant, mask or position table
        shape = reader.input_shapes[idx] if idx < len(reader.input_shapes) else ()
        if reader is op or joins is op or _numel(shape) >= _numel(joins.output_shape):
            hit_leaf = True
    return linears, crossed, hit_leaf


#: Cuts of a fused projection's output into parts along its features (the traced op's name):
#: ``split`` / ``chunk`` into equal widths, ``slice`` (``qkv[..., a:b]``) one part each.
_SPLIT_CUTS = ("split", "chunk")
_SLICE_CUTS = ("slice", "getitem")
#: the op that takes the parts of a view ``[..., k, ...]`` apart: ``unbind`` / ``select`` of dim k
_UNBIND_CUTS = ("unbind", "select")


def _fused_parts(linears: set[str], crossed: set[str], by_name: dict[str, OpNode]) -> dict[str, int]:
    """The linears among ``linears`` whose output is cut into parts along its output features
    before the row-wise linear reads it -- a fused projection (GPT-2's ``c_attn`` split into q, k
    and v; Phi-3's ``gate_up_proj`` chunked in two) -- with the number of equal parts it is cut
    into, or 0 where the cut is not recognised.

    A plain column split hands each rank a contiguous block of the features -- all of q and
    half of k on rank 0 of 2 -- so the parts would mix across ranks.  Split per part instead
    (style ``colwise:<k>``: each rank holds rows ``[r*n/tp, (r+1)*n/tp)`` of each part of n
    features), every part is the rank's share of heads (or hidden units) after the local cut,
    and the pair is as exact as an unfused one.  Recognised cuts, followed from the linear's
    output through views that keep its features whole (GPT-2's addmm is ``[tokens, 3C]``
    viewed to ``[batch, seq, 3C]``):

    * ``split`` / ``chunk`` of the features into widths n with n dividing them (k = features / n),
      every piece its readers see n wide (``split([48, 24, 24])`` is not);
    * ``slice``-s of width n, exactly k = features / n of them (``qkv[..., :C]`` ... ;
      the traced ops keep no offsets, so k disjoint slices of width n are taken to tile it);
    * a ``view`` to ``[..., k, ...]`` whose k-dim is then ``unbind``-ed or ``select``-ed (told
      apart by shape from a view to ``[..., heads, k, head_dim]`` taken apart on its k-dim,
      which interleaves the parts per head and splits evenly; where both dims are equal the
      graph cannot tell, and it is left whole).

    Parts of unequal widths (a fused GQA q/k/v with fewer key/value heads, Phi-3's ``qkv_proj``
    when ``num_key_value_heads < num_attention_heads``) or any other cut are 0: left whole.
    A cut of the per-head dimension after the heads are viewed out (GPT-NeoX's interleaved qkv,
    rotary's rotate-half) is not one: its size is the head dim, not the output features."""
    readers = _readers(crossed, by_name)
    out: dict[str, int] = {}
    for lin in linears:
        shape = by_name[lin].output_shape
        if not shape:
            continue
        features = int(shape[-1])
        widths: list[tuple[str, int]] = []      # (cut kind, part width)
        unknown = False
        frontier, seen = [lin], {lin}
        while frontier:
            for node in readers.get(frontier.pop(), []):
                if node.name in seen or not node.input_shapes or not node.output_shape:
                    continue
                seen.add(node.name)
                before, after = tuple(node.input_shapes[0]), tuple(node.output_shape)
                if node.kind in ("elementwise", "dropout"):
                    if after and after[-1] == features:
                        frontier.append(node.name)        # a scale, a bias, an activation on the whole output
                    continue
                if node.kind != "view" or not before or before[-1] != features:
                    continue
                target = node.target.lower()
                if after and after[-1] == features and _numel(after) == _numel(before):
                    frontier.append(node.name)            # a reshape that keeps the features whole
                elif len(after) == len(before) and _numel(after) < _numel(before) and after[-1] != features:
                    kind = "split" if any(c in target for c in _SPLIT_CUTS) else \
                        "slice" if any(c in target for c in _SLICE_CUTS) else None
                    if kind is None:
                        unknown = True
                    else:
                        widths.append((kind, int(after[-1])))
                    if kind == "split":   # every piece's width, as its readers saw it (split_with_sizes)
                        widths += [(kind, int(r.input_shapes[j][-1])) for r in readers.get(node.name, [])
                                   for j, src in enumerate(r.inputs) if src == node.name and j < len(r.input_shapes)
                                   and r.input_shapes[j]]
                elif _numel(after) == _numel(before) and len(after) > len(before) and \
                        after[:len(before) - 1] == before[:-1]:
                    k = int(after[len(before) - 1])
                    cut = [r for r in readers.get(node.name, []) if any(c in r.target.lower() for c in _UNBIND_CUTS)
                           and tuple(r.output_shape) == after[:len(before) - 1] + after[len(before):]]
                    nxt = after[len(before)] if len(after) > len(before) else None
                    if cut and nxt == k:
                        unknown = True      # [.., 3, 3, d]: the graph does not say which dim is taken apart
                    elif cut and k >= 2 and features % k == 0:
                        widths.append(("unbind", features // k))
                    # else the heads viewed out ([..., heads, head_dim]) or taken apart per head
                    # ([..., heads, 3, head_dim], examples/gpt.py): no cut of the features
        # any other cut of a tensor as wide as this output on the way (one reached by ops the
        # trace above does not follow) leaves it whole: better unsplit than another model
        unknown |= any(_cuts_features(by_name[n], features) for n in crossed if n not in seen)
        if not widths and not unknown:
            continue
        sizes = {w for _, w in widths}
        parts = features // next(iter(sizes)) if len(sizes) == 1 and features % next(iter(sizes)) == 0 else 0
        slices = sum(1 for kind, _ in widths if kind == "slice")
        if unknown or parts < 2 or (slices and slices != parts) or len({k for k, _ in widths}) > 1:
            parts = 0
        out[lin] = parts
    return out


def _readers(crossed, by_name: dict[str, OpNode]) -> dict[str, list[OpNode]]:
    """Tensor name -> the ops of a pair's crossed region that read it (the walks of
    ``_fused_parts`` and ``_head_counts`` follow a column linear's output through them)."""
    readers: dict[str, list[OpNode]] = {}
    for name in crossed:
        for src in by_name[name].inputs:
            readers.setdefault(src, []).append(by_name[name])
    return readers


def _head_counts(linears, crossed, by_name: dict[str, OpNode], parts: dict[str, int]) -> dict[str, list[tuple[int, tuple]]]:
    """Column linear -> [(head count, the view's output shape)] for each view on the way to the
    row linear that splits its features -- each part's, for a fused projection of ``parts``
    equal parts -- into ``[..., heads, head_dim]`` (or ``[..., heads, k, head_dim]``); empty
    where none does (an MLP).  The count is read from the captured output shape, so a model
    that views with ``-1`` for its heads shows it too.  Megatron-LM splits attention by heads
    (Shoeybi et al. 2019, Sec. 3: "each GPU computes a subset of the attention heads"), and a
    model's forward reshapes a rank's share of the features into whole heads of the same
    size: a degree that does not divide a head count leaves a rank a part of a head, and the
    forward fails (or trains another model).  Followed from the linear's output through the
    ops ``_fused_parts`` follows (scales, activations, reshapes that keep the features whole)
    and the cuts into the parts of a fused projection; a fused view ``[..., k, heads,
    head_dim]`` whose k-dim is taken apart (``_fused_parts``'s "unbind" cut) has its heads
    after the k parts."""
    readers = _readers(crossed, by_name)
    out: dict[str, list[tuple[int, tuple]]] = {}
    for lin in linears:
        shape = by_name[lin].output_shape
        if not shape:
            continue
        features = int(shape[-1])
        k = parts.get(lin, 1) or 1
        widths = {features, features // k}
        found: list[tuple[int, tuple]] = []
        frontier, seen = [lin], {lin}
        while frontier:
            for node in readers.get(frontier.pop(), []):
                if node.name in seen or not node.input_shapes or not node.output_shape:
                    continue
                seen.add(node.name)
                before, after = tuple(node.input_shapes[0]), tuple(node.output_shape)
                if node.kind in ("elementwise", "dropout"):
                    if after and after[-1] in widths:
                        frontier.append(node.name)       # a scale, a bias, an activation on the whole output
                    continue
                if node.kind != "view" or not before or before[-1] not in widths or _numel(after) > _numel(before):
                    continue
                if after and after[-1] in widths and (_numel(after) == _numel(before) or len(after) == len(before)):
                    frontier.append(node.name)           # a reshape keeping the features, or a cut into parts
                    continue
                new = _split_of_last(before, after)
                if k > 1 and before[-1] == features and new and new[0] == k:
                    new = new[1:]                        # [..., k, heads, head_dim]: the parts come first
                if len(new) >= 2:
                    found.append((int(new[0]), after))
        if found:
            out[lin] = list(dict.fromkeys(found))
    return out


def _split_of_last(before: tuple, after: tuple) -> tuple:
    """The dims a view cuts ``before``'s last dim into (``[b, s, 4*16] -> [b, s, 4, 16]``:
    ``(4, 16)``; leading 1s dropped), or () when the view does not keep the other dims and
    cut only the last one."""
    if _numel(after) != _numel(before) or len(after) <= len(before):
        return ()
    lead = _numel(before[:-1])
    for j in range(len(after) + 1):
        if _numel(after[:j]) == lead and _numel(after[j:]) == before[-1]:
            new = tuple(int(d) for d in after[j:])
            while new and new[0] == 1:
                new = new[1:]
            return new
    return ()


def _tp_refusal(cols, crossed, by_name: dict[str, OpNode], tp: int) -> str | None:
    """Why the degree ``tp`` cannot split this column/row pair, or None: a column linear's
    split dimension (each part's features, for a fused projection) or a head count it is
    viewed into (``_head_counts``) that tp does not divide."""
    parts = _fused_parts(set(cols), set(crossed), by_name)
    heads = _head_counts(set(cols), set(crossed), by_name, parts)
    for c in cols:
        node = by_name[c]
        n = parts.get(c, 1) or 1
        if node.output_shape and (node.output_shape[-1] % n or (node.output_shape[-1] // n) % tp):
            per = " per part" if n > 1 else ""
            return (f"{node.module_path} has {int(node.output_shape[-1]) // n} output features{per}, "
                    f"not divisible by tp={tp}")
        for h, view in heads.get(c, ()):
            if h % tp:
                per = f" per part (of {n})" if n > 1 else ""
                return (f"{node.module_path} has {h} heads{per} (its output viewed as {list(view)}), not divisible "
                        f"by tp={tp}: Megatron splits attention by heads, so each rank would hold part of a head")
    return None


def _cuts_features(node: OpNode, features: int) -> bool:
    """A view that cuts the last dim of a ``[..., features]`` tensor into something narrower."""
    if node.kind != "view" or not node.input_shapes or not node.output_shape:
        return False
    before, after = tuple(node.input_shapes[0]), tuple(node.output_shape)
    return bool(before) and len(before) == len(after) and before[-1] == features and after[-1] != features \
        and _numel(after) < _numel(before)


def _per_head_only(linears: set[str], crossed: set[str], by_name: dict[str, OpNode]) -> bool:
    """Every norm or reduction crossed works within one head (``PER_HEAD_KINDS``): it reduces
    only the last dim, of a tensor of 4 or more dims ([batch, seq, heads, head_dim] or
    [batch, heads, seq, head_dim]), whose size is below every column linear's output features."""
    features = [by_name[n].output_shape[-1] for n in linears if by_name[n].output_shape]
    for name in crossed:
        node = by_name[name]
        if node.kind not in PER_HEAD_KINDS:
            continue
        shape = tuple(node.input_shapes[0]) if node.input_shapes else ()
        out = tuple(node.output_shape or ())
        if len(shape) < 4 or not features or shape[-1] >= min(features):
            return False
        if out not in (shape, shape[:-1], shape[:-1] + (1,)):
            return False                      # it reduces some dim other than the last
    return True


def _pairs(graph: OpGraph, layer_index: int, fused=True):
    """[(colwise linear op names, pass-through op names, rowwise linear op name)] in topological order."""
    pairs, role, ops, by_name, _fused = _pairs_and_fused(graph, layer_index, fused)
    return pairs, role, ops, by_name


def fused_projections(graph: OpGraph, layer_index: int, fused=True) -> list[str]:
    """Module paths of the fused projections of a layer that no pair splits (``_fused_parts``):
    the reason a layer's attention (or MLP) stays whole under tensor parallelism.  ``fused``
    as for ``megatron_styles``: the recognised ones it leaves whole count too."""
    _, _, _, by_name, whole = _pairs_and_fused(graph, layer_index, fused)
    return sorted({by_name[n].module_path for n in whole})


def fused_part_counts(graph: OpGraph, layer_index: int) -> dict[str, int]:
    """Module path -> number of equal parts, for each fused projection of the layer that a
    pair splits per part (style ``colwise:<parts>``)."""
    pairs, _, _, by_name, _ = _pairs_and_fused(graph, layer_index, True)
    return {by_name[c].module_path: n for cols, crossed, _row in pairs
            for c, n in _fused_parts(set(cols), set(crossed), by_name).items()}


def fused_cuts(graph: OpGraph, layer_index: int) -> dict[str, int]:
    """Module path -> number of equal parts (0: cut in a way ``_fused_parts`` does not follow)
    of every projection of the layer whose output is cut along its features on its way to a
    Linear, whether or not a pair splits it: what a plan's style for it must say."""
    ops, by_name, _ = _layer_index(graph, layer_index)
    graph_kind = {n: o.kind for n, o in graph._ops_by_name().items()}
    out: dict[str, int] = {}
    for o in ops:
        if o.kind == "linear" and o.inputs:
            linears, crossed, _ = _walk_back(o, by_name, graph_kind)
            for n, parts in _fused_parts(linears, crossed, by_name).items():
                out[by_name[n].module_path] = parts
    return out


def _kept_whole(fused, module_path: str) -> bool:
    """``fused``: True (split every recognised fused projection per part), False (none), or
    the module paths of those left whole."""
    return fused is False or (not isinstance(fused, bool) and module_path in fused)


def _pairs_and_fused(graph: OpGraph, layer_index: int, fused_ok=True):
    ops, by_name, _ = _layer_index(graph, layer_index)
    graph_kind = {n: o.kind for n, o in graph._ops_by_name().items()}
    order = {o.name: i for i, o in enumerate(ops)}
    role: dict[str, str] = {}
    pairs = []
    fused_seen: list[str] = []
    for o in ops:
        if o.kind != "linear" or not o.inputs:
            continue
        linears, crossed, hit_leaf = _walk_back(o, by_name, graph_kind)
        if not linears or hit_leaf or any(role.get(n) == "rowwise" for n in linears):
            continue
        if o.name in role:
            continue
        if not _per_head_only(linears, crossed, by_name):
            continue
        fused = _fused_parts(linears, crossed, by_name)
        whole = sorted(n for n, parts in fused.items() if not parts or _kept_whole(fused_ok, by_name[n].module_path))
        if whole:
            fused_seen += whole
            continue
        for n in linears:
            role[n] = "colwise"
        role[o.name] = "rowwise"
        pairs.append((tuple(sorted(linears, key=order.__getitem__)), tuple(crossed), o.name))
    return pairs, role, ops, by_name, fused_seen


def _is_cast(node: OpNode) -> bool:
    """A dtype conversion (``aten._to_copy``: ``.float()``, ``.to(dtype)``): element by element,
    it keeps whatever split its input has."""
    return node.kind == "elementwise" and "_to_copy" in str(node.target)


def loss_chain(graph: OpGraph, layer_index: int) -> frozenset[str]:
    """The ops of a layer between a loss-feeding linear (the LM head) and the loss, and the loss
    itself: the reshapes, dtype casts and log-softmax a fused cross-entropy kernel replaces."""
    ops, by_name, consumers = _layer_index(graph, layer_index)
    found = _loss_feeders(ops, by_name, consumers, {}, _consumed(graph))
    return frozenset(n for _lin, path, loss in found if loss is not None for n in (*path, loss))


def _loss_feeders(ops: list[OpNode], by_name: dict[str, OpNode], consumers: dict[str, list[str]],
                  role: dict[str, str], all_consumed: set[str]) -> list[tuple[str, tuple[str, ...], str | None]]:
    """Linears outside any pair whose output reaches a loss op (through views, dtype casts and its
    log-softmax) or is a model output."""
    found = []
    for o in ops:
        if o.kind != "linear" or o.name in role:
            continue
        output_reached = False
        path: list[str] = []
        frontier = [o.name]
        loss = None
        ok = True
        while frontier and ok:
            name = frontier.pop()
            users = consumers.get(name, [])
            if not users and name not in all_consumed:
                output_reached = True                  # a model output: the loss function reads it
                continue
            for user in users:
                node = by_name[user]
                if node.kind == "loss":
                    loss = user
                elif node.kind in ("view", "softmax") or _is_cast(node):
                    # reshapes, a dtype cast (a bf16 model's logits upcast to fp32 for the loss)
                    # and the loss's log-softmax
                    path.append(user)
                    frontier.append(user)
                else:
                    ok = False
        if ok and (loss is not None or output_reached):
            found.append((o.name, tuple(path), loss))
    return found


def _consumed(graph: OpGraph) -> set[str]:
    """Names of ops whose output some op reads (the rest are model outputs)."""
    cached = graph.__dict__.get("_consumed_names")
    if cached is None or graph.__dict__.get("_consumed_len") != len(graph.ops):
        cached = {src for o in graph.ops for src in o.inputs}
        graph.__dict__["_consumed_names"] = cached
        graph.__dict__["_consumed_len"] = len(graph.ops)
    return cached


def stacked_experts(graph: OpGraph, layer_index: int) -> dict[str, int]:
    """Module path -> number of experts, for each module of the layer that holds stacked expert
    parameters.  The rule (the runtime's own is runtime/expert_tp.is_stacked_experts): every op
    that reads a parameter owned directly by the module reads it whole as a 3-D operand (its
    numel is the op's parameter count) with E rows, the same E for all of them, it is not a
    Linear or an embedding; no op inside the module reads another module's parameters (its
    children hold none); and a Linear of the same layer, outside the module, has E output
    features (the router, which the experts' caller runs: each tp rank sees its full output).
    A module that routes inside itself (the zoo's ``moe``) is not one: the runtime could not
    hand it a rank's experts without knowing its forward."""
    ops = graph.layer_ops(layer_index)
    rows: dict[str, set[int]] = {}
    bad: set[str] = set()
    for o in ops:
        for p in o.params:
            owner = p.rpartition(".")[0]
            stacked = [s for s in o.input_shapes if len(s) == 3 and _numel(s) == o.param_numel]
            if o.kind in ("linear", "embedding") or len(o.params) != 1 or not stacked:
                bad.add(owner)
            else:
                rows.setdefault(owner, set()).add(int(stacked[0][0]))
    out = {}
    for m, e in rows.items():
        inside = _expert_ops(ops, m)
        names = {o.name for o in inside}
        routers = {o.output_shape[-1] for o in ops if o.kind == "linear" and o.output_shape and o.name not in names}
        if m in bad or len(e) != 1 or next(iter(e)) < 2 or next(iter(e)) not in routers:
            continue
        if any(p.rpartition(".")[0] != m for o in inside for p in o.params):
            continue
        out[m] = next(iter(e))
    return out


def _expert_ops(ops: list[OpNode], module: str) -> list[OpNode]:
    return [o for o in ops if o.module_path == module or o.module_path.startswith(module + ".")]


def megatron_styles(graph: OpGraph, layer_index: int, fused=True) -> dict[str, str]:
    """Module path -> "colwise" | "rowwise" for the Megatron split of one layer ("expert" for
    stacked experts, split by expert; "colwise:<k>" for a fused projection of k equal parts,
    split per part).  ``fused`` False, or a collection of module paths: the pairs through
    every fused projection, or through those named, stay whole (the runtime could not run
    them: planner/runtime_check.py)."""
    pairs, role, ops, by_name = _pairs(graph, layer_index, fused)
    _, _, consumers = _layer_index(graph, layer_index)
    parts = {c: n for cols, crossed, _row in pairs for c, n in _fused_parts(set(cols), set(crossed), by_name).items()}
    styles: dict[str, str] = {}
    for op_name, style in role.items():
        styles[by_name[op_name].module_path] = parts_style(parts[op_name]) if op_name in parts else style
    for lin, _path, _loss in _loss_feeders(ops, by_name, consumers, role, _consumed(graph)):
        styles[by_name[lin].module_path] = "colwise"
    emb = _largest_embedding(ops)
    if emb is not None:
        styles[emb.module_path] = "rowwise"
    for module in stacked_experts(graph, layer_index):
        styles[module] = "expert"
    return styles


def _largest_embedding(ops: list[OpNode]) -> OpNode | None:
    embs = [o for o in ops if o.kind == "embedding" and o.param_numel > 0]
    return max(embs, key=lambda o: o.param_numel) if embs else None


# ---------------------------------------------------------------------------- propagation
def _tensor_bytes(name: str, reader: OpNode, by_graph: dict[str, OpNode]) -> float:
    node = by_graph.get(name)
    if node is not None:
        return float(node.output_bytes)
    idx = reader.inputs.index(name)
    shape = reader.input_shapes[idx] if idx < len(reader.input_shapes) else ()
    return float(_numel(shape) * dtype_bytes(reader.dtype))


#: Ops that mix the positions of a sequence: under sequence parallelism they must run inside a
#: column/row pair, where the activations are whole along the sequence (Korthikanti et al. 2022,
#: Sec. 4.2.2: only the norms and dropouts between the pairs run on sequence shards); a recurrent
#: module (op_costs._rnn) runs through every position in turn.
SEQUENCE_MIXING_KINDS = frozenset({"attention", "rnn"})


def sequence_mixing_outside_pairs(graph: OpGraph, layer_index: int, styles: dict[str, str], tp: int) -> list[str]:
    """The ops of a layer that mix sequence positions but lie outside every column/row pair the
    styles apply: with sequence parallelism on, the runtime hands them one rank's sequence shard,
    so they would compute on part of the sequence -- a layout that runs but trains another
    model (nn.MultiheadAttention, whose packed projections no style splits, is one).  Empty when
    the layer applies no pair (it then runs on whole activations)."""
    layout_pairs, _, ops, by_name = _pairs(graph, layer_index)
    applied = [(cols, crossed, row) for cols, crossed, row in layout_pairs
               if _pair_applies(cols, crossed, row, by_name, styles.get, tp)]
    if not applied or tp <= 1:
        return []
    inside = {n for _, crossed, _ in applied for n in crossed}
    return [o.name for o in ops if o.kind in SEQUENCE_MIXING_KINDS and o.name not in inside]


def _pair_applies(cols, crossed, row, by_name: dict[str, OpNode], style_of, tp: int) -> bool:
    """Whether the styles apply this column/row pair: the row linear row-wise and each column
    linear column-wise -- a fused one per part, with the number of parts the graph cuts it into
    (``_fused_parts``; an even split of it would train another model, so it is priced whole) --
    and tp divides every split dimension (each part's features) and every head count a column
    linear is viewed into (``_head_counts``, each key/value projection's own under grouped-query
    attention): Megatron splits attention by heads, the MLP by its hidden dim."""
    if style_of(by_name[row].module_path) != "rowwise":
        return False
    parts = _fused_parts(set(cols), set(crossed), by_name)
    for c in cols:
        base, n = tp_style_parts(style_of(by_name[c].module_path) or "")
        if base != "colwise" or n != parts.get(c, 1):
            return False
    return _tp_refusal(cols, crossed, by_name, tp) is None


def tp_refusals(graph: OpGraph, layer_index: int, styles: dict[str, str], tp: int) -> list[str]:
    """Why ``tp`` cannot split the column/row pairs ``styles`` ask for in a layer (one line per
    pair: a split dimension or a head count tp does not divide, ``_tp_refusal``); empty when
    every such pair applies.  Such a pair is priced whole (``propagate``) and the planner
    leaves the degree out for the layer (planner/runtime_check.py), saying this."""
    if tp <= 1:
        return []
    pairs, _role, _ops, by_name = _pairs(graph, layer_index)
    out = []
    for cols, crossed, row in pairs:
        if not _pair_applies(cols, crossed, row, by_name, styles.get, 1):
            continue                       # the styles do not ask for this pair
        why = _tp_refusal(cols, crossed, by_name, tp)
        if why:
            out.append(why)
    return out


def propagate(graph: OpGraph, layer_index: int, styles: dict[str, str], tp: int,
              sequence_parallel: bool = False, loss_parallel: bool = False) -> TPLayout:
    """Shard factors and collectives of one layer under the given tensor-parallel styles.

    ``styles`` maps module paths to "colwise" / "rowwise" (a LayerPlan's tp field).  A style
    that does not form a valid Megatron pair in this layer is ignored (the op stays
    replicated), so a plan can never be priced cheaper than it can run.

    ``loss_parallel``: the training code computes the loss on logits left sharded over the
    vocabulary (torch.distributed.tensor.parallel.loss_parallel; torchtitan keeps a column-wise
    head's output ``Shard(-1)`` when tp > 1, 9dec370 parallelize_llama.py): the head's logits,
    the reshapes and log-softmax between it and the loss hold 1/tp of the vocabulary on each rank,
    nothing gathers the logits, and the loss meets over per-token statistics -- three all-reduces of
    one fp32 value per token (the max and the sum of exponentials of the log-softmax, the target's
    log-probability of the nll loss).  autopar's runtime gathers the logits (runtime/apply_tp.py).
    """
    ops, by_name, consumers = _layer_index(graph, layer_index)
    if tp <= 1:
        ones = {o.name: 1 for o in ops}
        return TPLayout(tp, False, ones, dict(ones), dict(ones), dict(ones), ())
    pairs, _role, _, _ = _pairs(graph, layer_index)

    applied = [(cols, crossed, row) for cols, crossed, row in pairs
               if _pair_applies(cols, crossed, row, by_name, styles.get, tp)]
    # Sequence parallelism covers only the layers that hold a column/row pair (the runtime
    # applies it the same way, runtime/apply_tp.py); a layer without one runs replicated on
    # full activations even on a sequence-parallel mesh.
    split_experts = {m: e for m, e in stacked_experts(graph, layer_index).items()
                     if styles.get(m) == "expert" and e % tp == 0}
    sp = bool(sequence_parallel and (applied or split_experts))
    outside = tp if sp else 1
    compute = {o.name: outside for o in ops}
    saved = {o.name: outside for o in ops}
    output = {o.name: outside for o in ops}
    param = {o.name: 1 for o in ops}
    colls: list[TPCollective] = []
    graph_by_name = graph._ops_by_name()

    for cols, crossed, row in applied:
        region_inputs: dict[str, float] = {}
        fused = _fused_parts(set(cols), set(crossed), by_name)
        for c in cols:
            node = by_name[c]
            compute[c] = param[c] = output[c] = tp
            # keeps its replicated input, under sequence parallelism too: DTensor's ColwiseParallel
            # redistributes the Shard(1) input to Replicate before the matmul, which autograd saves
            # for the weight gradient (measured on the runtime: tests/integration/
            # test_collective_counts.py; Megatron-LM instead keeps the sharded input and gathers it
            # again in backward, Korthikanti et al. 2022, Sec. 4.2.2 -- no code priced here does)
            saved[c] = 1
            region_inputs.setdefault(node.inputs[0], _tensor_bytes(node.inputs[0], node, graph_by_name))
            if fused.get(c) and node.output_shape and any(p.endswith(".bias") for p in node.params):
                # split per part, its bias stays whole on every rank and each rank's gradient
                # covers its own rows: summed over tp backward (runtime/fused_tp.py)
                colls.append(TPCollective("all_reduce", float(node.output_shape[-1] * dtype_bytes(node.dtype)),
                                          "bwd", c))
        for n in crossed:
            compute[n] = saved[n] = output[n] = tp
        compute[row] = param[row] = saved[row] = tp
        output[row] = tp if sp else 1
        out_bytes = float(by_name[row].output_bytes)
        for src, nbytes in region_inputs.items():
            if sp:   # g-bar / g operators of Korthikanti et al. 2022, Fig. 5
                colls.append(TPCollective("all_gather", nbytes, "fwd", src))
                colls.append(TPCollective("reduce_scatter", nbytes, "bwd", src))
            else:    # f operator of Shoeybi et al. 2019, Fig. 3: identity fwd, all-reduce bwd
                colls.append(TPCollective("all_reduce", nbytes, "bwd", src))
        if sp:
            colls.append(TPCollective("reduce_scatter", out_bytes, "fwd", row))
            colls.append(TPCollective("all_gather", out_bytes, "bwd", row))
        else:        # g operator: all-reduce fwd, identity bwd
            colls.append(TPCollective("all_reduce", out_bytes, "fwd", row))

    for lin, path, loss in _loss_feeders(ops, by_name, consumers, {}, _consumed(graph)):
        node = by_name[lin]
        if styles.get(node.module_path) != "colwise" or (node.output_shape and node.output_shape[-1] % tp):
            continue
        # A column-wise head without a row-wise partner computes 1/tp of the logits and the
        # runtime gathers them (ColwiseParallel(output_layouts=Replicate()), runtime/apply_tp.py):
        # all-gather of the logits forward, all-reduce of the input gradient backward
        # (Shoeybi et al. 2019, Fig. 3 "f" operator); the loss then runs on full logits.
        compute[lin] = param[lin] = tp
        if not loss_parallel:
            colls.append(TPCollective("all_gather", float(node.output_bytes), "fwd", lin))
        colls.append(TPCollective("all_reduce", _tensor_bytes(node.inputs[0], node, graph_by_name), "bwd", lin))
        if not loss_parallel:
            continue
        output[lin] = tp
        for n in path:
            compute[n] = saved[n] = output[n] = tp
        if loss is not None and node.output_shape:
            tokens = _numel(node.output_shape) / node.output_shape[-1]
            for _ in range(3):
                colls.append(TPCollective("all_reduce", tokens * DTYPE_BYTES["float32"], "fwd", loss))

    for module in split_experts:
        inside = _expert_ops(ops, module)
        names = {o.name for o in inside}
        # each rank holds E/tp experts and multiplies only the rows routed to them: the ops that
        # read the stacked parameters (the grouped matmuls) divide their FLOPs and parameters by
        # tp, assuming balanced routing (the router's load-balancing loss aims at it; Fedus et al.
        # 2022, "Switch Transformers", Sec. 2.2); the routing bookkeeping and the element-wise
        # ops between them run on every routed row on every rank.
        for o in inside:
            # under SP the module runs on the tokens of every tp rank (gathered below)
            compute[o.name] = saved[o.name] = output[o.name] = 1
            if o.params:
                compute[o.name] = param[o.name] = tp
        # f operator on the floating inputs (tokens, routing weights): all-reduce of their
        # gradients backward; g operator on the output: all-reduce forward (Shoeybi et al. 2019,
        # Fig. 3).  Under SP, all-gather of the inputs forward (reduce-scatter backward) and
        # reduce-scatter of the output forward (all-gather backward): Korthikanti et al. 2022,
        # Fig. 5, as runtime/expert_tp.ExpertShard runs it
        entering = {src: _tensor_bytes(src, o, graph_by_name) for o in inside if o.requires_grad
                    and o.dtype.startswith(("float", "bfloat")) for src in o.inputs if src not in names
                    and by_name.get(src) is not None and by_name[src].requires_grad}
        for src, nbytes in entering.items():
            if sp:
                colls.append(TPCollective("all_gather", nbytes, "fwd", src))
                colls.append(TPCollective("reduce_scatter", nbytes, "bwd", src))
            else:
                colls.append(TPCollective("all_reduce", nbytes, "bwd", src))
        for o in inside:
            if any(c not in names for c in consumers.get(o.name, [])):
                if sp:
                    colls.append(TPCollective("reduce_scatter", float(o.output_bytes), "fwd", o.name))
                    colls.append(TPCollective("all_gather", float(o.output_bytes), "bwd", o.name))
                else:
                    colls.append(TPCollective("all_reduce", float(o.output_bytes), "fwd", o.name))

    if sp:
        # a replicated parameter read on the sequence shards (a norm's weight, a router): its
        # gradient is summed over tp backward, once per micro-batch (runtime/apply_tp.py: DTensor's
        # SequenceParallel for a norm, _sum_replicated_grads for the others; Megatron-LM sums
        # both the same way, once per step, finalize_model_grads)
        seen: set[str] = set()
        for o in ops:
            trained = [p for p in o.params if p not in o.frozen_params and p not in seen]
            if not trained or param[o.name] > 1 or compute[o.name] != tp:
                continue
            seen.update(trained)
            nbytes = float(o.param_numel - o.frozen_numel) * dtype_bytes(o.dtype)
            colls.append(TPCollective("all_reduce", nbytes, "bwd", o.name, per_sample=False))

    emb = _largest_embedding(ops)
    if emb is not None and styles.get(emb.module_path) == "rowwise":
        compute[emb.name] = param[emb.name] = tp
        # vocabulary-parallel lookup: partial rows, summed across tp (reduce-scattered under SP)
        colls.append(TPCollective("reduce_scatter" if sp else "all_reduce", float(emb.output_bytes), "fwd", emb.name))
    return TPLayout(tp, sp, compute, saved, output, param, tuple(colls))
