"""The planner's three solvers on synthetic cost tables, against brute-force enumeration."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autopar.core.errors import InfeasibleError
from autopar.planner.ilp import ChoiceNode, ReshardEdge, group_consecutive, objective, solve_intra_op
from autopar.planner.mcmc import acceptance_probability, metropolis_hastings
from autopar.planner.stage_dp import partition_stages, pipeline_latency


# ----------------------------------------------------------------------------- ILP
def _brute_force_ilp(nodes, edges, budget):
    """Enumerate every per-layer assignment (groups expanded into their layers)."""
    layer_node = [v for v, n in enumerate(nodes) for _ in range(n.count)]
    best = (math.inf, None)
    for assign in itertools.product(*[range(nodes[v].num_strategies) for v in layer_node]):
        mem = sum(nodes[v].memory_bytes[s] for v, s in zip(layer_node, assign))
        if mem > budget:
            continue
        cost = sum(nodes[v].cost_s[s] for v, s in zip(layer_node, assign))
        first = {}
        last = {}
        for v, s in zip(layer_node, assign):
            first.setdefault(v, s)
            last[v] = s
        cost += sum(e.cost_s[last[e.src], first[e.dst]] for e in edges)
        if cost < best[0]:
            best = (cost, assign)
    return best


def _random_chain(rng, counts, num_strategies, with_edges):
    nodes = [ChoiceNode(cost_s=rng.uniform(1.0, 10.0, num_strategies),
                        memory_bytes=rng.uniform(1e9, 8e9, num_strategies), count=c) for c in counts]
    edges = []
    if with_edges:
        edges = [ReshardEdge(v, v + 1, rng.uniform(0.0, 4.0, (num_strategies, num_strategies)))
                 for v in range(len(nodes) - 1)]
    return nodes, edges


@pytest.mark.parametrize("seed", range(8))
def test_ilp_matches_brute_force_on_single_layers_with_resharding(seed):
    rng = np.random.default_rng(seed)
    nodes, edges = _random_chain(rng, [1, 1, 1, 1, 1], 3, with_edges=True)
    budget = float(rng.uniform(0.35, 0.8) * sum(n.memory_bytes.max() for n in nodes))
    sol = _solve_and_compare_with_brute_force(nodes, edges, budget)
    assert sol is None or sol.optimal


@pytest.mark.parametrize("seed", range(8))
def test_ilp_groups_of_identical_layers_match_per_layer_enumeration(seed):
    rng = np.random.default_rng(100 + seed)
    nodes, edges = _random_chain(rng, [1, 4, 1], 3, with_edges=True)
    budget = float(rng.uniform(0.55, 0.9) * sum(n.count * n.memory_bytes.max() for n in nodes))
    sol = _solve_and_compare_with_brute_force(nodes, edges, budget)
    if sol is None:          # nothing fits: both agreed
        return
    # the per-layer expansion is consistent with the counts and the reported cost
    per_layer = [sol.layer_strategies(v) for v in range(len(nodes))]
    assert [len(x) for x in per_layer] == [1, 4, 1]
    recount = tuple(np.bincount(x, minlength=3) for x in per_layer)
    assert objective(nodes, edges, recount, [x[0] for x in per_layer], [x[-1] for x in per_layer])[0] == \
        pytest.approx(sol.cost_s, rel=1e-12)


def test_ilp_mixes_strategies_inside_a_group_when_the_budget_falls_between_uniform_choices():
    # strategy 0: fast, 10 GB; strategy 1 (recompute-like): 30% slower, 4 GB.  Six layers, 40 GB:
    # all-0 needs 60 GB, all-1 is slowest; the optimum keeps 2 fast layers (2*10 + 4*4 = 36 GB).
    node = ChoiceNode(cost_s=np.array([1.0, 1.3]), memory_bytes=np.array([10e9, 4e9]), count=6)
    sol = solve_intra_op([node], [], 40e9)
    assert list(sol.counts[0]) == [2, 4]
    assert sol.cost_s == pytest.approx(2 * 1.0 + 4 * 1.3)


def test_ilp_reports_infeasible_budget():
    node = ChoiceNode(cost_s=np.array([1.0, 2.0]), memory_bytes=np.array([5.0, 3.0]), count=4)
    with pytest.raises(InfeasibleError):
        solve_intra_op([node], [], 11.0)


def test_group_consecutive():
    assert group_consecutive(["pre", "b", "b", "b", "post"]) == [(0, 1), (1, 4), (4, 5)]
    assert group_consecutive(["a", "b", "a"]) == [(0, 1), (1, 2), (2, 3)]


# ----------------------------------------------------------------------------- stage DP
def _brute_force_stages(cost, num_stages, m):
    L = cost.shape[-2]
    best = (math.inf, None)
    for cuts in itertools.combinations(range(1, L), num_stages - 1):
        bounds = (0,) + cuts + (L,)
        lat = [cost[s, bounds[s], bounds[s + 1]] if cost.ndim == 3 else cost[bounds[s], bounds[s + 1]]
               for s in range(num_stages)]
        if not all(map(math.isfinite, lat)):
            continue
        T = pipeline_latency(lat, m)
        if T < best[0]:
            best = (T, bounds)
    return best


def _layer_range_costs(rng, L):
    per_layer = rng.uniform(0.5, 3.0, L)
    prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
    cost = np.full((L, L + 1), np.inf)
    for i in range(L):
        for j in range(i + 1, L + 1):
            cost[i, j] = prefix[j] - prefix[i] + 0.2   # + a per-stage overhead: not additive
    return cost


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_stage_dp_matches_brute_force(seed, m):
    rng = np.random.default_rng(seed)
    L, S = 9, 3
    cost = _layer_range_costs(rng, L)
    want, _ = _brute_force_stages(cost, S, m)
    got = partition_stages(cost, S, m)
    assert got.step_latency_s == pytest.approx(want, rel=1e-12)
    assert got.bounds[0] == 0 and got.bounds[-1] == L and len(got.bounds) == S + 1


@pytest.mark.parametrize("seed", range(6))
def test_stage_dp_with_position_dependent_costs_and_memory_limits(seed):
    rng = np.random.default_rng(50 + seed)
    L, S, m = 8, 4, 6
    base = _layer_range_costs(rng, L)
    cost = np.stack([base * rng.uniform(0.8, 1.2) for _ in range(S)])
    # stage s may hold at most 3 + (s % 2) layers: an unequal memory limit per position
    for s in range(S):
        for i in range(L):
            for j in range(i + 1, L + 1):
                if j - i > 3 + (s % 2):
                    cost[s, i, j] = np.inf
    want, want_bounds = _brute_force_stages(cost, S, m)
    got = partition_stages(cost, S, m)
    assert got.step_latency_s == pytest.approx(want, rel=1e-12)
    assert all(got.bounds[s + 1] - got.bounds[s] <= 3 + (s % 2) for s in range(S))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_stage_dp_with_an_upper_bound_against_brute_force(seed, m):
    """Above the brute-force optimum the bound changes nothing (the same partition); below it
    the DP answers None."""
    rng = np.random.default_rng(100 + seed)
    L, S = 9, 3
    cost = np.stack([_layer_range_costs(rng, L) for _ in range(S)])
    want, want_bounds = _brute_force_stages(cost, S, m)
    free = partition_stages(cost, S, m)
    for above in (want * (1 + 1e-9), want * 1.01, want * 2):
        got = partition_stages(cost, S, m, upper_bound=above)
        assert got is not None and got.bounds == free.bounds
        assert got.step_latency_s == pytest.approx(want, rel=1e-12)
    for below in (want * (1 - 1e-9), want * 0.9, want / (1 + (m - 1) / S) / 2):
        assert partition_stages(cost, S, m, upper_bound=below) is None


def test_stage_dp_unequal_stages_when_layers_are_unequal():
    # a heavy last layer (an LM head): the optimum gives the last stage fewer layers
    per_layer = np.array([1.0] * 7 + [3.0])
    prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
    cost = np.array([[prefix[j] - prefix[i] if j > i else np.inf for j in range(9)] for i in range(8)])
    got = partition_stages(cost, 2, 32)
    assert got.bounds == (0, 5, 8)        # 5 + 5: perfectly balanced, unequal layer counts


def test_stage_dp_infeasible():
    cost = np.full((4, 5), np.inf)
    with pytest.raises(InfeasibleError):
        partition_stages(cost, 2, 4)


# ----------------------------------------------------------------------------- MCMC
def test_acceptance_rule():
    assert acceptance_probability(2.0, 1.0, beta=3.0) == 1.0
    assert acceptance_probability(1.0, 2.0, beta=3.0) == pytest.approx(math.exp(-3.0))
    assert acceptance_probability(1.0, math.inf, beta=3.0) == 0.0


def _landscape(x: int, y: int) -> float:
    # a 2-D grid with many local minima (a discrete Rastrigin); global minimum 0 at (13, 7)
    dx, dy = x - 13, y - 7
    return dx * dx + dy * dy + 10 * (2 - math.cos(2 * math.pi * dx / 4) - math.cos(2 * math.pi * dy / 4))


def _grid_step(state, rng):
    x, y = state
    dx, dy = [(1, 0), (-1, 0), (0, 1), (0, -1)][rng.integers(4)]
    return (min(31, max(0, x + dx)), min(31, max(0, y + dy)))


def test_mcmc_finds_the_global_minimum_of_a_rugged_landscape():
    greedy = metropolis_hastings((0, 31), _grid_step, lambda s: _landscape(*s), beta=1e6, seed=3,
                                 max_iterations=3000)
    assert greedy.best_cost > 0            # pure descent gets stuck in a local minimum
    res = metropolis_hastings((0, 31), _grid_step, lambda s: _landscape(*s), beta=0.15, seed=3,
                              max_iterations=3000)
    assert res.best_state == (13, 7) and res.best_cost == 0.0


def test_mcmc_is_reproducible_and_samples_the_boltzmann_distribution():
    costs = [0.0, 1.0, 2.0]

    def ring(s, rng):                       # symmetric proposal on a 3-cycle
        return (s + (1 if rng.random() < 0.5 else -1)) % 3

    beta = 1.0
    a = metropolis_hastings(0, ring, lambda s: costs[s], beta=beta, seed=11, max_iterations=60_000)
    b = metropolis_hastings(0, ring, lambda s: costs[s], beta=beta, seed=11, max_iterations=60_000)
    assert [t[2] for t in a.trace] == [t[2] for t in b.trace]
    visits = np.bincount([int(round(c)) for _, _, c, _ in a.trace], minlength=3) / len(a.trace)
    want = np.exp(-beta * np.array(costs))
    want /= want.sum()
    assert visits == pytest.approx(want, abs=0.015)


def test_mcmc_time_budget_and_infeasible_states():
    t = iter(range(1000))
    res = metropolis_hastings(0, lambda s, r: s + 1, lambda s: math.inf if s % 2 else float(-s), beta=1.0,
                              max_iterations=10**6, time_budget_s=10, clock=lambda: float(next(t)))
    assert res.num_iterations == 9
    assert res.num_infeasible >= 1 and all(c % 2 == 0 for c in [res.best_state])


def test_mcmc_patience_stops_a_chain_that_stopped_improving():
    """With ``patience`` P the chain is the same chain cut where P proposals in a row have not
    lowered the best cost (read off the full chain's trace), with that prefix's best state."""
    full = metropolis_hastings((0, 31), _grid_step, lambda s: _landscape(*s), beta=0.15, seed=3,
                               max_iterations=3000)
    best, last, cut = math.inf, 0, None
    for it, _, current, _ in full.trace:
        if current < best:
            best, last = current, it
        if it - last >= 40:
            cut = it
            break
    assert cut is not None and cut < 3000
    res = metropolis_hastings((0, 31), _grid_step, lambda s: _landscape(*s), beta=0.15, seed=3,
                              max_iterations=3000, patience=40)
    assert res.num_iterations == cut and res.trace == full.trace[:cut]
    assert res.best_cost == best and _landscape(*res.best_state) == best
    # a start that nothing beats: exactly P proposals
    flat = metropolis_hastings(0, lambda s, r: s + 1, lambda s: 0.0 if s == 0 else 1.0, beta=1.0,
                               max_iterations=1000, patience=25)
    assert flat.num_iterations == 25 and flat.best_state == 0


def _solve_and_compare_with_brute_force(nodes, edges, budget):
    """The ILP's optimum equals brute-force enumeration (or both find nothing that fits)."""
    want, _ = _brute_force_ilp(nodes, edges, budget)
    if not math.isfinite(want):
        with pytest.raises(InfeasibleError):
            solve_intra_op(nodes, edges, budget)
        return None
    sol = solve_intra_op(nodes, edges, budget)
    assert sol.cost_s == pytest.approx(want, rel=1e-7)
    assert sol.memory_bytes <= budget
    return sol
