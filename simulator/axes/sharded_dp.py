"""What sharded data parallelism (FSDP2 / ZeRO-3, ZeRO-2) costs beyond its collectives' wire time.

Pure functions over plain numbers, and one adapter (``with_sharded_dp_costs``) that applies them
to the evaluator's per-layer rows (``plan_table_costs``: the "sharded_dp" cost term of
builtin_terms.py).  What the rows already hold (layer_cost.py, evaluator.py):
an all-gather per layer per micro-batch in forward and again in backward (FSDP2 reshards after
forward by default, ``reshard_after_forward=True``), a reduce-scatter per layer per micro-batch
(FSDP2 reduces every micro-batch unless ``set_requires_gradient_sync(False)``; the runtime does
not turn it off), prefetch one layer ahead, the first all-gather of each chunk and the last
reduce-scatter exposed, ring latency (N-1) alpha per collective, and the optimizer on the shard.
What this module adds:

1. Copy-out after each all-gather.  FSDP2 gathers a unit's shards into one flat buffer and
   then copies it out into the unsharded parameters (``torch.distributed.fsdp._fully_shard.
   _fsdp_collectives.foreach_all_gather_copy_out``, ``split_with_sizes_copy``) on the compute
   stream, where the next layer waits for it: a read and a write of the unit's bytes at HBM
   speed (``copy_out_s``).  Before a reduce-scatter the unsharded gradients are copied into
   its input buffer (``foreach_reduce``, ``torch._chunk_cat``) on the reduce-scatter stream:
   the same read and write, added to the reduce-scatter's time.
2. NCCL kernels slow the compute they overlap.  A collective runs as CUDA kernels, one thread
   block per channel, each resident on an SM for the collective's whole duration and streaming
   its data through HBM (NVIDIA, "NCCL: Environment Variables", NCCL_MIN_CTAS / NCCL_MAX_CTAS,
   NCCL_NCHANNELS_PER_NET_PEER); compute kernels launched meanwhile get fewer SMs and less
   memory bandwidth (Rashidi et al. 2021, "Enabling Compute-Communication Overlap in
   Distributed Deep Learning Training Platforms", ISCA: overlapped GEMMs slowed by the
   collectives' SM and memory use).  Priced as: each second of compute that runs under a
   collective takes ``1 + nccl_overlap_slowdown`` seconds (``overlap_slowdown_s``).  The
   constant is one of this module's two free parameters; benchmarks/published_runs.py --fit fits
   them on one half of the published runs and reports the other half, both ways.  The fitted
   value is above what a published characterisation measured (Lee et al. 2025, arXiv
   2507.03114, "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
   Learning": compute overlapped with communication on 4 A100 / H100 slowed 18.9% on average and
   40% at most), so it stands for more than the kernels' contention; docs/validation.md, "How
   firmly the halves fix the overlap slowdown", says what the rows let it absorb.

   Which collectives it applies to (``overlap_slowdown``): those that stream at the speed of the
   node's own links -- a group within one node, over NVLink (hundreds of GB/s through each GPU's
   HBM, on as many channels as the NVLink rings take), and DeepSpeed's per-GPU gathers (item 4).
   A ring that spans nodes on the node's aggregate network (FSDP1, FSDP2: simulator/network.py)
   is paced by the network adapters: its kernels move at most the GPU's share of the node's
   network through HBM (12.5 GB/s on the IBM H100 rows' 800 Gb/s nodes, under 0.4% of an H100's
   HBM bandwidth) and spend the collective waiting on the network, so the compute under it is not
   slowed here; what such a ring costs is its own length (item 6).

6. What a sharded collective over nodes reaches.  The profiles' ``collective_efficiency.inter``
   (0.85 of the node's network) is an all-reduce figure: the "average bus bandwidth" of an
   nccl-tests all-reduce sweep over 3 nodes (NVIDIA/nccl-tests issue #119, simulator/network.py).
   The all-gathers and reduce-scatters of sharded data parallelism over tens of nodes reach less:
   one published measurement on 32 nodes of 8 H100 (eight 400 Gb/s adapters a node, 2 GB
   messages) gave all-reduce 340 GB/s of bus bandwidth and all-gather 200 GB/s -- 0.85 and 0.5 of
   the node's 400 GB/s network (NVIDIA/nccl issue #1218; that run forced 16 channels).  NCCL runs
   all-gather and reduce-scatter on rings only, where all-reduce can take its trees, whose
   inter-node traffic per node does not grow with the ring.  Priced as: over a group that spans
   nodes on the node's aggregate network, a sharded all-gather or reduce-scatter reaches
   ``sharded_ring_efficiency`` of the node's network (``gather_bandwidth_scale``).  The
   constant is fitted by benchmarks/published_runs.py --fit with the overlap slowdown (item 2), on
   one half of the published runs, and reported on the other, both ways; the measurement above
   is what it is checked against, not where it comes from.  DeepSpeed's per-GPU gathers (item 4b)
   keep the figure their own rows imply.

3. The reduce dtype.  The rows price a reduce-scatter at the gradients' training precision (2
   bytes under bf16 / fp16); the runtime reduces them in fp32 (runtime/apply_dp.py,
   ``MixedPrecisionPolicy(param_dtype=<low>, reduce_dtype=torch.float32)``), twice the bytes.
   ``TrainingCode.reduce_bytes`` (simulator/training_code.py) says how many bytes a reduced
   gradient element takes, and the reduce-scatter
   (wire time and copy-in) scales by it over the priced 2 bytes (``reduce_scale``; its latency
   part scales too, which overstates it by (N-1) alpha at most -- small beside the bytes of a
   layer's gradients).  A run that reduced in bf16 is priced with ``reduce_bytes = 2``
   (benchmarks/published_runs.py does so for the published runs that state it).

4. Which implementation runs (``TrainingCode.sharded``, simulator/training_code.py).  Everything
   above is what FSDP2 does -- what autopar's runtime runs, and what every plan the planner writes
   is priced as.  A published run made with another implementation is priced as that one ran
   (benchmarks/published_runs.py describes each row's code): DeepSpeed's below, PyTorch's FSDP1
   in item 5.

   * ``DEEPSPEED_ZERO3_2021``: DeepSpeed ZeRO-3 as of April 2021 (deepspeedai/DeepSpeed
     c4f4ef5d4, the version the ZeRO-3 rows of Narayanan et al. 2021, Table 2 compare against).
     (a) Parameters are fetched by a forward pre-hook on every sub-module and released by its
     forward post-hook (``deepspeed/runtime/zero/stage3.py``, ``_pre_forward_module_hook`` ->
     ``fetch_sub_module``, ``_post_forward_module_hook`` -> ``release_sub_module``); the hooks do
     not tell a recomputed forward from the first one, so under activation recompute a layer's
     parameters are gathered three times per micro-batch -- forward, recomputed forward, backward
     -- where FSDP2 gathers twice (its pre-forward hook does nothing in backward).  The third
     gather runs on the backward's communication stream, with its copy-out.  (b) Its inter-node
     collectives are priced at one GPU's share of the node's network, not at the node's
     aggregate that NCCL's multi-channel rings reach for FSDP2's flat per-layer buffers
     (simulator/network.py): every parameter is gathered by its own ``torch.distributed.
     all_gather`` into a list of ``world_size`` views, each preceded by a ``torch.cuda.
     synchronize()`` (``partition_parameters.py``, ``_allgather_param``), which DeepSpeed's own
     later work found left the gathers far below the link's bandwidth (deepspeedai/DeepSpeed
     issue #1174, "ZeRO3 is slow, even with nvlink for all-gather", and PR #1188, 2021).  The
     share is the figure the Table 2 runs themselves imply: at 768 and 1536 GPUs (one
     micro-batch of 2 and 1 samples a GPU) the step stays at 66.7 s while the compute halves,
     i.e. a fixed per-GPU traffic of about four model sizes in fp16 (three gathers and the
     reduce-scatter, 4 x 349 GB) at about 21 GB/s a GPU -- one 200 Gb/s adapter at the
     profile's inter-node efficiency.  This is a choice made on the rows of half A; the
     benchmark's half B (the 384-GPU row) is held back from it.  Not modelled: its default
     gradient all-reduce (``reduce_scatter`` false in that version's config defaults; the rows'
     configuration is not published), which would price the rows slower.
     (c) Every sub-module's fetch drains the device (``stage3.py`` ``fetch_sub_module`` ->
     ``_synchronize_communication``: a wait on every gather in flight, then
     ``torch.cuda.synchronize()``) and then prefetches the next weight only, so a gather overlaps
     the compute up to the next fetch and no more; parameters under 1e5 elements stay gathered,
     and ``stage3_max_reuse_distance`` (1e9 elements) keeps a block's last weight gathered from
     its recomputed forward to its backward.  A ZeRO-3 layer is priced fetch by fetch
     (simulator/zero3_fetch_spans.py, ``_priced_by_fetch``), which replaces (a)'s third gather
     and item 1's copy-out on the compute stream for it: the spans carry the gathers, their
     copy-out on the NCCL stream and the zero fill before each, and the gradient reductions.
     The ring latency stays one (N-1) alpha per layer and pass, as every collective of the rows
     is priced, not one per parameter's call: docs/validation.md, "The ZeRO-3 rows priced fetch
     by fetch", says why.  The evaluator hands in each layer's units (its graph's ops); the
     planner's per-layer tables (``layer_among_equals``) price FSDP2 only and never take this
     path.

5. PyTorch FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``, FULL_SHARD, one
   ``FlatParameter`` per wrapped block, ``use_orig_params=False``), the implementation the
   published FSDP runs used: llm-foundry's MPT benchmarks (composer; the table the data copies was
   run on the mosaicml/pytorch:2.1.0 image, its earlier revisions on 1.13.1, and its two 70B rows
   are kept from those -- benchmarks/published_runs.py ``sharded_runtime``) and fms-fsdp's Llama-2 runs (PyTorch nightlies after 2.2;
   ``main_training.py`` at foundation-model-stack/fms-fsdp 7746dac, 2024-03-13, wraps the model in
   ``FullyShardedDataParallel`` with ``limit_all_gathers=True``).  ``fully_shard`` (FSDP2) did
   not exist in either.  What its code does per unit that FSDP2's does not (items 1 and 3 price
   FSDP2):

   (a) No copy-out.  The all-gather writes straight into the unit's padded unsharded flat buffer
       (``_flat_param.py``, ``flat_param.py`` in 1.13: ``FlatParamHandle.unshard`` -> ``_all_gather_flat_param``, one
       ``all_gather_into_tensor`` into ``_full_param_padded``), and the module's parameters are
       views into it (``_use_unsharded_flat_param`` -> ``_use_unsharded_views``: a ``split`` of
       the flat tensor, each piece ``view``-ed to its shape).  Nothing is copied after the gather
       (``ShardedRuntime.copy_out`` False).
   (b) The gradient.  Because the parameters are views of one flat tensor, autograd assembles the
       unit's gradient itself: the backward of the ``split`` concatenates the views' gradients into
       one new flat tensor, on the compute stream, before the ``FlatParameter``'s
       ``AccumulateGrad`` hook runs (``SplitWithSizesBackward``; facebookresearch/fairscale PR
       #1180, 2024, shows it in traces of its FSDP1, once per micro-batch per unit) -- a read and
       a write of the unit's gradient where the next layer's backward waits for it
       (``grad_concat_on_compute``).  The post-backward hook then works on the reduce-scatter's
       stream (``_runtime_utils.py``, ``_post_backward_hook`` / ``_reduce_grad``): it divides
       the whole unsharded gradient in place by the pre-divide factor before the reduce-scatter
       (``_div_if_needed``; the factor, ``DefaultState._get_gradient_predivide_factor``, doubles
       from 1 while it divides the world size and stays below world size / factor: about
       sqrt(world size), 2 or more for any world size of 2 or more) -- one read and write,
       priced as FSDP2's copy-in is -- and pads the gradient to a multiple of the world size
       with ``F.pad``.  In torch 1.13 the pad ran on every gradient (``_post_backward_hook``:
       ``F.pad(unsharded_grad, [0, numel_to_pad])`` with no test; pytorch/pytorch PR #88769,
       merged November 2022 after the 1.13 release, removed the call where no padding is needed
       and notes that a zero pad still allocates and copies): a second pass.  From 2.0 the pad
       runs only where the numel is not a multiple of the world size
       (``_get_reduce_scatter_tensors`` in 2.2), which the runs' blocks are (power-of-two widths
       over 8-128 ranks).  Hence ``reduce_prep_passes`` 2 for torch 1.13 and 1 for 2.1 / 2.2.
   (c) The mixed-precision cast.  Before each gather the fp32 shard is cast to the low-precision
       shard on the pre-unshard stream (``FlatParamHandle.pre_unshard`` ->
       ``_use_low_precision_shard``); FSDP2 casts the same shard into its gather's input.  It is
       1/N of the unit on a side stream, the same for both, and priced for neither.
   (d) Prefetch.  ``limit_all_gathers=True`` (fms-fsdp; llm-foundry's pretraining yamls) lets
       at most two all-gathers be in flight: the CPU waits on the free event of the unit two back
       before issuing another (``_runtime_utils.py`` ``_unshard``; ``_limiter_utils.py``
       ``_FreeEventQueue``, a limit of two); with the CPU running ahead of the GPU this is the
       one-layer-ahead prefetch the rows already price.
       In backward FSDP1's default ``BACKWARD_PRE`` (fms-fsdp leaves it) issues the next unit's
       gather in the current unit's pre-backward hook; composer's default ``BACKWARD_POST``
       (llm-foundry's MPT runs) issues it in the post-backward hook, before that unit's
       reduce-scatter, so both keep the gather one unit ahead and ahead of the reduce-scatter
       on the process group's one NCCL stream: priced the same.
   (e) Not modelled: the reduce-scatter output allocated zeroed in 1.13 (``zeros_like``, 1/N of
       the unit), the post-divide of the shard (1/N), and the per-unit Python of the hooks.

Kept apart from CPU effects: on a gloo profile (``host_dispatch_bound``) communication already
takes turns with compute (topology.serial_communication) and nothing here applies.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.core import rules as _rules
from autopar.core.dtypes import precision_bytes
from autopar.core.plan import Mesh
from autopar.simulator.device.calibration import Calibration
from autopar.simulator.axes.pp_fsdp import traffic_shares
from autopar.simulator.axes.sharded_dp_zero3_spans import layer_pass_times

#: the two fitted constants (items 2 and 6) are fields of simulator/calibration.py's ``Calibration``,
#: which the cost model carries (``CostModel.calibration``) and the callers below pass in


@dataclass(frozen=True)
class ShardedRuntime:
    """How an implementation of sharded data parallelism moves parameters (module doc, item 4)."""
    name: str
    #: parameters are gathered again for a recomputed forward (a third gather per micro-batch)
    regather_for_recompute: bool
    #: inter-node collectives reach the node's aggregate network (simulator/network.py), not one
    #: GPU's share of it
    node_aggregate_rings: bool
    #: the unsharded parameters are copied out of the gather's buffer (item 1); FSDP1's are views
    #: into the buffer the gather writes (item 5a)
    copy_out: bool = True
    #: autograd concatenates the unit's gradient into one flat tensor on the compute stream (item 5b)
    grad_concat_on_compute: bool = False
    #: read-and-write passes over the unsharded gradient on the reduce-scatter's stream before it:
    #: FSDP2's copy-in (item 1), FSDP1's pre-divide and, in torch 1.13, its pad (item 5b)
    reduce_prep_passes: int = 1
    #: every sub-module's fetch drains the device and prefetches one weight ahead (item 4c,
    #: simulator/zero3_fetch_spans.py)
    drains_each_fetch: bool = False


FSDP2 = ShardedRuntime("fsdp2", regather_for_recompute=False, node_aggregate_rings=True)
DEEPSPEED_ZERO3_2021 = ShardedRuntime("deepspeed-zero3-2021", regather_for_recompute=True, node_aggregate_rings=False,
                                      drains_each_fetch=True)
#: FSDP1 as torch 1.13 ran it (llm-foundry's 70B A100 rows, kept from the table's 1.13 revision:
#: benchmarks/published_runs.py ``MPT_TORCH_1_13``) and as torch 2.1 (the rest of llm-foundry's
#: table) and the nightlies after 2.2 (fms-fsdp) run it: item 5
FSDP1_TORCH_1_13 = ShardedRuntime("fsdp1-torch-1.13", regather_for_recompute=False, node_aggregate_rings=True,
                                  copy_out=False, grad_concat_on_compute=True, reduce_prep_passes=2)
FSDP1_TORCH_2_2 = ShardedRuntime("fsdp1-torch-2.2", regather_for_recompute=False, node_aggregate_rings=True,
                                 copy_out=False, grad_concat_on_compute=True)


def gather_bandwidth_scale(runtime: ShardedRuntime, level: str, ring_GBps: float, per_gpu_GBps: float,
                           inter_efficiency: float, ring_efficiency: float) -> float:
    """Factor on the bandwidth part of a sharded collective's time, over the price of the rows
    (the group's link at the profile's ``inter_efficiency`` for a group over nodes): on a ring
    over nodes the node's network at ``ring_efficiency`` (item 6; the calibration's
    ``sharded_ring_efficiency``), and where the runtime does not reach the node's aggregate, the
    aggregate ring's bandwidth over one GPU's share (item 4b)."""
    if level != "inter":
        return 1.0
    if network_paced(runtime, level):
        return max(1.0, inter_efficiency / ring_efficiency)
    if per_gpu_GBps <= 0:
        return 1.0
    return max(1.0, ring_GBps / per_gpu_GBps)


def network_paced(runtime: ShardedRuntime, level: str) -> bool:
    """Whether a runtime's sharded collectives at ``level`` run on a ring over nodes on the node's
    aggregate network: priced at the calibration's sharded_ring_efficiency and slowing no compute (items 2, 6)."""
    return level == "inter" and runtime.node_aggregate_rings


def overlap_slowdown(runtime: ShardedRuntime, level: str, calibration: Calibration) -> float:
    """The overlap slowdown (item 2) of compute under a runtime's sharded collectives at ``level``:
    none under a ring over nodes, paced by the network (``network_paced``), else the
    calibration's ``nccl_overlap_slowdown``."""
    return 0.0 if network_paced(runtime, level) else calibration.nccl_overlap_slowdown


def collective_terms(runtime: ShardedRuntime, level: str, group_size: int, link_GBps: float, link_latency_s: float,
                     per_gpu_GBps: float, inter_efficiency: float, calibration: Calibration) -> dict:
    """``with_sharded_dp_costs``'s keyword arguments for a data-parallel group: the slowdown, the
    bandwidth scale and the ring latency ((N-1) alpha) of its collectives (items 2, 4b, 6), at the
    fitted constants of ``calibration`` (simulator/calibration.py)."""
    return dict(runtime=runtime, slowdown=overlap_slowdown(runtime, level, calibration),
                bandwidth_scale=gather_bandwidth_scale(runtime, level, link_GBps, per_gpu_GBps, inter_efficiency,
                                                       calibration.sharded_ring_efficiency),
                latency_s=(group_size - 1) * link_latency_s)


def reduce_scale(precision: str, reduce_bytes: float) -> float:
    """Reduce-scatter bytes over those the rows priced: mixed precision prices 2 bytes a gradient,
    fp32 4 (core/dtypes.py precision_bytes; simulator/memory.py STATE_BYTES)."""
    priced = float(precision_bytes(precision))
    return max(1.0, reduce_bytes / priced)


def copy_out_s(unit_bytes: float, memory_bandwidth_Bps: float, efficiency: float) -> float:
    """A read and a write of ``unit_bytes`` at the achievable HBM bandwidth."""
    if unit_bytes <= 0:
        return 0.0
    return 2.0 * unit_bytes / (memory_bandwidth_Bps * efficiency)


def overlap_slowdown_s(compute_s, comm_s, slowdown: float):
    """Extra seconds of compute when ``comm_s`` of collectives overlap ``compute_s`` of compute:
    the overlapped part, min(compute, comm), runs ``slowdown`` slower."""
    return slowdown * np.minimum(compute_s, comm_s)


def with_sharded_dp_costs(rows: np.ndarray, col: dict, zero_col: int, memory_bandwidth_Bps: float, memory_efficiency: float,
                          slowdown: float, reduce_factor: float = 1.0, *,
                          runtime: ShardedRuntime = FSDP2, bandwidth_scale: float = 1.0,
                          latency_s: float = 0.0, units: list | None = None,
                          pipeline_m: int | None = None) -> np.ndarray:
    """Rows with the copies and the overlap slowdown of sharded layers (zero >= 2) added.

    ``col``: column index by LayerCost field; ``zero_col``: the effective ZeRO stage column.  In
    forward layer k computes under layer k+1's gather, in backward under layer k-1's gather and
    its own reduce-scatter (the prefetch order of compose.layer_effective_times).  The unit
    bytes are the unsharded-parameter and -gradient buffers the rows already hold.
    ``reduce_factor`` (``reduce_scale``) scales the reduce-scatter and its copy-in.
    ``runtime``: the implementation priced (item 4); ``bandwidth_scale``
    (``gather_bandwidth_scale``) multiplies the part of each gather and reduce-scatter beyond its
    ring latency ``latency_s`` ((N-1) alpha, what the rows' alpha-beta price holds besides bytes).

    ``units``: per layer, its gathered sub-modules (zero3_fetch_spans.layer_units, None for a
    layer without); where the runtime drains the device at each fetch (item 4c) a ZeRO-3 layer
    with units is priced fetch by fetch (``_priced_by_fetch``) instead of by the terms below.

    ``pipeline_m``: a pipeline's micro-batches, None without one.  Under a pipeline the gathers
    are per step (pipeline_fsdp.py), so each micro-batch carries its share of them
    (pipeline_fsdp.traffic_shares) and of the copy-out after ZeRO-3's backward gather, and no
    reduce-scatter overlaps a micro-batch's backward (they run after the last one).

    Locality (the evaluator's memo of derived rows relies on it, step/layer_memo.LayerMemo): row k of
    the result reads rows k-1, k and k+1 only, and its dp_allgather_s, h2d_s, zero and offload
    columns row k alone; beyond that, only whether any layer is sharded changes what is computed.
    """
    zero = rows[:, zero_col]
    sharded = zero >= 2
    if not np.count_nonzero(sharded):           # (count_nonzero: a cheaper any)
        return rows
    out = rows.copy()
    unit_s = memory_bandwidth_Bps * memory_efficiency           # bytes per second of one copy pass
    gather3 = zero >= 3
    # the copies of each sharded layer's buffers (copy_out_s, buffer bytes never negative; a
    # mask multiplies where a select would do: the same numbers for finite ones, fewer calls)
    cp_param = 2.0 * rows[:, col["fsdp_param_buffer_bytes"]] / unit_s
    cp_grad = 2.0 * rows[:, col["fsdp_grad_buffer_bytes"]] * reduce_factor / unit_s * sharded
    fwd, bwd = rows[:, col["fwd_s"]], rows[:, col["bwd_s"]]
    rec = rows[:, col["recompute_s"]]
    ag, rs = rows[:, col["dp_allgather_s"]], rows[:, col["dp_reducescatter_s"]] * reduce_factor
    if bandwidth_scale != 1.0:
        ag = np.where(ag > 0, latency_s + np.maximum(ag - latency_s, 0.0) * bandwidth_scale, 0.0)
        rs = np.where(rs > 0, latency_s + np.maximum(rs - latency_s, 0.0) * bandwidth_scale, 0.0)
        out[:, col["dp_allgather_s"]] = ag
    reduce_only = rs
    if runtime.regather_for_recompute:
        # item 4a: the recomputed forward gathers again, on the backward's communication stream
        # (carried in the reduce-scatter column, the other traffic of that stream), with its copy-out
        regather = gather3 & (rows[:, col["recompute"]] >= 2)
        rs = rs + np.where(regather, ag, 0.0)
        if runtime.copy_out:
            rec = rec + np.where(regather, cp_param, 0.0)      # (regather: sharded layers only)
        out[:, col["recompute_s"]] = rec
    # 1. copy-out after each gather (forward; backward again under ZeRO-3), on the compute stream
    #    (none where the parameters are views into the gathered buffer: FSDP1, item 5a)
    cp_param3 = cp_param * gather3 if runtime.copy_out else 0.0
    #    copy-in (FSDP2) or pre-divide and, in torch 1.13, pad (FSDP1, item 5b) before each
    #    reduce-scatter, on its stream
    rs_in = rs + cp_grad * runtime.reduce_prep_passes
    # (without a pipeline the shares are 1 on the layers they apply to: cp_param3 is ZeRO-3's only,
    # and the slowdown below is masked to sharded layers)
    f_share, b_share, rs_share = traffic_shares(zero, pipeline_m)
    bwd_copies = cp_param3 * b_share
    if runtime.grad_concat_on_compute:
        # FSDP1: autograd concatenates the unit's gradient on the compute stream (item 5b), in the
        # dtype it was computed in (the rows' gradient bytes, before any reduce-dtype scaling)
        bwd_copies = bwd_copies + 2.0 * rows[:, col["fsdp_grad_buffer_bytes"]] / unit_s * sharded
    out[:, col["dp_reducescatter_s"]] = rs_in
    # 2. compute under collectives: forward under the next layer's gather, backward under this
    #    layer's reduce-scatter and the next gather
    n = len(zero)
    next_fwd = np.empty(n)
    np.multiply(ag[1:], f_share[1:], out=next_fwd[:-1])
    next_fwd[-1] = 0.0
    next_bwd = np.empty(n)
    next_bwd[0] = 0.0
    np.multiply(ag[:-1], b_share[:-1], out=next_bwd[1:])
    rs_beside = rs_in * rs_share
    # (sharded layers only: the slowdown is masked by ``sharded`` below, so its inputs need not be)
    out[:, col["fwd_s"]] = fwd + cp_param3 + overlap_slowdown_s(fwd, next_fwd, slowdown) * sharded
    out[:, col["bwd_s"]] = bwd + bwd_copies + overlap_slowdown_s(bwd + rec, rs_beside + next_bwd, slowdown) * sharded
    if runtime.drains_each_fetch and units is not None:
        _priced_by_fetch(out, rows, col, gather3, units, ag, reduce_only,
                         rows[:, col["fsdp_param_buffer_bytes"]] / unit_s, slowdown)
    return out


def _priced_by_fetch(out: np.ndarray, rows: np.ndarray, col: dict, gather3: np.ndarray, units: list,
                     ag: np.ndarray, rs: np.ndarray, copy_pass_s: np.ndarray, slowdown: float) -> None:
    """Item 4c: the ZeRO-3 layers with gathered units priced span by span
    (zero3_fetch_spans.layer_pass_times), in place.  The forward column takes the forward's spans
    (at least its gathers, so the step model's max with the next gather keeps it); the backward
    column the recompute and backward's spans less the recompute column, which the step model
    adds back; the reduce-scatter column what those spans communicate beyond the backward gather
    the step model adds (fsdp_traffic), so that where the spans are bound by communication the
    step model's max reads the same total."""
    for k in np.flatnonzero(gather3):
        u = units[k] if k < len(units) else None
        if u is None:
            continue
        r = rows[k]
        rec = r[col["recompute_s"]]
        fwd, back, back_comm = layer_pass_times(u, r[col["fwd_s"]], rec, r[col["bwd_s"]], ag[k], rs[k],
                                                copy_pass_s[k], slowdown, recomputed=r[col["recompute"]] >= 2)
        out[k, col["fwd_s"]] = fwd
        out[k, col["recompute_s"]] = rec
        out[k, col["bwd_s"]] = back - rec
        out[k, col["dp_reducescatter_s"]] = max(back_comm - ag[k], 0.0)


def layer_among_equals(row: np.ndarray, col: dict, zero_col: int, memory_bandwidth_Bps: float,
                       memory_efficiency: float, reduce_factor: float = 1.0, pipeline_m: int | None = None,
                       **terms) -> np.ndarray:
    """``with_sharded_dp_costs`` for one layer whose neighbours are like it (the planner's
    per-layer tables price a layer alone): the middle of three copies of its row, so the gather
    it computes under is its own size.  ``terms``: ``collective_terms`` of the plan's group."""
    return with_sharded_dp_costs(np.tile(row, (3, 1)), col, zero_col, memory_bandwidth_Bps, memory_efficiency,
                                 reduce_factor=reduce_factor, pipeline_m=pipeline_m, **terms)[1]


def effective_zero(zero: int, mesh: Mesh) -> int:
    """The ZeRO stage that will run.

    When another axis splits the model (tensor or pipeline parallelism: ``mesh.splits_model``)
    the runtime runs ZeRO-1 as FSDP2 without reshard
    (ZeroRedundancyOptimizer cannot broadcast DTensor parameters; core/rules.py,
    data_parallel_kind), i.e. ZeRO-2: the simulator prices what will run (core/rules.zero_stage_that_runs).
    """
    return _rules.zero_stage_that_runs(zero, mesh.splits_model)
