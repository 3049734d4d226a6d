"""What compressing the data-parallel gradient reduce saves and costs: the "grad_compression"
cost term (a "table" term, registered in builtin_terms.py after sharded data parallelism's).

What runs is the plan's ``grad_compression`` (core/grad_compression.py; the runtime:
runtime/apply_dp.py), priced as ``TrainingCode.grad_compression`` (simulator/simulate.py
``plan_cost_models``).  The rows reaching this term price the reduce uncompressed; it rewrites:

* **bf16 / fp16 on the wire** -- every gradient element crosses the wire in 2 bytes
  (``WIRE_BYTES``).  The reduce-scatter of sharded layers (FSDP2, ZeRO-2/3) was priced at the
  reduce dtype's bytes (sharded_dp.py item 3: ``max(priced, TrainingCode.reduce_bytes)`` where
  the sharded term acts, the training precision's where it does not) and scales by 2 over those
  bytes -- wire, copy-in and the ring latency with them, as sharded_dp.py item 3 scales them.  The
  all-reduce of ZeRO-0/1 layers was priced at the bytes the uncompressed all-reduce sends (dp.py
  ``ddp_reduce_bytes``: fp32 in autopar's runtime, whose DDP reduces the fp32 gradients of
  autocast's fp32 parameters) and is priced again at 2 bytes an element: per DDP bucket on a
  plain data-parallel plan (ddp_buckets.py), per layer otherwise (``replicate``).
* **PowerSGD, rank R** (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression
  for Distributed Optimization", NeurIPS, Algorithm 1; torch's ``powerSGD_hook``, whose docstring
  lists the steps priced here) -- DDP only.  Per DDP bucket, one after another as the hook chains
  them: the all-reduce of the tensors it leaves whole (vectors, and matrices with
  (n + m) R 2 >= n m: core/grad_compression.py ``powersgd_compresses``), then per compressed n x m
  matrix P = M Q (2 n m R FLOPs), the all-reduce of all P (n R elements each), Gram-Schmidt of P
  (about 2 n R^2 FLOPs: per pair of columns a dot product and an update of n elements; torch
  takes QR above rank 2: ``orthogonalise_flops``),
  Q = M^T P (2 n m R), the all-reduce of all Q (m R each), and M~ = P Q^T (2 n m R); warm start
  orthogonalises last step's Q first (2 m R^2).  The matmuls read M three times and the
  decompression writes it once; error feedback adds the error (read M and e, write M), keeps a
  copy (read, write) and forms the new error (read two, write one): 12 passes over the bucket's
  bytes in all, at the device's memory bandwidth where that is slower than its FLOPs
  (``CostModel.compute_time_ex``).  Each of the hook's kernels costs at least a launch
  (``op_launch_s``).  The chain sits on the gradient-sync stream where the bucket's all-reduce
  was; its matmuls in fact run on the compute stream beside backward (not priced as contention).
  Error feedback keeps one more gradient-sized buffer per bucket: added to the gradient bytes.

The matrices of each layer are read from its captured ops (``layer_matrices``): an op with
weights holds one matrix whose one side is the op's output width, plus a bias vector when one of
its parameters is named ``*.bias``; an op whose parameters are at most two vectors of its output
width (a norm's weight and bias) holds vectors only.  The output width is the features of a
channels-last op (a Linear's last dimension) and the channels of a channels-first one (a
convolution's or a batch / group / instance norm's dimension 1): torch's hook views a weight as
``(shape[0], -1)``, and a convolution's weight's first dimension is its output channels.
"""
from __future__ import annotations

import numpy as np

from autopar.core.dtypes import precision_bytes
from autopar.core.grad_compression import WIRE_BYTES, GradCompression, powersgd_compresses
from autopar.simulator.axes.dp import ddp_reduce_bytes
from autopar.simulator.axes.dp_buckets import buckets
from autopar.simulator.device.network import ring_wire_bytes

#: bytes of the PowerSGD hook's traffic through memory per byte of the bucket (module docstring)
POWERSGD_MEMORY_PASSES = 12


def matmul_flops(n: int, m: int, r: int) -> float:
    """P = M Q, Q = M^T P and M~ = P Q^T of an n x m matrix at rank r: 3 x 2 n m r."""
    return 3 * 2.0 * n * m * r


def orthogonalise_kernels(r: int) -> int:
    """Kernels of one orthogonalisation in torch's hook (``_orthogonalize``): Gram-Schmidt for
    r <= 2 (per column a norm and a division, and but for the last a product, a sum, a product
    and a subtraction), one ``torch.linalg.qr`` above (counted as one launch)."""
    return 2 * r + 4 * (r - 1) if r <= 2 else 1


def orthogonalise_flops(rows: int, r: int) -> float:
    """FLOPs of orthogonalising a rows x r matrix: Gram-Schmidt about 2 rows r^2 (per pair of
    columns a dot product and an update); for r > 2 torch's hook takes Householder QR with the
    Q factor formed, about twice that (Golub & Van Loan, "Matrix Computations", 4th ed., Sec.
    5.2.2: 2 rows r^2 - 2 r^3 / 3 for the factorisation, as much again to form Q)."""
    return (2.0 if r <= 2 else 4.0) * rows * r * r


def powersgd_kernels(r: int) -> int:
    """Kernels the hook launches per compressed matrix: three bmm and two orthogonalisations."""
    return 3 + 2 * orthogonalise_kernels(r)


#: ops whose features run along dimension 1 of their output (N, C, ...): torch.nn's convolutions
#: and the norms over channels
CHANNELS_FIRST_NORMS = ("BatchNorm", "GroupNorm", "InstanceNorm")


def output_width(op) -> int:
    """The features of ``op``'s output: dimension 1 of a convolution's or a channel norm's
    (N, C, ...) output, the last dimension otherwise (module docstring)."""
    shape = op.output_shape
    if not shape:
        return 1
    if len(shape) >= 3 and (op.kind == "conv" or any(n in op.target for n in CHANNELS_FIRST_NORMS)):
        return int(shape[1])
    return int(shape[-1])


def layer_matrices(graph, layer: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """(the weight matrices as (n, m), elements held in vectors) of ``layer``'s trainable
    parameters, from its ops (module docstring)."""
    mats, vec = [], 0
    for op in graph.layer_ops(layer):
        numel = op.param_numel - op.frozen_numel
        if numel <= 0:
            continue
        width = output_width(op)
        if width <= 0 or numel <= 2 * width:
            vec += numel
            continue
        bias = width if any(p.endswith("bias") for p in op.params) else 0
        other = (numel - bias) // width
        mats.append((width, other))
        vec += numel - bias - width * other + bias
    return tuple(mats), vec


def graph_matrices(graph) -> tuple:
    """``layer_matrices`` of every layer of ``graph`` (the evaluator keeps them per graph:
    PlanEvaluator.per_graph)."""
    return tuple(layer_matrices(graph, i) for i in range(len(graph.layers)))


def powersgd_layer(mats, vec: int, rank: int) -> tuple[float, float, float, float, int]:
    """(elements all-reduced whole, P elements, Q elements, FLOPs, kernels) of a layer whose
    matrices are ``mats`` and vectors ``vec`` elements, at ``rank``."""
    whole, p, q, flops, kernels = float(vec), 0.0, 0.0, 0.0, 0
    for n, m in mats:
        r = min(n, m, rank)
        if not powersgd_compresses(n, m, rank):
            whole += n * m
            continue
        p += n * r
        q += m * r
        flops += matmul_flops(n, m, r) + orthogonalise_flops(n, r) + orthogonalise_flops(m, r)
        kernels += powersgd_kernels(r)
    return whole, p, q, flops, kernels


def compression_acts(ctx) -> bool:
    return ctx.rank_cm[0].code.grad_compression != "none"


def with_compression(rows, ctx, matrices, gloo: bool = False):
    """``rows`` with the dp reduce priced compressed (module docstring); unchanged for "none".
    ``matrices``: the model's ``graph_matrices``.
    ``gloo``: the cluster runs gloo, where the runtime keeps PowerSGD's gradients in one DDP bucket
    (runtime/apply_dp.py ``one_bucket_on_gloo``)."""
    cm = ctx.rank_cm[0]
    c = GradCompression.parse(cm.code.grad_compression)
    mesh = ctx.mesh
    if c.kind == "none" or mesh.grad_degree <= 1:
        return rows
    dpl, procs = ctx.links.dp, ctx.processes
    grad_ranks = mesh.grad_degree
    priced = float(precision_bytes(ctx.precision))          # a sharded row's bytes per gradient element
    ddp_priced = ddp_reduce_bytes(ctx.precision, cm.code)   # ... a DDP row's: its all-reduce's (dp.py)
    ddp = rows.zero <= 1
    plain_ddp = not mesh.splits_model and mesh.ep <= 1 and bool(ddp.all())
    if c.kind in WIRE_BYTES:
        wire = float(WIRE_BYTES[c.kind])
        sharded_acted = not (cm.host_dispatch_bound or ctx.serial_comm)
        rs_bytes = max(priced, cm.code.reduce_bytes) if sharded_acted else priced
        rs = np.where(ddp, rows.dp_reducescatter_s, rows.dp_reducescatter_s * (wire / rs_bytes))
        ar = np.zeros(len(rows))
        if plain_ddp:
            for closing, _top, filled in buckets(rows.dp_grad_bytes):
                ar[closing] = cm.collective_time("all_reduce", filled * wire / ddp_priced, grad_ranks, dpl.link,
                                                 dpl.level, processes=procs)
        else:
            for k in np.flatnonzero(ddp & (rows.dp_grad_bytes > 0)):
                ar[k] = cm.collective_time("all_reduce", rows.dp_grad_bytes[k] * wire / ddp_priced, grad_ranks,
                                           dpl.link, dpl.level, processes=procs)
            ar = np.where(ddp, ar, rows.dp_allreduce_s)
        # the bytes each rank sends (the rows counted a DDP row's at its all-reduce's bytes, a
        # sharded row's at the training precision's)
        less = ring_wire_bytes("reduce_scatter", rows.dp_grad_bytes, grad_ranks) * (
            1.0 - wire / np.where(ddp, ddp_priced, priced))
        sharded_step = mesh.pp > 1                  # a pipeline reduce-scatters once a step
        return rows.with_columns(
            dp_reducescatter_s=rs, dp_allreduce_s=ar,
            dp_wire_bytes_per_step=rows.dp_wire_bytes_per_step - np.where(ddp, 2 * less, less if sharded_step else 0.0),
            dp_wire_bytes_per_mb=rows.dp_wire_bytes_per_mb - np.where(ddp | sharded_step, 0.0, less))
    # PowerSGD: plain DDP only (core/grad_compression.py compression_problem)
    per_layer = matrices
    ar = np.zeros(len(rows))
    # the hook compresses DDP's bucket in its dtype: P, Q and the whole tensors at the all-reduce's bytes
    sent = np.array([sum(powersgd_layer(*per_layer[k], c.rank)[:3]) * ddp_priced for k in range(len(rows))])
    launch = cm.overhead("op_launch_s")
    groups = [(0, len(rows) - 1, float(rows.dp_grad_bytes.sum()))] if gloo else buckets(rows.dp_grad_bytes)
    for closing, top, filled in groups:
        whole = p = q = flops = 0.0
        kernels = 0
        for k in range(closing, top + 1):
            w, pk, qk, fk, nk = powersgd_layer(*per_layer[k], c.rank)
            whole, p, q, flops, kernels = whole + w, p + pk, q + qk, flops + fk, kernels + nk
        compute = max(cm.compute_time_ex("matmul", flops, 0.0, "fp32")[0],
                      POWERSGD_MEMORY_PASSES * filled / cm.achievable_memory_Bps)
        ar[closing] = (cm.collective_time("all_reduce", whole * ddp_priced, grad_ranks, dpl.link, dpl.level,
                                          processes=procs)
                       + cm.collective_time("all_reduce", p * ddp_priced, grad_ranks, dpl.link, dpl.level,
                                            processes=procs)
                       + cm.collective_time("all_reduce", q * ddp_priced, grad_ranks, dpl.link, dpl.level,
                                            processes=procs)
                       + max(compute, kernels * launch))
    # error feedback: one more buffer of the bucket's gradients, held for the whole run
    wire = rows.dp_wire_bytes_per_step + (ring_wire_bytes("all_reduce", sent, grad_ranks)
                                          - ring_wire_bytes("all_reduce", rows.dp_grad_bytes, grad_ranks))
    return rows.with_columns(dp_allreduce_s=ar, grad_bytes=rows.grad_bytes + rows.dp_grad_bytes,
                             dp_wire_bytes_per_step=wire)


def compressed_fraction(graph, spec: str) -> float:
    """Elements-times-bytes a rank puts into the dp reduce per step under ``spec`` over those
    without: the runtime reduces fp32 gradients uncompressed (runtime/apply_dp.py: DDP's fp32
    master gradients, FSDP2's ``reduce_dtype=torch.float32``), so a cast sends 2 of 4 bytes;
    PowerSGD sends the whole tensors plus P and Q (``powersgd_layer``) of the model's elements."""
    c = GradCompression.parse(spec)
    if c.kind == "none":
        return 1.0
    if c.kind in WIRE_BYTES:
        return WIRE_BYTES[c.kind] / 4.0
    total = sent = 0.0
    for mats, vec in graph_matrices(graph):
        whole, p, q, _, _ = powersgd_layer(mats, vec, c.rank)
        total += vec + sum(n * m for n, m in mats)
        sent += whole + p + q
    return sent / total if total else 1.0
