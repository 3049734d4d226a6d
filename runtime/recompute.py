"""Activation recompute per layer through the checkpoint wrappers.

* ``full``: ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``) around the
  layer's module: only the layer input is kept and its forward reruns inside backward
  (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").
* ``selective``: the same wrapper with a ``context_fn`` from
  ``create_selective_checkpoint_contexts``: the outputs of the matmul-class ops (mm, addmm,
  bmm, baddbmm, scaled-dot-product attention) are saved, every other op (norms, activations,
  softmax, dropout, elementwise) is recomputed -- the op-level policy of torchtitan, close to
  Korthikanti et al. 2022 Sec. 5 (keep the expensive, recompute the cheap).

  The layer's communication is saved too (``SAVED_COLLECTIVE_OPS``), so the rerun in backward
  issues no collective the forward issued: tensor parallelism's functional all-reduce,
  reduce-scatter and all-gather (what DTensor's redistribution dispatches), expert
  parallelism's row all-to-alls (``_c10d_functional.all_to_all_single``) and its in-place
  all-to-all of the counts per expert (``c10d.alltoall_base_``, ``_InPlaceReplay``: the
  cached op writes nothing into its output buffer, so the rerun is handed the forward's
  counts).  torchtitan's op-level policy saves its reduce-scatter and all-to-all outputs for
  the same reason (pytorch/torchtitan b5bcd76, 2026-08,
  ``torchtitan/distributed/activation_checkpoint.py`` ``_get_default_save_ops``).
  ``wait_tensor`` is left to rerun: on a tensor whose collective already completed it waits
  for nothing.  Two kinds of collectives do rerun:
  those on the ``rerun_groups`` the caller names -- context parallelism's K/V all-gather
  (runtime/apply_cp.py): saving it would keep every layer's gathered K/V (cp times the
  local K/V) from forward to backward, the memory context parallelism exists to cut, where
  the rerun costs one all-gather per attention in backward (priced:
  simulator/layer_cost.py ``_TensorParallelComm.selective_fwd_s``) -- and FSDP2's in-place
  parameter all-gathers inside a layer (a nested FSDP unit: expert parallelism's experts),
  which write into FSDP's own buffers, freed after the forward.

A layer made of several top-level modules (the "pre" and "post" layers) wraps each of them.

``recompute_context``: a context manager factory entered around each recomputation (the
checkpoint's ``context_fn`` pair: forward context, recompute context).  Context parallelism
passes its attention mode (runtime/apply_cp.py): the forward runs under it, and the rerun in
backward must too, or it would attend over the rank's own tokens only.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, Iterable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


# Profiler annotations run as they are called, in the forward and in the rerun, uncached and
# uncounted: a selective checkpoint otherwise refuses a rerun whose op sequence differs from the
# forward's, and FSDP2 annotates a rerun that the forward did not -- a unit nested in the layer
# (expert parallelism's experts) enters its ``_root_pre_forward`` in backward, the forward's root
# having cleared ``iter_forward_root``, under ``record_function("FSDP::root_pre_forward")``
# (torch 2.13; ep 2 with selective recompute of the zoo's moe_aux, moe_grouped and deepseek_moe
# failed on it).  SAC_IGNORED_OPS is torch.utils.checkpoint's own set of such ops.
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})

_funcol = torch.ops._c10d_functional
#: functional collectives whose outputs a selective recompute saves (module docstring)
SAVED_COLLECTIVE_OPS = {
    _funcol.all_reduce.default, _funcol.reduce_scatter_tensor.default, _funcol.all_gather_into_tensor.default,
    _funcol.all_to_all_single.default,
}
#: in-place collectives saved and replayed (``_InPlaceReplay``): each writes into its first argument
REPLAYED_COLLECTIVES = {torch.ops.c10d.alltoall_base_.default}


def _group_name(op, args, kwargs):
    """The ``group_name`` argument of a functional collective (its schema names it)."""
    if "group_name" in kwargs:
        return kwargs["group_name"]
    names = [a.name for a in op._schema.arguments]
    i = names.index("group_name")
    return args[i] if i < len(args) else None


class _InPlaceReplay:
    """An in-place collective saved by the selective policy returns its cached ``Work`` in the
    rerun without writing into the output buffer the rerun passes it: ``record`` keeps (by
    reference) the buffer the forward's op filled, and ``mode`` wraps the checkpoint's recompute
    mode with one that copies it into the rerun's buffer after the cached op."""

    def __init__(self):
        self.filled: list[torch.Tensor] = []

    def record(self, args) -> None:
        self.filled.append(args[0])

    def mode(self, cached: TorchDispatchMode) -> TorchDispatchMode:
        return _RecomputeWithReplay(cached, self)


class _RecomputeWithReplay(TorchDispatchMode):
    """The checkpoint's recompute mode ``cached``, and inside it -- where the forward recorded an
    in-place collective -- the copy of what that collective wrote (``_InPlaceReplay``).  One
    ``TorchDispatchMode``, as ``torch.compile`` requires of a checkpoint's recompute context."""

    def __init__(self, cached: TorchDispatchMode, replay: _InPlaceReplay):
        super().__init__()
        self.cached, self.replay, self.active = cached, replay, False

    def __enter__(self):
        self.cached.__enter__()
        # entered in backward, after the forward recorded what it replays
        self.active = bool(self.replay.filled)
        if self.active:
            super().__enter__()
        return self

    def __exit__(self, *exc):
        if self.active:
            super().__exit__(*exc)
        return self.cached.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in REPLAYED_COLLECTIVES:
            with _disable_current_modes(), torch.no_grad():
                args[0].copy_(self.replay.filled.pop(0))
        return out


def _selective_policy(rerun_groups: frozenset, replay: _InPlaceReplay, ctx, op, *args, **kwargs):
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    if op in SAVED_COLLECTIVE_OPS:
        if _group_name(op, args, kwargs) in rerun_groups:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    if op in REPLAYED_COLLECTIVES:
        replay.record(args)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context(rerun_groups: frozenset = frozenset()):
    replay = _InPlaceReplay()
    fwd, rec = create_selective_checkpoint_contexts(functools.partial(_selective_policy, rerun_groups, replay))
    return fwd, replay.mode(rec)


def _with_recompute_context(context_fn: Callable | None, extra: Callable[[], ContextManager]) -> Callable:
    """A ``context_fn`` whose recompute context also enters ``extra()``."""
    def both():
        fwd, rec = context_fn() if context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext())

        @contextlib.contextmanager
        def recompute():
            # extra() first, as in the forward (the caller's mode outside the checkpoint's): its
            # own set-up ops must not run under selective recompute's replay, which refuses
            # ops the forward did not record
            with extra(), rec:
                yield
        return fwd, recompute()
    return both


def wrap_for_recompute(child: nn.Module, mode: str,
                       recompute_context: Callable[[], ContextManager] | None = None,
                       rerun_groups: Iterable[str] = ()) -> nn.Module:
    """``rerun_groups``: names of process groups whose functional collectives a selective
    recompute reruns rather than saves (module docstring)."""
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode {mode!r}")
    context_fn = None
    if mode == "selective":
        groups = frozenset(rerun_groups)
        context_fn = _selective_context if not groups else (lambda: _selective_context(groups))
    if recompute_context is not None:
        context_fn = _with_recompute_context(context_fn, recompute_context)
    if context_fn is None:
        return checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)
    return checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True,
                              context_fn=context_fn)


def apply_recompute(module: nn.Module, layer_modules: list[tuple[list[str], str]],
                    recompute_context: Callable[[], ContextManager] | None = None,
                    rerun_groups: Iterable[str] = ()) -> None:
    """Wrap, inside ``module``, each listed module path with its layer's recompute mode.

    ``layer_modules``: (module paths of one layer present in ``module``, "none"|"selective"|"full").
    ``rerun_groups``: as ``wrap_for_recompute``.
    """
    rerun_groups = frozenset(rerun_groups)
    for paths, mode in layer_modules:
        if mode == "none":
            continue
        for path in paths:
            parent_path, _, child_name = path.rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            setattr(parent, child_name, wrap_for_recompute(getattr(parent, child_name), mode, recompute_context,
                                                           rerun_groups))
