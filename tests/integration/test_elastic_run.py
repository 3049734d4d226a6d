"""``autopar run --elastic``: a node lost, a re-plan, the run goes on; the node comes back, a
re-plan again, the run finishes on both.

The launch: two "nodes" on this machine, each ``autopar run PLAN --elastic`` (its own torchrun
agent of 2 gloo ranks, c10d rendezvous on 127.0.0.1); node 0 is started first and hosts the
rendezvous store.  The plan is dp 2 x tp 2 (ZeRO-3) for the small GPT on a cluster of two
2-device nodes.

* Lost: after step 3 is logged, node 1 -- its ``autopar run``, its agent and its ranks -- is
  killed with SIGKILL.  Node 0's ranks fail on the dead peer, its ``autopar run --elastic``
  launches again, the rendezvous holds node 0 alone, and the round's rank 0 re-plans through
  the planner for one node (2 ranks) and resumes from the checkpoint of step 2.
* Back: once node 0 logged step 4 alone, node 1 is started again (the same command).  Its
  agent waits in the rendezvous; torch's agent on node 0 sees it (``num_nodes_waiting``) and
  restarts the round: node 0's ranks, sent SIGTERM, finish their step and save a checkpoint;
  the round of both nodes re-plans for two nodes (4 ranks) and resumes from that checkpoint.
  (Node 0's ranks are paused while node 1 starts, so they cannot finish the run first:
  ``elastic_support``.)

Checked: both nodes end well, under the second re-plan (4 ranks); each step runs exactly once
after the checkpoint it resumed from and the steps lost are the ones logged past the
checkpoint before the loss (none at the join: the stop saved them); the losses and final
parameters equal the plain loop's (the uninterrupted run, which every layout matches within
1e-5: tests/integration/test_runtime_parity.py) -- so the steps after each switch equal an
uninterrupted run of the new layout from the same checkpoint; measured.json records both
switches, "node lost" then "node joined"; the switch times are printed.  Bad input exits 2
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

STEPS = 10
KILL_AFTER = 3                 # node 1 dies once step 3 is logged; the newest checkpoint is step 2
RETURN_AFTER = 4               # node 1 comes back once node 0, alone, logged step 4


def _logged_steps(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"\[autopar\] step (\d+)/", text)]


@pytest.mark.multiproc
def test_elastic_run_loses_a_node_takes_it_back_and_matches_the_plain_loop(tmp_path):
    plan = plan_on_cluster(tmp_path)
    ck = tmp_path / "ck"
    run = run_losing_a_node(tmp_path, plan, ck, STEPS, KILL_AFTER,
                            ("--checkpoint-every", "2", "--rendezvous-timeout", "2", "--replan-budget", "1",
                             "--timing-warmup", "0"), return_after=RETURN_AFTER, timeout_s=600)
    out, back = run.node0, run.node1_back
    assert run.code == 0 and run.back_code == 0, out[-6000:] + back[-4000:]
    m = json.loads((tmp_path / "measured.json").read_text())
    assert m["world_size"] == 4 and m["plan"].endswith("plan_2.json"), m["plan"]
    lost, joined = m["switches"]
    # the loss: 4 ranks -> 2, node 1 gone
    assert lost["reason"] == "node lost" and lost["why"].startswith("node lost: ranks failed"), lost
    assert lost["old_layout"] == "4 ranks, dp 2 x tp 2" and lost["new_layout"].startswith("2 ranks"), lost
    assert len(lost["nodes_before"]) == 2 and len(lost["nodes_after"]) == 1, lost
    assert lost["nodes_lost"] == [n for n in lost["nodes_before"] if n not in lost["nodes_after"]], lost
    assert not lost["nodes_joined"], lost
    ckpt_step = lost["checkpoint_step"]
    assert ckpt_step == 2, lost
    # the return: 2 ranks -> 4, node 1 (a new autopar run) joined node 0
    assert joined["reason"] == "node joined" and "joined the rendezvous" in joined["why"], joined
    assert joined["nodes_before"] == lost["nodes_after"] and not joined["nodes_lost"], joined
    (newcomer,) = joined["nodes_joined"]
    assert sorted(joined["nodes_after"]) == sorted(lost["nodes_after"] + [newcomer]), joined
    assert newcomer not in lost["nodes_before"], joined           # another autopar run: another name
    assert joined["old_layout"] == lost["new_layout"] and joined["new_layout"].startswith("4 ranks"), joined
    back_step = joined["checkpoint_step"]
    assert RETURN_AFTER <= back_step < STEPS and m["first_step"] == back_step, (joined, m["first_step"])
    assert joined["steps_lost"] == 0 and joined["last_step_before"] == back_step, joined
    assert f"stopped by SIGTERM after step {back_step}/{STEPS}" in " ".join(out.split()), out[-4000:]
    # the steps: before the loss 1..last (logged by the round's rank 0, on either node); after it
    # ckpt+1..back_step on node 0 alone, then back_step+1..STEPS by the round of both nodes
    # (its rank 0 on either): each once, the lost ones run again
    first_round, _, later = out.partition("launching again with the nodes that remain")
    assert later, out[-4000:]
    before = _logged_steps(first_round) + _logged_steps(run.node1)
    after = _logged_steps(later) + _logged_steps(back)
    assert before == list(range(1, before[-1] + 1)) and before[-1] >= KILL_AFTER, before
    assert after == list(range(ckpt_step + 1, STEPS + 1)), after
    assert lost["steps_lost"] == before[-1] - ckpt_step == lost["last_step_before"] - ckpt_step, lost
    recorded = [json.loads(l)["step"] for l in (ck / "elastic" / "metrics.jsonl").read_text().splitlines()]
    assert recorded == list(range(1, STEPS + 1)), recorded
    # the losses of every step (the resumed ones from the checkpoints) and the final weights: the plain loop's
    assert_matches_reference(tmp_path / "measured.json", ck, reference(STEPS), "elastic 4 -> 2 -> 4 ranks",
                             steps=STEPS)
    for switch in (lost, joined):
        assert switch["measured_switch_s"] > 0 and switch["predicted_switch_s"]["total"] > 0, switch
    assert joined["failure_time"] >= run.returned_at - 1, (joined, run.returned_at)
    said = out + back
    assert re.search(r"switch 1: measured switch time \d+\.\d+ s, from the failure to step 3 \(predicted "
                     r"\d+\.\d+ s\)", said), said
    assert re.search(rf"switch 2: measured switch time \d+\.\d+ s, from the joining node's launch to step "
                     rf"{back_step + 1} \(predicted \d+\.\d+ s\)", said), said
    assert "predicted step time:" in said and "steps lost since it: " in said
    # each re-plan describes the checkpoint it resumes from (autopar replan's switch lines)
    flat = " ".join(said.split())
    assert "is step 2 saved by 4 ranks (dp2 x tp2, ZeRO-3)" in flat, said
    assert f"is step {back_step} saved by 2 ranks" in flat, said
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
