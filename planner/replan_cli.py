"""``autopar replan PLAN (--nodes N | --cluster FILE) -o NEW``: the same model and global batch,
planned again for another cluster, and the commands that carry the run over.

The old plan records what it was made from: the model file and its arguments (``plan.model``),
the cluster (``provenance.cluster_ref`` and ``cluster_nodes``), the precision and the global
batch.  ``--nodes N`` rescales that cluster to N nodes (a single-group cluster,
``Cluster.scaled``); ``--cluster`` names another one.  The search is ``autopar plan``'s own
(``autopar.plan``, planner/plan_api.py, with the same runtime check), so the new plan is what
``autopar plan`` writes for that cluster.

The global batch is kept, so a resumed run takes the same samples per step.  Where no plan of
the new cluster holds it and the new rank count does not divide it, the search's "no plan fits"
(exit 3) becomes a message (exit 2) that names the nearest batches the rank count divides and
asks for ``--global-batch``; a run resumed with another batch trains on a different number of samples
per step from the checkpoint's step on.

Then it prints the switch: the predicted step time before (the old plan's figure, on its own
cluster) and after, what the checkpoint under ``--checkpoint-dir`` holds (step, the layout it
was saved under), and the commands to resume.  A checkpoint is saved with
``torch.distributed.checkpoint`` under the names of the full tensors, so the new layout's ranks
each read their own slices of it (``runtime/checkpointing.py``): the run continues from the
checkpoint's step under the new plan.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from autopar.core.errors import UserError, paragraph


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.core import cli_types as T

    parser.add_argument("plan", metavar="PLAN_JSON", help="the plan the run was started with")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--nodes", type=T.positive, default=None, metavar="N",
                       help="the plan's cluster with N nodes (a cluster of one node group)")
    where.add_argument("--cluster", default=None, metavar="PATH_OR_NAME", help="another cluster file or bundled cluster")
    parser.add_argument("--global-batch", type=T.global_batch, default=None, metavar="N",
                        help="samples per step (default: the plan's; give one where the new cluster cannot keep it)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                        help="the run's checkpoint folder: its newest checkpoint is described, and the resume "
                             "commands name it")
    parser.add_argument("--time-budget", type=T.positive_number, default=40.0, metavar="SECONDS",
                        help="wall-clock budget of the search (default 40)")
    parser.add_argument("--seed", type=T.seed, default=0, help="seed of the search (default 0)")
    parser.add_argument("-o", "--output", required=True, metavar="PATH", help="the new plan file to write")


def _cluster(old, plan_path: str, args: argparse.Namespace) -> tuple[str, int | None]:
    """The cluster to plan for and its node count: --cluster, else the old plan's rescaled to --nodes."""
    if args.cluster is not None:
        return args.cluster, None
    ref = old.provenance.get("cluster_ref")
    if not isinstance(ref, str):
        raise UserError(f"plan file {plan_path} does not record the cluster it was planned for (provenance."
                        f"cluster_ref), so --nodes has nothing to rescale; give the new cluster with --cluster.")
    return ref, args.nodes


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


def main(args: argparse.Namespace) -> int:
    from autopar.core.output_file import check_writable
    from autopar.core.plan import load_plan
    from autopar.planner import plan_api, plan_report
    from autopar.runtime.plan_check import resolve_model_path

    check_writable(args.output, "-o")
    plan_path = Path(args.plan)
    old = load_plan(plan_path)
    batch = args.global_batch or old.global_batch
    cluster, nodes = _cluster(old, args.plan, args)
    console = plan_report.console()
    try:
        with plan_report.progress_bar(console) as progress:
            out = plan_api.plan(resolve_model_path(old, plan_path), cluster, batch, model_args=dict(old.model.args),
                                nodes=nodes, precision=old.precision, time_budget=args.time_budget, seed=args.seed,
                                output=args.output, grad_clip=old.grad_clip,      # priced as the old plan was
                                progress=progress, warn=lambda text: print(paragraph(text), file=sys.stderr))
    except UserError as e:
        from autopar.core.cluster_file import load_cluster

        if e.exit_code != 3 or args.global_batch is not None:
            raise
        world = load_cluster(cluster, nodes=nodes).world_size
        if batch % world == 0:                        # the batch splits evenly: it is not what is short
            raise
        options = " or ".join(f"--global-batch {b}" for b in _nearest_batches(batch, world))
        raise UserError(f"no plan of the new cluster ({world} ranks) keeps the global batch of {batch} samples "
                        f"({e}). A resumed run can take another batch, but then every step from the checkpoint's "
                        f"on trains on that many samples instead of {batch}: give {options} (a multiple of the "
                        f"rank count), or a cluster with more memory.") from None
    plan_report.print_outcome(console, out)
    new = load_plan(args.output)
    print()
    print(f"autopar replan: {plan_path} ({old.world_size} ranks, {_layout(old)}, on {old.cluster or '?'}) "
          f"-> {args.output} ({new.world_size} ranks, {_layout(new)}, on {new.cluster or '?'})")
    print(f"  predicted step time: {_step_ms(old)} before, {_step_ms(new)} after")
    if batch != old.global_batch:
        print(f"  global batch: {old.global_batch} -> {batch} samples per step (changed by --global-batch)")
    else:
        print(f"  global batch: {batch} samples per step, kept")
    ck = args.checkpoint_dir
    if ck is not None:
        print(f"  checkpoint: {_checkpoint_note(ck)}")
    resume = ["autopar", "run", str(args.output), "--checkpoint-dir", str(ck) if ck is not None else "CHECKPOINT_DIR"]
    print("  resume with the run's other options as before:")
    print(f"    {shlex.join(resume)}")
    print(f"    (on SLURM: autopar launch {shlex.quote(str(args.output))} --slurm --checkpoint-dir "
          f"{shlex.quote(str(ck) if ck is not None else 'CHECKPOINT_DIR')} -o job.sbatch ...)")
    sys.stdout.flush()
    return 0
