"""An elastic run's state and its switches of plan, kept under ``CHECKPOINT_DIR/elastic/``.

* ``state.json``: the plan the run trains now (the given one, or the newest re-plan), the
  nodes of the last rendezvous round, the start-up time the last launch measured, and the
  switches so far.  Written whole through a temporary file and ``os.replace`` (atomic), by the
  round's rank 0 only.
* ``failure.json``: what ended the last launch (time, exit code, the first failing rank's
  message), written by ``autopar run --elastic`` on the node that saw it, read and removed by
  the next round's rank 0.
* ``plan_K.json``: the K-th re-plan (``autopar replan PLAN --nodes N``, the planner's own
  search).

A switch is recorded when a round's world size differs from its plan's: the reason ("node
lost": fewer ranks than the plan's; "node joined": more), the nodes before and after, why, the
old and new plan and layout, the planner's predicted step times, the steps lost
(the last step the metrics file holds minus the newest checkpoint's step: those steps run
again), the predicted switch time and, once the first step after it is logged, the measured
one.  The predicted switch time is the sum of

* the rendezvous wait: a round with fewer nodes than the plan's completes ``last_call_timeout``
  (``--rendezvous-timeout``) after its minimum is reached (torch's c10d rendezvous,
  ``DynamicRendezvousHandler``), plus torch's dead-node detection, ``keep_alive_interval`` x
  ``keep_alive_max_attempt`` (the values ``autopar run --elastic`` gives it).  Where a node
  joined, the training nodes' agents see it waiting at their next check of the workers
  (torchrun's ``--monitor-interval``) and restart the round; the round is then full and
  completes at once;
* the re-plan: the search's wall-clock budget (``--replan-budget``; the planner stops there);
* the restart: the start-up of the previous launch's ranks (from their start, once its
  rendezvous completed, to the first logged step: imports, plan check, model build, and where
  it resumed, the checkpoint read).  The reshard of the checkpoint into the new layout is part
  of that read; a first launch read no checkpoint, so the first switch's prediction leaves it
  out, and so it does the agents' own start (a Python process importing torch).

The measured switch time runs from the failure (the first failing rank's record; where a node
joined, the time its ``autopar run`` launched; else the launch's start) to the first step after
logged in the metrics file.  Where a node joined, the training ranks were stopped by torch's
agent with SIGTERM: they finish the step and save a checkpoint (``runtime/stop_signals``), so
the round resumes from it and no step is lost; the step and the save are part of the measured
time, not of the prediction, and neither is the joining node's own start.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from autopar.core.errors import UserError

STATE = "state.json"
FAILURE = "failure.json"
# torch's c10d rendezvous settings autopar run --elastic passes (--rdzv-conf): a dead node's
# heartbeat is missed for KEEP_ALIVE_INTERVAL_S x KEEP_ALIVE_MAX_ATTEMPT before it is dropped
# (torch defaults: 5 s x 3; autopar's choice: 1 s x 3, so a lost node is noticed in seconds)
KEEP_ALIVE_INTERVAL_S = 1
KEEP_ALIVE_MAX_ATTEMPT = 3
# torchrun's agent checks its workers, and whether a node waits to join, this often: its
# --monitor-interval default (torch/distributed/run.py), which autopar run --elastic keeps
MONITOR_INTERVAL_S = 0.1


def state_dir(checkpoint_dir: Path) -> Path:
    from autopar.runtime.checkpointing import ELASTIC_DIR

    return Path(checkpoint_dir) / ELASTIC_DIR


def write_json(path: Path, data: dict) -> None:
    """``path`` replaced whole: a temporary file beside it, then ``os.replace`` (atomic)."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def record_failure(directory: Path, record: dict) -> None:
    """``failure.json``, unless another node's ``autopar run --elastic`` wrote one first."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(directory / FAILURE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")


def clear_earlier_round_lock(checkpoint_dir: Path, run_id: str, log) -> None:
    """Remove the checkpoint lock an earlier round of this elastic run left (its rank 0 may have
    been on a node that is gone, so the runtime cannot see that its pid is dead).  A new round
    starts only after the agents stopped the earlier round's ranks; a lock of another run is kept."""
    from autopar.runtime.checkpoint_lock import LOCK

    holder = read_json(Path(checkpoint_dir) / LOCK)
    if holder is not None and holder.get("elastic_run") == run_id:
        (Path(checkpoint_dir) / LOCK).unlink(missing_ok=True)
        log(f"removed the checkpoint lock of an earlier round of this run (pid {holder.get('pid')} on "
            f"{holder.get('host')})")


def restarted_after() -> dict | None:
    """Within one launch, torchrun restarts the workers after a failure while ``--max-restarts``
    last: the failure is then the first failing rank's record in ``$AUTOPAR_ERROR_FILE``
    (runtime/rank_errors.py, kept by the launch across its restarts), or None."""
    from autopar.runtime.rank_errors import ERROR_FILE_ENV

    record = read_json(Path(os.environ.get(ERROR_FILE_ENV) or "/nonexistent"))
    if not record or not isinstance(record.get("time"), (int, float)) or record.get("stopped"):
        return None               # a stop (rank_errors.report_stop) the agent asked for when a node joined
    said = (str(record.get("message") or "").strip().splitlines() or [""])[-1][:200]
    return {"time": record["time"], "why": f"ranks failed (first: rank {record.get('rank', '?')}: {said}) and "
                                           f"torchrun restarted the workers"}


def layout(plan) -> str:
    """``dp 2 x tp 2``: the plan's axes that split (as ``autopar replan`` prints them)."""
    m = plan.mesh
    return " x ".join(f"{n} {getattr(m, n)}" for n in m.degree_names() if getattr(m, n) > 1) or "one rank"


def last_logged_step(metrics: Path) -> int | None:
    """The highest ``step`` of the metrics file's step records, or None."""
    best = None
    try:
        lines = Path(metrics).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and "loss" in rec:
            best = rec["step"] if best is None else max(best, rec["step"])
    return best


def checkpoint_step(checkpoint_dir: Path) -> int:
    from autopar.runtime.checkpointing import latest_checkpoint

    found = latest_checkpoint(checkpoint_dir)
    return found[0] if found else 0


def replan_for_nodes(plan_path: Path, nodes: int, output: Path, checkpoint_dir: Path, budget_s: float) -> None:
    """``autopar replan PLAN --nodes N -o OUTPUT``: the planner's search for N nodes of the plan's
    cluster, the global batch kept (a ``UserError`` saying what to do where it cannot be)."""
    import sys

    from autopar.core.errors import paragraph
    from autopar.core.output_file import check_writable
    from autopar.planner import plan_report, replan_api

    check_writable(output, "-o")
    console = plan_report.console()
    with plan_report.progress_bar(console) as progress:
        old, out, batch = replan_api.replan(plan_path, output=output, nodes=nodes, time_budget=budget_s,
                                            progress=progress,
                                            warn=lambda text: print(paragraph(text), file=sys.stderr))
    plan_report.print_outcome(console, out)
    for line in replan_api.switch_lines(Path(plan_path), old, output, batch, checkpoint_dir):
        print(line)
    sys.stdout.flush()


def _step_ms(plan) -> float | None:
    s = plan.predicted.get("step_time_s")
    return float(s) if isinstance(s, (int, float)) else None


def decide(*, directory: Path, given_plan: Path, checkpoint_dir: Path, metrics: Path, world: int, nodes: list[str],
           max_nodes: int, rendezvous_timeout_s: float, budget_s: float, launched_at: float, log,
           arrived: dict[str, float] | None = None) -> dict:
    """Rank 0 of a rendezvous round: the plan this round trains (``{"plan": path}``), re-planned
    through the planner where the round's world size differs from the current plan's; the
    switch is logged with ``log`` and recorded in ``state.json``.  ``arrived``: each node's
    name -> the time its ``autopar run`` made the launch that brought it to this round (where
    a node joined, the switch starts there)."""
    from autopar.core.plan import load_plan

    directory.mkdir(parents=True, exist_ok=True)
    state = read_json(directory / STATE) or {"plan": str(given_plan), "switches": []}
    failure = read_json(directory / FAILURE) or restarted_after()
    (directory / FAILURE).unlink(missing_ok=True)
    current_path = Path(state["plan"])
    current = load_plan(current_path)
    before = state.get("nodes")
    out = {"plan": str(current_path), "resume_step": checkpoint_step(checkpoint_dir)}
    state.update(nodes=nodes, world=world, launched_at=launched_at)
    if current.world_size == world:
        if failure is not None:
            log(f"restarted on the same {len(nodes)} node(s) after: {failure.get('why')}; plan {current_path} kept")
        write_json(directory / STATE, state)
        return out
    lost = [n for n in (before or []) if n not in nodes]
    joined = [n for n in nodes if before is not None and n not in before]
    reason = "node lost" if world < current.world_size else "node joined"
    if failure is not None:
        why = failure.get("why")
    elif joined:
        why = f"node(s) {', '.join(joined)} joined the rendezvous and torch restarted the round"
    else:
        why = "the run started"
    why = f"{reason}: {why}"
    why += (f"; the rendezvous gathered {len(nodes)} node(s) within --rendezvous-timeout {rendezvous_timeout_s:g} s"
            f" where {current_path.name} runs on {current.world_size} ranks")
    # when the switch began: the failure; where a node joined (no failure), its launch; else this launch
    came = [arrived[n] for n in joined if isinstance((arrived or {}).get(n), (int, float))]
    began = (failure or {}).get("time") or (min(came) if came else launched_at)
    index = len(state["switches"]) + 1
    new_path = directory / f"plan_{index}.json"
    per_node = world // len(nodes)
    t0 = time.time()
    replan_for_nodes(current_path, len(nodes), new_path, checkpoint_dir, budget_s)
    replan_s = time.time() - t0
    new = load_plan(new_path)
    if new.world_size != world:
        raise UserError(f"the re-plan for {len(nodes)} node(s) ({new_path}) uses {new.world_size} ranks, but the "
                        f"rendezvous started {world} ({per_node} per node): the plan's cluster does not describe "
                        f"these nodes. Give autopar run the plan of a cluster file whose nodes hold {per_node} "
                        f"devices each.")
    last = last_logged_step(metrics)
    step = out["resume_step"]
    startup = state.get("ranks_startup_s")
    if failure is None and joined:
        # the joining node waits in the rendezvous until a training node's agent sees it, at its
        # next check of the workers (torchrun's --monitor-interval)
        rendezvous = MONITOR_INTERVAL_S
    else:
        detect = KEEP_ALIVE_INTERVAL_S * KEEP_ALIVE_MAX_ATTEMPT
        rendezvous = detect + (rendezvous_timeout_s if len(nodes) < max_nodes else 0.0)
    predicted = {"rendezvous_s": rendezvous, "replan_s": budget_s, "restart_s": startup}
    switch = {
        "index": index, "reason": reason, "why": why, "at": time.time(),
        "failure_time": began,
        "nodes_before": before, "nodes_after": nodes, "nodes_lost": lost, "nodes_joined": joined,
        "old_plan": str(current_path), "new_plan": str(new_path),
        "old_layout": f"{current.world_size} ranks, {layout(current)}",
        "new_layout": f"{new.world_size} ranks, {layout(new)}",
        "predicted_step_time_s": {"before": _step_ms(current), "after": _step_ms(new)},
        "checkpoint_step": step, "last_step_before": last,
        "steps_lost": max(0, (last or step) - step),
        "predicted_switch_s": {**predicted, "total": sum(v for v in predicted.values() if v is not None)},
        "replan_measured_s": replan_s,
    }
    state["switches"].append(switch)
    state["plan"] = str(new_path)
    write_json(directory / STATE, state)
    out.update(plan=str(new_path), switch=index)
    for line in switch_log_lines(switch):
        log(line)
    return out


def _s(v) -> str:
    return f"{v:.2f} s" if isinstance(v, (int, float)) else "n/a"


def switch_log_lines(switch: dict) -> list[str]:
    """The switch's log lines."""
    p, t = switch["predicted_switch_s"], switch["predicted_step_time_s"]
    ms = lambda v: f"{1e3 * v:.2f} ms" if isinstance(v, (int, float)) else "not predicted"  # noqa: E731
    return [
        f"switch {switch['index']}: {switch['why']}",
        f"  nodes: {switch['nodes_before']} -> {switch['nodes_after']} (lost {switch['nodes_lost']}, "
        f"joined {switch['nodes_joined']})",
        f"  plan: {switch['old_plan']} ({switch['old_layout']}) -> {switch['new_plan']} ({switch['new_layout']})",
        f"  predicted step time: {ms(t['before'])} before, {ms(t['after'])} after",
        f"  resumes from the checkpoint of step {switch['checkpoint_step']}; steps lost since it: "
        f"{switch['steps_lost']} (last step logged before: {switch['last_step_before']})",
        f"  predicted switch time: {_s(p['total'])} (rendezvous {_s(p['rendezvous_s'])}, re-plan "
        f"{_s(p['replan_s'])}, restart {_s(p['restart_s'])}); the re-plan took {_s(switch['replan_measured_s'])}",
    ]


def watch_first_step(directory: Path, metrics: Path, after_step: int, launched_at: float, started_at: float,
                     switch: int | None, log, poll_s: float = 0.05) -> threading.Thread:
    """A daemon thread that waits for the metrics file's first step record past ``after_step``,
    then records the launch's start-up (from its launch, and from its ranks' start) and, for a
    switch, the measured switch time."""
    def watch():
        while True:
            last = last_logged_step(metrics)
            if last is not None and last > after_step:
                break
            time.sleep(poll_s)
        now = time.time()
        state = read_json(directory / STATE) or {}
        state["startup_s"] = now - launched_at
        state["ranks_startup_s"] = now - started_at
        if switch is not None:
            rec = state["switches"][switch - 1]
            rec["first_step_after_at"] = now
            rec["measured_switch_s"] = now - rec["failure_time"]
            since = "the joining node's launch" if rec.get("reason") == "node joined" and rec["nodes_joined"] \
                else "the failure"
            log(f"switch {switch}: measured switch time {rec['measured_switch_s']:.2f} s, from {since} to "
                f"step {after_step + 1} (predicted {_s(rec['predicted_switch_s']['total'])})")
        write_json(directory / STATE, state)

    thread = threading.Thread(target=watch, name="autopar-elastic-watch", daemon=True)
    thread.start()
    return thread


def add_to_measured(directory: Path, measured: Path) -> None:
    """Put the run's switches into measured.json (``Measured.switches``)."""
    from autopar.core.measured import Measured

    state = read_json(directory / STATE) or {}
    if not state.get("switches"):
        return
    data = Measured.from_json(read_json(measured), source=str(measured)).to_json()
    data["switches"] = state["switches"]
    write_json(measured, data)
