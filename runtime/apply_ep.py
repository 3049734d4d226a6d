"""Expert parallelism: each of ``ep`` ranks holds ``E / ep`` of a layer's ``E`` routed experts,
and every token goes to the rank holding its expert and back.

The ranks.  ``ep`` is borrowed from the data and context ranks (core/parallel_dims.py): the
group of a rank is ``ep`` consecutive values of its flattened dp x cp coordinate with its pp and
tp coordinates (``ParallelDims.ep_group``).  On the DeviceMesh that is the flattened dp x cp
mesh (``RankContext.get_mesh("grad")``) unflattened into ``(dp x cp / ep, ep)``: ``ep`` is the
inner dim, the outer one (``ep_rep``) joins the ranks that hold the same experts -- torchtitan's
``dp_shard_mod_ep`` x ``ep`` (its ParallelDims, 2025) with the ep ranks innermost.  Under a
pipeline the ranks of a group share their pp coordinate, so they hold the same stages and run
their exchanges in the same schedule order; each stage splits the experts it calls (a stage cut
from the ``torch.export`` graph calls stacked / grouped experts modules: runtime/expert_calls.py).

The weights.  A stacked experts module's ``[E, ...]`` parameters become DTensors ``Shard(0)``
over the ``ep`` mesh (each rank's local tensor: its ``E / ep`` experts), so checkpoints (DCP),
materialisation (runtime/materialize.py) and FSDP2 see their full shape; an ``nn.ModuleList``
of experts keeps on each rank only its own experts (under their global indices, so their
parameter names are the model's), the others replaced by an empty placeholder.  FSDP2 (or
``replicate`` for ZeRO-0) then shards / replicates the experts over ``ep_rep`` and the rest of
the layer over dp x cp, as torchtitan does.

The exchange (``route_rows``), per layer and micro-batch, as GShard's dispatch and combine
(Lepikhin et al. 2021, Sec. 2.2) and torchtitan's ``ExpertParallel``: the rows routed to each
expert, sorted by expert, first their counts per expert by ``all_to_all_single`` (equal splits),
then the rows themselves by ``all_to_all_single`` with those variable splits; the rank runs
its experts on the rows it received and sends the results back by the reverse all-to-all.  The
row exchanges are ``_functional_collectives.all_to_all_single_autograd``, whose backward is the
reverse all-to-all (checked on gloo, torch 2.13).  Under DualPipeV each exchange -- the counts,
the rows both ways, forward and backward -- is launched, handed over to the other pass of the
schedule's forward-backward pair while in flight, and then waited for (runtime/turns.py,
runtime/dualpipe_overlap.py): DeepSeek-V3's overlap of the all-to-alls with compute.

Where the tokens are taken and handed back, by form (core/experts.py):

- ``grouped`` (torchtitan's ``experts(x_sorted_by_expert, num_tokens_per_expert)``): the rows and
  counts are what the exchange takes; the module's own forward runs on the received rows.
- ``stacked`` (``experts(hidden, top_k_index, top_k_weights)``): the module's forward is
  replaced by the dispatch: each (token, slot) row goes to its expert's rank, the module's own
  forward runs there on the received rows with their local expert index and a weight of one,
  and the rows come back and are summed with the router's weights in the original token order.
- ``list`` (the block's forward calls ``experts[i](rows)`` itself): the block's forward runs
  twice.  The first run records the rows handed to each expert (returning zeros); the rows are
  exchanged and computed as above; the second run -- the same forward on the same inputs, the
  random state restored -- is handed each expert call's computed rows in the same order, and
  its output is the block's.  The gradient reaches the block's input through the first run's
  row selection (the second run's selection of the same rows feeds nothing) and the router
  through the second run.  Assumed: the block selects the same rows both times (it is checked),
  and an expert's output has its input's shape (a feed-forward expert).

Gradients.  The plain loop's loss is the mean over the global batch, so a dense weight's
gradient is the mean over the dp x cp ranks of each rank's gradient of its local mean loss.
An expert's weights receive, through the reverse all-to-all, the sum of the gradients of the
``ep`` ranks of its group; FSDP2 / ``replicate`` then average over ``ep_rep`` (dp x cp / ep
ranks), so one more factor ``1 / ep`` is due.  It is applied in the exchange: the experts'
output gradient is multiplied by ``1 / ep`` and their input gradient by ``ep`` (``_ScaleGrad``),
so the weights' gradient is scaled and the tokens' is exact.  (torchtitan sets FSDP2's
``set_gradient_divide_factor`` to dp x cp instead.  Here that fails twice on torch 2.13: with
ep = dp x cp the replica mesh has one rank, FSDP2 skips its reduction and the factor with it
-- the experts' gradients came out ep times too large --, and elsewhere it reduces with
``PREMUL_SUM``, which gloo refuses.)
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from autopar.core.errors import PlanFileError
from autopar.core.experts import GROUPED, LIST, STACKED, ExpertSite, expert_sites_refusal, expert_sites
from autopar.runtime.turns import hand_over, in_pair, rng_state, set_rng_state


@dataclass
class ExpertParallel:
    """One rank's expert-parallel groups and the expert modules it holds."""
    ep: int
    rank_in_group: int
    ep_mesh: DeviceMesh             # the ep ranks of this rank's group
    replica_mesh: DeviceMesh        # the ranks holding the same experts (dp x cp / ep of them)
    holders: list[nn.Module] = field(default_factory=list)   # what to shard over replica_mesh
    # the exchanges hand over to the other pass of a DualPipeV pair while in flight
    # (runtime/dualpipe_overlap.py; ``_AllToAllInTurns``)
    in_turns: bool = False

    @property
    def group(self):
        return self.ep_mesh.get_group()


def expert_meshes(flat: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(the ep mesh, the replica mesh) from the flattened dp x cp mesh ``flat``."""
    size = flat.size()
    two = flat._unflatten(0, (size // ep, ep), ("ep_rep", "ep"))
    return two["ep"], two["ep_rep"]


def build_expert_parallel(flat: DeviceMesh, ep: int, expected_group: tuple[int, ...]) -> ExpertParallel:
    ep_mesh, replica = expert_meshes(flat, ep)
    got = tuple(int(r) for r in ep_mesh.mesh.flatten().tolist())
    assert got == tuple(expected_group), f"ep mesh {got} != ParallelDims.ep_group {expected_group}"
    return ExpertParallel(ep=ep, rank_in_group=ep_mesh.get_local_rank(), ep_mesh=ep_mesh, replica_mesh=replica)


# ----------------------------------------------------------------------------- the exchange
class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _exchange_counts(counts: torch.Tensor, state: ExpertParallel) -> torch.Tensor:
    """[ep, E/ep]: how many rows each rank of the group sends to each of this rank's experts."""
    ep = state.ep
    local = counts.numel() // ep
    # the receive buffer starts as "every rank sends what this rank sends itself": what a fake
    # process group (the dry run, runtime/dry_run.py) leaves in it is then
    # consistent; a real all-to-all overwrites all of it
    recv = counts.view(ep, local)[state.rank_in_group].repeat(ep).contiguous()
    if in_pair():             # in flight while the pair's other pass runs (runtime/turns.py)
        work = dist.all_to_all_single(recv, counts.contiguous(), group=state.group, async_op=True)
        hand_over()
        work.wait()
    else:
        dist.all_to_all_single(recv, counts.contiguous(), group=state.group)
    return recv.view(ep, local)


class _AllToAllInTurns(torch.autograd.Function):
    """The rows' all-to-all (forward) and its reverse (backward), each launched, then handed over
    to the other pass of a DualPipeV pair (runtime/turns.py ``hand_over``: nothing outside a pair)
    while in flight, then waited for -- the functional collective ``all_to_all_single`` and
    ``wait_tensor`` that ``all_to_all_single_autograd`` runs, with the hand-over between them in
    both directions."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group_name):
        ctx.exchange = (out_splits, in_splits, group_name)
        return _exchange_in_turns(rows, out_splits, in_splits, group_name)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group_name = ctx.exchange
        return _exchange_in_turns(grad, in_splits, out_splits, group_name), None, None, None


def _exchange_in_turns(x: torch.Tensor, out_splits, in_splits, group_name: str) -> torch.Tensor:
    y = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, group_name)
    hand_over()
    return torch.ops._c10d_functional.wait_tensor(y)


def _exchange_rows(rows: torch.Tensor, out_splits, in_splits, state: ExpertParallel) -> torch.Tensor:
    if state.in_turns:
        return _AllToAllInTurns.apply(rows, out_splits, in_splits, state.group.group_name)
    return all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, state.group)


def _balanced_splits(rows: int, experts: int, state: ExpertParallel):
    """(recv_counts [ep, E/ep], send_splits, recv_splits) of a balanced routing of ``rows`` rows
    over ``experts`` experts (expert ``e`` gets ``rows // E`` rows, one more for the first
    ``rows % E``), as this rank would see it if every rank of the group routed alike.

    Under ``FakeTensorMode`` (the planner's dry run of a large model, runtime/dry_run.py) the
    routed counts are tensors without values: read with ``.tolist()`` they become unbacked
    symbols, and the all-to-all's output size (a sum of them) cannot be evaluated
    (``GuardOnDataDependentSymNode``).  The exchange's shapes are then those of this stand-in
    routing: what the dry run checks -- that every transformation applies and every shape
    lines up in forward and backward -- holds for any routing, since the code path is the same
    and only the row counts differ (no routing makes a shape mismatch that a balanced one
    hides: the rows each expert gets are cut by the same counts on both sides of each
    exchange).  The simulator prices the mean rows per expert too, times a capacity factor
    (simulator/ep_cost.py)."""
    ep, local = state.ep, experts // state.ep
    per = [rows // experts + (1 if e < rows % experts else 0) for e in range(experts)]
    mine = per[state.rank_in_group * local:(state.rank_in_group + 1) * local]
    send_splits = [sum(per[r * local:(r + 1) * local]) for r in range(ep)]
    recv_splits = [sum(mine)] * ep
    return torch.tensor([mine] * ep, dtype=torch.int64), send_splits, recv_splits


def route_rows(rows: torch.Tensor, counts: torch.Tensor, compute, state: ExpertParallel) -> torch.Tensor:
    """Rows sorted by expert (``counts[e]`` rows for expert ``e`` of ``E``) -> the experts'
    outputs, same order, computed on the ranks holding them.  ``compute(rows, local_index,
    per_expert)`` runs this rank's experts on rows sorted by local expert."""
    ep = state.ep
    local = counts.numel() // ep
    recv_counts = _exchange_counts(counts, state)
    if is_fake(counts):
        recv_counts, send_splits, recv_splits = _balanced_splits(rows.shape[0], counts.numel(), state)
    else:
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
    received = _exchange_rows(rows, recv_splits, send_splits, state)
    # received rows: by source rank, then by local expert -> by local expert, then by source
    # (not torch.arange: under context parallelism apply_cp.CPAttention answers an arange of the
    # local sequence length with the rank's token positions)
    index = torch.repeat_interleave(torch.tensor(list(range(local)) * ep, device=rows.device),
                                    recv_counts.flatten().to(rows.device), output_size=sum(recv_splits))
    order = torch.argsort(index, stable=True)
    # the experts' weight gradients scaled by 1 / ep, their input gradient left exact (module
    # docstring, "Gradients"); ep is a power of two in practice, so the scaling rounds nothing
    rows_in = _ScaleGrad.apply(received[order], float(ep))
    out = _ScaleGrad.apply(compute(rows_in, index[order], recv_counts.sum(0)), 1.0 / ep)
    back = out[torch.argsort(order)]
    return _exchange_rows(back, send_splits, recv_splits, state)


# ----------------------------------------------------------------------------- stacked form
class _LocalParams:
    """Inside: the module's DTensor parameters read as their local tensors (autograd kept)."""

    def __init__(self, module: nn.Module):
        self.module, self.saved = module, {}

    def __enter__(self):
        for name, p in list(self.module._parameters.items()):
            if isinstance(p, DTensor):
                self.saved[name] = p
                self.module._parameters[name] = p.to_local()

    def __exit__(self, *exc):
        self.module._parameters.update(self.saved)


def _three_arguments(module: nn.Module) -> list[str]:
    order = [n for n, p in inspect.signature(module.forward).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(order) < 3:
        raise PlanFileError(f"{type(module).__name__}.forward takes {order}, not (hidden_states, top_k_index, "
                            f"top_k_weights): expert parallelism cannot hand it the tokens of its experts")
    return order[:3]


def shard_stacked(module: nn.Module, state: ExpertParallel) -> None:
    total = module.num_experts
    local = total // state.ep
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, state.ep_mesh, [Shard(0)], src_data_rank=None),
            requires_grad=param.requires_grad))
    module.num_experts = local
    keys = _three_arguments(module)
    own_forward = module.forward

    def forward(*args, **kwargs):
        values = dict(zip(keys, args))
        values.update({k: kwargs.pop(k) for k in keys if k in kwargs})
        hidden, index, weights = (values[k] for k in keys)
        rest = args[3:]
        tokens, k = index.shape
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # (not ``bincount``, whose length depends on the largest index: a value, unknown under
        # the dry run's FakeTensorMode)
        counts = torch.zeros(total, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat.long(), torch.ones_like(flat, dtype=torch.int64))

        def compute(rows, local_index, _per_expert):
            n, local_index = rows.shape[0], local_index.unsqueeze(1)
            if n == 0:
                # no token chose this rank's experts: the module's own code runs on one row with
                # the index num_experts, which adds nothing (the ``_is_expert_parallel`` contract:
                # core/experts.is_stacked_experts), so it never sees an empty batch (a model's
                # ``y.view(t, k, -1)`` cannot infer -1 from 0 elements) and its weights still take
                # part in backward on every rank (FSDP2 reduces them all)
                rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
                local_index = torch.full((1, 1), local, dtype=local_index.dtype, device=rows.device)
            ones = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=rows.device)
            with _LocalParams(module):
                return own_forward(rows, local_index, ones, *rest, **kwargs)[:n]

        out = route_rows(hidden[order // k], counts, compute, state)
        out = out[torch.argsort(order)].view(tokens, k, -1)
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1).to(hidden.dtype)

    module.forward = forward
    state.holders.append(module)


# ----------------------------------------------------------------------------- grouped form
def shard_grouped(module: nn.Module, total: int, state: ExpertParallel) -> None:
    """torchtitan's ``GroupedExperts``: the caller hands the rows sorted by expert and their
    counts -- exactly what ``route_rows`` exchanges; the module runs on its own experts' rows."""
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, state.ep_mesh, [Shard(0)], src_data_rank=None),
            requires_grad=param.requires_grad))
    own_forward = module.forward

    def forward(x, num_tokens_per_expert):
        def compute(rows, _local_index, per_expert):
            with _LocalParams(module):
                return own_forward(rows, per_expert)

        return route_rows(x, num_tokens_per_expert, compute, state)

    module.forward = forward
    state.holders.append(module)


# ----------------------------------------------------------------------------- list form
class _Absent(nn.Module):
    """An expert another rank holds."""

    def forward(self, *_args, **_kwargs):
        raise RuntimeError("this expert lives on another expert-parallel rank (runtime/apply_ep.py)")


class _Call:
    """What the block calls as ``experts[i]`` during its two runs."""

    def __init__(self, owner: "ExpertList", index: int):
        self.owner, self.index = owner, index

    def __call__(self, x, *args, **kwargs):
        if args or kwargs:
            raise RuntimeError("expert parallelism hands an expert its rows only; this expert takes more arguments")
        return self.owner._call(self.index, x)


class ExpertList(nn.ModuleList):
    """The ``nn.ModuleList`` of experts on one rank: its own experts at their indices, the
    others ``_Absent``.  Between the block's runs it hands out ``_Call`` s (module docstring)."""

    def __init__(self, modules: list[nn.Module], lo: int, local: int):
        super().__init__(modules)
        self.lo, self.local = lo, local
        self._recorded: list[tuple[int, torch.Tensor]] | None = None
        self._replay: dict[int, list[torch.Tensor]] | None = None

    def _phase(self) -> bool:
        return self._recorded is not None or self._replay is not None

    def __getitem__(self, idx):
        if self._phase() and not isinstance(idx, slice):
            return _Call(self, operator.index(idx) % len(self))
        return super().__getitem__(idx)

    def __iter__(self):
        if self._phase():
            return iter([_Call(self, i) for i in range(len(self))])
        return super().__iter__()

    def _call(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._recorded is not None:
            self._recorded.append((index, x))
            return torch.zeros_like(x)
        queue = self._replay[index]
        if not queue or queue[0].shape[0] != x.shape[0]:
            raise RuntimeError(f"expert {index} was handed other rows in the block's second run than in its first: "
                               f"expert parallelism needs a block whose routing is a function of its inputs")
        return queue.pop(0)

    def forward(self, rows: torch.Tensor, _local_index: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """This rank's experts, each on its rows (every one called, on zero rows too: FSDP2's
        hooks of the unit then run the same on every rank)."""
        outs, start = [], 0
        for j, n in enumerate(per_expert.tolist()):
            outs.append(self._modules[str(self.lo + j)](rows.narrow(0, start, n)))
            start += n
        return torch.cat(outs) if outs else rows


def shard_list(block: nn.Module, name: str, state: ExpertParallel) -> None:
    experts = getattr(block, name)
    total = len(experts)
    local = total // state.ep
    lo = state.rank_in_group * local
    kept = [experts[i] if lo <= i < lo + local else _Absent() for i in range(total)]
    lst = ExpertList(kept, lo, local)
    setattr(block, name, lst)
    own_forward = block.forward

    def forward(*args, **kwargs):
        rng = rng_state()
        lst._recorded = recorded = []
        try:
            own_forward(*args, **kwargs)                     # run 1: which rows go to which expert
        finally:
            lst._recorded = None
        by_expert: dict[int, list[torch.Tensor]] = {i: [] for i in range(total)}
        for i, x in recorded:
            by_expert[i].append(x)
        pieces = [x for i in range(total) for x in by_expert[i]]
        if pieces:
            rows = torch.cat(pieces)
        else:
            first = next(a for a in args if isinstance(a, torch.Tensor))
            rows = first.new_zeros(0, first.shape[-1])
        counts = torch.tensor([sum(x.shape[0] for x in by_expert[i]) for i in range(total)], dtype=torch.int64,
                              device=rows.device)
        out = route_rows(rows, counts, lst, state)
        replay, start = {}, 0
        for i in range(total):
            replay[i] = []
            for x in by_expert[i]:
                replay[i].append(out.narrow(0, start, x.shape[0]))
                start += x.shape[0]
        set_rng_state(rng)
        lst._replay = replay
        try:
            result = own_forward(*args, **kwargs)            # run 2: the block's output
        finally:
            lst._replay = None
        left = [i for i, q in replay.items() if q]
        if left:
            raise RuntimeError(f"experts {left} were called fewer times in the block's second run than in its first")
        return result

    block.forward = forward
    state.holders.append(lst)


# ----------------------------------------------------------------------------- entry points
def check_ep_plan(checked) -> None:
    """Refuse (exit 2), before any process group, a plan with ep > 1 the model or this runtime
    cannot run: a model without recognised experts or whose expert count ep does not divide
    (core/experts.py), or a combination not implemented here (``refuse_combinations``: a tp
    style on the experts; under a pipeline, experts its stages do not call as modules:
    ``stages_hold_experts``, when the stages are cut)."""
    from autopar.runtime.materialize import build_meta_model

    plan, where = checked.plan, f"plan file {checked.plan_path}"
    model = build_meta_model(checked.model_file, dict(plan.model.args))
    refuse_combinations(plan, expert_sites_or_refuse(model, plan.mesh.ep, where), where)


def refuse_combinations(plan, sites: list[ExpertSite], where: str) -> None:
    paths = {s.path for s in sites}
    split = [fqn for lp in plan.layers for fqn, _style in lp.tp if fqn in paths or
             any(fqn.startswith(p + ".") for p in paths)]
    unsupported = [(bool(split), f"a tensor-parallel split of the experts ({', '.join(split[:2])}): they are split "
                                 f"by ep already; plan them without a tp style")]
    for bad, what in unsupported:
        if bad:
            raise PlanFileError(f"{where} has ep = {plan.mesh.ep} with {what}. Plan expert parallelism with dp, "
                                f"cp, ZeRO, recompute and tensor parallelism of the other modules, or ep = 1.")


def expert_sites_or_refuse(model: nn.Module, ep: int, where: str) -> list[ExpertSite]:
    sites = expert_sites(model)
    reason = expert_sites_refusal(sites, ep)
    if reason:
        raise PlanFileError(f"{where} has ep = {ep}, but the model cannot take expert parallelism: {reason}. "
                            f"Plan with ep = 1 for this model.")
    return sites


def stages_hold_experts(meta: nn.Module, stages: list[nn.Module], ep: int, cut_by: str, where: str) -> None:
    """Under a pipeline, refuse (exit 2, on every rank alike) when a routed-experts site of the
    model is not among the stage modules' (runtime/expert_calls.py: a stage cut from the
    ``torch.export`` graph keeps stacked and grouped experts as module calls, not an
    ``nn.ModuleList`` of experts that its block's code calls one by one)."""
    held = {s.path for stage in stages for s in expert_sites(stage)}
    lost = [s for s in expert_sites(meta) if s.path not in held]
    if lost:
        s = lost[0]
        how = ("torch.fx cannot trace the model's forward, so its stages are cut from the torch.export graph, which "
               "keeps a stacked or grouped experts module as a call but inlines a block that calls an nn.ModuleList "
               "of experts one by one" if cut_by == "export" else "the stage modules do not hold it")
        cut = "torch.export-cut " if cut_by == "export" else ""
        raise PlanFileError(f"{where} has ep = {ep} with pp > 1, but its {cut}pipeline stages do not call the "
                            f"experts at {s.path} ({s.form} form) as a module: {how}. Plan ep = 1 or pp = 1 for "
                            f"this model.")


def apply_ep(part: nn.Module, state: ExpertParallel, plan, where: str) -> ExpertParallel:
    """Split every routed-experts site of ``part`` ``state.ep`` ways (on meta, before FSDP2).
    Under a pipeline ``part`` is a stage, which may hold no experts (the embeddings' stage): the
    whole model was checked (``check_ep_plan``, ``stages_hold_experts``)."""
    sites = expert_sites(part) if plan.mesh.pp > 1 else expert_sites_or_refuse(part, state.ep, where)
    refuse_combinations(plan, sites, where)
    # DualPipeV runs forward-backward pairs in turns (apply_pp.build_schedule)
    state.in_turns = plan.mesh.pp > 1 and plan.pipeline.schedule == "dualpipev"
    for site in sites:
        if site.form == STACKED:
            shard_stacked(part.get_submodule(site.path), state)
        elif site.form == GROUPED:
            shard_grouped(part.get_submodule(site.path), site.num_experts, state)
        else:
            assert site.form == LIST, site.form
            block = part.get_submodule(site.block) if site.block else part
            shard_list(block, site.path.rpartition(".")[2], state)
    return state


def local_expert_modules(state: ExpertParallel) -> list[list[nn.Module]]:
    """Each holder's modules that hold parameters: the stacked module itself, or a list's own experts."""
    out = []
    for h in state.holders:
        if isinstance(h, ExpertList):
            out.append([h[i] for i in range(h.lo, h.lo + h.local)])
        else:
            out.append([h])
    return out


def shard_expert_weights(part: nn.Module, state: ExpertParallel, dp_kind: str, layer_of, precision: str,
                         device: torch.device) -> None:
    """FSDP2 (``fsdp``) or ``replicate`` of each holder's experts over the replica mesh, before the
    layers' units take the rest (a child unit first, as FSDP2 wants); they average the gradient
    over the replica mesh (module docstring, "Gradients").  ``layer_of(module)`` -> (ZeRO
    stage, offload) of the layer holding it."""
    from torch.distributed.fsdp import fully_shard

    from autopar.runtime.apply_dp import mixed_precision_policy, offload_policy

    mp = mixed_precision_policy(precision)
    for mods in local_expert_modules(state):
        target = mods if len(mods) > 1 else mods[0]
        zero, offload = layer_of(mods[0])
        if dp_kind == "fsdp":
            fully_shard(target, mesh=state.replica_mesh, reshard_after_forward=zero == 3, mp_policy=mp,
                               offload_policy=offload_policy(offload, device))
        elif dp_kind == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(target, mesh=state.replica_mesh, mp_policy=mp)
        else:
            raise AssertionError(f"expert parallelism runs under FSDP2 or replicate, not {dp_kind}")

