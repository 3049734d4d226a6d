"""benchmarks/grad_compression_runs.py: the published PowerSGD runs load with their source and
assumptions, and their pricing runs through the simulator (DDP with torch's PowerSGD hook against
one GPU).  Not a test of the error's size."""
import copy
from pathlib import Path

import pytest
from plain_loop import load          # a file loaded as a module once, cached in sys.modules

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load(ROOT / "benchmarks" / "grad_compression_runs.py")


def test_rows_load_with_source_and_assumptions(bench):
    runs = bench.load_runs()
    assert [(r["gpus"], r["published_speedup"]) for r in runs["rows"]] == [(4, 3.5), (6, 5.23), (8, 5.46)]
    common = runs["common"]
    assert common["source"]["url"] == "https://github.com/pytorch/pytorch/issues/74148"
    assert all(v["why"] for v in common["assumed"].values())
    assert common["priced_as"]["layout"]["grad_compression"] == "powersgd:1"
    assert all(x["why_not_a_row"] and x["source"]["url"] for x in runs["read_but_not_runs"])
    assert (ROOT / common["priced_as"]["cluster"]).exists() and (ROOT / common["priced_as"]["model"]["file"]).exists()


def test_pricing_runs_and_the_speedup_is_its_ratio(bench):
    """The rows' pricing path on 64 x 64 images at micro-batch 2, so that the capture stays fast:
    speed-up = N x one GPU's step / N GPUs' step, error = speed-up / published - 1."""
    runs = bench.load_runs()
    common = copy.deepcopy(runs["common"])
    common["priced_as"]["model"]["args"] = {"image": 64}
    p = bench.price_row(runs["rows"][0], common, {}, micro_batch=2)
    assert p["one_gpu_step_s"] > 0 and p["step_s"] > 0
    assert p["predicted_speedup"] == pytest.approx(4 * p["one_gpu_step_s"] / p["step_s"])
    assert p["error"] == pytest.approx(p["predicted_speedup"] / 3.5 - 1)
    assert 0 < p["predicted_speedup_uncompressed"] <= 4 + 1e-9


def test_resnet50_has_torchvisions_parameter_count():
    """benchmarks/models/resnet50.py written out as torchvision's resnet50: 25,557,032 parameters
    (torchvision's model card), counted on meta."""
    import torch

    model_file = load(ROOT / "benchmarks" / "models" / "resnet50.py")
    with torch.device("meta"):
        model = model_file.build_model()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
