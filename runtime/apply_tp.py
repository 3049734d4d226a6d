"""Tensor (and sequence) parallelism through DTensor's ``parallelize_module``.

The plan gives, per layer, ``{module FQN: "colwise" | "rowwise"}`` (Megatron-LM's column /
row split of a Linear's weight; Shoeybi et al. 2019, Sec. 3).  FQNs are the model's own names
("blocks.0.attn.qkv"); a name relative to its layer ("attn.qkv" in layer "blocks.0") is
accepted too.

Pairing: a column-wise module whose parent also holds a row-wise module (attn.qkv -> attn.proj,
mlp.fc -> mlp.proj) keeps its output sharded on the feature dim, so the pair costs one
all-reduce.  A column-wise module without such a partner (e.g. the LM head) gathers its output
(``output_layouts=Replicate()``); a row-wise module without a column-wise partner shards its
replicated input itself (``input_layouts=Replicate()``).

A module given the style "colwise:<k>" is a fused projection whose output the model cuts into k
equal parts (GPT-2's ``c_attn``: q | k | v): it is split per part (``fused_tp.PartsColwise``:
each rank holds its share of every part), and the parent's part width attributes
(``split_size`` ...) are divided by tp with its head counts.

A module given the style "expert" (a mixture of experts' stacked experts) is split by expert
(``expert_tp.ExpertShard``): each rank runs experts / tp of them and the outputs are summed.

Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) applies to the layers that hold a
column/row pair: between the TP regions the activations are sharded on the sequence dim
(``Shard(1)``): norms run under ``SequenceParallel``, the sequence is all-gathered on entry to
each column-wise module's parent (the attention or MLP module, whose forward may read the
sequence length from its input; the column-wise module itself where the parent runs an unsplit
module of its own on that input, as a LoRA wrapper runs its frozen base layer) and each
row-wise module reduce-scatters back into it
(``output_layouts=Shard(1)``).  At the edges of a run of such layers the activation is cut
(``Replicate -> Shard(1)``, no communication) on entry and all-gathered on exit, so the layers
outside the run, and pipeline stage boundaries, see ordinary full tensors.

Gradients keep their parameter's sharding.  DTensor's backward of an embedding lookup has no
vocab-sharded (row-wise) strategy: with the indices and the incoming gradient replicated it
computes the weight gradient ``Replicate()``, the full ``[vocab, hidden]`` on every tp rank
(``embedding_dense_backward`` in torch/distributed/tensor/_ops/_embedding_ops.py).  Megatron-LM's
vocab-parallel embedding keeps only this rank's ``vocab / tp`` rows of it (Shoeybi et al. 2019,
Sec. 3), and so does FSDP2 when it wraps the TP parameters (it redistributes each gradient to
the parameter's TP placements before reducing).  Without FSDP2 a hook after accumulation
(``keep_embedding_grads_sharded``) brings such a gradient to its parameter's placements
(``Replicate -> Shard``: a local slice, no communication) and keeps only the slice, so the
full gradient lives only during the embedding's backward, not until the step.

Frozen parameters (``requires_grad=False``: a LoRA model's base weights, embedding and head)
stay frozen under every style: they are split like the others, get no gradient and no hook.
"""
from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from autopar.core.errors import PlanFileError
from autopar.core.plan import tp_style_parts
from autopar.runtime.expert_tp import EXPERT_STYLE, ExpertShard, is_stacked_experts
from autopar.runtime.fused_tp import PartsColwise, is_parts_split

SEQ_DIM = 1      # activations are [batch, seq, hidden]
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


def resolve_tp_styles(module: nn.Module, layer_name: str, styles: dict[str, str], where: str) -> dict[str, str]:
    """Plan FQNs -> FQNs inside ``module``, checked to name an ``nn.Linear`` or ``nn.Embedding``
    (or, for the "expert" style, a stacked-experts module: runtime/expert_tp.py)."""
    names = dict(module.named_modules())
    out = {}
    for fqn, style in styles.items():
        target = fqn if fqn in names else f"{layer_name}.{fqn}" if f"{layer_name}.{fqn}" in names else None
        if target is None:
            raise PlanFileError(f"{where}: tp names module {fqn!r}, which the model does not have. "
                                f"Use module names from 'autopar inspect' (e.g. {layer_name}.attn.qkv).")
        if style == EXPERT_STYLE:
            if not is_stacked_experts(names[target]):
                raise PlanFileError(f"{where}: tp splits module {fqn!r} by expert, but it is a "
                                    f"{type(names[target]).__name__}, not a module of stacked expert parameters "
                                    f"(transformers 5's *Experts with num_experts rows each). Split it colwise / "
                                    f"rowwise, or leave it out of tp.")
        elif not isinstance(names[target], (nn.Linear, nn.Embedding)) and not is_conv1d(names[target]):
            raise PlanFileError(f"{where}: tp module {fqn!r} is a {type(names[target]).__name__}; only "
                                f"nn.Linear, transformers' Conv1D and nn.Embedding can be split column- or "
                                f"row-wise.")
        out[target] = style
    return out


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, layer_styles: list[tuple[str, dict[str, str]]],
             sequence_parallel: bool) -> None:
    """Parallelise ``module`` (the whole model or one pipeline stage) over ``tp_mesh``.

    ``layer_styles``: for each layer held by ``module``, in forward order, (the layer's module
    path or "" for layers that are not one module, its resolved {FQN: style}).
    """
    if tp_mesh.size() == 1:
        return
    plan: dict[str, object] = {}
    matmul = {f for _, styles in layer_styles for f in styles if _is_matmul(module.get_submodule(f))}
    sp_layers = [sequence_parallel and _has_pair(styles, matmul) and bool(path) for path, styles in layer_styles]
    for (path, styles), sp in zip(layer_styles, sp_layers):
        if sp:
            _check_sequence_parallel_params(module, path, styles)
        # a pair is a column- and a row-wise Linear (or Conv1D) under one parent; a row-wise
        # embedding is a vocabulary-parallel lookup, never the second half of a pair
        parents_with_row = {_parent(f) for f, s in styles.items() if s == "rowwise" and f in matmul}
        parents_with_col = {_parent(f) for f, s in styles.items() if _base(s) == "colwise" and f in matmul}
        for fqn, style in styles.items():
            if style == EXPERT_STYLE:
                # tokens and routing are replicated over tp (also under SP: the layer's
                # router is then a loose parameter and _check_sequence_parallel_params refuses it)
                plan[fqn] = ExpertShard()
                continue
            paired = fqn in matmul and _parent(fqn) in (parents_with_row if _base(style) == "colwise"
                                                        else parents_with_col)
            # the sequence is all-gathered where the TP region starts: at the colwise module's
            # parent (attn, mlp), whose forward may read the sequence length from its input --
            # unless the parent also runs modules of its own on that input (a LoRA wrapper's
            # base layer beside its split adapters): those stay on the sequence shard, and the
            # colwise module gathers the sequence itself
            gather_at_parent = sp and _base(style) == "colwise" and _parent(fqn) not in ("", path) \
                and not _runs_unsplit(module.get_submodule(_parent(fqn)), _parent(fqn), styles)
            plan[fqn] = _style(style, paired, sp and not gather_at_parent, sp,
                               conv1d=is_conv1d(module.get_submodule(fqn)))
            if gather_at_parent:
                plan[_parent(fqn)] = _gather_sequence(module.get_submodule(_parent(fqn)))
        head_norms = _region_norms(module, path, styles, parents_with_row & parents_with_col)
        for fqn in head_norms:
            # a per-head norm inside the TP region (Qwen3's q_norm over [.., heads, head_dim])
            # sees this rank's heads: its replicated weight's gradient is summed over the tp
            # ranks (SequenceParallel on the heads dim: Replicate weight, Partial -> Replicate grad)
            plan[fqn] = SequenceParallel(sequence_dim=-2, use_local_output=True)
        if sp:
            for name, sub in module.get_submodule(path).named_modules():
                if _is_norm(sub) and f"{path}.{name}" not in head_norms:
                    plan[f"{path}.{name}"] = SequenceParallel(use_local_output=True)
    # enter / leave each run of sequence-parallel layers with full activations
    for i, ((path, _), sp) in enumerate(zip(layer_styles, sp_layers)):
        if not sp:
            continue
        first = i == 0 or not sp_layers[i - 1]
        last = i == len(sp_layers) - 1 or not sp_layers[i + 1]
        enter = dict(input_layouts=(Replicate(),), desired_input_layouts=(Shard(SEQ_DIM),), use_local_input=True)
        leave = dict(output_layouts=(Shard(SEQ_DIM),), desired_output_layouts=(Replicate(),), use_local_output=True)
        if first and last:
            plan[path] = PrepareModuleInputOutput(**enter, **leave)
        elif first:
            enter["use_local_output"] = enter.pop("use_local_input")
            plan[path] = PrepareModuleInput(**enter)
        elif last:
            plan[path] = PrepareModuleOutput(**leave)
    # torch's SequenceParallel re-registers a norm's parameters as trainable whatever they were:
    # each parameter keeps the model file's requires_grad (a frozen one stays frozen)
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    for fqn, style in plan.items():
        parallelize_module(module.get_submodule(fqn), tp_mesh, style)
    for name, p in module.named_parameters(remove_duplicate=False):
        if name in frozen:
            p.requires_grad_(False)
    _divide_head_counts(module, plan, tp_mesh.size())


def _region_norms(module: nn.Module, path: str, styles: dict[str, str], parents: set[str]) -> list[str]:
    """The norms inside each column/row pair's parent module (the attention, say), which run on
    this rank's heads; any other trained parameter there that no split covers is refused: it
    would be replicated while each rank's gradient covers only its own heads (a frozen one has
    no gradient and stays as it is on every rank)."""
    norms = []
    for parent in sorted(p for p in parents if p not in ("", path)):
        covered = set()
        for name, sub in module.get_submodule(parent).named_modules():
            fqn = f"{parent}.{name}" if name else parent
            if fqn in styles:
                covered.update(id(p) for p in sub.parameters())
            elif name and _is_norm(sub):
                norms.append(fqn)
                covered.update(id(p) for p in sub.parameters())
        loose = [f"{parent}.{n}" for n, p in module.get_submodule(parent).named_parameters()
                 if id(p) not in covered and p.requires_grad]
        if loose:
            raise PlanFileError(
                f"tensor parallelism: {parent} splits its projections over the tp ranks but also holds "
                f"{', '.join(loose[:3])}, which no split covers; each rank would train it on its own heads only. "
                f"Leave {parent} unsplit (plan tp without its column/row pair).")
    return norms


def _check_sequence_parallel_params(module: nn.Module, path: str, styles: dict[str, str]) -> None:
    """Under sequence parallelism a layer's activations between its TP regions are sequence
    shards, so a replicated parameter used there (other than a norm's, which ``SequenceParallel``
    sums over the tp ranks) would get the gradient of this rank's tokens only and the replicas
    would drift apart -- a mixture of experts' router (transformers 5 Mixtral's, and its
    stacked experts unless split by expert) is such a parameter.  Refuse the layout instead of training another model.
    A frozen parameter (``requires_grad=False``) gets no gradient and cannot drift."""
    layer = module.get_submodule(path)
    covered = set()
    for name, sub in layer.named_modules():
        fqn = f"{path}.{name}" if name else path
        if fqn in styles or _is_norm(sub):
            covered.update(id(p) for p in sub.parameters())
    loose = [f"{path}.{n}" for n, p in layer.named_parameters() if id(p) not in covered and p.requires_grad]
    if loose:
        raise PlanFileError(
            f"sequence parallelism: layer {path} holds parameters that neither a tp split nor a norm covers "
            f"({', '.join(loose[:3])}{', ...' if len(loose) > 3 else ''}); on a sequence shard their gradients "
            f"would cover one rank's tokens only. Plan sequence_parallel false for this model, or split those "
            f"modules too.")


def keep_embedding_grads_sharded(module: nn.Module) -> None:
    """Hook every trained row-wise (vocab-sharded) embedding weight of ``module``, and every
    trained replicated bias of a fused projection split per part, so its gradient keeps the
    parameter's placements; a frozen one (``requires_grad=False``) has no gradient and no hook.
    Call it on the materialised module (``to_empty`` swaps the parameter tensors, and their
    hooks with them), and only without FSDP2, which does the same itself."""
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if isinstance(sub, nn.Embedding) and isinstance(weight, DTensor) and Shard(0) in weight.placements \
                and weight.requires_grad:
            weight.register_post_accumulate_grad_hook(_shard_grad_like_param)
        bias = getattr(sub, "bias", None)
        if is_parts_split(sub) and isinstance(bias, DTensor) and bias.requires_grad:
            # a fused projection's replicated bias: its gradient arrives Partial (runtime/fused_tp.py)
            bias.register_post_accumulate_grad_hook(_shard_grad_like_param)


def _shard_grad_like_param(param: nn.Parameter) -> None:
    """Bring ``param.grad`` to ``param``'s placements, holding only this rank's part."""
    grad = param.grad
    if not isinstance(grad, DTensor) or not isinstance(param, DTensor) or grad.placements == param.placements:
        return
    sharded = grad.redistribute(param.device_mesh, param.placements)
    local = sharded.to_local()
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        # the slice is a view that would keep the full gradient's storage alive
        sharded = DTensor.from_local(local.clone(), param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
    param.grad = sharded


class GatherSequence(ParallelStyle):
    """All-gather the sequence dim of a module's activation input on entry, whether the caller
    passes it positionally (``attn(x)``) or by keyword (``self_attn(hidden_states=x, ...)``,
    as Hugging Face layers do): the first positional argument, else the keyword named by the
    forward's first parameter.  ``PrepareModuleInput`` needs the positional count fixed."""

    def __init__(self, keyword: str | None):
        super().__init__()
        self.keyword = keyword

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, device_mesh, (Shard(SEQ_DIM),), run_check=False) \
                    .redistribute(device_mesh, (Replicate(),)).to_local()
            return x

        def hook(_module, args, kwargs):
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if self.keyword in kwargs:
                return args, {**kwargs, self.keyword: gather(kwargs[self.keyword])}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _runs_unsplit(parent: nn.Module, path: str, styles: dict[str, str]) -> bool:
    """``parent`` holds a parameterised module that no split covers and that is not a norm
    (PEFT's ``LoraLayer``: the frozen ``base_layer`` beside ``lora_A`` / ``lora_B``)."""
    for name, sub in parent.named_children():
        fqn = f"{path}.{name}"
        if fqn not in styles and not _is_norm(sub) and any(True for _ in sub.parameters()) \
                and not any(s == fqn or s.startswith(f"{fqn}.") for s in styles):
            return True
    return False


def _gather_sequence(parent: nn.Module) -> GatherSequence:
    """All-gather the activation input's sequence dim on entry to ``parent``."""
    positional = [name for name, p in inspect.signature(parent.forward).parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return GatherSequence(positional[0] if positional else None)


def _is_norm(module: nn.Module) -> bool:
    """torch's LayerNorm / RMSNorm, or a model's own per-token norm (Hugging Face's
    ``LlamaRMSNorm``, ``T5LayerNorm``: a class named ``*Norm`` holding only a 1-D weight and
    bias): under sequence parallelism it runs on the local tokens with a replicated weight
    whose gradient is summed over the tp ranks (``SequenceParallel``)."""
    if isinstance(module, _NORM_TYPES):
        return True
    params = list(module.parameters(recurse=False))
    return (type(module).__name__.endswith("Norm") and not list(module.children()) and bool(params)
            and all(p.dim() == 1 for p in params))


def _base(style: str) -> str:
    return tp_style_parts(style)[0]


def _style(style: str, paired: bool, sp_input: bool, sp_output: bool | None = None, conv1d: bool = False):
    sp_output = sp_input if sp_output is None else sp_output
    style, parts = tp_style_parts(style)
    if parts > 1:            # a fused projection, split per part (runtime/fused_tp.py)
        return PartsColwise(parts, 1 if conv1d else 0, input_layouts=Shard(SEQ_DIM) if sp_input else Replicate(),
                            output_layouts=Shard(-1) if paired else Replicate())
    if style == "colwise":
        cls = Conv1DColwise if conv1d else ColwiseParallel
        return cls(input_layouts=Shard(SEQ_DIM) if sp_input else Replicate(),
                   output_layouts=Shard(-1) if paired else Replicate())
    cls = Conv1DRowwise if conv1d else RowwiseParallel
    return cls(input_layouts=Shard(-1) if paired else Replicate(),
               output_layouts=Shard(SEQ_DIM) if sp_output else Replicate())


def is_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): ``y = addmm(bias, x, W)``
    with ``W`` of shape ``[in, out]`` -- a Linear with its weight transposed.  Recognised by
    name and shape so that the runtime needs no ``transformers`` import."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and getattr(module, "nf", None) == weight.shape[1])


def _is_matmul(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _distribute_conv1d(module: nn.Module, device_mesh: DeviceMesh, weight: Placement, bias: Placement,
                       src_data_rank) -> None:
    for name, placement in (("weight", weight), ("bias", bias)):
        param = getattr(module, name, None)
        if param is not None:
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=src_data_rank),
                requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """Column split of a ``Conv1D``: its weight is ``[in, out]``, so the output features are dim 1
    (and the bias's dim 0); input and output layouts as ``ColwiseParallel``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            lambda _n, m, mesh: _distribute_conv1d(m, mesh, Shard(1), Shard(0), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """Row split of a ``Conv1D``: weight ``[in, out]`` sharded on dim 0 (the input features),
    bias replicated (added once to the reduced sum); layouts as ``RowwiseParallel``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda _n, m, mesh: _distribute_conv1d(m, mesh, Shard(0), Replicate(), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _has_pair(styles: dict[str, str], matmul: set[str]) -> bool:
    kinds = {s for f, s in styles.items() if f in matmul}
    return kinds == {"colwise", "rowwise"}


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


# Attributes that hold a head count which the forward uses to reshape; with the heads split
# over tp ranks each rank runs heads / tp of them (torchtitan adjusts the same way).
_HEAD_COUNT_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads",
                     "num_key_value_heads", "heads")


# Attributes of a fused projection's parent that hold the width of one part, which the forward
# cuts the fused output with (GPT-2: ``c_attn(x).split(self.split_size, dim=2)``): each rank's
# parts are 1/tp as wide.  Divided only where equal to the part width.
_PART_WIDTH_ATTRS = ("split_size", "embed_dim", "n_embd", "hidden_size", "all_head_size")


def _divide_head_counts(module: nn.Module, plan: dict, tp: int) -> None:
    parents = {_parent(f) for f, s in plan.items() if isinstance(s, ColwiseParallel)}
    widths = {(_parent(f), module.get_submodule(f).weight.shape[s.dim] // s.parts)
              for f, s in plan.items() if isinstance(s, PartsColwise)}
    for p, width in widths:
        owner = module.get_submodule(p)
        for attr in _PART_WIDTH_ATTRS:
            value = owner.__dict__.get(attr)
            if value == width and not isinstance(value, bool):
                setattr(owner, attr, width // tp)
    for p in parents:
        owner = module.get_submodule(p)
        _divide_config_heads(owner, p, tp)
        for attr in _HEAD_COUNT_ATTRS:
            value = owner.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp:
                    raise PlanFileError(f"{p}.{attr} = {value} heads do not divide over tp = {tp} ranks; "
                                        f"plan a tp degree that divides the head count.")
                setattr(owner, attr, value // tp)


# The config attributes a Hugging Face attention reads its head counts from in its forward
# (Phi-3: ``query_pos = self.config.num_attention_heads * self.head_dim``).
_CONFIG_HEAD_ATTRS = ("num_attention_heads", "num_key_value_heads")


def _divide_config_heads(owner: nn.Module, path: str, tp: int) -> None:
    """Give a split module that holds the model's config (``owner.config``, shared by every
    module) its own copy with the head counts divided by tp, as its head count attributes are:
    a forward that reads them from the config then cuts this rank's heads.  Other modules
    keep the shared config."""
    import copy

    config = owner.__dict__.get("config")
    if config is None or not any(isinstance(getattr(config, a, None), int) for a in _CONFIG_HEAD_ATTRS):
        return
    own = copy.copy(config)
    for attr in _CONFIG_HEAD_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % tp:
                raise PlanFileError(f"{path}.config.{attr} = {value} heads do not divide over tp = {tp} ranks; "
                                    f"plan a tp degree that divides the head count.")
            setattr(own, attr, value // tp)
    owner.config = own
