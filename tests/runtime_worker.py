"""torchrun worker for the runtime tests: runs several plans one after another in one process
group (each a full ``autopar.runtime.train.run``), so one launch covers many parity cases."""
import json
import os
import sys
from pathlib import Path

from autopar.runtime.mesh import shutdown
from autopar.runtime.options import RunOptions
from autopar.runtime.train import run


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    for case in cases:
        # "options": any further RunOptions fields of the case (paths as strings)
        extra = {k: (Path(v) if k.endswith(("_path", "_dir", "_file")) and isinstance(v, str) else v)
                 for k, v in case.get("options", {}).items()}
        run(RunOptions(plan_path=Path(case["plan"]), steps=case.get("steps", 5), timing_warmup_steps=1,
                       checkpoint_dir=Path(case["checkpoint_dir"]) if case.get("checkpoint_dir") else None,
                       checkpoint_every=case.get("checkpoint_every", 0), measured_path=Path(case["measured"]),
                       init=case.get("init", "auto"), profile=case.get("profile", False), **extra))
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
