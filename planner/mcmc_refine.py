"""The MCMC search (FlexFlow style, Jia et al. 2019): Metropolis-Hastings over whole plans with
the simulator as the cost and random local moves (moves.py), started from the best structured
plans or, for ``algo="mcmc"``, from plain corners of the space (``start_candidates``); a chain
stops early once half its iteration budget has passed without a better plan (mcmc.py).

``McmcRefine`` is that part of ``search.Planner``; it reads the planner's ``options``,
``meshes``, ``moves``, ``styles``, ``num_layers``, ``seen`` and ``progress``, and prices through
``CandidatePricing.price``.
"""
from __future__ import annotations

import math
import time

from autopar.core.plan import equal_bounds
from autopar.planner.candidate import Candidate
from autopar.planner.candidate_pricing import Evaluated
from autopar.planner.mcmc import metropolis_hastings
from autopar.planner.moves import propose
from autopar.planner.space import LayerChoice, microbatch_candidates


class McmcRefine:
    """Plain starting plans, and the chains that refine starting plans."""

    def start_candidates(self) -> list[Candidate]:
        """Plain starts for MCMC alone: every mesh, fewest micro-batches, its smallest-memory corner too."""
        o = self.options
        out = []
        for mesh in self.meshes:
            mbs = microbatch_candidates(o.global_batch, mesh.batch_degree, max_micro_batch=o.max_micro_batch,
                                        refused=o.refused_micro_batches)
            if o.micro_batch is not None:
                mbs = [x for x in microbatch_candidates(o.global_batch, mesh.batch_degree,
                                                        refused=o.refused_micro_batches) if x[0] == o.micro_batch]
            if not mbs:
                continue
            corners = [("ddp", "none", "none"), ("zero1", "none", "none"),
                       ("fsdp", "full", o.offload_tier if o.allow_offload else "none")]
            for family, rc, off in corners:
                if family not in o.zero_families or (family == "zero1" and "ddp" in o.zero_families):
                    continue
                if o.offload is not None:
                    off = o.offload
                mb, m = mbs[-1] if family != "fsdp" else mbs[0]
                zero = o.zero if o.zero is not None else {"ddp": 0, "zero1": 1, "fsdp": 3}[family]
                choices = tuple(LayerChoice(tp=mesh.tp > 1 and bool(self.styles[i]), zero=zero,
                                            recompute=rc if rc in o.recompute else o.recompute[-1],
                                            offload=off) for i in range(self.num_layers))
                schedule = o.fixed_schedule if mesh.pp > 1 and o.fixed_schedule in ("1f1b", "gpipe") else "1f1b"
                out.append(Candidate(mesh=mesh, micro_batch=mb, num_microbatches=m, schedule=schedule,
                                     bounds=self._cuttable_bounds(mesh.pp), choices=choices))
        return out

    def _cuttable_bounds(self, num_stages: int) -> tuple[int, ...]:
        """Equal stages, each boundary moved to the nearest layer where a stage may start."""
        bounds = list(equal_bounds(self.num_layers, num_stages))
        ex = self.options.executable
        if ex is None or num_stages == 1 or not ex.cuttable:
            return tuple(bounds)
        cuts = sorted(ex.cuttable)
        for k in range(1, num_stages):
            bounds[k] = min((c for c in cuts if bounds[k - 1] < c < self.num_layers),
                            key=lambda c: abs(c - bounds[k]), default=bounds[k])
        return tuple(bounds)

    def refine(self, starts: list[Evaluated], deadline: float) -> list[Evaluated]:
        o = self.options
        found: list[Evaluated] = []
        for n, start in enumerate(starts):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            budget_s = remaining / (len(starts) - n)
            ref = start.step_time_s

            def cost(c: Candidate) -> float:
                ev = self.price(c)
                return ev.step_time_s / ref if ev is not None else math.inf

            def step(c: Candidate, rng) -> Candidate:
                return propose(c, rng, self.moves)

            done = [0]

            def tick(c: Candidate, rng) -> Candidate:
                done[0] += 1
                if done[0] % 50 == 0:
                    self.progress(f"MCMC refine {n + 1}/{len(starts)}", done[0], o.mcmc_iterations)
                return step(c, rng)

            patience = o.mcmc_patience if o.mcmc_patience is not None else max(1, o.mcmc_iterations // 2)
            res = metropolis_hastings(start.candidate, tick, cost, beta=o.mcmc_beta, seed=o.seed + n,
                                      max_iterations=o.mcmc_iterations, time_budget_s=budget_s, patience=patience,
                                      keep_trace=False)
            best = self.seen.get(res.best_state)
            if best is not None:
                found.append(best)
        return found
