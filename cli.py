"""The ``autopar`` command: parse arguments, call one function per verb, print.

Each verb lives in the part of autopar it belongs to; this file only registers them.  A verb
module exposes ``add_arguments(parser)`` and ``main(args) -> int`` and is imported only when
its verb runs, so ``autopar inspect`` never pays for OR-Tools.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# verb -> (module, one-line help)
VERBS = {
    "inspect": ("autopar.core.inspect_cli", "capture a model on the meta device and show its layers, parameters and FLOPs"),
    "simulate": ("autopar.simulator.simulate_cli", "predict step time and memory of a configuration or a plan.json"),
    "plan": ("autopar.planner.plan_cli", "search for the fastest plan that fits the cluster and write plan.json"),
    "replan": ("autopar.planner.replan_cli", "plan a plan.json's model and global batch again for another cluster; "
                                             "print how the run resumes"),
    "run": ("autopar.elastic.run_cli", "train a plan.json with torchrun (prints the command for multi-node clusters; "
                                       "--elastic: re-plan and go on when nodes are lost)"),
    "launch": ("autopar.runtime.launch_cli", "write a batch script that trains a plan.json on a SLURM cluster"),
    "export": ("autopar.runtime.export_cli", "write a checkpoint's weights as safetensors (from_pretrained / load_state_dict)"),
    "profile": ("autopar.profiling.profile_cli", "measure op and collective costs on this machine into a profile file"),
    "report": ("autopar.report.report_cli", "compare a plan's prediction with a measured run; calibrate the profile"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Automatic parallelization planner for PyTorch training: capture, simulate, plan, run, report.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if argv is None:                                  # the command line, not a caller in Python
        _exit_past_stray_threads(code)
        _exit_past_torch_teardown(code)
    return code


def _exit_past_torch_teardown(code: int) -> None:
    """Under torchrun (``autopar profile`` timing collectives on several ranks) leave through
    ``os._exit`` once the work is written and the process group destroyed, as the runtime's ranks
    do (runtime/__main__.py): a rank tearing torch's C++ state down in interpreter exit has aborted
    after a successful profile ("terminate called without an active exception", rank 1 of
    tests/integration/test_profiling_profile.py, twice in fresh-clone runs), failing a run that
    had done its job."""
    import os

    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(argv: list[str] | None) -> int:
    import signal

    from autopar.core import interrupts
    from autopar.core.errors import UserError, paragraph
    from autopar.core.modelfile import bound_user_code, default_time_limit_s

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"autopar {args.verb}: this verb is not available in this installation.", file=sys.stderr)
        return 2
    previous = signal.getsignal(signal.SIGINT)
    try:
        from autopar.core.output_file import forget_inputs, note_arguments

        forget_inputs()                               # a fresh command (tests call main() repeatedly)
        note_arguments(parser, args)                  # no output may overwrite one of these
        interrupts.install_sigint_flag()                          # a real Ctrl-C, told from a raised KeyboardInterrupt
        bound_user_code(default_time_limit_s(), f"autopar {args.verb}")   # a model file that never returns is an error
        return int(importlib.import_module(args._module).main(args) or 0)
    except UserError as e:
        print(paragraph(f"autopar {args.verb}: error: {e}"), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"autopar {args.verb}: interrupted.", file=sys.stderr)
        return 130
    finally:
        bound_user_code(None)
        try:
            signal.signal(signal.SIGINT, previous)
        except (ValueError, OSError, TypeError):
            pass


def _exit_past_stray_threads(code: int) -> None:
    """A model file may leave a non-daemon thread running (a timer, a server): the interpreter
    would wait for it forever at exit.  The work is done and written, so leave at once."""
    import os
    import threading

    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
