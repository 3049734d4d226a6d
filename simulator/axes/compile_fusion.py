"""What regional ``torch.compile`` removes from a block: the eager kernels of its memory-bound ops.

Mechanism (Ansel et al., "PyTorch 2", ASPLOS 2024, Sec. 4-5: TorchInductor lowers the captured
graph to a loop-level IR and fuses producer/consumer pointwise and reduction ops into one
generated kernel; matrix multiplies and convolutions stay calls into the vendor libraries unless
max-autotune is asked for, which autopar's runtime does not):

* **Fused regions.**  The block's memory-bound ops (elementwise, norm, softmax, dropout,
  reduction, views) that feed one another form regions: the connected pieces of the block's
  data flow once the GEMMs, attention kernels, embeddings and opaque ops are taken out.  A
  region runs as one kernel that reads each tensor entering it once from memory and writes
  once each tensor leaving it -- read by an op outside the region, or kept for backward --
  instead of every op reading its inputs and writing its output.  Its seconds are the cost
  model's for one memory-bound op of those bytes and FLOPs (the profile's elementwise rows, else
  the roofline), so the per-kernel launch floor is paid once per region, not once per op.
* **Backward.**  AOTAutograd traces the block's backward and inductor fuses it alike: the
  region's backward is one kernel moving twice the forward's bytes (the cost model's backward
  convention: the saved inputs and the output gradients read, the input gradients written).
* **Autograd.**  A compiled block records one autograd node per compiled graph instead of one
  per op: the per-op recording cost of the fused ops (``autograd_fwd_op_s``) is paid once per
  region.

Kept as in eager: the GEMMs and attention, the collectives, the activations kept for backward
(AOTAutograd's min-cut partitioner may recompute some fused intermediates instead of saving
them; not priced).  Parameters read by the fused ops (norm weights, biases: hidden-sized
vectors) are left out of the fused bytes.

Validation row: torchtitan's Llama 3.1 8B on 8 H100 (FSDP2), eager 5,762 -> per-block compile
6,667 tokens/s/GPU (+16%; torchtitan benchmark, Table 1) -- ``../shared/validation/published_runs.json``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from autopar.core.dtypes import dtype_bytes, precision_bytes
from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh
from autopar.core.sharding import TPLayout
from autopar.simulator.device import autocast as _autocast
from autopar.simulator.device.cost_model import CostModel, op_variant
from autopar.simulator.axes.sharded_dp import effective_zero

#: op kinds inductor fuses into one generated kernel (pointwise, reductions, views)
FUSIBLE_KINDS = frozenset({"elementwise", "norm", "softmax", "dropout", "view", "reduction"})


def graph_consumers(graph) -> dict[str, tuple[str, ...]]:
    """op name -> the ops reading its output, graph-wide (cached on the graph)."""
    cache = graph.__dict__.get("_compile_consumers")
    if cache is None:
        acc: dict[str, list[str]] = {}
        for op in graph.ops:
            for src in op.inputs:
                acc.setdefault(src, []).append(op.name)
        cache = {k: tuple(v) for k, v in acc.items()}
        graph.__dict__["_compile_consumers"] = cache
    return cache


@dataclass(frozen=True)
class FusedRegion:
    ops: tuple[str, ...]           # the fused ops, in graph order
    read_bytes: float              # tensors entering the region, each read once (captured batch, dtype)
    write_bytes: float             # tensors leaving it or kept for backward, each written once
    fwd_flops: float
    bwd_flops: float
    needs_backward: bool           # some fused op has a backward


def fused_regions(ops: list, consumers: Mapping[str, Iterable[str]],
                  producer_bytes: Callable[[str], float | None] | None = None) -> list[FusedRegion]:
    """The fused regions of ``ops`` (one layer's ``OpNode``s in graph order); ``consumers``: op
    name -> names of the ops (graph-wide) that read its output; ``producer_bytes``: bytes of a
    tensor entering from outside the layer's ops (a graph op's output), None if unknown."""
    fusible = {op.name: op for op in ops if op.kind in FUSIBLE_KINDS}
    by_name = {op.name: op for op in ops}
    # epoch: how many non-fused kernels (GEMMs, attention, ...) lie on the longest path to the op.
    # Two fused ops of different epochs cannot share a kernel: a GEMM between them needs the
    # first's output and feeds the second (inductor fuses no node into a region it depends on
    # through an extern kernel), so regions join only ops of one epoch.
    epoch: dict[str, int] = {}
    for op in ops:
        epoch[op.name] = max((epoch.get(src, 0) + (0 if src in fusible or src not in by_name else 1)
                              for src in op.inputs), default=0)
    parent = {n: n for n in fusible}          # union-find over producer -> consumer edges

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for op in fusible.values():
        for src in op.inputs:
            if src in fusible and epoch[src] == epoch[op.name]:
                parent[find(src)] = find(op.name)
    groups: dict[str, list] = {}
    for op in ops:
        if op.name in fusible:
            groups.setdefault(find(op.name), []).append(op)
    out = []
    for members in groups.values():
        names = {op.name for op in members}
        if all(op.kind == "view" for op in members):
            continue                                    # no kernel to fuse
        read = 0.0
        seen: set[str] = set()
        for op in members:
            for pos, src in enumerate(op.inputs):
                if src in names or src in seen:
                    continue
                seen.add(src)
                read += _input_bytes(op, pos, src, by_name, producer_bytes)
        write = 0.0
        for op in members:
            readers = set(consumers.get(op.name, ()))
            leaves = not readers or bool(readers - names)
            # a tensor leaving the region is written once; a view leaving it is written only where
            # it shows data made inside the region (a view of an outside tensor is a relabelling)
            if leaves and (op.kind != "view" or any(src in names for src in op.inputs)):
                write += op.output_bytes
            if op.saved_bytes > 0 and any(src in names for src in op.inputs):
                # kept for backward: what the op keeps beyond its inputs from outside the region
                # (already in memory) was made inside the region and must be written
                outside = sum(_input_bytes(op, pos, src, by_name, producer_bytes)
                              for pos, src in enumerate(op.inputs) if src not in names)
                write += max(0.0, op.saved_bytes - outside)
        out.append(FusedRegion(ops=tuple(op.name for op in members), read_bytes=read, write_bytes=write,
                               fwd_flops=sum(op.fwd_flops for op in members),
                               bwd_flops=sum(op.bwd_flops for op in members),
                               needs_backward=any(getattr(op, "requires_grad", True) and op.bwd_flops > 0
                                                  for op in members)))
    return out


def _input_bytes(op, pos: int, src: str, by_name: Mapping, producer_bytes) -> float:
    if src in by_name:
        return float(by_name[src].output_bytes)
    if producer_bytes is not None and not src.startswith("input:"):
        got = producer_bytes(src)
        if got is not None:
            return float(got)
    # a model input (or an unknown producer): its shape as the op saw it, in the op's dtype
    shape = op.input_shapes[pos] if pos < len(op.input_shapes) else ()
    numel = 1
    for d in shape:
        numel *= d
    per_element = op.output_bytes / max(1, _numel(op.output_shape))
    return float(numel * per_element)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class CompileSaving:
    """Seconds per micro-batch that compile takes off a layer's eager forward and backward."""
    fwd_s: float
    bwd_s: float
    regions: int                  # fused kernels that replace ...
    fused_ops: int                # ... this many eager ops (views included)


def compile_saving(regions: list[FusedRegion], eager_fwd_s: Mapping[str, float], eager_bwd_s: Mapping[str, float],
                   fused_time: Callable[[FusedRegion, bool], float], autograd_op_s: float) -> CompileSaving:
    """Eager seconds of the fused ops minus the fused kernels' (a region the cost model prices
    slower fused than eager -- possible only where its rows are noisy -- is priced as eager, never
    as a loss).  ``eager_*_s``: each op's eager seconds as the layer's cost
    priced it; ``fused_time(region, backward)``: seconds of one fused kernel."""
    fwd = bwd = 0.0
    n_ops = 0
    for r in regions:
        eager_f = sum(eager_fwd_s.get(n, 0.0) for n in r.ops)
        eager_b = sum(eager_bwd_s.get(n, 0.0) for n in r.ops)
        fused_f = fused_time(r, False) + (autograd_op_s if r.needs_backward else 0.0)
        fused_b = fused_time(r, True) if r.needs_backward else 0.0
        fwd += max(0.0, eager_f - fused_f)
        bwd += max(0.0, eager_b - fused_b)
        n_ops += len(r.ops)
    return CompileSaving(fwd_s=fwd, bwd_s=bwd, regions=len(regions), fused_ops=n_ops)


def compiled_work(graph: OpGraph, layer_index: int, w: "OpWork", layout: TPLayout, lp: LayerPlan, mesh: Mesh,
              precision: str, cm: CostModel, scale: float) -> None:
    """Take off ``w`` what regional compile removes (simulator/compile_fusion.py): each fused
    region's eager ops cost one kernel moving the region's fused bytes, at the bytes per element
    the eager ops were priced at (the plan's precision, and fp32 where autocast runs an op in
    fp32: the region's largest such factor); selective recompute reruns the fused kernels, not
    the eager ops."""
    ops = graph.layer_ops(layer_index)
    by_name = {op.name: op for op in ops}
    every = graph._ops_by_name()
    regions = fused_regions(ops, graph_consumers(graph), lambda n: every[n].output_bytes if n in every else None)
    prec_bytes = precision_bytes(precision)
    amp = _autocast.autocast_mode(effective_zero(lp.zero, mesh), mesh, precision, cm.code.autocast)

    def fused_time(r, backward: bool) -> float:
        first = by_name[r.ops[0]]
        shard = layout.compute_shard.get(first.name, 1)
        bscale = prec_bytes / dtype_bytes(first.dtype) * max(
            _autocast.bytes_factor(by_name[n].kind, op_variant(by_name[n].kind, str(by_name[n].target)), amp)
            for n in r.ops)
        nbytes = (r.read_bytes + r.write_bytes) * bscale * scale / shard * (2.0 if backward else 1.0)
        flops = (r.bwd_flops if backward else r.fwd_flops) * scale / shard
        t, _ = cm.compute_time_ex("elementwise", flops, nbytes, precision)
        return max(t, cm.overhead("op_backward_launch_s" if backward else "op_launch_s"))

    saving = compile_saving(regions, w.op_fwd_s, w.op_bwd_s, fused_time, cm.overhead("autograd_fwd_op_s"))
    w.fwd_s -= saving.fwd_s
    w.bwd_s -= saving.bwd_s
    w.cheap_fwd_s = max(0.0, w.cheap_fwd_s - saving.fwd_s)
    w.compile_regions, w.compile_fused_ops = saving.regions, saving.fused_ops
