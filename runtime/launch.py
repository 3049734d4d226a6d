"""``python -m autopar.runtime.launch <torchrun arguments>``: torchrun, without its failure traceback.

``autopar run`` starts torchrun through this module.  It is torchrun's own entry point
(``torch.distributed.run.parse_args`` and ``run``) with one difference: when a worker fails,
torchrun raises ``ChildFailedError`` and Python prints the launcher's traceback and a summary
table after the workers' output, burying the failing rank's message (already printed by that
rank, see ``autopar.runtime.rank_errors``).  Here that exception becomes one line and the
first failed worker's exit code.  A signal (SIGTERM, Ctrl-C), which torchrun passes on to
the ranks before it re-raises it as ``SignalException``, ends it with 128 + the signal number
and no traceback: the ranks say what they saved (``autopar.runtime.stop_signals``).
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except SignalException as e:                   # the ranks were sent the same signal and have stopped
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"autopar run: torchrun stopped the run: global rank {rank} exited first, with code "
              f"{failure.exitcode}.", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
