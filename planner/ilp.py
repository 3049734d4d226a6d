"""Intra-operator choice as an integer linear program (Alpa, Zheng et al. 2022, Sec. 4.1).

Alpa's eq. 1 picks one strategy per node ``v`` of the graph with a one-hot vector ``s_v``::

    min  sum_v  s_v^T (c_v + d_v)  +  sum_{(v,u) in E}  s_v^T R_vu s_u
    s.t. s_v in {0,1}^{k_v},  sum_i s_v[i] = 1                                  (1a)

``c_v`` is compute and ``d_v`` communication cost of each strategy, ``R_vu`` the resharding cost
between the strategies of two connected nodes.  Here a node is a *layer* (or a run of
identical layers), its strategies are the per-layer choices of the planner (tensor-parallel
split, ZeRO stage, recompute, offload), and the memory knobs sit inside the program as one
more constraint, so that memory is traded against time by the solver itself::

    sum_v  s_v^T m_v  <=  budget                                               (1b)

The quadratic edge term is linearised as in Alpa with one boolean ``e_vu[i, j]`` per pair::

    sum_j e_vu[i, j] = s_v[i],   sum_i e_vu[i, j] = s_u[j]                      (1c)

**Identical layers are solved once.**  A node may stand for ``count`` structurally identical,
consecutive layers (same ``Layer.signature``).  For such a node the one-hot vector becomes a
vector of integer counts ``n_v`` with ``sum_i n_v[i] = count`` (1a'), its cost and memory are
``n_v^T c_v`` and ``n_v^T m_v``.  This is exact, not an approximation, for the memory
constraint: identical layers are interchangeable, so only *how many* of them take each
strategy matters, and the solver may still mix strategies inside the run (say 30 of 96
blocks recompute, the rest keep their activations) when the budget falls between two
uniform choices.  Multiplying one uniform choice by ``count`` would instead force all or
nothing and waste up to a whole layer-choice of memory per group.  The layers of a group must
hand activations to each other in the same layout whatever they choose (no internal
resharding); their edges to neighbouring nodes see the group's first and last layer, chosen
by one-hot boundary vectors ``f_v``, ``l_v`` that may only name strategies the group uses::

    f_v[i] <= n_v[i],  l_v[i] <= n_v[i],  f_v[i] + l_v[i] <= n_v[i] when count >= 2   (1d)

**Scaling.**  CP-SAT solves over integers.  Costs (seconds) are scaled so that the largest
possible objective maps to ``COST_RESOLUTION`` = 2^40 units and rounded to nearest: each
of the at most T terms is off by half a unit, so the chosen solution is within
T / 2^40 of the largest objective of the true optimum (T ~ 10^3 gives ~1e-9 relative); the
returned cost is re-evaluated in floating point.  Memory coefficients are rounded *up* and the
budget *down* (unit = budget / ``MEMORY_RESOLUTION`` = budget / 2^30), so every solution the
solver accepts fits the real budget; the price is that a solution closer than
(number of layers) units ~ 1e-7 of the budget to the limit may be refused.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from autopar.core.errors import InfeasibleError

COST_RESOLUTION = 2 ** 40      # integer units for the largest possible objective
MEMORY_RESOLUTION = 2 ** 30    # integer units for the memory budget


@dataclass(frozen=True)
class ChoiceNode:
    """One layer, or ``count`` identical consecutive layers, with its strategies' costs."""

    cost_s: np.ndarray          # (S,) seconds per layer for each strategy (compute + communication)
    memory_bytes: np.ndarray    # (S,) bytes per layer for each strategy
    count: int = 1
    name: str = ""

    @property
    def num_strategies(self) -> int:
        return len(self.cost_s)


@dataclass(frozen=True)
class ReshardEdge:
    """Resharding between the last layer of node ``src`` and the first layer of node ``dst``."""

    src: int
    dst: int
    cost_s: np.ndarray          # (S_src, S_dst) seconds


@dataclass(frozen=True)
class IntraOpSolution:
    counts: tuple[np.ndarray, ...]   # per node: how many of its layers take each strategy
    first: tuple[int, ...]           # per node: strategy of its first layer
    last: tuple[int, ...]            # per node: strategy of its last layer
    cost_s: float                    # objective, re-evaluated in floating point
    memory_bytes: float
    optimal: bool                    # proven optimal (False: time limit hit, best found)
    solve_s: float

    def layer_strategies(self, node: int) -> list[int]:
        """Strategies of the node's layers in order: first, the others (by index), last."""
        counts = self.counts[node].astype(int).copy()
        total = int(counts.sum())
        if total == 1:
            return [self.first[node]]
        counts[self.first[node]] -= 1
        counts[self.last[node]] -= 1
        middle = [i for i, n in enumerate(counts) for _ in range(n)]
        return [self.first[node]] + middle + [self.last[node]]


def objective(nodes: list[ChoiceNode], edges: list[ReshardEdge], counts, first, last) -> tuple[float, float]:
    """(cost_s, memory_bytes) of an assignment, in floating point (eq. 1 and 1b)."""
    cost = sum(float(np.dot(n_v, node.cost_s)) for node, n_v in zip(nodes, counts))
    memory = sum(float(np.dot(n_v, node.memory_bytes)) for node, n_v in zip(nodes, counts))
    cost += sum(float(e.cost_s[last[e.src], first[e.dst]]) for e in edges)
    return cost, memory


def solve_intra_op(nodes: list[ChoiceNode], edges: list[ReshardEdge], memory_budget_bytes: float,
                   *, time_limit_s: float = 10.0, seed: int = 0) -> IntraOpSolution:
    """Solve eq. 1 with (1a)-(1d) by CP-SAT; raise InfeasibleError when nothing fits the budget."""
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    _check(nodes, edges)
    # ---- the budget admits nothing
    min_memory = sum(node.count * float(np.min(node.memory_bytes)) for node in nodes)
    if min_memory > memory_budget_bytes:
        raise InfeasibleError(
            f"the least memory any choice needs is {min_memory:.4g} bytes, over the budget of "
            f"{memory_budget_bytes:.4g} bytes")

    # ---- the unconstrained optimum fits: it is the optimum (without edges it is per node)
    if not edges:
        pick = [int(np.lexsort((node.memory_bytes, node.cost_s))[0]) for node in nodes]
        if sum(node.count * float(node.memory_bytes[i]) for node, i in zip(nodes, pick)) <= memory_budget_bytes:
            counts = tuple(np.bincount([i], minlength=node.num_strategies) * node.count
                           for node, i in zip(nodes, pick))
            cost, memory = objective(nodes, edges, counts, pick, pick)
            return IntraOpSolution(counts=counts, first=tuple(pick), last=tuple(pick), cost_s=cost,
                                   memory_bytes=memory, optimal=True, solve_s=time.perf_counter() - t0)

    # ---- integer scaling (module docstring)
    max_objective = sum(node.count * float(np.max(node.cost_s)) for node in nodes)
    max_objective += sum(float(np.max(e.cost_s)) for e in edges)
    cost_unit = max(max_objective, 1e-30) / COST_RESOLUTION
    mem_unit = max(memory_budget_bytes, 1.0) / MEMORY_RESOLUTION
    budget_units = math.floor(memory_budget_bytes / mem_unit)

    def cost_int(x: float) -> int:
        return int(round(x / cost_unit))

    def mem_int(x: float) -> int:
        return int(math.ceil(x / mem_unit - 1e-9))

    model = cp_model.CpModel()
    n_vars, f_vars, l_vars, obj_terms, mem_terms = [], [], [], [], []
    for v, node in enumerate(nodes):
        S = node.num_strategies
        if node.count == 1:
            s = [model.NewBoolVar(f"s_{v}_{i}") for i in range(S)]
            model.AddExactlyOne(s).WithName(f"(1a) one-hot s_{v}")
            n, f, last = s, s, s
        else:
            n = [model.NewIntVar(0, node.count, f"n_{v}_{i}") for i in range(S)]
            model.Add(sum(n) == node.count).WithName(f"(1a') counts n_{v} sum to {node.count}")
            f = [model.NewBoolVar(f"f_{v}_{i}") for i in range(S)]
            last = [model.NewBoolVar(f"l_{v}_{i}") for i in range(S)]
            model.AddExactlyOne(f).WithName(f"(1d) one-hot first layer f_{v}")
            model.AddExactlyOne(last).WithName(f"(1d) one-hot last layer l_{v}")
            for i in range(S):
                model.Add(f[i] + last[i] <= n[i]).WithName(f"(1d) boundary strategies used, node {v} strategy {i}")
        n_vars.append(n)
        f_vars.append(f)
        l_vars.append(last)
        obj_terms += [cost_int(float(node.cost_s[i])) * n[i] for i in range(S)]
        mem_terms += [mem_int(float(node.memory_bytes[i])) * n[i] for i in range(S)]
    model.Add(sum(mem_terms) <= budget_units).WithName("(1b) memory budget")
    for k, e in enumerate(edges):
        src_last, dst_first = l_vars[e.src], f_vars[e.dst]
        if not np.any(e.cost_s):
            continue
        pair = {}
        for i in range(len(src_last)):
            for j in range(len(dst_first)):
                pair[i, j] = model.NewBoolVar(f"e_{k}_{i}_{j}")
                obj_terms.append(cost_int(float(e.cost_s[i, j])) * pair[i, j])
        for i in range(len(src_last)):
            model.Add(sum(pair[i, j] for j in range(len(dst_first))) == src_last[i]).WithName(
                f"(1c) edge {e.src}->{e.dst} row {i}")
        for j in range(len(dst_first)):
            model.Add(sum(pair[i, j] for i in range(len(src_last))) == dst_first[j]).WithName(
                f"(1c) edge {e.src}->{e.dst} column {j}")
    model.Minimize(sum(obj_terms))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = 1          # one worker: the result is reproducible
    solver.parameters.random_seed = int(seed)
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError(
            f"no choice of strategies fits the memory budget of {memory_budget_bytes:.4g} bytes "
            f"(CP-SAT status {solver.StatusName(status)})")
    counts = tuple(np.array([solver.Value(x) for x in n], dtype=np.int64) for n in n_vars)
    first = tuple(int(np.argmax([solver.Value(x) for x in f])) for f in f_vars)
    last = tuple(int(np.argmax([solver.Value(x) for x in lv])) for lv in l_vars)
    cost, memory = objective(nodes, edges, counts, first, last)
    return IntraOpSolution(counts=counts, first=first, last=last, cost_s=cost, memory_bytes=memory,
                           optimal=status == cp_model.OPTIMAL, solve_s=time.perf_counter() - t0)


def group_consecutive(signatures: list[str]) -> list[tuple[int, int]]:
    """Runs of equal consecutive signatures as (start, end) layer ranges, end exclusive."""
    runs: list[tuple[int, int]] = []
    for i, sig in enumerate(signatures):
        if runs and signatures[runs[-1][0]] == sig:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _check(nodes: list[ChoiceNode], edges: list[ReshardEdge]) -> None:
    for v, node in enumerate(nodes):
        if node.count < 1:
            raise ValueError(f"node {v}: count must be >= 1, got {node.count}")
        if node.cost_s.shape != node.memory_bytes.shape or node.cost_s.ndim != 1 or len(node.cost_s) == 0:
            raise ValueError(f"node {v}: cost_s and memory_bytes must be equal-length 1-D arrays")
        if not (np.all(np.isfinite(node.cost_s)) and np.all(node.cost_s >= 0)):
            raise ValueError(f"node {v}: costs must be finite and non-negative (drop infeasible strategies)")
    for e in edges:
        shape = (nodes[e.src].num_strategies, nodes[e.dst].num_strategies)
        if e.cost_s.shape != shape:
            raise ValueError(f"edge {e.src}->{e.dst}: cost_s has shape {e.cost_s.shape}, expected {shape}")
        if not (np.all(np.isfinite(e.cost_s)) and np.all(e.cost_s >= 0)):
            raise ValueError(f"edge {e.src}->{e.dst}: resharding costs must be finite and non-negative")
