"""``autopar replan`` as functions: ``replan`` plans a plan.json's model and global batch again for
another cluster (``autopar.plan``, planner/plan_api.py, with the same runtime check), and
``switch_lines`` says how the run carries over.  See replan_cli.py for the rules (the batch
kept, the message where the new rank count cannot keep it, the checkpoint read by name)."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from autopar.core.errors import UserError


def replan(plan_path: str | Path, *, output: str | Path, nodes: int | None = None, cluster: str | None = None,
           global_batch: int | None = None, time_budget: float = 40.0, seed: int = 0, progress=None, warn=None):
    """The plan file ``plan_path`` planned again for ``cluster`` (or its own cluster rescaled to
    ``nodes``) and written to ``output``; returns (the old plan, the plan_api.PlanOutcome, the
    global batch planned)."""
    from autopar.core.plan import load_plan
    from autopar.planner import plan_api
    from autopar.runtime.plan_check import resolve_model_path

    plan_path = Path(plan_path)
    old = load_plan(plan_path)
    batch = global_batch or old.global_batch
    where, nodes = _cluster(old, str(plan_path), cluster, nodes)
    try:
        out = plan_api.plan(resolve_model_path(old, plan_path), where, batch, model_args=dict(old.model.args),
                            nodes=nodes, precision=old.precision, time_budget=time_budget, seed=seed,
                            output=output, grad_clip=old.grad_clip,      # priced as the old plan was
                            progress=progress, warn=warn)
    except UserError as e:
        from autopar.core.cluster_file import load_cluster

        if e.exit_code != 3 or global_batch is not None:
            raise
        world = load_cluster(where, nodes=nodes).world_size
        if batch % world == 0:                        # the batch splits evenly: it is not what is short
            raise
        options = " or ".join(f"--global-batch {b}" for b in _nearest_batches(batch, world))
        raise UserError(f"no plan of the new cluster ({world} ranks) keeps the global batch of {batch} samples "
                        f"({e}). A resumed run can take another batch, but then every step from the checkpoint's "
                        f"on trains on that many samples instead of {batch}: give {options} (a multiple of the "
                        f"rank count), or a cluster with more memory.") from None
    return old, out, batch


def switch_lines(plan_path, old, output, batch: int, checkpoint_dir: Path | None) -> list[str]:
    """The switch, as ``autopar replan`` prints it: the layouts and step times before and after,
    the global batch, the checkpoint, and the commands to resume."""
    from autopar.core.plan import load_plan

    new = load_plan(output)
    lines = ["", f"autopar replan: {plan_path} ({old.world_size} ranks, {_layout(old)}, on {old.cluster or '?'}) "
                 f"-> {output} ({new.world_size} ranks, {_layout(new)}, on {new.cluster or '?'})",
             f"  predicted step time: {_step_ms(old)} before, {_step_ms(new)} after"]
    if batch != old.global_batch:
        lines.append(f"  global batch: {old.global_batch} -> {batch} samples per step (changed by --global-batch)")
    else:
        lines.append(f"  global batch: {batch} samples per step, kept")
    ck = checkpoint_dir
    if ck is not None:
        lines.append(f"  checkpoint: {_checkpoint_note(ck)}")
    resume = ["autopar", "run", str(output), "--checkpoint-dir", str(ck) if ck is not None else "CHECKPOINT_DIR"]
    lines += ["  resume with the run's other options as before:", f"    {shlex.join(resume)}",
              f"    (on SLURM: autopar launch {shlex.quote(str(output))} --slurm --checkpoint-dir "
              f"{shlex.quote(str(ck) if ck is not None else 'CHECKPOINT_DIR')} -o job.sbatch ...)"]
    return lines


def _cluster(old, plan_path: str, cluster: str | None, nodes: int | None) -> tuple[str, int | None]:
    """The cluster to plan for and its node count: --cluster, else the old plan's rescaled to --nodes."""
    if cluster is not None:
        return cluster, None
    ref = old.provenance.get("cluster_ref")
    if not isinstance(ref, str):
        raise UserError(f"plan file {plan_path} does not record the cluster it was planned for (provenance."
                        f"cluster_ref), so --nodes has nothing to rescale; give the new cluster with --cluster.")
    return ref, nodes


def _layout(plan) -> str:
    """``dp 2 x tp 2``: the plan's axes that split (degree > 1)."""
    m = plan.mesh
    return " x ".join(f"{n} {getattr(m, n)}" for n in m.degree_names() if getattr(m, n) > 1) or "one rank"


def _step_ms(plan) -> str:
    s = plan.predicted.get("step_time_s")
    return f"{1e3 * s:.2f} ms" if isinstance(s, (int, float)) else "not predicted"


def _nearest_batches(batch: int, world: int) -> list[int]:
    """The multiples of ``world`` nearest ``batch`` (one per data-parallel rank at least)."""
    below = (batch // world) * world
    return sorted({b for b in (below, below + world) if b > 0})


def _checkpoint_note(directory: Path) -> str:
    """What the newest checkpoint under ``directory`` holds (latest.json and its manifest)."""
    try:
        latest = json.loads((directory / "latest.json").read_text())
        manifest = json.loads((directory / latest["path"] / "manifest.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return f"no complete checkpoint found under {directory} yet: the run resumed there starts from step 0."
    mesh = manifest.get("mesh") or {}
    layout = " x ".join(f"{k}{v}" for k, v in mesh.items() if isinstance(v, int) and v > 1) or "one rank"
    return (f"the newest checkpoint, {directory / latest['path']}, is step {manifest.get('step', latest.get('step'))} "
            f"saved by {manifest.get('world_size', '?')} ranks ({layout}, ZeRO-{manifest.get('zero', '?')}): "
            f"torch.distributed.checkpoint stores full tensors by name, so each rank of the new layout reads "
            f"its own slices, and the run goes on from that step.")
