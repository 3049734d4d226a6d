"""measured.json's schema (autopar.core.measured): round trip, files of the runtime before the
schema load, the runtime writes through it, and a bad file is refused with the file and key
named (exit 2 from ``autopar report``)."""
from __future__ import annotations

import json

import pytest

from autopar.core.measured import Measured, MeasuredFileError, RankModelState, read_measured

# measured.json as the runtime wrote it before the schema had a version (runtime/measure.py at
# d41496c, a --profile run of 2 ranks): no "version", the breakdown both nested and flat.
PRE_SCHEMA = {
    "step_time_s": 0.0123, "samples_per_s": 325.2, "tokens_per_s": 10406.5, "max_memory_bytes": 52428800,
    "memory_per_rank_bytes": [52428800, 50331648], "memory_kind": "cpu_peak_rss_growth", "losses": [5.61, 5.48, 5.37],
    "step_times_s": [0.05, 0.0121, 0.0123], "warmup_steps": 1, "first_step": 0, "fingerprint": "9f2c4e1d0a7b3c55",
    "world_size": 2, "device": "cpu", "device_kind": "cpu", "global_batch": 4, "init": "seeded", "plan": "plan.json",
    "model_state_bytes_per_rank": [
        {"rank": 0, "params_bytes": 1000, "grads_bytes": 1000, "optimizer_bytes": 2000, "optimizer_step_bytes": 32},
        {"rank": 1, "params_bytes": 1000, "grads_bytes": 1000, "optimizer_bytes": 2000, "optimizer_step_bytes": 32}],
    "breakdown": {"fwd_s": 0.003, "bwd_s": 0.006, "comm_s": 0.002, "optimizer_s": 0.001, "profiled_steps": 2},
    "fwd_s": 0.003, "bwd_s": 0.006, "comm_s": 0.002, "optimizer_s": 0.001, "profiled_steps": 2,
    "trace_file": "measured.trace.rank0.json",
}


def test_a_pre_schema_file_loads_with_every_figure(tmp_path):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(PRE_SCHEMA, indent=2))
    m = read_measured(path)
    assert m.version == 1
    for key, value in PRE_SCHEMA.items():
        if key in ("breakdown", "model_state_bytes_per_rank"):
            continue
        got = getattr(m, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    assert m.model_state_bytes_per_rank[1] == RankModelState(1, 1000, 1000, 2000, 32)
    assert m.figures() == {k: PRE_SCHEMA[k] for k in ("step_time_s", "fwd_s", "bwd_s", "comm_s", "optimizer_s",
                                                       "max_memory_bytes", "samples_per_s", "tokens_per_s")}
    assert m.extra == {}
    # written again: the same keys and values, one copy of the breakdown, and a version
    again = m.to_json()
    assert again == {"version": 1, **{k: v for k, v in PRE_SCHEMA.items() if k != "breakdown"}}


def test_round_trip_through_text_keeps_everything():
    m = Measured.from_json({**PRE_SCHEMA, "cpu_busy_before_run": 0.07})
    assert m.extra == {"cpu_busy_before_run": 0.07}                  # a key of no field is kept, not lost
    back = Measured.from_json(json.loads(m.to_json_text()))
    assert back == m
    minimal = Measured(step_time_s=0.5)
    assert minimal.to_json() == {"version": 1, "step_time_s": 0.5}  # what was not measured is left out
    assert Measured.from_json(minimal.to_json()) == minimal


def test_the_runtime_writes_through_the_schema():
    """runtime/measure.measured_report builds a Measured whose file holds the runtime's figures."""
    import torch

    from autopar.runtime.measure import measured_report

    m = measured_report(step_times_s=[0.3, 0.1, 0.2, 0.4], warmup_steps=1, global_batch=8, seq_len=16,
                        memory_per_rank_bytes=[100, 300], memory_kind="cpu_peak_rss_growth", losses=[2.0, 1.5],
                        fingerprint="ab", world_size=2, device=torch.device("cpu"), plan_file="p.json",
                        first_step=0, breakdown={"fwd_s": 0.05, "bwd_s": 0.1, "comm_s": 0.02, "optimizer_s": 0.01,
                                                 "profiled_steps": 3},
                        trace_file="t.json", init_mode="seeded",
                        model_state_bytes_per_rank=[{"rank": 0, "params_bytes": 4, "grads_bytes": 4,
                                                     "optimizer_bytes": 8, "optimizer_step_bytes": 1}])
    d = json.loads(m.to_json_text())
    assert d["step_time_s"] == 0.2                      # median of 0.1, 0.2, 0.4 (the first step is warm-up)
    assert d["samples_per_s"] == pytest.approx(8 / 0.2) and d["tokens_per_s"] == pytest.approx(16 * 8 / 0.2)
    assert d["max_memory_bytes"] == 300 and d["fwd_s"] == 0.05 and d["profiled_steps"] == 3
    assert d["model_state_bytes_per_rank"] == [{"rank": 0, "params_bytes": 4, "grads_bytes": 4, "optimizer_bytes": 8,
                                                "optimizer_step_bytes": 1}]
    assert Measured.from_json(d) == m


@pytest.mark.parametrize("key,value,words", [
    ("step_time_s", "fast", ("step_time_s", "'fast'", "number >= 0")),
    ("fwd_s", -1.0, ("fwd_s", "-1.0")),
    ("world_size", 0, ("world_size", "whole number >= 1")),
    ("memory_per_rank_bytes", [1, "x"], ("memory_per_rank_bytes", "list of numbers")),
    ("fingerprint", 12, ("fingerprint", "text")),
    ("model_state_bytes_per_rank", [{"rank": 0}], ("model_state_bytes_per_rank", "params_bytes")),
    ("breakdown", {"fwd_s": True}, ("breakdown.fwd_s",)),
    ("version", 2, ("version 2", "newer autopar")),
    ("float8", {"recipe": "tensorwise", "converted": "head"}, ("float8", "converted (a list of texts)")),
    ("val_losses", [[0, 2.5]], ("val_losses", "[step, loss] pairs")),
    ("val_losses", [[3, "x"]], ("val_losses", "[step, loss] pairs")),
])
def test_a_bad_value_names_the_file_and_the_key(key, value, words):
    data = {k: v for k, v in PRE_SCHEMA.items() if not (key == "breakdown" and k in ("fwd_s", "profiled_steps"))}
    with pytest.raises(MeasuredFileError) as e:
        Measured.from_json({**data, key: value}, source="/runs/m.json")
    msg = str(e.value)
    assert "/runs/m.json" in msg and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_no_step_time_is_refused():
    with pytest.raises(MeasuredFileError, match="has no 'step_time_s'"):
        Measured.from_json({"fingerprint": "ab"}, source="m.json")


def test_float8_record_round_trip():
    """A float8 run's record (runtime/apply_fp8.py) is a schema field: read back as written."""
    record = {"recipe": "rowwise", "fsdp_float8_all_gather": False, "converted": ["blocks.0.mlp.fc"],
              "left_bf16": {"head": "weight [60, 32] has a dim not divisible by 16"}}
    m = Measured.from_json({**PRE_SCHEMA, "float8": record})
    assert m.float8 == record and "float8" not in m.extra
    assert Measured.from_json(json.loads(m.to_json_text())).float8 == record


def test_validation_losses_round_trip():
    """``val_losses`` ([[step, loss], ...], written by a run that evaluates) is optional: a file
    without it reads as before."""
    import torch

    from autopar.runtime.measure import measured_report

    m = measured_report(step_times_s=[0.1, 0.2], warmup_steps=0, global_batch=4, seq_len=None,
                        memory_per_rank_bytes=[1], memory_kind="cpu_peak_rss_growth", losses=[2.0, 1.5],
                        fingerprint="ab", world_size=1, device=torch.device("cpu"), plan_file="p.json", first_step=0,
                        breakdown=None, trace_file=None, init_mode="host", val_losses=[(1, 2.25), (2, 1.75)])
    d = json.loads(m.to_json_text())
    assert d["val_losses"] == [[1, 2.25], [2, 1.75]]
    assert Measured.from_json(d) == m and Measured.from_json(d).val_losses == ((1, 2.25), (2, 1.75))
    assert Measured.from_json(PRE_SCHEMA).val_losses is None


def test_an_elastic_runs_switches_round_trip_and_a_file_without_them_reads_as_before(tmp_path):
    """``switches`` (autopar run --elastic): a list of objects, kept as written; absent in older
    files, which read as before; anything but a list of objects is refused, naming the key."""
    switch = {"index": 1, "why": "ranks failed", "nodes_before": ["a:1", "b:2"], "nodes_after": ["a:1"],
              "old_layout": "4 ranks, dp 2 x tp 2", "new_layout": "2 ranks, pp 2", "steps_lost": 1,
              "predicted_switch_s": {"total": 9.5}, "measured_switch_s": 12.25}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({**PRE_SCHEMA, "switches": [switch]}))
    m = read_measured(path)
    assert m.switches == (switch,) and m.to_json()["switches"] == [switch]
    path.write_text(json.dumps(PRE_SCHEMA))
    assert read_measured(path).switches is None and "switches" not in read_measured(path).to_json()
    path.write_text(json.dumps({**PRE_SCHEMA, "switches": ["not an object"]}))
    with pytest.raises(MeasuredFileError, match="field switches: .*not a list of objects"):
        read_measured(path)
