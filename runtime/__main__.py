"""``torchrun --nproc-per-node N -m autopar.runtime plan.json --steps 50``: one training process.

A user error (malformed plan, wrong world size, fingerprint mismatch) is printed once, by
rank 0, as one paragraph, and every rank exits with code 2.  After the process group is
destroyed the process leaves through ``os._exit``: FSDP2 workers can otherwise abort in
interpreter teardown after a successful run.
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
    from autopar.core.errors import UserError

    code = 0
    try:
        from autopar.runtime.train import run

        run(options_from_args(args))
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            from autopar.cli import _paragraph

            print(_paragraph(f"autopar run: error: {e}"), file=sys.stderr, flush=True)
        code = e.exit_code
    finally:
        from autopar.runtime.mesh import shutdown

        shutdown()
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
