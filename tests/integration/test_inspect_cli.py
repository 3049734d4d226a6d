"""The inspect verb end to end (in process)."""
from __future__ import annotations

import json
from pathlib import Path

from autopar.cli import main as cli_main

GPT = str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")


def test_inspect_json_gpt3_175b_on_meta(capsys):
    rc = cli_main(["inspect", GPT, "--model-arg", "size=gpt3-175b", "--batch-size", "8", "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    # Brown et al. 2020, Table 2.1: 175.0B (this model's untied head adds 0.6B)
    assert abs(s["params"] - 50257 * 12288 - 175.0e9) / 175.0e9 < 0.01
    assert len(s["layers"]) == 98 and s["layers"][1]["name"] == "blocks.0"
    # Narayanan et al. 2021 Appendix, no recompute: 72 B s l h^2 (1 + s/6h + V/12lh)
    B, s_, l, h, V = 8, 2048, 96, 12288, 50257
    megatron = 72 * B * s_ * l * h * h * (1 + s_ / (6 * h) + V / (12 * l * h))
    assert megatron <= s["flops_per_step"] <= 1.05 * megatron
    assert s["capture_method"] == "symbolic_trace" and s["sequential_layers"] is True


def test_inspect_table_folds_identical_layers(capsys):
    rc = cli_main(["inspect", GPT, "--model-arg", "layers=4", "--model-arg", "hidden=64",
                   "--model-arg", "heads=4", "--model-arg", "seq=32", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "blocks.0-3 (x4)" in out and "ONE layer" in out and "capture: symbolic_trace" in out
    rc = cli_main(["inspect", GPT, "--model-arg", "layers=2", "--model-arg", "hidden=64",
                   "--model-arg", "heads=4", "--model-arg", "seq=32", "--all"])
    out = capsys.readouterr().out
    assert "blocks.1" in out and "(x2)" not in out
