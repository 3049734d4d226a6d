"""Expert parallelism's costs, per MoE layer and per rank: which ops are routed experts, the
token dispatch and combine all-to-alls, the expert GEMMs at their per-expert shapes under a
stated routing imbalance, and the expert weights split ep ways.

``Mesh.ep`` borrows ep ranks from the dp x cp ranks (core/parallel_dims.py): an ep group holds
E/ep experts per rank, and the tokens a rank routes reach their experts by an all-to-all inside
the group (GShard, Lepikhin et al. 2021, Sec. 2.2 and 3.2: dispatch and combine; DeepSpeed-MoE,
Rajbhandari et al. 2022, Sec. 4.1).  ``layer_cost.compute_layer_cost`` puts the all-to-alls in
the layer's ``ep_comm_*`` columns (on the critical path, as the tensor-parallel collectives) and
calls ``expert_work`` for the compute and the parameters.

Sources:

* Dispatch / combine volume: every token goes to ``top_k`` experts, so a rank sends T x k x h
  elements (its T tokens, hidden width h) in the dispatch and receives as many back in the
  combine; the backward sends the gradients of both the other way (GShard Sec. 3.2; Switch
  Transformer, Fedus et al. 2022, Sec. 2.2, Fig. 3: "all-to-all communication" of tokens to
  experts and back).  Of each all-to-all, 1/ep of the buffer stays on the rank.
* Within and across nodes: an all-to-all sends M/ep to each peer at once; the bytes to peers on
  the rank's node cross the node link, the bytes to other nodes the rank's share of the node's
  network, concurrently, so the slower part sets the time (DeepSeek-V3 technical report,
  DeepSeek-AI 2024, Sec. 3.2.2: dispatch traffic over InfiniBand at ~50 GB/s against NVLink at
  ~160 GB/s per GPU is what bounds cross-node expert parallelism).  Plus (ep - 1) latencies,
  the pairwise exchange's steps (Thakur et al. 2005, "Optimization of Collective Communication
  Operations in MPICH", Sec. 4.4).
* Routing imbalance: the busiest rank of an ep group receives more than the mean T x k tokens;
  the ranks meet at the combine, so its expert GEMMs set the pace.  ``CAPACITY_FACTOR`` = 1.25
  is the capacity factor Switch Transformer trains with (Fedus et al. 2022, Sec. 2.2 and
  Table 1: expert capacity = tokens per expert x capacity factor, 1.25 for their main runs;
  GShard Sec. 2.2 bounds expert capacity the same way): the busiest expert's tokens over the
  mean.  With ep = 1 every rank computes all experts on its own tokens, whatever their split,
  so no imbalance shows.
* Per-expert GEMM shapes: a grouped GEMM over E/ep local experts, each on its m = T x k x ep / E
  x capacity rows (the wave-quantisation of cost_model.CostModel.compute_time_ex sees the small
  per-expert GEMMs, not one GEMM of all rows).
* Expert weights: split ep ways along the expert dimension; their gradients and FSDP shards
  span the dp x cp / ep ranks that hold the same experts (torchtitan's ``dp_mod_ep`` mesh; the
  experts are their own FSDP unit) -- ``axes/dp.data_parallel_parts``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.core.graph import OpGraph
from autopar.core.sharding import TPLayout
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.topology import MeshLinks
from autopar.simulator.axes.recompute import collective_output_bytes, saves_collective
from autopar.simulator.axes.tp import fold_into_tp
# the busiest expert's tokens over the mean (Switch Transformer's training capacity factor), defined
# beside TrainingCode.expert_load, whose default it is
from autopar.simulator.device.training_code import CAPACITY_FACTOR


_INDEXED = re.compile(r"^(.*)\.(\d+)(?:\..*)?$")
#: a max over the scores that returns the chosen index (Tensor.max(dim), aten.max.dim, argmax); not amax
_TOP1 = re.compile(r"(^|\.)(max(\.dim)?|argmax(\.default)?)$")


@dataclass(frozen=True)
class RoutedExperts:
    """One layer's routed experts as the captured graph shows them."""
    module: str                  # the module holding the experts ("model.layers.0.mlp.experts")
    form: str                    # "stacked" (3-D parameters [E, ...]) | "module_list" (module.<i>)
    experts: int                 # E
    top_k: int                   # experts per token (the router's topk)
    hidden: int                  # width of a dispatched token
    tokens: float                # tokens the router scores at the captured batch
    ops: frozenset               # names of the ops inside the experts module
    gemms: frozenset             # ... those that multiply by expert weights (priced per expert)
    param_numel: int             # expert parameters (before any split)
    param_names: frozenset


def routed_experts(graph: OpGraph, layer_index: int) -> tuple[RoutedExperts, ...]:
    """The routed experts of layer ``layer_index`` (cached on the graph): a module whose experts
    are stacked 3-D parameters read whole (core/sharding.stacked_experts: transformers 5's
    Mixtral / Qwen-MoE experts, torchtitan's GroupedExperts), or a module with children
    ``<module>.0 .. <module>.E-1`` holding parameters (an ``nn.ModuleList`` of experts, as
    older transformers and DeepSeek-V3's reference code build them); in both, a Linear of the
    layer outside the module with E outputs (the router) and a ``topk`` over E scores give
    the routing (a ``max`` / ``argmax`` over the E scores: top 1).  A module that capture keeps
    opaque (a ``leaf`` op: the per-expert ``torch.where`` of DeepSeek-V3's reference code has
    data-dependent shapes) is found from its parameters and the ``topk`` it ran
    (``_leaf_experts``)."""
    cache = graph.__dict__.setdefault("_routed_experts", {})
    if layer_index not in cache:
        cache[layer_index] = _find(graph, layer_index)
    return cache[layer_index]


def has_routed_experts(graph: OpGraph) -> tuple[int, ...]:
    """The expert counts of the graph's routed-expert modules (empty: a dense model)."""
    return tuple(sorted({r.experts for i in range(len(graph.layers)) for r in routed_experts(graph, i)}))


def _find(graph: OpGraph, layer_index: int) -> tuple[RoutedExperts, ...]:
    from autopar.core.sharding import stacked_experts

    ops = graph.layer_ops(layer_index)
    found: dict[str, tuple[str, int]] = {m: ("stacked", e) for m, e in stacked_experts(graph, layer_index).items()}
    children: dict[str, set[int]] = {}
    for o in ops:
        if not o.params:
            continue
        m = _INDEXED.match(o.module_path)
        while m:
            children.setdefault(m.group(1), set()).add(int(m.group(2)))
            m = _INDEXED.match(m.group(1))
    for parent, idx in children.items():
        if len(idx) >= 2 and idx == set(range(len(idx))) and parent not in found and \
                not any(parent.startswith(f + ".") or f.startswith(parent + ".") for f in found):
            found[parent] = ("module_list", len(idx))
    out = []
    for module, (form, experts) in found.items():
        inside = [o for o in ops if o.module_path == module or o.module_path.startswith(module + ".")]
        names = {o.name for o in inside}
        routers = [o for o in ops if o.kind == "linear" and o.name not in names and o.output_shape
                   and o.output_shape[-1] == experts and o.input_shapes]
        ks = [o.output_shape[-1] for o in ops if "topk" in str(o.target) and o.input_shapes
              and o.input_shapes[0] and o.input_shapes[0][-1] == experts and o.output_shape]
        # top-1 routing by a max / argmax over the E scores (Switch Transformer's router)
        ks += [1 for o in ops if _TOP1.search(str(o.target)) and o.input_shapes
               and o.input_shapes[0] and o.input_shapes[0][-1] == experts
               and tuple(o.output_shape) == tuple(o.input_shapes[0][:-1])]
        if not routers or not ks or not 0 < ks[0] <= experts:
            continue
        router = routers[0]
        tokens = _numel(router.output_shape) / experts
        gemms = frozenset(o.name for o in inside if o.params and o.kind in ("matmul", "linear"))
        params = {p for o in inside for p in o.params}
        out.append(RoutedExperts(module, form, experts, int(ks[0]), int(router.input_shapes[0][-1]), tokens,
                                 frozenset(names), gemms, sum(o.param_numel for o in inside), frozenset(params)))
    out += [r for o in ops if o.kind == "leaf" for r in _leaf_experts(graph, o)
            if not any(r.module == f or r.module.startswith(f + ".") for f in found)]
    # a module_list parent inside a stacked module, or the experts' own children: keep the outermost
    return tuple(sorted(out, key=lambda r: r.module))


def _leaf_experts(graph: OpGraph, op) -> list[RoutedExperts]:
    """The routed experts inside an opaque (``leaf``) op: parameters ``<leaf>.<list>.<i>.*`` for
    i = 0 .. E-1 (an ``nn.ModuleList`` of E >= 2 experts), a ``topk(k)`` over E scores that the
    module ran (``OpGraph.leaf_routing``) and a router parameter of E rows beside them (its
    columns: the width of a dispatched token).  The leaf is priced whole as capture costed it
    (k of E experts per token: core/trace_fx.routed_expert_numel), so no GEMM is repriced
    (``gemms`` empty); the expert parameters are those of the list, sized from the leaf's
    parameter shapes (capture appends them to its inputs, in ``params`` order)."""
    routing = graph.leaf_routing.get(op.module_path, ())
    if not routing or not op.params or len(op.input_shapes) < len(op.params) + 1:
        return []
    shapes = dict(zip(op.params, op.input_shapes[len(op.input_shapes) - len(op.params):]))
    prefix = op.module_path + "." if op.module_path else ""
    lists: dict[str, set[int]] = {}
    for p in op.params:
        m = re.match(r"^(.+)\.(\d+)\.[^.]+(?:\..+)?$", p[len(prefix):]) if p.startswith(prefix) else None
        if m:
            lists.setdefault(prefix + m.group(1), set()).add(int(m.group(2)))
    out = []
    for module, idx in lists.items():
        experts = len(idx)
        if experts < 2 or idx != set(range(experts)):
            continue
        mine = [p for p in op.params if p.startswith(module + ".")]
        routers = [shapes[p] for p in op.params if not p.startswith(module + ".") and len(shapes[p]) == 2
                   and shapes[p][0] == experts]
        ks = [k for k, n in routing if n == experts and 0 < k <= experts]
        if not routers or not ks:
            continue
        tokens = _numel(op.input_shapes[0][:-1])
        out.append(RoutedExperts(module, "module_list", experts, int(ks[0]), int(routers[0][1]), tokens,
                                 frozenset({op.name}), frozenset(), int(sum(_numel(shapes[p]) for p in mine)),
                                 frozenset(mine)))
    return out


def ep_refusal(graph: OpGraph, ep: int) -> str | None:
    """Why ``graph`` cannot be planned with expert-parallel degree ``ep`` (one sentence), or None."""
    if ep == 1:
        return None
    counts = has_routed_experts(graph)
    if not counts:
        return ("it has no routed experts (a module of stacked [experts, ...] parameters or an nn.ModuleList of "
                "experts, chosen per token by a router Linear and a topk), so there is nothing to split over ep ranks")
    bad = [e for e in counts if e % ep]
    if bad:
        return f"its {bad[0]} experts do not split into {ep} equal shares (ep must divide the number of experts)"
    return None


# ----------------------------------------------------------------------- all-to-all
def all_to_all_s(message_bytes: float, ep: int, cm, links, processes: int | None = None) -> tuple[float, bool]:
    """Seconds of one all-to-all of ``message_bytes`` (one rank's whole buffer) over the ep group.

    A profile's measured all-to-all rows price it where they exist; otherwise the buffer splits
    into M/ep per peer: (r - 1)/ep M to the other ranks of the node (node link), (ep - r)/ep M to
    other nodes (the rank's share of the network), both at once, plus (ep - 1) latencies of the
    slower level (module docstring)."""
    if ep <= 1 or message_bytes <= 0:
        return 0.0, False
    g = links.ep
    t, measured = cm.collective_time_ex("all_to_all", message_bytes, ep, g.link, g.level, processes=processes)
    if measured or g.level == "intra" or links.ep_network is None:
        return t, measured
    r = max(1, links.ep_ranks_per_node)
    eff = cm.collective_efficiency
    intra, net = links.ep_intra, links.ep_network
    t_intra = (r - 1) / ep * message_bytes / (intra.bandwidth_Bps * eff.get("intra", 1.0))
    t_inter = (ep - r) / ep * message_bytes / (net.bandwidth_Bps * eff.get("inter", 1.0))
    return max(t_intra, t_inter) + (ep - 1) * net.latency_s, False


@dataclass(frozen=True)
class EPLayerTerms:
    """One MoE layer on one rank, one micro-batch: the dispatch / combine all-to-alls."""
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    wire_fwd: float = 0.0
    wire_bwd: float = 0.0
    meetings: int = 0
    measured: int = 0
    estimated: int = 0


def group_hit(experts: int, top_k: int, group: float) -> float:
    """The chance that a token's ``top_k`` experts, drawn uniformly without replacement from
    ``experts``, include one of a given ``group`` of them: 1 - C(E - g, k) / C(E, k).  Uniform is
    the routing of the force-balanced benchmarks (NVIDIA/Megatron-LM megatron/core/transformer/moe/
    router.py ``moe_router_force_load_balancing``: ``apply_random_logits`` replaces the scores by
    i.i.d. normal ones, so the top k is a uniform k-subset)."""
    g = int(round(group))
    if g >= experts or top_k <= 0:
        return 1.0 if g > 0 else 0.0
    miss = 1.0
    for i in range(top_k):                       # C(E-g, k) / C(E, k) as a product
        miss *= max(0.0, (experts - g - i) / (experts - i))
    return 1.0 - miss


def deepep_dispatch_s(tokens: float, r: "RoutedExperts", ep: int, elem_bytes: float, cm, links) -> tuple[float, float]:
    """(seconds, bytes sent) of one dispatch (or combine) by DeepEP's kernels, Megatron-Core's ``flex``
    dispatcher (megatron/core/transformer/moe/README.md, Token Dispatching: it "removes redundant
    tokens during cross-node communication"): a token crosses the network once per destination node,
    to the GPU of its own local index there, carrying a bit mask of the node's ranks it is for
    (deepseek-ai/DeepEP csrc/kernels/internode.cu ``SourceMeta.is_token_in_nvl_rank_bits``), which
    forwards it over NVLink once per destination rank; within a node it goes once to each destination
    rank (DeepSeek-AI 2024, DeepSeek-V3 Sec. 3.2.2, the same two-hop scheme).  The combine sends the
    experts' outputs back the same way, reduced per rank and per node.  HybridEP, NVIDIA's TMA
    rewrite of it, keeps the hierarchical design (DeepEP hybrid-ep branch) and is priced the same.

    Per rank, with N = ep / r nodes of r ranks and e = E / ep experts a rank:
    network bytes T h b (N - 1) hit(E / N), NVLink bytes T h b N (r - 1) hit(e) (group_hit), both at
    once, the slower setting the time, plus (ep - 1) latencies of the slower level (all_to_all_s)."""
    g = links.ep
    r_node = max(1, min(ep, links.ep_ranks_per_node)) if links.ep_network is not None else ep
    nodes = max(1, ep // r_node)
    row = tokens * r.hidden * elem_bytes
    eff = cm.collective_efficiency
    intra = links.ep_intra or g.link
    nvl = row * nodes * (r_node - 1) * group_hit(r.experts, r.top_k, r.experts / ep)
    t_intra = nvl / (intra.bandwidth_Bps * eff.get("intra", 1.0))
    t_inter = net = 0.0
    lat = intra.latency_s
    if links.ep_network is not None and nodes > 1:
        net = row * (nodes - 1) * group_hit(r.experts, r.top_k, r.experts / nodes)
        t_inter = net / (links.ep_network.bandwidth_Bps * eff.get("inter", 1.0))
        lat = links.ep_network.latency_s
    return max(t_intra, t_inter) + (ep - 1) * lat, nvl + net


def ep_layer_terms(experts: tuple[RoutedExperts, ...], ep: int, local_scale: float, elem_bytes: float, cm, links,
                   processes: int | None = None) -> EPLayerTerms:
    """The all-to-alls of a layer's routed experts on an ep rank: per experts module, forward a
    dispatch and a combine of T x k x h elements (T the rank's tokens: the graph's at
    ``local_scale`` = micro-batch / captured batch / cp), backward the same two with gradients;
    by DeepEP's deduplicated exchange where the code dispatches with it (TrainingCode.ep_dispatch,
    ``deepep_dispatch_s``)."""
    if ep <= 1:
        return EPLayerTerms()
    fwd = wire = 0.0
    n = measured = estimated = 0
    deepep = cm.code.ep_dispatch == "deepep"
    for r in experts:
        if deepep:
            t, sent = deepep_dispatch_s(r.tokens * local_scale, r, ep, elem_bytes, cm, links)
            fwd += 2 * t
            wire += 2 * sent
            n += 2
            estimated += 2
            continue
        message = r.tokens * local_scale * r.top_k * r.hidden * elem_bytes
        t, m = all_to_all_s(message, ep, cm, links, processes)
        fwd += 2 * t                                  # dispatch + combine
        wire += 2 * (ep - 1) / ep * message
        n += 2
        measured += 2 * m
        estimated += 2 * (not m)
    return EPLayerTerms(fwd, fwd, wire, wire, n, 2 * measured, 2 * estimated)


# ----------------------------------------------------------------------- compute and params
@dataclass(frozen=True)
class ExpertWork:
    fwd_delta_s: float           # the expert GEMMs at per-expert shapes less what the ops were priced at
    bwd_delta_s: float
    flops_factor: float          # the busiest rank's expert FLOPs over the mean (capacity, ep > 1)
    expert_fwd_flops: float      # the expert GEMMs' forward FLOPs on the rank before that factor
    expert_bwd_flops: float
    local_numel: float           # expert parameters on the rank (after the tp and ep splits)
    local_frozen_numel: float
    param_names: frozenset
    removed_numel: float         # what the ep split takes off the layer's per-rank parameters
    removed_frozen_numel: float


def expert_work(graph: OpGraph, experts: tuple[RoutedExperts, ...], layout, ep: int, local_scale: float,
                precision: str, cm, op_fwd_s: dict, op_bwd_s: dict, capacity_factor: float = CAPACITY_FACTOR
                ) -> ExpertWork:
    """The expert GEMMs of a layer repriced at their per-expert shapes (module docstring), and
    the expert parameters split ep ways.  ``op_fwd_s`` / ``op_bwd_s``: what layer_cost priced
    each op at (the ops' own shapes, no imbalance); ``layout``: the tensor-parallel layout (a
    stacked-experts module split by expert over tp holds E/tp of them)."""
    from autopar.core.dtypes import dtype_bytes, precision_bytes
    from autopar.simulator.device.cost_model import op_variant

    by_name = graph._ops_by_name()
    factor = capacity_factor if ep > 1 else 1.0
    elem = float(precision_bytes(precision))
    dfwd = dbwd = ffl = bfl = 0.0
    local = frozen = removed = removed_frozen = 0.0
    names: set[str] = set()
    for r in experts:
        for name in r.ops:
            op = by_name[name]
            whole = set(op.params) <= r.param_names        # an opaque op also holds the router etc.
            numel = op.param_numel if whole else r.param_numel
            if numel:
                shard = layout.param_shard.get(op.name, 1)
                mine = numel / shard
                local += mine / ep
                removed += mine * (1 - 1 / ep)
                fz = (op.frozen_numel if whole else _leaf_frozen_numel(op, r)) / shard
                frozen += fz / ep
                removed_frozen += fz * (1 - 1 / ep)
            names.update(set(op.params) & r.param_names)
            if name not in r.gemms or name not in op_fwd_s or not op.input_shapes or not op.output_shape:
                continue
            shard = layout.compute_shard.get(op.name, 1)
            n_out, k_in = float(op.output_shape[-1]), float(op.input_shapes[0][-1])
            rows = _numel(op.output_shape[:-1]) * local_scale / shard      # the rank's T x k rows
            per_rank = max(1.0, r.experts / ep / (shard if r.form == "stacked" else 1))
            m = rows * factor / per_rank if r.form == "stacked" else rows * factor
            batch = per_rank if r.form == "stacked" else 1.0
            flops_f = op.fwd_flops * local_scale / shard
            flops_b = op.bwd_flops * local_scale / shard
            w_bytes = op.param_numel / shard / ep * elem
            act_bytes = rows * factor * (k_in + n_out) * elem
            variant = op_variant(op.kind, str(op.target))
            t_f, _ = cm.compute_time_ex(op.kind, flops_f * factor, w_bytes + act_bytes, precision, (m, n_out, batch),
                                        variant=variant)
            t_b, _ = cm.compute_time_ex(op.kind, flops_b * factor, 2 * (w_bytes + act_bytes), precision,
                                        (m, n_out, batch), variant=variant, backward=True)
            # replace the kernel the op was priced at (its own shape, no imbalance: step/op_work.op_work);
            # the autograd recording cost layer_cost added to its forward stays
            bscale = elem / dtype_bytes(op.dtype)
            osh = layout.output_shard.get(op.name, 1)
            old_f, _ = cm.op_time_ex(op, precision, shard, scale=local_scale, bytes_scale=bscale, out_shard=osh)
            old_b, _ = cm.op_time_ex(op, precision, shard, backward=True, scale=local_scale, bytes_scale=bscale,
                                     out_shard=osh)
            dfwd += max(t_f, cm.overhead("op_launch_s")) - old_f
            if flops_b > 0 and name in op_bwd_s:
                dbwd += max(t_b, cm.overhead("op_backward_launch_s")) - old_b
            ffl += flops_f
            bfl += flops_b
    return ExpertWork(dfwd, dbwd, factor, ffl, bfl, local, frozen, frozenset(names), removed, removed_frozen)


def _leaf_frozen_numel(op, r: RoutedExperts) -> float:
    shapes = dict(zip(op.params, op.input_shapes[len(op.input_shapes) - len(op.params):]))
    return sum(_numel(shapes[p]) for p in op.frozen_params if p in r.param_names)


def _numel(shape) -> float:
    out = 1.0
    for d in shape:
        out *= d
    return out


def ep_degrees(graph: OpGraph, world_size: int) -> tuple[int, ...]:
    """The expert-parallel degrees the planner searches for ``graph``: 1, and every divisor of
    the experts count (of each experts module) up to the world (``ep_refusal``)."""
    counts = has_routed_experts(graph)
    if not counts:
        return (1,)
    out = [d for d in range(2, min(min(counts), world_size) + 1) if all(e % d == 0 for e in counts)]
    return (1, *out)


def ep_layer_work(graph: OpGraph, experts, w: "OpWork", tpc: "TensorParallelComm", layout: TPLayout, ep: int,
                  scale: float, precision: str, elem: float, cm: CostModel, links: MeshLinks,
                  node_processes: int | None, selective: str | None = None, work_cache: dict | None = None,
                  layout_key: tuple = ()) -> EPLayerTerms:
    """Expert parallelism's in-layer terms (``ep_layer_terms``), returned (the layer's
    ``ep_comm_*`` columns: step/layer_cost.py) and folded into ``w`` and ``tpc`` (step/op_work.py's
    ``OpWork``, tp.py's ``TensorParallelComm``): the experts' dispatch / combine all-to-alls are
    collectives on the critical path inside the layer, which a recompute reruns as it does the
    tensor-parallel ones (tp.fold_into_tp); the expert GEMMs are priced at their per-expert
    shapes and their parameters split ep ways (``expert_work``).  ``selective``: the code's
    selective policy where the layer is selectively recomputed (tp.tensor_parallel).
    ``work_cache`` (step/layer_cost.py's): where ``expert_work`` is kept by what it reads --
    ``layout_key`` (the layer and what fixes its tensor-parallel layout), ep, the scale,
    precision, cost model and which expert GEMMs the ops' pricing holds -- the same for every
    ZeRO, recompute, offload, dp and pp choice.  Its ``meetings``: the collectives where the ranks
    meet."""
    e = ep_layer_terms(experts, ep, scale, elem, cm, links, node_processes)
    fold_into_tp(tpc, e)
    if selective is not None and ep > 1 and saves_collective("all_to_all", selective):
        # the dispatch's and the combine's output per experts module: the rank's T x k rows of
        # h elements each (ep_layer_terms's message)
        tpc.selective_saved_bytes += sum(
            2 * collective_output_bytes("all_to_all", r.tokens * scale * r.top_k * r.hidden * elem, ep)
            for r in experts)
    elif selective is not None:
        tpc.selective_fwd_s += e.fwd_s
        tpc.selective_wire += e.wire_fwd
        tpc.selective_meetings += e.meetings
    key = None
    if work_cache is not None:
        priced = tuple((n in w.op_fwd_s, n in w.op_bwd_s) for r in experts for n in sorted(r.gemms))
        key = ("expert_work", layout_key, ep, scale, precision, cm.name, cm.code.expert_load, priced)
    x = work_cache.get(key) if key is not None else None
    if x is None:
        x = expert_work(graph, experts, layout, ep, scale, precision, cm, w.op_fwd_s, w.op_bwd_s,
                        capacity_factor=cm.code.expert_load)
        if key is not None:
            work_cache[key] = x
    w.fwd_s += x.fwd_delta_s
    w.bwd_s += x.bwd_delta_s
    w.param_numel -= x.removed_numel
    w.frozen_numel -= x.removed_frozen_numel
    w.expert_numel, w.expert_frozen_numel, w.expert_names = x.local_numel, x.local_frozen_numel, x.param_names
    return e
