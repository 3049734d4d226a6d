"""``torchrun --nproc-per-node N -m autopar.runtime plan.json --steps 50``: one training process.

A signal (SIGTERM, Ctrl-C) stops the run at a step boundary (``autopar.runtime.stop_signals``);
a failure after one arrived is its consequence and stays quiet.  Any other failure goes through
``autopar.runtime.rank_errors.report_failure``: the first rank to
fail prints its message (a user error as one paragraph, with its rank; anything else as a
traceback), the ranks that fail because of it stay quiet, and every rank exits with the first
one's code (2 for a user error).  The output paths are checked before anything else.  After
the process group is destroyed the process leaves through ``os._exit``: FSDP2 workers can
otherwise abort in interpreter teardown after a successful run.
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.runtime",
                                     description="Train a plan.json (start it with torchrun).")
    from autopar.runtime.options import add_run_arguments, options_from_args

    add_run_arguments(parser)
    args = parser.parse_args(argv)
    from autopar.runtime import stop_signals
    from autopar.runtime.rank_errors import report_failure, report_stop

    stop_signals.install()                   # SIGTERM / Ctrl-C: stop at a step boundary, resumable
    code = 0
    try:
        from autopar.runtime.output_paths import check_output_paths
        from autopar.runtime.train import run

        from autopar.core.output_file import note_arguments

        note_arguments(parser, args)
        opts = options_from_args(args)
        check_output_paths(opts)
        run(opts)
    except stop_signals.RunStopped as e:
        stop_signals.ending()
        code = report_stop(e)
    except Exception as e:  # noqa: BLE001 -- every failure becomes one message and one exit code
        stop_signals.ending()                # a SIGTERM torchrun sends now must not cut the report short
        if stop_signals.received():
            # torchrun signalled this rank (a peer died, or the user stopped the run) and a
            # collective with the gone peer failed: a consequence, not a cause -- stay quiet
            code = 128 + stop_signals.received()
        else:
            code = report_failure(e)
    finally:
        from autopar.runtime.mesh import shutdown

        stop_signals.ending()                # torchrun's SIGTERM during teardown: recorded, not raised
        shutdown()
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
