"""torchrun worker for the zoo parity tests: one model, several plans, one process group.

Each case is a full ``autopar.runtime.train.run`` of one plan; a case the runtime refuses with
a ``UserError`` (the same on every rank, before any collective) is recorded with its message
and the next case runs.  The captured graph is computed once per (model, args, micro-batch)
(tests/capture_memo.py): the cases of one model share it.
"""
import json
import os
import sys
import traceback
from pathlib import Path

from autopar.core.errors import UserError
from autopar.runtime.mesh import shutdown
from autopar.runtime.options import RunOptions
from autopar.runtime.train import run

import capture_memo

capture_memo.install()      # one capture per model file, arguments and micro-batch in this process


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    for case in cases:
        result = Path(case["result"])
        try:
            report = run(RunOptions(plan_path=Path(case["plan"]), steps=case["steps"], timing_warmup_steps=0,
                                    measured_path=Path(case["measured"]), log_every=case["steps"],
                                    **({"lr": case["lr"]} if "lr" in case else {}),
                                    # "options": further RunOptions fields (a weights file for init_from)
                                    **{k: Path(v) if k == "init_from" else v
                                       for k, v in case.get("options", {}).items()}))
            out = {"losses": list(report.losses)}
        except UserError as e:
            out = {"refused": str(e)}
        except Exception as e:  # noqa: BLE001 - recorded for the test to show; the launch fails
            out = {"crashed": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            if int(os.environ.get("RANK", "0")) == 0:
                result.write_text(json.dumps(out))
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            result.write_text(json.dumps(out))
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
