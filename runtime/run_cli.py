"""``autopar run plan.json``: start torchrun for a plan (one node), or print the per-node commands.

What it checks and starts is runtime/run_launch.py's ``launch`` (its docstring); this module
declares the flags and calls it.
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.runtime.options import add_run_arguments
    from autopar.runtime.run_launch import add_launch_arguments

    add_run_arguments(parser)
    add_launch_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from autopar.runtime.run_launch import launch

    return launch(args)
