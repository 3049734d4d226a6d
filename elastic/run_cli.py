"""``autopar run PLAN ...``: the runtime's ``autopar run`` (``autopar.runtime.run_launch``), and with
``--elastic`` an elastic run (``autopar.elastic.orchestrate``), which re-plans through the
planner when the nodes change and so cannot live in the runtime."""
from __future__ import annotations

import argparse

from autopar.core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.elastic import orchestrate
    from autopar.runtime.options import add_run_arguments
    from autopar.runtime.run_launch import add_launch_arguments

    add_run_arguments(parser)
    add_launch_arguments(parser)
    orchestrate.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from autopar.runtime.run_launch import launch

    if args.elastic:
        from autopar.elastic import orchestrate

        return orchestrate.main(args)
    given = [f for f, v in (("--min-nodes", args.min_nodes), ("--rendezvous-timeout", args.rendezvous_timeout),
                            ("--start-timeout", args.start_timeout),
                            ("--replan-budget", args.replan_budget)) if v is not None]
    if given:
        raise UserError(f"{', '.join(given)} only apply to an elastic run: add --elastic (and --checkpoint-dir).")
    return launch(args)
