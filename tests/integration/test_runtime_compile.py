"""Parity of compiled plans: regional torch.compile under DDP, FSDP2 (+ recompute, + offload), TP and PP
trains like the plain eager loop (tests/plain_loop.py, which never compiles).

Cost: one torchrun launch (2 ranks, gloo, fp32) for every case, the 4-block test GPT (the
smallest that still has repeated blocks and two pipeline stages of two layers), 3 steps.
Measured on the shared 2-core machine: 106 s for the launch with an empty inductor cache (load
~5), 381 s under load ~12 with part of it cached.  Every case runs micro-batches of 2 (the pipeline
case 2 x 2, not 1 x 4): the pipeline stages' blocks then compile to the kernels the data-parallel
cases compiled (inductor's FX graph cache), and the whole file took 103 CPU-s with an empty cache
where it took 116 (``TORCHINDUCTOR_CACHE_DIR`` empty, idle machine).
Dynamo compiles the block's forward once per distinct setting (plain tensors, DTensor under TP,
checkpointed) and later cases reuse it; inductor's FX graph cache (on by default, under
/tmp/torchinductor_$USER) makes a second session cheaper still.

Tolerance: the eager layouts' own (``runtime_support``: losses within 1e-5, parameters within
1e-5 except the noise-gradient elements).  Why it holds for compiled numerics: inductor's kernels
fuse the elementwise/norm chains and may reorder a reduction's additions and evaluate
exp/tanh/erf with vectorised approximations, each a few ulp of fp32 (eps = 2^-23 ~ 1.2e-7)
relative per op; the loss (~4.2) is a mean over 4 x 16 tokens after ~10 such reductions per
block, so the first-step loss moves by O(ulp(4.2)) = 4.8e-7 (measured: at most one ulp on every
case), twenty times inside 1e-5; AdamW divides the update by sqrt(v), so a relative gradient
error of a few ulp moves a parameter by ~lr x that error per step, far below 1e-5 after 3 steps.
The data-parallel layouts already reorder the gradient sums by as much and are held to the same
bound.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime_support import (ROOT, assert_matches_reference, make_plan, reference, torchrun, failure_summary,
                             worker_env)

STEPS = 3
CASES = {
    "ddp": dict(dp=2, micro_batch=2),
    "fsdp": dict(dp=2, micro_batch=2, zero=3),
    "fsdp_recompute_full": dict(dp=2, micro_batch=2, zero=3, recompute="full"),
    "fsdp_offload": dict(dp=2, micro_batch=2, zero=3, offload="cpu"),
    "tp2": dict(tp=2, micro_batch=2, num_microbatches=2),
    "pp2_1f1b": dict(pp=2, micro_batch=2, num_microbatches=2, schedule="1f1b"),
}
WORKER = Path(__file__).resolve().parents[1] / "compile_worker.py"


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    import time

    tmp = tmp_path_factory.mktemp("compiled")
    cases = [{"name": n, "plan": str(make_plan(tmp / f"{n}.json", compile=True, **kw)), "steps": STEPS,
              "measured": str(tmp / f"{n}.measured.json"), "checkpoint_dir": str(tmp / f"{n}.ckpt")}
             for n, kw in CASES.items()]
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    start = time.perf_counter()
    # one inductor compile worker per rank: the 2 ranks already fill a 2-core CI machine
    out = torchrun(2, str(WORKER), str(spec), timeout_s=540, env=worker_env(TORCHINDUCTOR_COMPILE_THREADS="1"))
    assert out.returncode == 0, failure_summary(out.stdout + out.stderr)
    print(f"compiled parity launch: {time.perf_counter() - start:.0f} s")
    return {c["name"]: c for c in cases}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_plan_matches_plain_loop(compiled_runs, name):
    case = compiled_runs[name]
    assert json.loads(Path(case["plan"]).read_text())["compile"] is True
    assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), reference(steps=STEPS), name,
                             steps=STEPS)


@pytest.mark.slow
@pytest.mark.multiproc
def test_blocks_ran_compiled(compiled_runs):
    """Dynamo compiled frames and never gave up on one (a recompile-limit fallback would run the
    blocks eager and the parity above would prove nothing about compile)."""
    counters = {n: json.loads(Path(c["measured"] + ".dynamo.json").read_text()) for n, c in compiled_runs.items()}
    first = counters["ddp"]
    assert first.get("frames", {}).get("ok", 0) >= 1, first
    last = counters[list(CASES)[-1]]
    assert not any("limit" in k for k in last.get("recompiles", {})), last
    assert not last.get("unimplemented"), last
    # every block traced whole: no graph break left part of a block eager
    assert not last.get("graph_break"), last["graph_break"]
