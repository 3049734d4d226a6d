"""How sure a prediction is: the validation error of its plan family against published runs.

benchmarks/published_runs.py prices published training runs (Megatron-LM PTD-P, DeepSpeed ZeRO-3,
FSDP) and commits, per family and GPU type, the median |error| and the mean signed error of the
predicted throughput (benchmarks/results/published_runs.json).  A plan's family is what its
runtime runs: any layer sharded (ZeRO-2/3: FSDP2) -> "FSDP"; otherwise "PTD-P" (DDP or
ZeRO-1 with tensor and pipeline parallelism, Megatron-LM's family, plain data parallel included).

Those families price each published run as *its own* software ran it (FSDP1, Megatron-LM,
DeepSpeed).  The plans autopar prints run on autopar's runtime, whose price is validated by the
``AUTOPAR`` family: published runs of the same stack (FSDP2, eager; torchtitan's Table 1), priced
with autopar's own training code.  So where that family has rows for the plan's GPU die and the
plan is one of that stack's kind (sharded: FSDP2), its figures are the plan's; otherwise the
mechanism family above stands in (on H100 the two differ by far: FSDP/h100 reads 2%, AUTOPAR
on H100 20%).

The band: a runner-up whose predicted step is within the winner's family's median |error| of
the winner's is too close to call -- the simulator's error on such plans is as large as the
gap.  Among the plans inside the band the one of the better-validated family (smaller median
|error|) is preferred, unless the winner's family is the better one already or no figures exist.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: the committed results of benchmarks/published_runs.py (absent from an installed wheel)
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "published_runs.json"
#: profile name -> the GPU key of the results; H200 runs the H100's GH100 compute die, as does the
#: 96 GB HBM2e, 500 W H100 variant (profiles/h100-sxm-96gb-500w.json)
GPU_KEY = {"a100-80gb-sxm": "a100", "h100-sxm": "h100", "h200": "h100", "h100-sxm-96gb-500w": "h100"}
#: the family of rows priced as autopar's own runtime ran them (benchmarks/published_runs.py)
OWN_RUNTIME = "AUTOPAR"


@dataclass(frozen=True)
class FamilyError:
    family: str
    gpu: str
    median_abs: float       # fraction, e.g. 0.08
    mean_signed: float
    rows: int

    def describe(self) -> str:
        return (f"{self.family} plans on {self.gpu}: median |error| {100 * self.median_abs:.1f}%, mean signed "
                f"{100 * self.mean_signed:+.1f}% over {self.rows} published runs")


def plan_family(plan) -> str:
    return "FSDP" if any(lp.zero >= 2 for lp in plan.layers) else "PTD-P"


def load_family_errors(path: Path = RESULTS) -> dict[str, FamilyError]:
    """"FAMILY/gpu" -> FamilyError from the committed results; {} when the file is absent."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    out = {}
    for key, s in (data.get("families") or {}).items():
        if s.get("rows"):
            fam, gpu = key.split("/")
            out[key] = FamilyError(fam, gpu, float(s["median_abs"]), float(s["mean_signed"]), int(s["rows"]))
    return out


def own_runtime_error(gpu: str, errors: dict[str, FamilyError]) -> FamilyError | None:
    """The AUTOPAR rows on GPUs of die ``gpu`` ("h100"), pooled: the rows of every variant of the die
    (the results key a row by its variant, "AUTOPAR/h100-96gb-500w"), weighted by their row counts."""
    own = [fe for key, fe in errors.items()
           if key.split("/")[0] == OWN_RUNTIME and (fe.gpu == gpu or fe.gpu.startswith(gpu + "-"))]
    if not own:
        return None
    if len(own) == 1:
        return own[0]
    n = sum(fe.rows for fe in own)
    # a pooled median is not recoverable from per-variant medians; the row-weighted mean of them is
    # the stated stand-in until the results keep AUTOPAR rows per die
    return FamilyError(OWN_RUNTIME, gpu, sum(fe.median_abs * fe.rows for fe in own) / n,
                       sum(fe.mean_signed * fe.rows for fe in own) / n, n)


def family_error(plan, gpu_profile: str, errors: dict[str, FamilyError]) -> FamilyError | None:
    """The validation figures that apply to ``plan`` on ``gpu_profile``: autopar's own runtime's
    (AUTOPAR) for a sharded plan where that family has rows on the die, else the mechanism family's."""
    gpu = GPU_KEY.get(gpu_profile)
    if not gpu:
        return None
    family = plan_family(plan)
    if family == "FSDP":
        own = own_runtime_error(gpu, errors)
        if own is not None:
            return own
    return errors.get(f"{family}/{gpu}")


def too_close(best_step_s: float, other_step_s: float, band: float) -> bool:
    """True when ``other`` is within ``band`` (a fraction) of the best predicted step."""
    return other_step_s <= best_step_s * (1.0 + band)


def choose(steps: list[float], errors: list[FamilyError | None]) -> tuple[int, list[bool], str]:
    """(index of the plan to prefer, too-close mark per plan, why).

    ``steps[0]`` is the fastest predicted plan.  The band is its family's median |error|; plans
    inside it are marked; among them the one whose family has the smallest median |error| is
    preferred (the fastest of those on a tie); the winner stays when its family is as well
    validated as any inside the band, or when it has no figures.
    """
    best_err = errors[0]
    if best_err is None:
        return 0, [False] * len(steps), "no validation figures for this plan family and GPU"
    band = best_err.median_abs
    close = [i > 0 and too_close(steps[0], s, band) for i, s in enumerate(steps)]
    pick = 0
    for i in range(1, len(steps)):
        e = errors[i]
        if close[i] and e is not None and e.median_abs < errors[pick].median_abs:
            pick = i
    if pick == 0:
        why = "the fastest plan's family is validated as well as any plan within its error band"
    else:
        why = (f"runner-up {pick} is predicted within the fastest plan's error band ({100 * band:.1f}%) and its family "
               f"is validated better ({100 * errors[pick].median_abs:.1f}% vs {100 * band:.1f}% median |error|)")
    return pick, close, why


def apply(result, cluster, errors: dict[str, FamilyError] | None = None, reorder: bool = True):
    """The search result with the preferred plan first, and per plan (best first) its FamilyError,
    too-close mark and the reason: (result, [FamilyError|None], [bool], why).  With
    ``reorder=False`` the order is kept and only the errors and marks are computed."""
    from dataclasses import replace

    errors = load_family_errors() if errors is None else errors
    gpu = cluster.groups[0].gpu if len({g.gpu for g in cluster.groups}) == 1 else None
    plans = [result.best] + list(result.runner_ups)
    errs = [family_error(ev.plan, gpu, errors) if gpu else None for ev in plans]
    pick, _, why = choose([ev.step_time_s for ev in plans], errs)
    if pick and reorder:
        plans = [plans[pick]] + plans[:pick] + plans[pick + 1:]
        errs = [errs[pick]] + errs[:pick] + errs[pick + 1:]
        result = replace(result, best=plans[0], runner_ups=plans[1:])
    band = errs[0].median_abs if errs[0] else 0.0
    close = [i > 0 and errs[0] is not None and too_close(plans[0].step_time_s, ev.step_time_s, band)
             for i, ev in enumerate(plans)]
    return result, errs, close, why
