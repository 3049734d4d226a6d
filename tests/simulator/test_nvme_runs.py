"""benchmarks/nvme_runs.py: the published NVMe-offload runs load with their sources, their own
figures agree with hand derivations, and a priced row's pricing runs through the simulator.  Not a
test of the error's size."""
import copy
from pathlib import Path

import pytest
from plain_loop import load          # a file loaded as a module once, cached in sys.modules

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load(ROOT / "benchmarks" / "nvme_runs.py")


def test_rows_load_with_sources_and_reasons(bench):
    runs = bench.load_runs()
    assert {r["id"] for r in runs["rows"]} == {"ds1776_50b_dgx2_nvme", "dse192_10b_2x_a100pcie40_nvme"}
    for r in runs["rows"]:
        assert r["source"]["url"].startswith("https://github.com/") and r["source"]["location"]
        assert r["priced_as"]["layout"]["offload"] == "nvme"
        assert r["not_modelled"] and all(x["what"] and x["detail"] for x in r["not_modelled"])
    for x in runs["read_but_not_runs"]:
        assert x["source"]["repo"] and x["source"]["path"] and x["source"]["commit"] and x["why_not_a_row"]


def test_issue_1776_figures_fix_the_inferred_shape(bench):
    """By hand: 62 layers of hidden 8192 (12 h^2 + 13 h each), Megatron's padded GPT-2 vocabulary
    50304 and 1024 positions, final layernorm -> the log's 50.356 B; DeepSpeedExamples' formula
    P x b x s x 8 / (t x 1000) at b = 26, s = 1024, t = 298.9101 s -> the log's 35.88."""
    row = {r["id"]: r for r in bench.load_runs()["rows"]}["ds1776_50b_dgx2_nvme"]
    h, l = 8192, 62
    params = l * (12 * h * h + 13 * h) + (50304 + 1024) * h + 2 * h
    assert params == 50_356_092_928
    assert round(params / 1e9, 3) == row["stated"]["total_parameters_B"]
    assert round(50.356 * 26 * 1024 * 8 / 298.9101 / 1000, 2) == row["stated"]["tflops_per_gpu"]
    got = {what.split(" ")[0]: (stated, derived) for what, stated, derived in bench.checks(row)}
    assert got["parameters"] == (50.356, 50.356) and got["TFLOP/s"] == (35.88, 35.88)
    stated, derived = got["iteration"]
    assert derived == pytest.approx(stated, rel=1e-4)        # the log's parts sum to its iteration


def test_priced_row_runs_through_the_simulator(bench):
    """The 50B row's pricing path (cluster file, V100 profile, DeepSpeed's ZeRO-3, the NVMe tier)
    on a 2-block copy of its model of hidden 1024, so that the capture stays fast: a positive iteration, the
    run's own TFLOP/s formula applied to it, the error against the published iteration."""
    row = copy.deepcopy({r["id"]: r for r in bench.load_runs()["rows"]}["ds1776_50b_dgx2_nvme"])
    row["priced_as"]["model"]["args"].update(layers=2, hidden=1024, heads=8)
    p = bench.price_row(row, {})
    assert p["predicted_iteration_s"] > 0 and p["published_iteration_s"] == pytest.approx(298.9101)
    assert p["predicted_tflops_per_gpu"] == pytest.approx(50.356 * 26 * 1024 * 8 / (p["predicted_iteration_s"] * 1000))
    assert p["error"] == pytest.approx(298.9101 / p["predicted_iteration_s"] - 1)
    assert p["nvme_GB_per_node"] > 0                        # the optimizer's moments went to the drives
    phases = p["predicted_phases_s"]                        # the log's split of the step, predicted
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) == pytest.approx(p["predicted_iteration_s"])
    assert p["published_phases_s"] == pytest.approx({"forward_s": 53.56519, "backward_s": 152.70214,
                                                     "optimizer_s": 92.63716})
    # the optimizer as DeepSpeed ran it, by hand: the node's 16 ranks step all its trainable
    # parameters (the moments' bytes / 8) on one host at the profile's 1e9 per node, and the
    # node's moments are read and written at the cluster file's 28 GB/s each, serially (the row's
    # nvme_swap_overlapped false: no compute hides them)
    moments = p["nvme_GB_per_node"] * 1e9
    assert phases["optimizer_s"] == pytest.approx(moments / 8 / 1e9 + 2 * moments / 28e9, rel=1e-9)


def test_issue_192_iteration_from_its_tflops(bench):
    """No iteration in the text: the one its 1.5 TFLOP/s stands for under the code's formula, by
    hand: 50 layers of hidden 4096 -> 10.279 B parameters; 10.279 x 8 x 1024 x 8 / (1.5 x 1000)."""
    row = copy.deepcopy({r["id"]: r for r in bench.load_runs()["rows"]}["dse192_10b_2x_a100pcie40_nvme"])
    h, l = 4096, 50
    assert round((l * (12 * h * h + 13 * h) + (50304 + 1024) * h + 2 * h) / 1e9, 3) == 10.279
    row["priced_as"]["model"]["args"].update(layers=2, hidden=1024, heads=8)
    p = bench.price_row(row, {})
    assert p["iteration_from_tflops"] and p["published_iteration_s"] == pytest.approx(10.279 * 8 * 1024 * 8 / 1500)
