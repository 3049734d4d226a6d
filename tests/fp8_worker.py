"""Run fp8 plans in one process on the CPU, for tests/integration/test_runtime_fp8.py.

    python tests/fp8_worker.py OUT.json STEPS PLAN.json [PLAN.json ...]
    torchrun --nproc-per-node 2 tests/fp8_worker.py OUT.json STEPS PLAN.json ...

The runtime refuses float8 on a machine without fp8 tensor cores (runtime/fp8_check.py); this
worker alone tells it the CPU has them, so that torchao's float8 linears -- which
``torch._scaled_mm`` runs on the CPU in torch 2.13 -- train through the runtime's own path
(plan check, build, train step, measured.json) in a gloo group (one rank, or torchrun's).
Rank 0 writes, per plan, the losses and the float8 record of measured.json.  With
``FP8_WORKER_CHECKPOINTS=DIR`` each plan checkpoints into (and resumes from) ``DIR/<plan name>``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import autopar.runtime.fp8_check as fp8_check

fp8_check.device_fp8_support = lambda: (True, "the CPU (tests/fp8_worker.py)")

from autopar.runtime.mesh import shutdown  # noqa: E402
from autopar.runtime.options import RunOptions  # noqa: E402
from autopar.runtime.train import run  # noqa: E402


def main() -> None:
    out, steps, plans = Path(sys.argv[1]), int(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
    rows = {}
    checkpoints = os.environ.get("FP8_WORKER_CHECKPOINTS")
    for plan in plans:
        m = run(RunOptions(plan_path=plan, steps=steps, init="host", measured_path=plan.with_suffix(".measured.json"),
                           checkpoint_dir=Path(checkpoints) / plan.stem if checkpoints else None))
        rows[plan.name] = {"losses": list(m.losses), "float8": m.float8}
    shutdown()
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
