"""planner/confidence.py: the validation band and the preference for a better-validated family."""
from autopar.planner.confidence import FamilyError, choose, too_close

FSDP = FamilyError("FSDP", "a100", 0.12, 0.08, 15)
PTDP = FamilyError("PTD-P", "a100", 0.04, -0.01, 13)


def test_band_marks_runner_ups_within_the_winners_error():
    assert too_close(1.0, 1.10, 0.12) and not too_close(1.0, 1.13, 0.12)
    pick, close, _ = choose([1.0, 1.05, 1.20], [FSDP, FSDP, FSDP])
    assert pick == 0 and close == [False, True, False]


def test_better_validated_family_inside_the_band_is_preferred():
    pick, close, why = choose([1.0, 1.05, 1.10], [FSDP, FSDP, PTDP])
    assert pick == 2 and close == [False, True, True] and "validated better" in why
    # outside the band the faster plan stays
    pick, _, _ = choose([1.0, 1.20], [FSDP, PTDP])
    assert pick == 0
    # a better-validated winner keeps its place; no figures: no band
    assert choose([1.0, 1.01], [PTDP, FSDP])[0] == 0
    assert choose([1.0, 1.01], [None, PTDP])[:2] == (0, [False, False])


def test_committed_figures_are_the_benchmarks_rows():
    """The band reads the committed per-family figures of benchmarks/published_runs.py, each the
    median |error| of that family's rows in the same file; the planner's plans (FSDP2 or PTD-P)
    never take the DeepSpeed ZeRO-3 family's figures."""
    import json
    import statistics

    import pytest

    from autopar.planner.confidence import RESULTS, load_family_errors

    if not RESULTS.exists():
        pytest.skip("no committed benchmarks/results/published_runs.json")
    errs = load_family_errors()
    rows = json.loads(RESULTS.read_text())["rows"]
    assert {"FSDP/a100", "FSDP/h100", "PTD-P/a100"} <= set(errs)
    for key, fe in errs.items():
        fam, gpu = key.split("/")
        vals = [r["error"] for r in rows if r["family"] == fam and r["gpu"] == gpu]
        assert fe.rows == len(vals)
        assert fe.median_abs == pytest.approx(statistics.median(abs(v) for v in vals))
        assert fe.mean_signed == pytest.approx(sum(vals) / len(vals))


def test_a_sharded_plan_on_h100_takes_autopar_s_own_runtime_figures():
    """A plan autopar prints runs on its own runtime: where the AUTOPAR family (published runs of
    FSDP2, priced with autopar's training code) has rows on the plan's die, a sharded plan takes its
    figures, on every profile of that die; a PTD-P plan and an A100 plan keep the mechanism family's."""
    from types import SimpleNamespace

    from autopar.planner.confidence import family_error

    own = FamilyError("AUTOPAR", "h100-96gb-500w", 0.20, 0.20, 1)
    fsdp_h100 = FamilyError("FSDP", "h100", 0.02, -0.01, 4)
    errors = {"AUTOPAR/h100-96gb-500w": own, "FSDP/h100": fsdp_h100, "FSDP/a100": FSDP, "PTD-P/a100": PTDP}
    sharded = SimpleNamespace(layers=[SimpleNamespace(zero=3)])
    ddp = SimpleNamespace(layers=[SimpleNamespace(zero=0)])
    for profile in ("h100-sxm", "h100-sxm-96gb-500w", "h200"):
        assert family_error(sharded, profile, errors) is own
    assert family_error(sharded, "a100-80gb-sxm", errors) is FSDP
    assert family_error(ddp, "a100-80gb-sxm", errors) is PTDP
    assert family_error(ddp, "h100-sxm", errors) is None
    # two variants of a die pool by row count
    errors["AUTOPAR/h100"] = FamilyError("AUTOPAR", "h100", 0.10, -0.10, 3)
    pooled = family_error(sharded, "h100-sxm", errors)
    assert pooled.rows == 4 and abs(pooled.median_abs - (0.20 + 3 * 0.10) / 4) < 1e-12
