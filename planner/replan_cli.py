"""``autopar replan PLAN (--nodes N | --cluster FILE) -o NEW``: the same model and global batch,
planned again for another cluster, and the commands that carry the run over.

The old plan records what it was made from: the model file and its arguments (``plan.model``),
the cluster (``provenance.cluster_ref`` and ``cluster_nodes``), the precision and the global
batch.  ``--nodes N`` rescales that cluster to N nodes (a single-group cluster,
``Cluster.scaled``); ``--cluster`` names another one.  The search is ``autopar plan``'s own
(``autopar.plan``, planner/plan_api.py, with the same runtime check; the work is
planner/replan_api.py's), so the new plan is what ``autopar plan`` writes for that cluster.

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
import sys
from pathlib import Path


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


def main(args: argparse.Namespace) -> int:
    from autopar.core.errors import paragraph
    from autopar.core.output_file import check_writable
    from autopar.planner import plan_report, replan_api

    check_writable(args.output, "-o")
    console = plan_report.console()
    with plan_report.progress_bar(console) as progress:
        old, out, batch = replan_api.replan(args.plan, output=args.output, nodes=args.nodes, cluster=args.cluster,
                                            global_batch=args.global_batch, time_budget=args.time_budget,
                                            seed=args.seed, progress=progress,
                                            warn=lambda text: print(paragraph(text), file=sys.stderr))
    plan_report.print_outcome(console, out)
    for line in replan_api.switch_lines(Path(args.plan), old, args.output, batch, args.checkpoint_dir):
        print(line)
    sys.stdout.flush()
    return 0
