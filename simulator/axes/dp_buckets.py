"""DDP's gradient buckets: the data-parallel all-reduces of a plain data-parallel plan priced as
the calls the runtime makes (a "table" cost term: builtin_terms.py)."""
from __future__ import annotations

import numpy as np

from autopar.simulator.step.layer_table import LayerTable
from autopar.simulator.step.memory import DDP_BUCKET_BYTES

#: DistributedDataParallel's first gradient bucket holds about 1 MiB, the others DDP_BUCKET_BYTES
#: (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)
DDP_FIRST_BUCKET_BYTES = 1 << 20


def ddp_bucketed_all_reduces(rows: LayerTable, ctx, processes: int) -> LayerTable:
    """Rows whose per-layer DDP all-reduces are priced as the calls the runtime makes: a plain
    data-parallel plan (no tensor or pipeline parallelism, every layer
    ZeRO-0 or 1; runtime/apply_dp.py runs it on ``DistributedDataParallel``) all-reduces its
    gradients in buckets, filled in backward order (the last layer first) and all-reduced when
    the bucket's last gradient is ready (Li et al. 2020, "PyTorch Distributed", Sec. 3.2.3), so
    a bucket's all-reduce is priced once, on the layer that closes it, at the bucket's size
    (the buckets are cut at layer boundaries here, at tensor boundaries in DDP).  Where a call's
    latency is small (NCCL) this changes little; on a CPU, where each call that must wake gloo's
    threads costs milliseconds (profiling/collectives.py), it is most of the data-parallel
    cost.  Other plans are returned unchanged."""
    mesh = ctx.mesh
    # (with ep > 1 the experts' gradients sync over dp / ep ranks, not in DDP's buckets: layer_cost)
    if mesh.grad_degree <= 1 or mesh.splits_model or mesh.ep > 1 or not (rows.zero <= 1).all():
        return rows
    if ctx.rank_cm[0].code.optimizer.sync_after_flush:      # no buckets: one sync after the backward
        return rows
    cm, link, level = ctx.rank_cm[0], ctx.links.dp.link, ctx.links.dp.level
    ar = np.zeros(len(rows))
    for closing, _top, filled in buckets(rows.dp_grad_bytes):
        ar[closing] = cm.collective_time("all_reduce", filled, mesh.grad_degree, link, level, processes=processes)
    return rows.with_columns(dp_allreduce_s=ar)


def buckets(grad_bytes) -> list[tuple[int, int, float]]:
    """DDP's buckets over layers whose gradients hold ``grad_bytes``: (the layer that closes the
    bucket -- the lowest, which backward reaches last --, the highest layer in it, its bytes), in
    backward order (``ddp_bucketed_all_reduces``)."""
    out = []
    cap, filled, start = DDP_FIRST_BUCKET_BYTES, 0.0, len(grad_bytes) - 1
    for k in range(len(grad_bytes) - 1, -1, -1):
        filled += grad_bytes[k]
        if filled > 0 and (filled >= cap or k == 0):
            out.append((k, start, filled))
            cap, filled, start = DDP_BUCKET_BYTES, 0.0, k - 1
    return out


def ddp_buckets_act(ctx) -> bool:
    """Whether ``ddp_bucketed_all_reduces`` may rewrite the rows of context ``ctx``: a plain
    data-parallel mesh (it reads the whole table: which layers close a bucket)."""
    return ctx.mesh.grad_degree > 1 and not ctx.mesh.splits_model
