"""Metropolis-Hastings search over any state (FlexFlow, Jia et al. 2019, Sec. 5).

FlexFlow explores the strategy space with a Markov chain whose proposals are random local
changes; a proposal with cost ``cost_new`` replaces the current one with probability
(Sec. 5.2, from the Metropolis-Hastings rule with a symmetric proposal)::

    accept = min(1, exp(beta * (cost_old - cost_new)))

so the chain's stationary distribution is proportional to exp(-beta * cost): improvements
are always taken, regressions sometimes, which lets the search leave local minima.  The
search stops at an iteration budget or a time budget, whichever comes first, or -- FlexFlow's
stop rule (Sec. 5.2: the search ends when it has not improved the best strategy found for half
of its budget) -- once ``patience`` proposals in a row have not improved on the best state;
it returns the best state seen.  States are opaque to this module: ``propose(state, rng) -> state`` and
``cost(state) -> float`` (``inf`` for a state that cannot run, never accepted).  Seeded: with
the same seed, proposal function, iteration budget and patience the chain is identical.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

import numpy as np

State = TypeVar("State")


@dataclass
class McmcResult(Generic[State]):
    best_state: State
    best_cost: float
    num_iterations: int
    num_accepted: int
    num_infeasible: int
    elapsed_s: float
    trace: list[tuple[int, float, float, bool]] = field(default_factory=list)
    # trace rows: (iteration, proposed cost, current cost after the step, accepted)


def acceptance_probability(cost_old: float, cost_new: float, beta: float) -> float:
    """min(1, exp(beta * (cost_old - cost_new))) (FlexFlow Sec. 5.2); 0 for an infeasible proposal."""
    if not math.isfinite(cost_new):
        return 0.0
    if not math.isfinite(cost_old) or cost_new <= cost_old:
        return 1.0
    return math.exp(beta * (cost_old - cost_new))


def metropolis_hastings(initial: State, propose: Callable[[State, np.random.Generator], State],
                        cost: Callable[[State], float], *, beta: float, seed: int = 0,
                        max_iterations: int = 10_000, time_budget_s: float | None = None,
                        patience: int | None = None, keep_trace: bool = True,
                        clock: Callable[[], float] = time.perf_counter) -> McmcResult[State]:
    """Run the chain from ``initial``; return the best state visited.  ``patience``: stop after
    that many proposals in a row that did not lower the best cost (None: never)."""
    rng = np.random.default_rng(seed)
    t0 = clock()
    current, current_cost = initial, float(cost(initial))
    best, best_cost = current, current_cost
    accepted = infeasible = 0
    trace: list[tuple[int, float, float, bool]] = []
    it = last_best = 0
    for it in range(1, max_iterations + 1):
        if time_budget_s is not None and clock() - t0 >= time_budget_s:
            it -= 1
            break
        candidate = propose(current, rng)
        candidate_cost = float(cost(candidate))
        if not math.isfinite(candidate_cost):
            infeasible += 1
        take = rng.random() < acceptance_probability(current_cost, candidate_cost, beta)
        if take:
            current, current_cost = candidate, candidate_cost
            accepted += 1
            if current_cost < best_cost:
                best, best_cost, last_best = current, current_cost, it
        if keep_trace:
            trace.append((it, candidate_cost, current_cost, take))
        if patience is not None and it - last_best >= patience:
            break
    return McmcResult(best_state=best, best_cost=best_cost, num_iterations=it, num_accepted=accepted,
                      num_infeasible=infeasible, elapsed_s=clock() - t0, trace=trace)
