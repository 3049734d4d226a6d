"""Tensor parallelism's costs in a layer: the collectives the layout puts after the split
modules, and the framework overheads of the modules the runtime wraps (runtime/apply_tp.py's
twin).  Context and expert parallelism's in-layer collectives join these for a recompute's
rerun and the bytes on the wire (cp.py, ep.py: ``fold_into_tp``); their seconds have their own
columns (step/layer_cost.py ``cp_comm_*``, ``ep_comm_*``)."""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.sharding import TPLayout
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.network import ring_wire_bytes
from autopar.simulator.device.topology import MeshLinks
from autopar.simulator.axes.recompute import collective_output_bytes, saves_collective


def add_module_overheads(w: "OpWork", cm: CostModel) -> None:
    """Framework overheads of the modules the runtime wraps for tensor parallelism
    (profiling/overheads.py).

    A column/row-wise split module costs what profiling/cpu_overheads_in_step.py measured a pair to
    cost beyond its arithmetic and all-reduces (dispatch, hooks, the asynchronous collectives'
    threads); a sequence-parallel norm issues no collective of its own (the sequence is gathered
    and scattered by the linears around it), so it costs what SequenceParallel adds to a norm on
    one rank (sp_norm_*; older profiles: a DTensor module's one-rank figure, else the split modules')."""
    w.fwd_s += w.num_tp_modules * cm.overhead("tp_module_fwd_s")
    w.bwd_s += w.num_tp_modules * cm.overhead("tp_module_bwd_s")
    if w.num_sp_norms:
        w.fwd_s += w.num_sp_norms * cm.overheads.get(
            "sp_norm_fwd_s", cm.overheads.get("dtensor_module_fwd_s", cm.overhead("tp_module_fwd_s")))
        w.bwd_s += w.num_sp_norms * cm.overheads.get(
            "sp_norm_bwd_s", cm.overheads.get("dtensor_module_bwd_s", cm.overhead("tp_module_bwd_s")))


@dataclass
class TensorParallelComm:
    fwd_s: float = 0.0                     # collectives in forward, per micro-batch
    bwd_s: float = 0.0
    wire_fwd: float = 0.0                  # bytes this device sends for them
    wire_bwd: float = 0.0
    fwd_meetings: int = 0                  # forward collectives: the ranks meet at each
    # the forward collectives on the outputs of the ops an early-stopped recompute skips
    skipped_fwd_s: float = 0.0
    skipped_wire: float = 0.0
    skipped_meetings: int = 0
    # the forward collectives a selective recompute reruns: context parallelism's K/V all-gather
    # (the runtime's policy reruns it, runtime/recompute.py -- counted in backward on a cp 2 run
    # of the zoo's Llama, one gather per attention in each direction:
    # tests/integration/test_collective_counts.py), and those the code's policy does not save
    # (selective_mm_policy.saves_collective)
    selective_fwd_s: float = 0.0
    selective_wire: float = 0.0
    selective_meetings: int = 0
    # ... the outputs of those it saves, on the device: kept from forward to backward
    selective_saved_bytes: float = 0.0
    measured: int = 0
    estimated: int = 0


def tensor_parallel(layout: TPLayout, tp: int, cm: CostModel, links: MeshLinks, scale: float, act_scale: float,
                     node_processes: int | None, skipped_ops: frozenset = frozenset(),
                     selective: str | None = None, ep_ops: frozenset = frozenset(), ep: int = 1) -> TensorParallelComm:
    """Tensor parallelism: the collectives the layout puts after the split modules (Shoeybi et
    al. 2019, Sec. 3: f/g all-reduces; with sequence parallelism all-gather/reduce-scatter pairs,
    Korthikanti et al. 2022, Sec. 4.2.2), on the tensor-parallel group's link.  ``skipped_ops``:
    the ops a recompute that stops early does not run; the all-reduce or reduce-scatter of such
    an op's output does not run in it either (an all-gather of its input, issued before the op,
    does).  ``selective``: the code's selective policy where the layer is selectively recomputed:
    a forward collective it saves keeps its output (``selective_saved_bytes``), one it does not
    reruns in backward (``selective_fwd_s``; simulator/selective_mm_policy.py).  A parameter
    gradient's sum (``per_sample`` False) does not grow with the batch; at an op of ``ep_ops``
    it holds 1 / ``ep`` of the experts."""
    c = TensorParallelComm()
    for coll in layout.collectives:
        if coll.per_sample:
            nbytes = coll.bytes * scale * act_scale
        else:
            nbytes = coll.bytes / (ep if coll.at in ep_ops else 1)
        wire = ring_wire_bytes(coll.kind, nbytes, tp)
        t, m = cm.collective_time_ex(coll.kind, nbytes, tp, links.tp.link, links.tp.level, processes=node_processes)
        c.measured += m
        c.estimated += not m
        if coll.pass_ == "fwd":
            c.wire_fwd += wire
            c.fwd_s += t
            c.fwd_meetings += 1
            if coll.at in skipped_ops and coll.kind in ("all_reduce", "reduce_scatter"):
                c.skipped_fwd_s += t
                c.skipped_wire += wire
                c.skipped_meetings += 1
            if selective is not None and saves_collective(coll.kind, selective):
                c.selective_saved_bytes += collective_output_bytes(coll.kind, nbytes, tp)
            elif selective is not None:
                c.selective_fwd_s += t
                c.selective_wire += wire
                c.selective_meetings += 1
        else:
            c.wire_bwd += wire
            c.bwd_s += t
    return c


def fold_into_tp(tpc, terms) -> int:
    """Add an in-layer collective's terms (cp.cp_layer_terms, ep.ep_layer_terms) to the layer's
    tensor-parallel communication -- the same mechanism: collectives on the critical path inside
    the layer, which a full recompute reruns (recompute.recompute reads ``tpc``), their bytes in
    ``tp_wire_bytes``; returns the ranks' meetings it adds."""
    tpc.fwd_s += terms.fwd_s
    tpc.bwd_s += terms.bwd_s
    tpc.wire_fwd += terms.wire_fwd
    tpc.wire_bwd += terms.wire_bwd
    tpc.fwd_meetings += terms.meetings
    tpc.measured += terms.measured
    tpc.estimated += terms.estimated
    return terms.meetings
