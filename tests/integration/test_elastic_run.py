"""``autopar run --elastic``: a node lost for good, a re-plan, the run goes on.

The launch: two "nodes" on this machine, each ``autopar run PLAN --elastic`` (its own torchrun
agent of 2 gloo ranks, c10d rendezvous on 127.0.0.1); node 0 is started first and hosts the
rendezvous store.  The plan is dp 2 x tp 2 (ZeRO-3) for the small GPT on a cluster of two
2-device nodes.  After step 3 is logged, node 1 -- its ``autopar run``, its agent and its ranks
-- is killed with SIGKILL and never restarted.  Node 0's ranks fail on the dead peer, its
``autopar run --elastic`` launches again, the rendezvous holds node 0 alone, and the round's
rank 0 re-plans through the planner for one node (2 ranks) and resumes from the checkpoint of
step 2.

Checked: the run ends well under the re-planned layout (2 ranks); each step after the
checkpoint runs exactly once after the switch and the steps lost are the ones logged past the
checkpoint before it; the losses and final parameters equal the plain loop's (the uninterrupted
run, which every layout matches within 1e-5: tests/integration/test_runtime_parity.py) -- so
the steps after the switch equal an uninterrupted run of the new layout from the same
checkpoint; measured.json records the switch; the switch time is printed.  Bad input exits 2
with one paragraph, in one process.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest

from cli_inprocess import run_cli
from elastic_support import plan_on_cluster, run_losing_a_node
from runtime_support import assert_matches_reference, reference

STEPS = 6
KILL_AFTER = 3                 # node 1 dies once step 3 is logged; the newest checkpoint is step 2


def _logged_steps(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"\[autopar\] step (\d+)/", text)]


@pytest.mark.multiproc
def test_elastic_run_loses_a_node_replans_and_matches_the_plain_loop(tmp_path):
    plan = plan_on_cluster(tmp_path)
    ck = tmp_path / "ck"
    run = run_losing_a_node(tmp_path, plan, ck, STEPS, KILL_AFTER,
                            ("--checkpoint-every", "2", "--rendezvous-timeout", "2", "--replan-budget", "1",
                             "--timing-warmup", "0"))
    code, out = run.code, run.node0
    assert code == 0, out[-6000:]
    m = json.loads((tmp_path / "measured.json").read_text())
    assert m["world_size"] == 2 and m["plan"].endswith("plan_1.json"), m["plan"]
    (switch,) = m["switches"]
    assert switch["old_layout"] == "4 ranks, dp 2 x tp 2" and switch["new_layout"].startswith("2 ranks"), switch
    assert len(switch["nodes_before"]) == 2 and len(switch["nodes_after"]) == 1, switch
    assert switch["nodes_lost"] == [n for n in switch["nodes_before"] if n not in switch["nodes_after"]], switch
    assert not switch["nodes_joined"], switch
    ckpt_step = switch["checkpoint_step"]
    assert ckpt_step == 2 and m["first_step"] == ckpt_step, (switch, m["first_step"])
    # the steps: before the switch 1..last (logged by the round's rank 0, on either node), after it
    # ckpt+1..STEPS on node 0, each once; the lost ones run again
    first_round, _, second_round = out.partition("launching again with the nodes that remain")
    assert second_round, out[-4000:]
    before = _logged_steps(first_round) + _logged_steps(run.node1)
    after = _logged_steps(second_round)
    assert before == list(range(1, before[-1] + 1)) and before[-1] >= KILL_AFTER, steps
    assert after == list(range(ckpt_step + 1, STEPS + 1)), steps
    assert switch["steps_lost"] == before[-1] - ckpt_step == switch["last_step_before"] - ckpt_step, switch
    recorded = [json.loads(l)["step"] for l in (ck / "elastic" / "metrics.jsonl").read_text().splitlines()]
    assert recorded == list(range(1, STEPS + 1)), recorded
    # the losses of every step (the resumed ones from the checkpoint) and the final weights: the plain loop's
    assert_matches_reference(tmp_path / "measured.json", ck, reference(STEPS), "elastic 4 -> 2 ranks", steps=STEPS)
    assert switch["measured_switch_s"] > 0 and switch["predicted_switch_s"]["total"] > 0, switch
    assert re.search(r"measured switch time \d+\.\d+ s, from the failure to step 3 \(predicted \d+\.\d+ s\)", out), out
    assert "predicted step time:" in out and "steps lost since it: " in out
    assert not list(ck.glob("*.partial")) and not (ck / "lock.json").exists()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_elastic_bad_input_exits_2_with_one_paragraph(tmp_path):
    """--min-nodes above the plan's nodes or above the nodes that come to the rendezvous, a plan
    for another model than the checkpoint's, an unreachable rendezvous, and --elastic without a
    checkpoint folder: exit 2, one paragraph, no rank started."""
    plan = plan_on_cluster(tmp_path)
    ck = tmp_path / "ck"
    base = ("run", plan, "--elastic", "--checkpoint-dir", ck)
    out = run_cli(*base, "--dry-run")            # the first launch's command, nothing written
    assert out.returncode == 0 and "-m autopar.elastic.agent --nnodes 2:2 --nproc-per-node 2" in out.stdout, out
    assert not ck.exists()
    for extra, said in ((("--min-nodes", 3), "--min-nodes 3 is more than the 2 node(s)"),
                        (("--rdzv-endpoint", "rendezvous-host.invalid:29400", "--rendezvous-timeout", "1"),
                         "could not be reached within --rendezvous-timeout 1 s")):
        out = run_cli(*base, *extra)
        assert out.returncode == 2, (extra, out.stderr)
        assert said in _flat(out.stderr) and "Traceback" not in out.stderr, (extra, out.stderr)
    out = run_cli("run", plan, "--elastic")
    assert out.returncode == 2 and "needs --checkpoint-dir" in _flat(out.stderr), out.stderr
    # --min-nodes 2 where one node comes: the rendezvous (a torchrun agent, no rank starts) gives up
    out = run_cli(*base, "--min-nodes", 2, "--start-timeout", 1)
    assert out.returncode == 2, out.stderr
    assert "fewer than --min-nodes 2 node(s) came to the rendezvous" in _flat(out.stderr), out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    shutil.rmtree(ck)
    out = run_cli("run", plan, "--min-nodes", 1)
    assert out.returncode == 2 and "only apply to an elastic run" in _flat(out.stderr), out.stderr
    # a checkpoint of another model (the manifest's fingerprint) under --checkpoint-dir
    (ck / "step_00000002").mkdir(parents=True)
    (ck / "step_00000002" / "manifest.json").write_text(json.dumps(
        {"step": 2, "world_size": 4, "mesh": {"dp": 2, "pp": 1, "tp": 2}, "zero": 3, "fingerprint": "another-model"}))
    (ck / "latest.json").write_text(json.dumps({"step": 2, "path": "step_00000002"}))
    out = run_cli(*base)
    assert out.returncode == 2 and "is for another model than the checkpoint" in _flat(out.stderr), out.stderr
    assert not (ck / "elastic").exists()


def test_an_earlier_rounds_lock_is_cleared_and_another_runs_is_kept(tmp_path):
    """A round's rank 0 removes the checkpoint lock its own run's earlier round left (its holder
    may have died on a node that is gone: another host, whose pids cannot be checked), never the
    lock of another run."""
    from autopar.elastic.switches import clear_earlier_round_lock

    lock = tmp_path / "lock.json"
    said = []
    lock.write_text(json.dumps({"pid": 7, "host": "node-that-died", "elastic_run": "other@/ck"}))
    clear_earlier_round_lock(tmp_path, "mine@/ck", said.append)
    assert lock.exists() and not said
    lock.write_text(json.dumps({"pid": 7, "host": "node-that-died", "elastic_run": "mine@/ck"}))
    clear_earlier_round_lock(tmp_path, "mine@/ck", said.append)
    assert not lock.exists() and "pid 7 on node-that-died" in said[0]
