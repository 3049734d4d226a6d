"""The plan's gradient compression: price the search's plans with each allowed compression of the
data-parallel reduce and keep, per plan, the one that pays.

The search ranks plans uncompressed; this step then prices each kept plan (best and runner-ups)
with every compression allowed for it (core/grad_compression.py ``compression_problem``) by the
same simulator (simulator/grad_compression.py) and keeps the fastest, the best plan re-picked if
that reorders them (search.keep_best_unless_beaten).

Allowed by default: the 16-bit cast of the plan's own precision on the wire (bf16 for a bf16
plan, fp16 for an fp16 one) -- the gradients are rounded once more, to the type the plan already
computes in ("lossless-enough"); an fp32 plan keeps fp32 gradients unless the user asks.  A cast
is kept only where it shortens the step by more than ``MIN_GAIN`` (5%): a rounding of every
gradient for less than that is not worth taking by default, so plans whose reduce is hidden by
compute, or cheap, stay as they were.  The same bar holds for PowerSGD where the user allows it.

PowerSGD changes the training (Vogels et al. 2019: a biased low-rank compressor with error
feedback), so it is priced only where the user allows it: ``--grad-compression powersgd:R`` fixes
it (the search then keeps to plans torch's hook runs on: DDP, ZeRO-0/1, no other axis), and
``--allow-lossy-compression`` adds ``POWERSGD_RANKS`` to the options compared.

``--grad-compression none|bf16|fp16`` fixes the compression of every plan that can take it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.errors import UserError
from autopar.core.parallel_dims import DEGREE_NAMES
from autopar.core.grad_compression import CASTS, GradCompression, compression_problem
from autopar.core.units import fmt_seconds
from autopar.planner.search import Evaluated, SearchResult, keep_best_unless_beaten

#: the smallest step-time gain for which a cast is chosen by default (a choice: see the docstring)
MIN_GAIN = 0.05
#: the PowerSGD ranks compared under --allow-lossy-compression: those of Vogels et al. 2019's
#: experiments (Sec. 5: rank 1, 2 and 4 on ResNet-18 / CIFAR-10, rank 4 on the LSTM)
POWERSGD_RANKS = (1, 2, 4)


@dataclass(frozen=True)
class CompressionChoice:
    compression: str
    why: str
    none_step_s: float
    chosen_step_s: float
    #: bytes a rank puts into the dp reduce per step with the chosen compression over without
    wire_fraction: float = 1.0

    def summary(self) -> str:
        if self.compression == "none":
            return f"gradient compression none ({self.why})"
        gain = self.none_step_s / self.chosen_step_s - 1.0 if self.chosen_step_s > 0 else 0.0
        return (f"gradient compression {self.compression} ({self.why}): predicted step "
                f"{fmt_seconds(self.chosen_step_s)} vs {fmt_seconds(self.none_step_s)} uncompressed "
                f"({gain:+.1%} throughput); the dp reduce carries {self.wire_fraction:.1%} of its uncompressed bytes")

    def to_dict(self) -> dict:
        return {"grad_compression": self.compression, "why": self.why, "none_step_s": self.none_step_s,
                "chosen_step_s": self.chosen_step_s, "wire_fraction": self.wire_fraction}


def constrain_for(fixed: str | None, options):
    """The search's options for a fixed PowerSGD (DDP plans only: ZeRO-0/1, dp alone); UserError
    where the user fixed a knob that contradicts it.  Other values leave the options as they are."""
    if fixed is None or not GradCompression.parse(fixed).lossy:
        return options
    fixed_degrees = {**options.degrees, "ep": options.ep}
    clash = [f"--{n} {d}" for n, d in fixed_degrees.items() if n != "dp" and (d or 1) > 1]
    if options.zero is not None and options.zero >= 2:
        clash.append(f"--zero {options.zero}")
    if clash:
        raise UserError(f"--grad-compression {fixed} runs as torch's DDP communication hook (powerSGD_hook), which only "
                        f"plans with ZeRO-0/1 and data parallelism alone use, but {' and '.join(clash)} asks for "
                        f"another kind. Drop {' and '.join(clash)}, or use --grad-compression bf16 / fp16.")
    return replace(options, degrees={**options.degrees, **{n: 1 for n in DEGREE_NAMES if n != "dp"}},
                   zero_families=("ddp", "zero1"))


def options_for(plan, fixed: str | None, allow_lossy: bool) -> list[str]:
    """The compressions priced for ``plan``: "none" and those allowed (module docstring)."""
    if fixed is not None:
        return [fixed] if compression_problem(fixed, plan.mesh, plan.zero) is None else ["none"]
    out = ["none"]
    if plan.precision in CASTS:
        out.append(plan.precision)
    if allow_lossy:
        out += [f"powersgd:{r}" for r in POWERSGD_RANKS]
    return [c for c in out if compression_problem(c, plan.mesh, plan.zero) is None]


def choose_compression(result: SearchResult, graph, cluster, cost_models, fixed: str | None, allow_lossy: bool,
                       memory_headroom: float = 0.0) -> tuple[SearchResult, CompressionChoice]:
    """The result with every kept plan's ``grad_compression`` decided (``fixed``: by the user) and
    re-priced on the cluster as the search saw it (``memory_headroom``)."""
    from autopar.core.errors import InfeasibleError
    from autopar.planner.headroom import with_headroom
    from autopar.simulator.api import PlanEvaluator, plan_cost_models

    seen = with_headroom(cluster, memory_headroom)
    evaluators: dict[str, PlanEvaluator] = {}

    def price(plan):
        key = plan.grad_compression
        if key not in evaluators:
            evaluators[key] = PlanEvaluator(graph, seen, plan_cost_models(plan, cost_models))
        try:
            return evaluators[key].evaluate(plan)
        except InfeasibleError:
            return None

    choices = []
    for item in [result.best] + list(result.runner_ups):
        base = replace(item.plan, grad_compression="none")
        none = item.result if item.plan.grad_compression == "none" else price(base)
        best_c, best_r = "none", none
        for c in options_for(item.plan, fixed, allow_lossy):
            if c == "none":
                continue
            r = price(replace(item.plan, grad_compression=c))
            if r is None or not r.fits:
                continue
            if fixed is not None or (r.step_time_s < best_r.step_time_s and
                                     r.step_time_s < none.step_time_s * (1.0 - MIN_GAIN)):
                best_c, best_r = c, r
        if best_c == "none":
            why = (f"--grad-compression {fixed} cannot run on this plan" if fixed not in (None, "none") else
                   "--grad-compression none" if fixed == "none" else
                   "no data-parallel reduce to compress" if item.plan.mesh.grad_degree <= 1 else
                   f"fp32 plan: gradients stay fp32 unless --grad-compression asks" if item.plan.precision == "fp32"
                   and not allow_lossy else f"saves less than {MIN_GAIN:.0%} of the step")
            chosen = Evaluated(item.candidate, base, none)
        else:
            why = (f"--grad-compression {fixed}" if fixed is not None else
                   f"--allow-lossy-compression: the fastest, saving more than {MIN_GAIN:.0%} of the step"
                   if GradCompression.parse(best_c).lossy else
                   f"network-bound reduce: saves more than {MIN_GAIN:.0%} of the step")
            plan = replace(item.plan, grad_compression=best_c)
            chosen = Evaluated(item.candidate, plan.with_predicted(best_r.predicted_dict()) if item.plan.predicted
                               else plan, best_r)
        choices.append((chosen, CompressionChoice(best_c, why, none.step_time_s, best_r.step_time_s,
                                                  wire_fraction(graph, chosen.plan))))
    return keep_best_unless_beaten(result, choices)


def wire_fraction(graph, plan) -> float:
    """Bytes of the dp reduce per step under the plan's compression over those without
    (simulator/grad_compression.py ``compressed_fraction``)."""
    from autopar.simulator.api import compressed_fraction

    return compressed_fraction(graph, plan.grad_compression)
