"""`autopar report`: the join and its errors (checked by independent arithmetic), the HTML and
PNG outputs, the fingerprint check, the timeline breakdown, and `--calibrate` end to end.

The plan is a small GPT on a 2-device CPU cluster built in the test; the measured.json is
synthetic with known figures, so every error has a closed-form expected value.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cli import main as cli_main
from autopar.core.cluster import Cluster, Link, NodeGroup
from autopar.core.plan import save_plan
from autopar.report import resimulate
from autopar.report.timelines import measured_lanes, simulated_breakdown, union_length

REPO = Path(__file__).resolve().parents[2]
GPT_ARGS = dict(layers=2, hidden=64, heads=4, seq=32, vocab=256)
PROFILE = {
    "name": "test-cpu", "device": "cpu", "memory_bytes": 8 << 30, "memory_bandwidth_Bps": 20e9,
    "peak_flops": {"fp32": 50e9, "tf32": 50e9, "bf16": 50e9, "fp16": 50e9},
    "efficiency": {"linear": 0.7, "matmul": 0.5, "attention": 0.3, "conv": 0.3, "memory_bound": 0.3},
    "collective_efficiency": {"intra": 1.0, "inter": 1.0}, "sources": {}, "op_table": [], "collective_table": [],
    "measured_by": None,
}
CLUSTER = Cluster(name="test-2cpu", groups=(NodeGroup("cpu", "test-cpu", 1, 2, 8 << 30, Link(2.0, 40.0), 16 << 30,
                                                      Link(10.0, 1.0)),), inter_node=Link(1.0, 100.0), backend="gloo")


@pytest.fixture(scope="module")
def ctx():
    from autopar.core.capture import capture_model_file

    graph = capture_model_file(REPO / "examples" / "gpt.py", GPT_ARGS, batch_size=2)
    return resimulate.PlanContext(graph=graph, cluster=CLUSTER, profile=PROFILE, profile_name="test-cpu")


@pytest.fixture()
def pair(ctx, tmp_path, monkeypatch):
    """plan.json (dp 2, predicted step 10 ms, 4 MiB) and measured.json with known figures."""
    from autopar.simulator.configure import config_plan

    monkeypatch.setattr(resimulate, "load_context", lambda plan, path, **kw: ctx)
    plan = config_plan(ctx.graph, degrees={"dp": 2, "tp": 1, "pp": 1},
                       micro_batch=2, global_batch=None, schedule="1f1b",
                       virtual_stages=1, zero=0, recompute="none", offload="none", precision="fp32",
                       sequence_parallel=False, cluster_name="test-2cpu")
    plan = plan.with_predicted({"step_time_s": 0.010, "samples_per_s": 400.0, "max_memory_bytes": 4 * 2**20})
    save_plan(plan, tmp_path / "plan.json")
    resim, _ = resimulate.simulate_figures(ctx, plan)
    measured = {"step_time_s": 0.0125, "samples_per_s": 320.0, "max_memory_bytes": 5 * 2**20,
                "memory_per_rank_bytes": [5 * 2**20, 4.5 * 2**20], "fwd_s": 0.002, "bwd_s": 0.004,
                "comm_s": 0.003, "optimizer_s": 0.001, "fingerprint": plan.model.fingerprint, "world_size": 2,
                "losses": [5.0, 4.9]}
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    return tmp_path, plan, measured, resim


def _report_json(tmp_path, capsys, *extra) -> dict:
    rc = cli_main(["report", str(tmp_path / "plan.json"), str(tmp_path / "measured.json"), "--json", *extra])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


def test_errors_are_exact(pair, capsys):
    tmp_path, plan, measured, resim = pair
    out = _report_json(tmp_path, capsys)
    figs = {f["key"]: f for f in out["figures"]}
    # the plan's predicted block wins for the keys it holds
    assert figs["step_time_s"]["error"] == pytest.approx((0.010 - 0.0125) / 0.0125, abs=1e-15)   # -20 %
    assert figs["samples_per_s"]["error"] == pytest.approx((400 - 320) / 320, abs=1e-15)         # +25 %
    assert figs["max_memory_bytes"]["error"] == pytest.approx((4 - 5) / 5, abs=1e-15)            # -20 %
    # the breakdown comes from re-simulating the plan
    for key in ("fwd_s", "bwd_s", "comm_s", "optimizer_s"):
        assert figs[key]["simulated"] == pytest.approx(resim[key], rel=1e-12)
        assert figs[key]["error"] == pytest.approx((resim[key] - measured[key]) / measured[key], rel=1e-12)
    for r in range(2):
        f = figs[f"memory_rank{r}_bytes"]
        assert f["error"] == pytest.approx((resim["memory_per_rank_bytes"][r] - measured["memory_per_rank_bytes"][r])
                                           / measured["memory_per_rank_bytes"][r], rel=1e-12)
    errs = sorted(abs(f["error"]) for f in out["figures"])
    assert out["summary"]["worst_abs_error"] == pytest.approx(errs[-1])


def test_a_figure_measured_as_zero_is_left_out_and_said(pair, capsys):
    tmp_path, plan, measured, resim = pair
    (tmp_path / "measured.json").write_text(json.dumps({**measured, "fwd_s": 0.0, "bwd_s": 0.0}))
    out = _report_json(tmp_path, capsys)
    keys = {f["key"] for f in out["figures"]}
    assert "fwd_s" not in keys and "bwd_s" not in keys and "comm_s" in keys
    assert any("fwd_s, bwd_s measured as 0" in n for n in out["notes"])


def test_fingerprint_mismatch_is_a_user_error(pair, capsys):
    tmp_path, plan, measured, _ = pair
    (tmp_path / "measured.json").write_text(json.dumps({**measured, "fingerprint": "0123456789abcdef"}))
    rc = cli_main(["report", str(tmp_path / "plan.json"), str(tmp_path / "measured.json")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "0123456789abcdef" in err and plan.model.fingerprint in err and "Traceback" not in err


@pytest.mark.parametrize("edit,words", [
    ({"step_time_s": 0}, ("step_time_s", "time > 0")),
    ({"comm_s": "slow"}, ("comm_s", "'slow'")),
    ({"world_size": 2.5}, ("world_size", "2.5")),
    ({"version": 7}, ("version 7", "newer autopar")),
])
def test_a_bad_measured_file_exits_2_naming_file_and_key(pair, capsys, edit, words):
    """measured.json is read by its schema (autopar.core.measured): a wrong value is one paragraph
    naming the file and the key, exit 2, and --calibrate writes nothing."""
    tmp_path, plan, measured, _ = pair
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**measured, **edit}))
    rc = cli_main(["report", str(tmp_path / "plan.json"), str(bad), "--calibrate", "-o", str(tmp_path / "cal.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.count("\n\n") == 0
    assert str(bad) in err                                  # a path is never broken across lines
    for w in words:
        assert w in err.replace("\n", " "), (w, err)
    assert not (tmp_path / "cal.json").exists()


def test_the_report_shows_every_figure_a_run_measures():
    from autopar.core.measured import FIGURE_KEYS
    from autopar.report.compare import SCALAR_FIGURES

    assert [key for key, _, _ in SCALAR_FIGURES] == list(FIGURE_KEYS)


def test_html_and_png(pair, capsys):
    import matplotlib.image as mpimg

    tmp_path, *_ = pair
    assert cli_main(["report", str(tmp_path / "plan.json"), str(tmp_path / "measured.json"),
                     "--html", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and 'src="data:image/png;base64,' in page
    assert "-20.0%" in page and "12.500 ms" in page and "10.000 ms" in page
    assert "http" not in page.replace("http-equiv", "")          # self-contained: nothing fetched
    assert cli_main(["report", str(tmp_path / "plan.json"), str(tmp_path / "measured.json"),
                     "--png", str(tmp_path / "r.png")]) == 0
    data = (tmp_path / "r.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(tmp_path / "r.png")
    assert img.shape[0] > 200 and img.shape[1] > 1000


def test_curve_data_is_measured_jsons_arrays():
    from autopar.core.measured import Measured
    from autopar.report.curves import curve_data

    # a run resumed after step 3: it timed steps 4..6, and holds the losses of steps 1..6
    data = {"step_time_s": 0.02, "step_times_s": [0.03, 0.02, 0.01], "first_step": 3,
            "losses": [5.0, 4.5, 4.0, 3.5, 3.0, 2.5], "val_losses": [[3, 4.1], [6, 2.9]]}
    c = curve_data(Measured.from_json(data), 0.015)
    assert (c.loss_steps, c.losses) == ([1, 2, 3, 4, 5, 6], data["losses"])
    assert (c.time_steps, c.step_times_s) == ([4, 5, 6], data["step_times_s"])
    assert (c.val_steps, c.val_losses) == ([3, 6], [4.1, 2.9])
    assert (c.measured_step_time_s, c.simulated_step_time_s) == (0.02, 0.015)
    # an uninterrupted run; a hand-made file without per-step figures has no curves
    c = curve_data(Measured.from_json({"step_time_s": 0.5, "step_times_s": [0.4, 0.6], "losses": [2.0, 1.0]}), None)
    assert (c.loss_steps, c.time_steps, c.val_steps) == ([1, 2], [1, 2], [])
    assert curve_data(Measured.from_json({"step_time_s": 0.5}), None).empty


def test_png_writes_the_training_curves_beside_it(pair, capsys):
    import matplotlib.image as mpimg

    tmp_path, plan, measured, _ = pair
    m = {**measured, "step_times_s": [0.02, 0.012, 0.013], "losses": [5.0, 4.9, 4.7], "val_losses": [[3, 4.8]]}
    (tmp_path / "measured.json").write_text(json.dumps(m))
    assert cli_main(["report", str(tmp_path / "plan.json"), str(tmp_path / "measured.json"),
                     "--png", str(tmp_path / "r.png")]) == 0
    curves = tmp_path / "r.curves.png"
    assert f"and {curves} (loss and step time per step)" in capsys.readouterr().out
    img = mpimg.imread(curves)
    assert img.shape[0] > 200 and img.shape[1] > 800
    out = _report_json(tmp_path, capsys, "--png", str(tmp_path / "s.png"))
    assert out["curves_png"] == str(tmp_path / "s.curves.png") and (tmp_path / "s.curves.png").is_file()
    assert cli_main(["report", str(tmp_path / "plan.json"), str(tmp_path / "measured.json"),
                     "--html", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2 and "training curves" in page


def test_calibrate_writes_a_profile_that_predicts_the_run_better(pair, capsys, ctx):
    tmp_path, plan, measured, resim = pair
    # a run 1.6x slower than simulated in every phase: the fit must slow the informed factors
    slow = {**measured, **{k: 1.6 * resim[k] for k in ("fwd_s", "bwd_s", "comm_s", "optimizer_s", "step_time_s")}}
    (tmp_path / "measured.json").write_text(json.dumps(slow))
    out = _report_json(tmp_path, capsys, "--calibrate", "-o", str(tmp_path / "cal.json"))
    cal = out["calibration"]
    before = cal["errors_before"]["plan"]
    after = cal["errors_after"]["plan"]
    assert before["step_time_s"] == pytest.approx(1 / 1.6 - 1, rel=1e-9)
    for k in before:
        assert abs(after[k]) < abs(before[k])
    assert abs(after["step_time_s"]) < 0.05
    new = json.loads((tmp_path / "cal.json").read_text())
    assert new["name"] == "cal"
    for ch in cal["changes"]:
        f = ch["factor"]
        old = PROFILE["efficiency"].get(f) or PROFILE["collective_efficiency"][f.split(".")[1]]
        assert ch["old_efficiency"] == old and ch["new_efficiency"] < old      # slower run, lower efficiency
    # conv is not in a GPT, nothing crosses nodes: untouched
    assert new["efficiency"]["conv"] == PROFILE["efficiency"]["conv"]
    assert new["collective_efficiency"]["inter"] == PROFILE["collective_efficiency"]["inter"]
    resim_new, _ = resimulate.simulate_figures(ctx, plan, new)
    assert abs(resim_new["fwd_s"] / slow["fwd_s"] - 1) < abs(resim["fwd_s"] / slow["fwd_s"] - 1)


def test_calibrate_needs_output(pair, capsys):
    tmp_path, *_ = pair
    assert cli_main(["report", str(tmp_path / "plan.json"), str(tmp_path / "measured.json"), "--calibrate"]) == 2
    assert "-o" in capsys.readouterr().err


def test_breakdown_of_hand_made_events():
    ev = [
        {"device": 0, "stream": "compute", "name": "fwd L0", "start_s": 0.0, "dur_s": 1.0, "args": {"micro_batch": 0}},
        {"device": 0, "stream": "tp", "name": "tp fwd L0", "start_s": 1.0, "dur_s": 0.5, "args": {"micro_batch": 0}},
        {"device": 0, "stream": "compute", "name": "fwd L1", "start_s": 1.5, "dur_s": 1.0, "args": {"micro_batch": 0}},
        {"device": 0, "stream": "compute", "name": "bwd L1", "start_s": 2.5, "dur_s": 2.0, "args": {"micro_batch": 0}},
        {"device": 0, "stream": "dp", "name": "all_reduce L1", "start_s": 4.5, "dur_s": 1.0, "args": {}},
        {"device": 0, "stream": "compute", "name": "bwd L0", "start_s": 4.5, "dur_s": 2.0, "args": {"micro_batch": 0}},
        {"device": 0, "stream": "dp", "name": "all_reduce L0", "start_s": 6.5, "dur_s": 1.5, "args": {}},
        {"device": 0, "stream": "compute", "name": "optimizer", "start_s": 8.0, "dur_s": 0.25, "args": {}},
        {"device": 1, "stream": "compute", "name": "fwd L0", "start_s": 0.0, "dur_s": 9.0, "args": {"micro_batch": 0}},
    ]
    b = simulated_breakdown(ev, device=0)
    assert b["fwd_s"] == pytest.approx(2.5)           # 0 .. 2.5, tp included
    assert b["bwd_s"] == pytest.approx(8.0 - 2.5)     # 2.5 .. 6.5, extended to the last all-reduce's end (8.0)
    assert b["comm_s"] == pytest.approx(0.5 + 1.0 + 1.5)
    assert b["optimizer_s"] == pytest.approx(0.25)
    assert union_length([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)


def test_measured_lanes_from_a_chrome_trace(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "name": "autopar.forward", "ts": 1000.0, "dur": 300.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "aten::mm", "ts": 1010.0, "dur": 50.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "autopar.backward", "ts": 1300.0, "dur": 500.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "c10d::allreduce_", "ts": 1700.0, "dur": 200.0, "pid": 1, "tid": 2},
        {"ph": "X", "name": "autopar.optimizer", "ts": 1900.0, "dur": 100.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "autopar.forward", "ts": 2000.0, "dur": 300.0, "pid": 1, "tid": 1},
    ]}
    p = tmp_path / "measured.trace.rank0.json"
    p.write_text(json.dumps(trace))
    lanes = measured_lanes(p, max_steps=1)
    spans = [s for lane in lanes.values() for s in lane]
    assert sorted((round(s.start_s * 1e6), round(s.dur_s * 1e6), s.category) for s in spans) == [
        (0, 300, "fwd"), (300, 500, "bwd"), (700, 200, "comm"), (900, 100, "optimizer")]


def test_cluster_is_found_from_the_plan_or_the_flag(ctx, tmp_path):
    from autopar.core.errors import UserError
    from autopar.core.plan_cluster import load_plan_cluster
    from autopar.simulator.configure import config_plan

    plan = config_plan(ctx.graph, degrees={"dp": 2, "tp": 1, "pp": 1},
                       micro_batch=2, global_batch=None, schedule="1f1b",
                       virtual_stages=1, zero=0, recompute="none", offload="none", precision="fp32",
                       sequence_parallel=False, cluster_name="local-cpu")
    assert load_plan_cluster(plan, tmp_path / "plan.json", None).name == "local-cpu"
    labelled = plan.__class__(**{**plan.__dict__, "cluster": "local-cpu (some/where/else.yaml)"})
    assert load_plan_cluster(labelled, tmp_path / "plan.json", None).name == "local-cpu"
    with pytest.raises(UserError, match="no-such-cluster"):
        load_plan_cluster(plan, tmp_path / "plan.json", "no-such-cluster.yaml")


def _autopar_imports(folder: str) -> dict[str, set[str]]:
    """file -> the autopar packages it imports (autopar.X of every import, lazy ones included)."""
    import ast

    out = {}
    for path in sorted((REPO / folder).glob("*.py")):
        pkgs = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            pkgs |= {n.split(".")[1] for n in names if n.startswith("autopar.")}
        out[path.name] = pkgs
    return out


def test_imports_run_one_way():
    """The report reads what the runtime wrote through core/ and never imports the runtime or
    the planner; the runtime imports core/ only (docs/design.md, data flow)."""
    for name, pkgs in _autopar_imports("report").items():
        assert pkgs <= {"core", "profiles", "simulator", "report"}, (name, pkgs)
    for name, pkgs in _autopar_imports("runtime").items():
        assert pkgs <= {"core", "runtime"}, (name, pkgs)
