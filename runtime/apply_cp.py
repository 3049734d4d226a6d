"""Context parallelism: each rank of a cp group holds 1/cp of every sequence's tokens.

The layout is the load-balanced head-tail split for causal masks: the sequence is cut into
``2 cp`` equal chunks and cp rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (Brandon et
al. 2023 "Striped attention" discuss the imbalance; torch's ``context_parallel`` and
torchtitan use this head-tail order, ``_HeadTailLoadBalancer``), so every rank's queries see
the same number of unmasked keys.

Attention runs over the whole sequence by an all-gather of K and V across the cp group
followed by the rank's own queries against the gathered keys -- the all-gather variant Llama 3
trained with (Dubey et al. 2024, Sec. 3.3.2 "Context parallelism"), which is also
``_RotateMethod.ALL_GATHER`` of torch's ``context_parallel``.  The gather is
``torch.distributed._functional_collectives.all_gather_single_autograd`` (its backward
reduce-scatters: each chunk's gradient summed over the ranks that read it goes back to its
owner; ``torch.distributed.nn.functional.all_gather`` is not used because on gloo its
backward scatters from group rank ``i`` as if it were global rank ``i``, which fails in any
cp group that does not start at rank 0), the attention is
torch's own ``F.scaled_dot_product_attention``.  Under a causal mask each of the rank's two
query chunks (chunk ``k`` holds global positions ``[k c, (k + 1) c)``, ``c = S / 2 cp``) attends
to the key prefix ``[0, (k + 1) c)`` with a lower-right-aligned causal mask
(``torch.nn.attention.bias.causal_lower_right``): the rank computes only its causal (query,
key) pairs, half of its S/cp x S block, and no [S/cp, S] mask is built.  On CUDA torch runs
that as its flash kernel (the kernel's own causal flag aligns lower-right when there are more
keys than queries) or its memory-efficient kernel with the lower-right mask type, both skipping
the masked blocks; on the CPU it materialises the chunk's mask.  The simulator prices it as
``TrainingCode.cp_attention`` = "causal_blocks" (simulator/cp_cost.py).

Why not torch's ``context_parallel`` itself: it dispatches the CUDA SDPA kernels (flash,
efficient, cuDNN) through DTensor; on the CPU, SDPA lowers to
``aten._scaled_dot_product_flash_attention_for_cpu``, which has no sharding strategy, so under
gloo it fails with ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered`` (torch 2.13).  Its ``buffers`` argument also shards tensors in place
(``resize_``), which refuses tensors that require grad.

``CPAttention`` is a ``TorchFunctionMode`` active during the forward: it replaces every
``F.scaled_dot_product_attention`` call (HF models reach it through transformers' "sdpa"
attention interface) and every ``torch.arange`` of the local sequence length starting at 0
(the positions a model computes itself, as GPT-2 style models do for their position
embedding) by the rank's global positions.  A model whose forward takes ``position_ids``
(HF) receives them explicitly instead, with an all-ones ``attention_mask`` (``forward_kwargs``),
and its ``arange`` calls are left alone.

Gradients: each rank's loss is the mean over its tokens; every rank holds the same number of
tokens, so the mean of the cp ranks' losses is the loss over the whole sequence, and averaging
the gradients over dp x cp (``RankContext.get_mesh("grad")``: DDP, ``replicate`` or FSDP2 over the flattened
dp x cp mesh, as torchtitan shards) gives the gradient of the global mean.

Pipelines (pp > 1): the batch is sliced before the schedule cuts it into micro-batches (along
the batch dim, so every micro-batch holds the same positions), each stage's forward of a
micro-batch runs under the mode (``apply_pp.build_schedule``'s ``forward_context``: the
schedule's metadata inference on meta tensors runs outside it), and the extra keyword
arguments reach the first stage as positional inputs (``stage_args``).  A stage cut from the
``torch.export`` graph (Hugging Face models) was traced on the rank's tokens with those
arguments, and calls ``aten.scaled_dot_product_attention`` with the mask transformers built
while tracing from the all-ones ``attention_mask``: the mode takes that call too, accepts the
mask when it is the causal mask of the rank's own tokens (``traced_masks``: in the head-tail
order a rank's tokens are in increasing position, so the causal mask among them is the lower
triangle) and attends causally over the gathered keys; any other mask is refused.  Each
stage's cp group is the ranks of its pp (and dp, tp) coordinate: they run the same schedule,
so their gathers meet in the same order.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autopar.core.cp_support import cp_refusal
from autopar.core.errors import PlanFileError, UserError
from autopar.runtime.mesh import RankContext


def check_cp_plan(checked) -> None:
    """Refuse (exit 2) a plan with cp > 1 the model or this runtime cannot run: the model's
    reason (core/cp_support.py), or a combination the runtime does not implement yet.

    Tensor parallelism composes (tests/integration/test_runtime_cp.py, cp 2 x tp 2 with and
    without sequence parallelism): its colwise projections hand SDPA the rank's heads of the
    rank's tokens, the mode gathers those heads' K/V over the cp group (a group of the same tp
    coordinate), and sequence parallelism's shards of the rank's tokens are gathered back over
    tp before attention.  Recompute composes: the rerun in backward enters the same attention
    mode (runtime/recompute.py's ``recompute_context``, set by runtime/parallelize.py).  Pipeline
    parallelism composes (tests/integration/test_runtime_cp.py, cp 2 x pp 2): each stage's
    forward runs under the mode (module docstring)."""
    plan, where = checked.plan, f"plan file {checked.plan_path}"
    reason = cp_refusal(checked.graph, plan.mesh.cp)
    if reason:
        raise PlanFileError(f"{where} has cp = {plan.mesh.cp}, but {checked.model_file.path} cannot take context "
                            f"parallelism: {reason}. Plan with cp = 1 for this model.")


def head_tail_positions(seq: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The global positions of cp rank ``cp_rank``'s tokens: chunks ``cp_rank`` and
    ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks, in that order."""
    assert seq % (2 * cp) == 0, f"sequence {seq} does not split into 2 x cp = {2 * cp} equal chunks"
    c = seq // (2 * cp)
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    tail_chunk = 2 * cp - 1 - cp_rank
    tail = torch.arange(tail_chunk * c, (tail_chunk + 1) * c)
    return torch.cat([head, tail])


def slice_sequence(t: torch.Tensor, positions: torch.Tensor, seq: int, dim: int = 1) -> torch.Tensor:
    """The rank's tokens of ``t`` when its dim ``dim`` is the sequence (length ``seq``); ``t``
    unchanged otherwise (a tensor without the sequence dimension)."""
    if t.dim() <= dim or t.shape[dim] != seq:
        return t
    return t.index_select(dim, positions.to(t.device))


def forward_parameters(model: nn.Module) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return ()


def takes_argument(model: nn.Module, name: str) -> bool:
    return name in forward_parameters(model)


class CPAttention(TorchFunctionMode):
    """During a forward: SDPA over the whole sequence by an all-gather of K/V over the cp group,
    and ``torch.arange(S_local)`` read as the rank's global positions (``positions_from_arange``)."""

    def __init__(self, group, cp: int, cp_rank: int, seq: int, positions_from_arange: bool,
                 traced_masks: bool = False):
        super().__init__()
        self.group, self.cp, self.seq = group, cp, seq
        self.traced_masks = traced_masks
        self.local = seq // cp
        self.positions = head_tail_positions(seq, cp, cp_rank)
        # gathered key index of each global position (the all-gather returns the keys in rank
        # order): the gathered K/V put in sequence order
        self.key_order = torch.argsort(torch.cat([head_tail_positions(seq, cp, r) for r in range(cp)]))
        self.chunk = seq // (2 * cp)
        self.query_chunks = (cp_rank, 2 * cp - 1 - cp_rank)
        # made here, outside the mode's handler, and with the dispatch modes set aside (a fake-tensor
        # mode in the planner's dry run, a counting or profiling mode around a step): a CausalBias
        # is a tensor subclass, and creating one while such a mode is active fails ("Creating a
        # new Tensor subclass CausalBias but the raw Tensor object is already associated ...")
        from torch.nn.attention.bias import causal_lower_right
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            self.chunk_masks = tuple(causal_lower_right(self.chunk, (k + 1) * self.chunk) for k in self.query_chunks)
        self.positions_from_arange = positions_from_arange

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is _ATEN_SDPA:
            return self._attention(*args, **kwargs)
        if func is torch.arange and self.positions_from_arange:
            out = self._positions_for(args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _positions_for(self, args, kwargs):
        """The global positions when the call is ``arange(S_local)`` / ``arange(0, S_local)``."""
        ends = [a for a in args if not isinstance(a, torch.dtype)]
        if "end" in kwargs:
            ends = [kwargs.get("start", 0), kwargs["end"]]
        if kwargs.get("step", 1) != 1 or not ends or len(ends) > 2:
            return None
        start, end = (0, ends[0]) if len(ends) == 1 else ends
        if int(start) != 0 or int(end) != self.local:
            return None
        out = self.positions.to(device=kwargs.get("device"))
        return out.to(kwargs["dtype"]) if kwargs.get("dtype") is not None else out

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        from torch.distributed._functional_collectives import all_gather_single_autograd

        if attn_mask is not None and self.traced_masks and _is_local_causal(attn_mask, self.local):
            attn_mask, is_causal = None, True
        if attn_mask is not None:
            raise UserError(
                "context parallelism supports F.scaled_dot_product_attention with is_causal=True or without a "
                "mask; this model passes an explicit attn_mask (a padding or custom mask), which the head-tail "
                "layout cannot slice; plan with cp = 1 for this model")
        if dropout_p:
            raise UserError("context parallelism with attention dropout is not supported (dropout_p > 0): run the "
                            "model with attention dropout 0, or plan with cp = 1")
        seq_dim = -2
        assert query.shape[seq_dim] == self.local, (query.shape, self.local)
        # K and V travel in one collective: two gathers would each have a backward collective,
        # and nothing orders those two alike on every rank
        kv = torch.cat([key, value], dim=-1).movedim(seq_dim, 0).contiguous()
        gathered = all_gather_single_autograd(kv, 0, self.group).movedim(0, seq_dim)
        keys, values = gathered.split([key.shape[-1], value.shape[-1]], dim=-1)
        if not is_causal:
            return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=enable_gqa)
        return self._causal_blocks(query, keys, values, scale, enable_gqa)

    def _causal_blocks(self, query, keys, values, scale, enable_gqa):
        """Each local query chunk against its causal key prefix (module docstring)."""
        seq_dim = query.dim() - 2
        order = self.key_order.to(query.device)
        keys, values = keys.index_select(seq_dim, order), values.index_select(seq_dim, order)
        if enable_gqa and keys.shape[-3] != query.shape[-3]:
            # the kernels that take a lower-right causal mask do not all take grouped K/V heads:
            # repeat them (what enable_gqa means) before the call
            groups = query.shape[-3] // keys.shape[-3]
            keys, values = keys.repeat_interleave(groups, dim=-3), values.repeat_interleave(groups, dim=-3)
        c = self.chunk
        outs = []
        for part, k, mask in zip(query.split(c, dim=seq_dim), self.query_chunks, self.chunk_masks):
            end = (k + 1) * c
            outs.append(F.scaled_dot_product_attention(
                part, keys.narrow(seq_dim, 0, end), values.narrow(seq_dim, 0, end), attn_mask=mask, scale=scale))
        return torch.cat(outs, dim=seq_dim)


class ContextParallel:
    """What train_step needs per rank: the slicing of a batch and the forward's mode."""

    def __init__(self, ctx: RankContext, cp: int, seq: int, model: nn.Module):
        self.cp, self.seq = cp, seq
        self.rank = ctx.coords["cp"]
        self.group = ctx.get_mesh("cp").get_group()
        self.positions = head_tail_positions(seq, cp, self.rank)
        self.pass_position_ids = takes_argument(model, "position_ids")
        self.pass_attention_mask = takes_argument(model, "attention_mask")
        self.forward_params = forward_parameters(model)
        # pipeline stages cut from the torch.export graph: SDPA receives the traced causal mask
        self.traced_masks = False
        # under a pipeline: whether a stage forward ran yet (``rerun_mode``); None without one
        self.stage_forward_ran: bool | None = None

    def slice(self, t: torch.Tensor) -> torch.Tensor:
        return slice_sequence(t, self.positions, self.seq)

    def forward_kwargs(self, inputs: tuple, device: torch.device) -> dict:
        """``position_ids`` (the global positions) for a forward that takes them, and with them an
        all-ones ``attention_mask`` (no padding) where the forward takes one: transformers reads
        position ids that do not step by 1 without a mask as packed sequences
        (``masking_utils.find_packed_sequence_indices``) and would mask across the head-tail
        chunks; with a mask of ones and no padding it calls SDPA with ``is_causal=True``."""
        if not self.pass_position_ids:
            return {}
        out = {"position_ids": self.positions.to(device)[None, :]}
        if self.pass_attention_mask and inputs:
            out["attention_mask"] = torch.ones(inputs[0].shape[0], len(self.positions), dtype=torch.long,
                                               device=device)
        return out

    def mode(self) -> CPAttention:
        return CPAttention(self.group, self.cp, self.rank, self.seq, positions_from_arange=not self.pass_position_ids,
                           traced_masks=self.traced_masks)

    def stage_forward(self) -> CPAttention:
        """The mode around a pipeline stage's forward of a micro-batch (``apply_pp.forward_with``)."""
        self.stage_forward_ran = True
        return self.mode()

    def rerun_mode(self) -> contextlib.AbstractContextManager:
        """What a recomputed layer's rerun in backward enters: the mode, as its forward did --
        except under a pipeline before the first stage forward: at its first step torch's
        ``PipelineStage`` infers the stages' shapes by a forward outside the mode (on tensors
        without values, ``stage.py``'s ``_forward_metadata_inference``) and a backward through
        it, which reruns the recomputed layers; that rerun must stay outside the mode too."""
        if self.stage_forward_ran is False:
            return contextlib.nullcontext()
        return self.mode()

    def stage_args(self, inputs: tuple, device: torch.device) -> tuple:
        """The positional inputs of a pipeline's first stage: ``inputs`` (already sliced), then
        ``forward_kwargs`` in the places the forward's signature gives them -- a stage is called
        with positional arguments only, and the schedule cuts each of them into micro-batches
        along dim 0, so the position ids are given a row per sample."""
        extra = self.forward_kwargs(inputs, device)
        if not extra:
            return tuple(inputs)
        rows = inputs[0].shape[0]
        extra = {k: (v.expand(rows, -1).contiguous() if k == "position_ids" else v) for k, v in extra.items()}
        names = list(self.forward_params)
        places = [names.index(k) for k in extra]
        if len(inputs) > len(names) or sorted(places) != list(range(len(inputs), len(inputs) + len(extra))):
            raise PlanFileError(
                f"context parallelism with pipeline parallelism passes {', '.join(extra)} to the first stage as "
                f"positional inputs after the model's {len(inputs)} input(s), but the forward's parameters are "
                f"({', '.join(names)}): they do not follow the inputs there. Plan with pp = 1 or cp = 1 for this "
                f"model.")
        return tuple(inputs) + tuple(extra[names[i]] for i in sorted(places))


_ATEN_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _is_local_causal(mask: torch.Tensor, local: int) -> bool:
    """Whether ``mask`` (bool: True attends; float: 0 attends) is the causal mask of ``local``
    tokens in increasing position, broadcast over batch and heads.  Under FakeTensorMode (the
    dry run of a large model) the values are unknown: its shape is all that is checked."""
    from torch._subclasses.fake_tensor import FakeTensor

    if mask.shape[-2:] != (local, local):
        return False
    if isinstance(mask, FakeTensor) or mask.device.type == "meta":
        return True
    attend = mask if mask.dtype == torch.bool else mask == 0
    idx = torch.arange(local, device=mask.device)
    return bool(torch.equal(attend, (idx[None, :] <= idx[:, None]).expand_as(attend)))
