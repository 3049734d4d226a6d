"""torchrun worker for the compiled parity cases: runs the plans one after another in one
process group, like ``runtime_worker``, and after each case writes dynamo's counters (frames
compiled, graph breaks, recompile-limit fallbacks) beside its measured.json, so the test can
tell that the blocks really ran compiled and did not fall back to eager."""
import json
import os
import sys
from pathlib import Path

import torch._dynamo.utils

from autopar.runtime.mesh import shutdown
from autopar.runtime.options import RunOptions
from autopar.runtime.train import run

import capture_memo

capture_memo.install()      # one capture per model file, arguments and micro-batch in this process


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    for case in cases:
        run(RunOptions(plan_path=Path(case["plan"]), steps=case.get("steps", 5), timing_warmup_steps=1,
                       checkpoint_dir=Path(case["checkpoint_dir"]) if case.get("checkpoint_dir") else None,
                       measured_path=Path(case["measured"])))
        counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
        if int(os.environ.get("RANK", "0")) == 0:
            Path(case["measured"] + ".dynamo.json").write_text(json.dumps(counters, default=str))
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
