"""How often FSDP2's collectives run in a step on autopar's runtime, against the counts the
simulator prices (simulator/pipeline_fsdp.py ``collectives_per_step``).

One 4-rank torchrun launch (gloo) runs each plan for two steps; tests/collective_count_worker.py
counts the second step's collectives on rank 0 with a dispatch mode outside the runtime's (the
first step also runs the pipeline's shape inference).  The reference is what ran: the count of
``_allgather_base_`` and ``_reduce_scatter_base_`` calls, which the test divides among rank 0's
FSDP units (its layers with parameters).  Under a pipeline torch's schedules skip gradient sync
and reshard-after-backward until the last backward; without one the runtime reduce-scatters
every micro-batch of an accumulation step (runtime/train.py ``_grad_sync``), and that run's losses
must still be the plain loop's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime_support import GPT, MODEL_ARGS, failure_summary, torchrun

WORKER = Path(__file__).resolve().parents[1] / "collective_count_worker.py"
GATHER, SCATTER = "c10d._allgather_base_", "c10d._reduce_scatter_base_"

# name -> uniform_plan arguments (4 ranks)
PLANS = {
    "gpipe_zero2_m2": dict(dp=2, pp=2, schedule="gpipe", zero=2, num_microbatches=2),
    "gpipe_zero2_m4": dict(dp=2, pp=2, schedule="gpipe", zero=2, num_microbatches=4),
    "gpipe_zero3_m4": dict(dp=2, pp=2, schedule="gpipe", zero=3, num_microbatches=4),
    "1f1b_zero3_m4": dict(dp=2, pp=2, schedule="1f1b", zero=3, num_microbatches=4),
    "interleaved_zero3_m4": dict(dp=2, pp=2, schedule="interleaved", virtual_stages=2, zero=3, num_microbatches=4),
    "accumulate_zero2_m2": dict(dp=4, zero=2, num_microbatches=2),
    "accumulate_zero3_m2": dict(dp=4, zero=3, num_microbatches=2),
}


def _plan(kw: dict):
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, uniform_plan

    g = capture_model_file(str(GPT), dict(MODEL_ARGS), 1)
    ref = ModelRef(file=str(GPT), args=dict(MODEL_ARGS), name="gpt", fingerprint=g.fingerprint)
    return g, uniform_plan(model=ref, num_layers=len(g.layers), micro_batch=1, precision="fp32", **kw)


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    from autopar.core.plan import save_plan

    tmp = tmp_path_factory.mktemp("pipeline_fsdp_counts")
    cases = []
    for name, kw in PLANS.items():
        save_plan(_plan(kw)[1], tmp / f"{name}.json")
        cases.append({"name": name, "steps": 2, "count_from": 1, "plan": str(tmp / f"{name}.json"),
                      "measured": str(tmp / f"{name}.measured.json"), "counts": str(tmp / f"{name}.counts.json")})
    (tmp / "cases.json").write_text(json.dumps(cases))
    out = torchrun(4, str(WORKER), str(tmp / "cases.json"), timeout_s=300)
    assert out.returncode == 0, failure_summary(out.stdout + out.stderr)
    return {c["name"]: (json.loads(Path(c["counts"]).read_text()), json.loads(Path(c["measured"]).read_text()))
            for c in cases}


def _rank0_units(name: str) -> int:
    """FSDP units on pipeline rank 0: the layers with parameters of its stages."""
    g, plan = _plan(PLANS[name])
    stages = [s for s in plan.pipeline.stages if s.index % plan.mesh.pp == 0]
    return sum(1 for s in stages for k in range(s.start, s.end) if g.layers[k].param_numel > 0)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(PLANS))
def test_fsdp_collectives_per_step_are_the_priced_counts(counted, name):
    from autopar.simulator.pipeline_fsdp import collectives_per_step

    kw = PLANS[name]
    counts, _ = counted[name]
    ran = {op: counts["fwd"].get(op, 0) + counts["bwd"].get(op, 0) for op in (GATHER, SCATTER)}
    units = _rank0_units(name)
    gathers, scatters = collectives_per_step(kw["zero"], kw["num_microbatches"], kw.get("pp", 1) > 1)
    assert (ran[GATHER], ran[SCATTER]) == (units * gathers, units * scatters), (name, units, counts)


@pytest.mark.multiproc
def test_pipeline_zero2_gathers_once_whatever_the_micro_batches(counted):
    """The step's ZeRO-2 traffic under a pipeline does not grow with the micro-batches: what the
    price used to charge per micro-batch."""
    two, four = (counted[f"gpipe_zero2_m{m}"][0] for m in (2, 4))
    assert two["fwd"].get(GATHER) == four["fwd"].get(GATHER) > 0
    assert two["fwd"].get(SCATTER) == four["fwd"].get(SCATTER) > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [2, 3])
def test_accumulation_reduce_scattering_each_micro_batch_trains_as_the_plain_loop(counted, zero):
    from plain_loop import train_plain

    _, measured = counted[f"accumulate_zero{zero}_m2"]
    want = train_plain(GPT, dict(MODEL_ARGS), 8, 2, chunks=2).losses      # dp 4 x 1 sample x 2 micro-batches
    assert len(measured["losses"]) == 2
    assert measured["losses"] == pytest.approx(want, abs=1e-5)
