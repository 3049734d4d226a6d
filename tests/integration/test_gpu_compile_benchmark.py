"""benchmarks/gpu_compile_fp8.py's CPU mode: the three-mode script runs end to end on a tiny
Llama (float8 skipped with its reason), the compiled mode trains like the eager one, and the
simulator's compiled step is not longer than its eager step.  The compile backend is
aot_eager here (dynamo + AOTAutograd, the runtime's wrapper and graph capture, without
inductor's C++ build, which the parity test tests/integration/test_runtime_compile.py already pays for)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.slow
def test_cpu_mode(tmp_path):
    import gpu_compile_fp8

    assert gpu_compile_fp8.main(["--cpu", "--backend", "aot_eager", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "gpu_compile_fp8.json").read_text())
    eager, compiled = d["modes"]["eager_bf16"], d["modes"]["compiled_bf16"]
    assert len(eager["losses"]) == d["steps"] == 3
    # aot_eager runs the same ATen ops as eager, in the same order: the same losses to fp32 rounding
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6)
    assert "no CUDA device" in d["modes"]["compiled_fp8"]["skipped"]
    assert 0 < d["simulated_step_s"]["compiled_bf16"] <= d["simulated_step_s"]["eager_bf16"]


@pytest.mark.slow
def test_cpu_mode_with_the_runtime_float8_path(tmp_path):
    """--fp8-on-cpu runs the compiled float8 mode through the runtime's float8 step
    (runtime/apply_fp8.py) on the CPU (torch._scaled_mm's CPU kernel; aot_eager): the blocks'
    linears converted, the output head left bf16, the loss within the issue's 1% of bf16's
    after 3 steps, and the simulator's fp8 step priced."""
    pytest.importorskip("torchao")
    import gpu_compile_fp8

    assert gpu_compile_fp8.main(["--cpu", "--fp8-on-cpu", "--backend", "aot_eager", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "gpu_compile_fp8.json").read_text())
    fp8 = d["modes"]["compiled_fp8"]
    blocks = {f"layers.{i}.{m}" for i in range(2) for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
                                                               "ffn.w1", "ffn.w2", "ffn.w3")}
    assert set(fp8["float8"]["converted"]) == blocks
    assert fp8["float8"]["left_bf16"] == {"output": "its layer's precision is bf16"}
    assert len(fp8["losses"]) == 3 and d["fp8_within_1pct"]
    assert d["simulated_step_s"]["compiled_fp8"] > 0
