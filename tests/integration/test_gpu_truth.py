"""benchmarks/gpu_truth.py as a lent GPU would run it, here in its tiny mode on the CPU (fp32), with
ortools made unimportable (the GPU machine has none): the profile it writes follows the schema,
holds the Llama block's op shapes with their closed-form FLOPs and is what the cost model reads;
each plan it runs is the configuration it names, and the figures it saves are the runs' own."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiproc
def test_gpu_truth_tiny_mode_measures_ops_runs_plans_and_prices_them(tmp_path):
    blocker = tmp_path / "no_ortools" / "ortools"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('ortools is not installed on the GPU machine')\n")
    out = tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(blocker.parent), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "benchmarks/gpu_truth.py", "--tiny", "--no-overheads", "--steps", "3",
           "--configs", "eager,fsdp2 selective", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    from autopar.profiles import load_profile
    from autopar.simulator.device.cost_model import CostModel

    # (a) the profile: valid, its command recorded, the Llama block's shapes at their closed forms
    prof = load_profile(out / "measured-profile.json")
    assert "benchmarks/gpu_truth.py --tiny" in prof["measured_by"]
    h, heads, kv, ffn, seq, vocab, mb = 64, 4, 2, 172, 64, 512, 2
    t, hd = mb * seq, h // heads
    linears = {tuple(r["shape"]): r for r in prof["op_table"] if r["kind"] == "linear"}
    assert set(linears) == {(t, h, h), (t, h, kv * hd), (t, h, ffn), (t, ffn, h), (t, h, vocab)}
    for (m, k, n), r in linears.items():
        assert r["flops"] == 2.0 * m * k * n
    # causal SDPA forward + backward at the step's tokens, seq/8 .. seq, as the flash2 causal series
    attn = sorted((r for r in prof["op_table"] if r["kind"] == "attention"), key=lambda r: r["shape"][2])
    assert [r["shape"] for r in attn] == [[t // s, heads, s, hd] for s in (8, 16, 32, 64)]
    assert all(r["variant"] == "sdpa_causal_fwd_bwd" and r["reference"] for r in attn)
    assert all(r["flops"] == 12.0 * b * hh * s * s * d for r in attn for b, hh, s, d in [r["shape"]])
    published = [[s, round(4.0 * b * hh * s * s * d / 2 * 3.5 / r["measured_seconds"] / 1e12, 3)]
                 for r in attn for b, hh, s, d in [r["shape"]]]
    assert prof["attention_kernels"]["flash2"]["causal"][str(hd)] == published
    variants = {(r["kind"], r["variant"]) for r in prof["op_table"]}
    assert {("norm", "rms_norm"), ("elementwise", "gelu"), ("copy", "copy"), ("elementwise", "silu"),
            ("elementwise", "rope"), ("loss", "cross_entropy_fwd_bwd"), ("loss", "cross_entropy_fp32_fwd_bwd")} <= variants
    assert all(r.get("reference") for r in prof["op_table"]
               if r["variant"] in ("silu", "rope", "cross_entropy_fwd_bwd", "cross_entropy_fp32_fwd_bwd"))
    assert not any(r.get("reference") for r in prof["op_table"] if r["kind"] in ("linear", "norm", "copy"))
    # the cost model prices a linear of a measured shape at its measured (isotonic) time
    cm = CostModel.from_profile(prof)
    r = linears[(t, h, kv * hd)]
    sec, measured = cm.compute_time_ex("linear", r["flops"], r["bytes"], "fp32", variant="linear")
    assert measured and sec == pytest.approx(r["seconds"])
    assert cm._curve("attention", "sdpa", "fp32") is None     # no forward-only curve replaces the fwd+bwd rates
    assert not (ROOT / "profiles" / "cpu-tiny-measured.json").exists()

    # (b) + (c) the plans ran through the runtime as named; the figures are the runs' and the plans'
    saved = json.loads((out / "gpu_truth.json").read_text())
    assert saved["precision"] == "fp32" and saved["device"] == "cpu"
    assert [p["name"] for p in saved["plans"]] == ["eager", "fsdp2 selective"]
    for row, (zero, recompute) in zip(saved["plans"], [(0, "none"), (3, "selective")]):
        run_dir = out / row["name"].replace(" ", "_")
        plan = json.loads((run_dir / "plan.json").read_text())
        assert plan["mesh"]["world_size"] == 1 and plan["precision"] == "fp32"
        assert {lp["zero"] for lp in plan["layers"]} == {zero}
        blocks = [lp["recompute"] for lp in plan["layers"] if lp["recompute"] != "none"]
        assert (recompute == "none" and not blocks) or (blocks and set(blocks) == {recompute})
        measured = json.loads((run_dir / "measured.json").read_text())
        assert measured["world_size"] == 1 and all(math.isfinite(x) for x in measured["losses"])
        assert row["measured"]["step_s"] == pytest.approx(measured["step_time_s"])
        assert set(row["simulated"]) == {"local-cpu", "measured-profile"}
        # the plan carries the measured profile's price, and the error is against the run's own step
        sim = row["simulated"]["measured-profile"]
        assert sim["step_s"] == pytest.approx(plan["predicted"]["step_time_s"])
        assert sim["step_error"] == pytest.approx(sim["step_s"] / measured["step_time_s"] - 1)


def test_sustained_clock_figures_are_second_half_medians():
    """The clock under sustained load is read once the board has settled: medians over the
    second half of the samples, a reading NVML did not give left out."""
    from plain_loop import load

    truth = load(ROOT / "benchmarks" / "gpu_truth.py")
    samples = [{"t_s": float(i), "sm_clock_MHz": c, "power_W": p, "tflops": f}
               for i, (c, p, f) in enumerate([(1980, 300, 700), (1980, 690, 760), (1755, 700, 700),
                                              (1710, 700, 680), (1740, None, 690), (1725, 699, 685)], start=1)]
    s = truth.summarize_clock_samples(samples)
    # second half: t >= 3 -> clocks 1755, 1710, 1740, 1725; power 700, 700, 699; TFLOP/s 700, 680, 690, 685
    assert (s["samples"], s["seconds"]) == (6, 6.0)
    assert s["sm_clock_MHz"] == (1725 + 1740) / 2 and s["power_W"] == 700 and s["tflops"] == (685 + 690) / 2
    assert truth.summarize_clock_samples([])["sm_clock_MHz"] is None
