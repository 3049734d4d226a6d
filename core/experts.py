"""Recognition of a model's routed experts: where they are, in which form, how many.

Expert parallelism (runtime/apply_ep.py) hands each of ``ep`` ranks ``E / ep`` of a layer's
``E`` experts and sends every token to the rank holding its expert.  It must know where a
layer's experts are called and with what, so it recognises two forms, both called with the
tokens of one rank after the router has chosen (a top-k router: a module whose 2-D ``weight``
has ``E`` rows, a ``nn.Linear(hidden, E)`` or transformers' ``*TopKRouter``):

- ``stacked``: one module holding every expert's weights as stacked 3-D parameters ``[E, ...]``
  and called as ``experts(hidden_states [T, h], top_k_index [T, k], top_k_weights [T, k])``,
  returning the weighted sum of each token's experts -- transformers 5's experts modules
  (``MixtralExperts``, ``Qwen2MoeExperts``, ``DeepseekV3NaiveMoe``, decorated with
  ``use_experts_implementation``) and the test zoo's ``moe`` / ``moe_aux``.  The rule
  (``is_stacked_experts``) is also tensor parallelism's (runtime/expert_tp.py): one rule decides
  both.
- ``list``: an ``nn.ModuleList`` of ``E >= 2`` experts with identical parameter names and
  shapes, next to the router inside the module whose forward routes (the "MoE block") -- the
  layout of Mixtral, Qwen2-MoE and DeepSeek-V3 before transformers 5 (and of their original
  code), one ``expert(x_rows)`` call per expert.  The block's forward is the model's own code,
  so the runtime leaves it as it is and exchanges the rows it hands each expert.

A module that routes inside itself and reads its experts' weights itself (gathering rows of a
parameter by the chosen index in the same forward) is neither: its forward gives no point at
which the tokens of one expert are known and not yet computed, so it is not recognised (the same
limit as tensor parallelism's, core/sharding.stacked_experts).

- ``grouped``: torchtitan's ``GroupedExperts``: stacked 3-D parameters ``[E, ...]`` (children
  without parameters) called as ``experts(x_sorted_by_expert, num_tokens_per_expert)`` -- its
  caller sorts the tokens by expert (forward arguments ``x, num_tokens_per_expert``); the test
  zoo's ``moe_grouped``.  ``E`` is the parameters' dim 0; a router beside it is required.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

STACKED, LIST, GROUPED = "stacked", "list", "grouped"


def is_stacked_experts(module: nn.Module) -> bool:
    """A transformers-5-style experts module with stacked ``[experts, ...]`` parameters: an
    integer ``num_experts`` = E, its own parameters all 3-D with E rows (dim 0), children
    holding no parameters, and transformers' ``_is_expert_parallel`` flag (set by its
    ``use_experts_implementation`` decorator; with it on, an expert index ``>= num_experts``
    adds nothing, which tensor parallelism relies on: runtime/expert_tp.py)."""
    experts = module.__dict__.get("num_experts")
    params = list(module.parameters(recurse=False))
    return (isinstance(experts, int) and not isinstance(experts, bool) and experts > 0 and bool(params)
            and all(p.dim() == 3 and p.shape[0] == experts for p in params)
            and not any(True for c in module.children() for _ in c.parameters())
            and "_is_expert_parallel" in module.__dict__)


@dataclass(frozen=True)
class ExpertSite:
    """One layer's routed experts.

    ``path``: the experts module (``stacked``) or the ``nn.ModuleList`` (``list``);
    ``block``: the module whose forward routes and calls them (the experts' parent);
    ``router``: the router's path inside the model, or "" when none was found next to them.
    """
    path: str
    form: str
    num_experts: int
    block: str
    router: str


def _router_of(block: nn.Module, block_path: str, experts: int, skip: str) -> str:
    """The path of a child of ``block`` (other than ``skip``) whose own 2-D ``weight`` has
    ``experts`` rows: ``nn.Linear(hidden, E)`` or a top-k router module."""
    for name, mod in block.named_children():
        if name == skip:
            continue
        w = mod._parameters.get("weight")
        if w is not None and w.dim() == 2 and w.shape[0] == experts:
            return f"{block_path}.{name}" if block_path else name
    return ""


def grouped_experts(module: nn.Module) -> int:
    """E for a torchtitan-style ``GroupedExperts`` module (see above), else 0."""
    import inspect

    params = list(module.parameters(recurse=False))
    if not params or any(p.dim() != 3 or p.shape[0] != params[0].shape[0] for p in params):
        return 0
    if any(True for c in module.children() for _ in c.parameters()):
        return 0
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return 0
    return int(params[0].shape[0]) if names[:2] == ["x", "num_tokens_per_expert"] else 0


def _same_layout(mods: list[nn.Module]) -> bool:
    shapes = [[(n, tuple(p.shape)) for n, p in m.named_parameters()] for m in mods]
    return bool(shapes[0]) and all(s == shapes[0] for s in shapes[1:])


def expert_sites(model: nn.Module) -> list[ExpertSite]:
    """Every layer's routed experts in ``model``, in module order (works on meta)."""
    out: list[ExpertSite] = []
    for path, mod in model.named_modules():
        parent_path, _, own = path.rpartition(".")
        if is_stacked_experts(mod):
            block = model.get_submodule(parent_path) if path else model
            out.append(ExpertSite(path, STACKED, mod.num_experts, parent_path,
                                  _router_of(block, parent_path, mod.num_experts, own)))
        elif path and grouped_experts(mod) >= 2:
            experts = grouped_experts(mod)
            block = model.get_submodule(parent_path) if parent_path else model
            router = _router_of(block, parent_path, experts, own)
            if router:
                out.append(ExpertSite(path, GROUPED, experts, parent_path, router))
        elif isinstance(mod, nn.ModuleList) and len(mod) >= 2 and path:
            children = list(mod)
            if not _same_layout(children):
                continue
            block = model.get_submodule(parent_path) if parent_path else model
            router = _router_of(block, parent_path, len(children), own)
            if router:   # a list of identical blocks without a router is a stack of layers
                out.append(ExpertSite(path, LIST, len(children), parent_path, router))
    return out


def expert_sites_refusal(sites: list[ExpertSite], ep: int) -> str | None:
    """Why a model with these expert sites cannot be split ``ep`` ways (None: it can)."""
    if not sites:
        return ("it has no routed experts that expert parallelism recognises (a transformers-5 stacked experts "
                "module called as experts(hidden, top_k_index, top_k_weights), or an nn.ModuleList of identical "
                "experts beside a router with one output per expert, or a torchtitan-style GroupedExperts "
                "module called as experts(x, num_tokens_per_expert): core/experts.py)")
    bad = [s for s in sites if s.num_experts % ep]
    if bad:
        s = bad[0]
        return (f"{s.path} holds {s.num_experts} experts, which do not divide into ep = {ep} equal parts (each "
                f"expert-parallel rank holds num_experts / ep of them)")
    return None
