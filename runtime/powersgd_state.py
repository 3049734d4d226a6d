"""PowerSGD's state across a checkpoint: torch's ``powerSGD_hook`` with its ``PowerSGDState``,
saved per rank with the checkpoint and restored on resume.

The hook keeps, per DDP bucket, the error feedback (the part of the gradient the last compression
left out, added to the next one: Vogels et al. 2019, Algorithm 2) and the warm-started P and Q
(Algorithm 1 starts each step's power iteration from the last step's Q), as flat tensors in the
bucket's order (torch's ``PowerSGDState.error_dict``, ``p_memory_dict``, ``q_memory_dict``),
beside its step count and the random generator that draws the first Q.

A bucket's order is not fixed: ``DistributedDataParallel`` builds its first buckets in the
reverse order of the parameters and rebuilds them after the first step in the order their
gradients became ready (torch's ``Reducer::rebuild_buckets``), so a resumed run's first step
sees another order than the step that saved (the reason torch asks for ``start_powerSGD_iter
>= 2``).  ``PowerSGDHook`` therefore records the parameters of every bucket it is called with,
saves the state per parameter (``state_dict``: each parameter's slice of the error and its P
and Q), and lays it out again in whatever order a bucket has when it is next called -- after a
resume, and after DDP's rebuild.  The P and Q of a bucket lie in the hook's own order: the
compressed gradients (torch's ``_should_compress``) grouped by shape in order of first
appearance (``_compressed_order``).

``state_dict`` holds tensors and plain numbers only (the generator's Mersenne Twister state as
a tensor), so ``torch.load(weights_only=True)`` reads it back.  Error feedback is each rank's
own residual: a checkpoint saved under another data-parallel layout (world size, mesh, ZeRO
stage) or another ``powersgd:R`` restarts the hook instead (``restart_reason``).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

STATE_FORMAT = "autopar-powersgd"
#: PowerSGDState's counters carried as they are
_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")
_KINDS = ("error", "p", "q")


def _compressed_order(entries, rank: int, min_rate: float) -> list[tuple[str, int, int, int]]:
    """(name, n, m, r) of the gradients of a bucket (``entries``: (name, offset, shape) in the
    bucket's order) that the hook compresses, in the order their P and Q lie in its memory: as
    ``powerSGD_hook`` builds it (``tensor.view(shape[0], -1)``, ``_should_compress``, then the
    matrices grouped by shape, groups in order of first appearance, one at a time:
    ``batch_tensors_with_same_shape=False``)."""
    groups: dict[tuple[int, int], list] = defaultdict(list)
    for name, _, shape in entries:
        n = shape[0] if shape else 1
        m = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if powerSGD_hook._should_compress(n, m, r, min_rate)[0]:
            groups[(n, m)].append((name, n, m, r))
    return [item for group in groups.values() for item in group]


class PowerSGDHook:
    """torch's ``powerSGD_hook`` over ``state`` (a ``PowerSGDState``), registered on DDP in its
    place (``hook``); it records each bucket's parameters (``names``: id(parameter) -> name) and keeps the
    state laid out in each bucket's current order (module docstring)."""

    def __init__(self, state: powerSGD_hook.PowerSGDState, names: dict[int, str], spec: str):
        self.state, self.names, self.spec = state, names, spec
        self.layout: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}   # bucket -> (name, offset, shape)
        self.pending: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _KINDS}   # per parameter, not laid out

    def hook(self, state, bucket):
        """The communication hook DDP calls per bucket (``register_comm_hook(state, self.hook)``)."""
        index, entries = bucket.index(), self._entries(bucket)
        if self.layout.get(index, entries) != entries:          # DDP rebuilt its buckets
            self._to_pending()
        self.layout[index] = entries
        if self.pending["error"] and index not in self.state.error_dict:
            self._lay_out(index, entries, bucket.buffer())
        return powerSGD_hook.powerSGD_hook(state, bucket)

    def _entries(self, bucket) -> list[tuple[str, int, tuple[int, ...]]]:
        buf = bucket.buffer()
        return [(self.names[id(p)], (g.data_ptr() - buf.data_ptr()) // buf.element_size(), tuple(g.shape))
                for p, g in zip(bucket.parameters(), bucket.gradients())]

    def _per_parameter(self, index: int, entries) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket ``index``'s state (laid out as ``entries``) per parameter name."""
        s, out = self.state, {k: {} for k in _KINDS}
        if index in s.error_dict:
            flat = s.error_dict[index]
            for name, offset, shape in entries:
                numel = int(np.prod(shape)) if shape else 1
                out["error"][name] = flat[offset:offset + numel].clone()
        if index in s.q_memory_dict:
            p_at = q_at = 0
            for name, n, m, r in _compressed_order(entries, s.matrix_approximation_rank, s.min_compression_rate):
                out["p"][name] = s.p_memory_dict[index][p_at:p_at + n * r].clone()
                out["q"][name] = s.q_memory_dict[index][q_at:q_at + m * r].clone()
                p_at, q_at = p_at + n * r, q_at + m * r
        return out

    def _to_pending(self) -> None:
        """Every bucket's state per parameter, into ``pending``; the hook's dicts emptied (a bucket
        takes its share back at its next call)."""
        s = self.state
        for index, entries in self.layout.items():
            for kind, values in self._per_parameter(index, entries).items():
                self.pending[kind].update(values)
        s.error_dict.clear()
        s.p_memory_dict.clear()
        s.q_memory_dict.clear()

    def _lay_out(self, index: int, entries, buffer: torch.Tensor) -> None:
        """Bucket ``index``'s error, P and Q from ``pending``, in the order of ``entries``; a
        parameter missing there leaves the bucket to start afresh (zero error, new Q)."""
        s, pending = self.state, self.pending
        if any(name not in pending["error"] for name, _, _ in entries):
            return
        error = torch.zeros(buffer.numel(), dtype=buffer.dtype, device=buffer.device)
        for name, offset, shape in entries:
            value = pending["error"].pop(name)
            error[offset:offset + value.numel()] = value.to(error.device)
        s.error_dict[index] = error
        order = _compressed_order(entries, s.matrix_approximation_rank, s.min_compression_rate)
        if order and all(name in pending["q"] for name, *_ in order):
            s.p_memory_dict[index] = torch.cat([pending["p"].pop(name) for name, *_ in order]).to(error.device)
            s.q_memory_dict[index] = torch.cat([pending["q"].pop(name) for name, *_ in order]).to(error.device)

    def state_dict(self) -> dict:
        """This rank's hook state per parameter, tensors and numbers only (module docstring)."""
        s = self.state
        per = {k: dict(v) for k, v in self.pending.items()}
        for index, entries in self.layout.items():
            for kind, values in self._per_parameter(index, entries).items():
                per[kind].update(values)
        _, keys, pos, has_gauss, cached = s.rng.get_state()
        return {"format": STATE_FORMAT, "spec": self.spec, **{k: int(getattr(s, k)) for k in _COUNTERS},
                "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)},
                **{k: {name: t.detach().cpu() for name, t in v.items()} for k, v in per.items()}}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from ``state_dict``'s ``saved``: counters and generator now, the tensors laid
        out into each bucket at its next call."""
        s = self.state
        for k in _COUNTERS:
            setattr(s, k, int(saved[k]))
        rng = saved["rng"]
        s.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                         rng["cached_gaussian"]))
        s.error_dict.clear()
        s.p_memory_dict.clear()
        s.q_memory_dict.clear()
        self.layout.clear()
        self.pending = {k: dict(saved[k]) for k in _KINDS}


def restart_reason(saved_layout: dict, run_layout: dict, saved_spec: str | None, spec: str,
                   has_file: bool) -> str | None:
    """Why a checkpoint's PowerSGD state cannot continue in this run, or None: the data-parallel
    layout (world size, mesh, ZeRO stage) and the ``powersgd:R`` must be the ones it was saved
    under (error feedback is each rank's own residual), and the checkpoint must hold it."""
    if saved_layout != run_layout:
        return (f"the checkpoint was saved under world size {saved_layout.get('world_size')}, mesh "
                f"{saved_layout.get('mesh')}, zero {saved_layout.get('zero')}, and this run has world size "
                f"{run_layout.get('world_size')}, mesh {run_layout.get('mesh')}, zero {run_layout.get('zero')}")
    if saved_spec is None or not has_file:
        return "the checkpoint holds no PowerSGD state (saved without PowerSGD, or by an older autopar)"
    if saved_spec != spec:
        return f"the checkpoint's state is of {saved_spec}, and this run compresses with {spec}"
    return None
