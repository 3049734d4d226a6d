"""Framework overheads: the fixed cost of running an op, a DTensor module, an FSDP unit, an
optimizer parameter -- what a roofline over FLOPs and bytes cannot see.

Each figure is a difference of two timed closures that do the same arithmetic on tiny tensors,
one plain and one through the framework feature, so the bytes and FLOPs cancel and what is
left is the feature's per-call cost (dispatch, hooks, bookkeeping).  Forwards are timed with
gradients enabled, as in training: DTensor's autograd wrappers cost there and not under
``no_grad`` (a 2-process run of the accuracy benchmark's GPT spent ~0.5 ms per tensor-parallel
module of forward, timed with module hooks on a one-rank mesh, where a single ``ColwiseParallel``
linear under ``no_grad`` measured 0.16 ms):

* ``op_launch_s``: one eager op (``torch.add`` on 4 elements), per op of a chain of 64;
* ``op_backward_launch_s``: the autograd cost one such op adds to a backward pass (a chain of
  64 adds with gradients, forward + backward, minus the forward, per op);
* ``tp_module_fwd_s`` / ``tp_module_bwd_s``: what tensor parallelism adds per module to a
  tiny MLP on ``[batch, seq, hidden]`` activations -- ``ColwiseParallel`` on its first linear,
  ``RowwiseParallel`` on its second, as the runtime pairs them -- in forward and in backward,
  halved, on a one-rank mesh (no traffic; collectives are priced from the collective table);
  Under torchrun on a CPU this and the FSDP figures are re-measured on pairs of ranks, in step,
  with their collectives (profiling/cpu_overheads_in_step.py), which is what they cost there;
* ``fsdp_unit_fwd_s`` / ``fsdp_unit_bwd_s``: what ``fully_shard`` (resharding after forward)
  adds to one tiny module per forward and per backward beyond its collectives, on a one-rank
  mesh: the plain module's time and the time of the same all-gather (forward; again in
  backward) and reduce-scatter (backward) called directly on that mesh are taken out -- the
  collective table prices those.  (On a mesh of several gloo processes the same difference
  swings from 0.1 to 2 ms between runs on this shared machine when timed back to back and by
  medians; profiling/cpu_overheads_in_step.py times it in step, by trimmed means, against a
  composite of the same collectives, and on CPU ranks under torchrun that figure, with a
  per-byte part ``fsdp_unit_*_per_byte_s``, replaces this one);
* ``dtensor_module_fwd_s`` / ``dtensor_module_bwd_s``: the one-rank tensor-parallel figures, kept
  as what a DTensor module costs with no collective of its own;
* ``sp_norm_fwd_s`` / ``sp_norm_bwd_s``: what ``SequenceParallel`` (local tensors in and out, as
  runtime/apply_tp.py applies it) adds to a LayerNorm, on a one-rank mesh -- a sequence-parallel
  plan's norms cost this, not a split module's pair of linears and activation;
* ``optimizer_tensor_s`` / ``optimizer_dtensor_tensor_s``: what one more parameter tensor adds
  to an ``AdamW`` step (64 tensors of 16 elements, per tensor), plain and as DTensors;
* ``recompute_{full,selective}_{fwd,bwd}_per_op_s``: what the runtime's checkpoint wrapper
  (runtime/recompute.py) adds per op of the wrapped module, beyond re-running its forward: a
  tiny pre-norm MLP block (norm, linear, GELU, linear, residual add: 5 ops) plain and wrapped,
  forward, and backward less what the simulator prices the recompute as rerunning
  (``recompute_rerun``: for the full wrapper the forward up to the last saved tensor -- norm,
  linear, GELU; for the selective one the ops between the matmuls -- norm, GELU, add.  Profiles
  measured before these rules subtracted the whole forward, so their backward figures are low by
  the forward of what is not rerun over 5: for the full wrapper the projection and the add, two
  tiny ops' dispatch; for the selective one the two linears).  The
  non-reentrant wrapper packs and unpacks every saved tensor through hooks; the selective one
  also runs its policy in a dispatch mode on every ATen op, forward and recompute -- on this
  2-core CPU ~0.1 ms an op, more than the ops of a small block cost (a GPT block of hidden 128:
  +4.0 ms forward on 2.3 ms, measured with time.perf_counter medians);
* ``autograd_fwd_op_s`` / ``autograd_fwd_per_byte_s``: what recording the autograd graph adds
  to a forward beyond the same ops under ``no_grad`` (the op table's rows), per op and per byte
  of the ops' outputs: a chain of 4 of the probe blocks at four sizes ([2, 8, 16] to
  [4, 64, 128]), forward with and without gradients in alternation, the median of the paired
  differences, and a least-squares line per op over (bytes per op, seconds per op).  The outputs a
  forward keeps for its backward cannot be freed and reused, so each op writes memory that is
  not in cache.  On this CPU a lone process pays ~5 us an op and ~0.1 ns a byte (the accuracy
  benchmark's GPT: 1.8-2.8 ms on a forward of ~10 ms, which the sum of the op rows left out);
  with two ranks busy, as the profile measures it, ~3-5 us an op and nothing per byte (the GPT
  in a 2-rank DDP run: 0.6 ms a rank).  On a GPU the host's bookkeeping overlaps the queued
  kernels: not measured there.

One-rank meshes come from ``dist.new_group([rank])`` for every rank (under torchrun, so every
rank measures at the same time, sharing the machine as in training) or from a one-process
gloo group started here.  Timed with ``autopar.profiling.timing.time_call`` (medians).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.profiling.timing import RepeatPolicy, lockstep_median, median_of_runs, time_call, wall_seconds
from autopar.profiles import OVERHEAD_KEYS   # the figures measured here

CHAIN_OPS = 64           # ops per timed chain
TINY_NUMEL = 4           # elements of a tiny op's operands
OPT_TENSORS = 64         # parameter tensors of the optimizer probe
OPT_TENSOR_NUMEL = 16
OVERHEAD_REPEATS = 3
#: ops of the recompute probe's block (norm, linear, gelu, linear, add), and its shape
RECOMPUTE_BLOCK_OPS = 5
RECOMPUTE_BLOCK_SHAPE = (2, 8, 16)


def measure_overheads(device: torch.device, policy: RepeatPolicy, quick: bool = False) -> dict[str, float]:
    """The figures of ``OVERHEAD_KEYS`` in seconds (each >= 0).  Under torchrun on a CPU the
    tensor-parallel and FSDP figures come from pairs of ranks in step
    (profiling/cpu_overheads_in_step.py), which replace the one-rank ones."""
    out: dict[str, float] = {"fsdp_unit_fwd_per_byte_s": 0.0, "fsdp_unit_bwd_per_byte_s": 0.0}
    t = lambda fn: time_call(fn, device, policy).median_s   # noqa: E731
    a = torch.randn(TINY_NUMEL, device=device)
    b = torch.randn(TINY_NUMEL, device=device)

    def chain():
        z = a
        for _ in range(CHAIN_OPS):
            z = torch.add(z, b)
        return z

    a_grad = a.clone().requires_grad_(True)

    def chain_fwd():
        z = a_grad
        for _ in range(CHAIN_OPS):
            z = torch.add(z, b)
        return z

    def chain_fwd_bwd():
        chain_fwd().backward(torch.ones_like(a))

    out["op_launch_s"] = t(chain) / CHAIN_OPS
    out["op_backward_launch_s"] = max(0.0, t(chain_fwd_bwd) - t(chain_fwd)) / CHAIN_OPS
    # the median of a few whole measurements: one swings by up to 4x between runs here
    out.update(median_of_runs(lambda: _recompute(device, t), 1 if quick else OVERHEAD_REPEATS))
    out.update(_autograd_forward(device, policy, quick) if device.type == "cpu" else
               {"autograd_fwd_op_s": 0.0, "autograd_fwd_per_byte_s": 0.0})
    in_step = device.type == "cpu" and dist.is_initialized() and dist.get_world_size() >= 2
    with _one_rank_mesh(device) as mesh:
        out.update(_tp_module(mesh, device, t))
        out.update(_sp_norm(mesh, device, t))
        if not in_step:                           # in step, cpu_overheads_in_step.py measures the unit
            out.update(_fsdp_unit(mesh, device, t))
        out.update(_optimizer(mesh, device, t))
    # the one-rank pair is a DTensor module's dispatch and hooks alone: kept as such (a
    # sequence-parallel norm's cost) before the in-step figures replace the split modules'
    out["dtensor_module_fwd_s"], out["dtensor_module_bwd_s"] = out["tp_module_fwd_s"], out["tp_module_bwd_s"]
    if in_step:
        from autopar.profiling.cpu_overheads_in_step import measure_in_step_overheads

        dist.barrier()
        out.update(measure_in_step_overheads(quick))
    return {k: max(0.0, float(out[k])) for k in OVERHEAD_KEYS}


def _linear_pair(device):
    torch.manual_seed(0)
    return nn.Linear(8, 8, device=device), torch.randn(2, 8, device=device)


def _fwd_bwd_times(module, x, t) -> tuple[float, float]:
    """(forward, backward) seconds of ``module`` on ``x``; the forward with gradients enabled."""
    def fwd():
        return module(x)

    def fwd_bwd():
        module(x).sum().backward()
    f = t(fwd)
    return f, max(0.0, t(fwd_bwd) - f)


class _ProbeBlock(nn.Module):
    """x + W2 gelu(W1 norm(x)): the ops of a transformer MLP half-block, tiny."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm, self.fc, self.act, self.proj = (nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                                   nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.norm(x))))


def _recompute(device, t) -> dict[str, float]:
    from autopar.runtime.recompute import wrap_for_recompute

    torch.manual_seed(0)
    x = torch.randn(*RECOMPUTE_BLOCK_SHAPE, device=device, requires_grad=True)
    plain = _ProbeBlock(RECOMPUTE_BLOCK_SHAPE[-1]).to(device)
    pf, pb = _fwd_bwd_times(plain, x, t)
    out = {}
    for mode in ("full", "selective"):
        wrapped = wrap_for_recompute(_ProbeBlock(RECOMPUTE_BLOCK_SHAPE[-1]).to(device), mode)
        wf, wb = _fwd_bwd_times(wrapped, x, t)
        out[f"recompute_{mode}_fwd_per_op_s"] = (wf - pf) / RECOMPUTE_BLOCK_OPS
        # the backward re-runs part of the forward (priced from the op table): only what is beyond it
        out[f"recompute_{mode}_bwd_per_op_s"] = (wb - pb - t(recompute_rerun(plain, x, mode))) / RECOMPUTE_BLOCK_OPS
    return out


def recompute_rerun(block: _ProbeBlock, x, mode: str):
    """The part of the probe block's forward that simulator/layer_cost.py ``_recompute`` prices as a
    recompute's rerun, as a callable to time.  Full: the forward up to the block's last saved tensor,
    the output projection's operands, packed before its kernel runs -- norm, linear and GELU, not
    the projection or the residual add.  Selective: the ops outside MATMUL_KINDS (``cheap_fwd_s``)
    -- norm, GELU and the residual add, on the matmuls' kept outputs."""
    if mode == "full":
        return lambda: block.act(block.fc(block.norm(x)))
    fc_out = block.fc(block.norm(x)).detach()
    proj_out = block.proj(block.act(fc_out)).detach()
    return lambda: (block.norm(x), block.act(fc_out), x + proj_out)


#: [batch, seq, hidden] of the autograd probe's sizes, and its chain of blocks
# (a chain of 11.5 MB of outputs, [8, 64, 128], costs 1.2-1.8 ms alone and 4-5 ms with two ranks
# busy -- past what the caches hold the cost is no longer a line in the bytes; left out)
AUTOGRAD_SHAPES = ((2, 8, 16), (4, 32, 64), (4, 64, 64), (4, 64, 128))
AUTOGRAD_BLOCKS = 4


#: independent fits whose median is kept (one fit swings by 2-4x between runs on a shared machine)
AUTOGRAD_FITS = 3


def _autograd_forward(device, policy: RepeatPolicy, quick: bool = False) -> dict[str, float]:
    from autopar.profiling.cpu_overheads_in_step import _nonnegative_line

    chains = []
    for shape in AUTOGRAD_SHAPES[:2] if quick else AUTOGRAD_SHAPES:
        torch.manual_seed(0)
        chain = nn.Sequential(*[_ProbeBlock(shape[-1]) for _ in range(AUTOGRAD_BLOCKS)]).to(device)
        tokens, h = shape[0] * shape[1], shape[-1]
        # outputs per block: norm h, fc 4h, gelu 4h, proj h, add h (fp32), per token
        ops, out_bytes = AUTOGRAD_BLOCKS * RECOMPUTE_BLOCK_OPS, AUTOGRAD_BLOCKS * 11 * h * tokens * 4
        chains.append((chain, torch.randn(*shape, device=device), ops, out_bytes))
    fits = []
    for _ in range(1 if quick else AUTOGRAD_FITS):
        per_op_s = [_paired_median(lambda c=c, x=x: c(x), policy, 10 if quick else 50) / ops
                    for c, x, ops, _ in chains]
        fits.append(_nonnegative_line([b / ops for _, _, ops, b in chains], per_op_s))
    fixed, per_byte = np.median(np.asarray(fits), axis=0)
    return {"autograd_fwd_op_s": float(fixed), "autograd_fwd_per_byte_s": float(per_byte)}


def _paired_median(fwd, policy: RepeatPolicy, min_pairs: int = 50) -> float:
    """Median over pairs of (``fwd()`` with gradients - ``fwd()`` under ``no_grad``), the two in
    alternation so a slow spell of the machine falls on both; at least ``min_pairs`` pairs and
    until the pairs add up to 4 x the policy's target time."""
    for _ in range(max(2, policy.warmup)):
        fwd()
        with torch.no_grad():
            fwd()
    diffs, total = [], 0.0
    while len(diffs) < min_pairs or (total < 4 * policy.target_total_s and len(diffs) < 5000):
        with_grad = wall_seconds(fwd)
        with torch.no_grad():
            without = wall_seconds(fwd)
        diffs.append(with_grad - without)
        total += with_grad + without
    return statistics.median(diffs)


def _sp_norm(mesh, device, t) -> dict[str, float]:
    """What ``SequenceParallel`` adds to a LayerNorm (as the runtime applies it: local tensors in and
    out, a DTensor sharded on the sequence inside), forward and backward, on a one-rank mesh."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, device=device)          # [batch, seq, hidden]
    plain, norm = nn.LayerNorm(8).to(device), nn.LayerNorm(8).to(device)
    parallelize_module(norm, mesh, SequenceParallel(use_local_output=True))
    pf, pb = _fwd_bwd_times(plain, x, t)
    sf, sb = _fwd_bwd_times(norm, x, t)
    return {"sp_norm_fwd_s": sf - pf, "sp_norm_bwd_s": sb - pb}


def _tp_module(mesh, device, t) -> dict[str, float]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, device=device)          # [batch, seq, hidden], the runtime's layout

    def mlp():
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).to(device)
    plain, pair = mlp(), mlp()
    parallelize_module(pair, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    pf, pb = _fwd_bwd_times(plain, x, t)
    tf, tb = _fwd_bwd_times(pair, x, t)
    return {"tp_module_fwd_s": (tf - pf) / 2, "tp_module_bwd_s": (tb - pb) / 2}


def _fsdp_unit(mesh, device, t) -> dict[str, float]:
    from torch.distributed.fsdp import fully_shard

    # closures that communicate: the same counts on every rank, the slowest rank's time
    t = lambda fn: lockstep_median(fn, device, mesh.get_group())   # noqa: E731

    plain, x = _linear_pair(device)
    wrapped, _ = _linear_pair(device)
    fully_shard(wrapped, mesh=mesh, reshard_after_forward=True)
    pf, pb = _fwd_bwd_times(plain, x, t)
    f, b = _fwd_bwd_times(wrapped, x, t)      # FSDP's hooks run with gradients enabled only
    # the unit's own collectives, called directly: its flat parameter (weight + bias of the
    # tiny linear) all-gathered, its gradient reduce-scattered, padded to the mesh size
    group, n = mesh.get_group(), mesh.size()
    numel = -(-sum(p.numel() for p in plain.parameters()) // n) * n
    full, shard = torch.zeros(numel, device=device), torch.zeros(numel // n, device=device)
    gather = t(lambda: dist.all_gather_into_tensor(full, shard, group=group))
    scatter = t(lambda: dist.reduce_scatter_tensor(shard, full, group=group))
    return {"fsdp_unit_fwd_s": f - pf - gather, "fsdp_unit_bwd_s": b - pb - gather - scatter}


def _optimizer(mesh, device, t) -> dict[str, float]:
    from torch.distributed.tensor import Shard, distribute_tensor

    def step_time(params_per_group: int, as_dtensor: bool) -> float:
        torch.manual_seed(0)
        params = []
        for _ in range(params_per_group):
            data = torch.randn(OPT_TENSOR_NUMEL, device=device)
            if as_dtensor:
                data = distribute_tensor(data, mesh, [Shard(0)])
            p = nn.Parameter(data)
            p.grad = torch.randn_like(p)
            params.append(p)
        opt = torch.optim.AdamW(params, lr=1e-4)
        return t(opt.step)
    # per tensor: the slope between OPT_TENSORS and 2 * OPT_TENSORS tensors (a fixed per-step cost cancels)
    plain = (step_time(2 * OPT_TENSORS, False) - step_time(OPT_TENSORS, False)) / OPT_TENSORS
    dt = (step_time(2 * OPT_TENSORS, True) - step_time(OPT_TENSORS, True)) / OPT_TENSORS
    return {"optimizer_tensor_s": plain, "optimizer_dtensor_tensor_s": dt}


@contextlib.contextmanager
def _one_rank_mesh(device: torch.device):
    """A DeviceMesh of this rank alone (a one-process gloo/nccl group when none is running)."""
    from torch.distributed.device_mesh import DeviceMesh

    started = False
    if not dist.is_initialized():
        store_file = tempfile.NamedTemporaryFile(prefix="autopar-overheads-", delete=False)
        store_file.close()
        store = dist.FileStore(store_file.name, 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        started = True
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = None
        for r in range(world):                        # every rank creates every group, in the same order
            g = dist.new_group([r], backend="nccl" if device.type == "cuda" else "gloo") if world > 1 else dist.group.WORLD
            if r == rank:
                mine = g
        yield DeviceMesh.from_group(mine, device.type)
    finally:
        if started:
            dist.destroy_process_group()
            with contextlib.suppress(OSError):
                os.unlink(store_file.name)

