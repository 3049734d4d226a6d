"""torchrun worker for the runtime tests: runs several plans one after another in one process
group (each a full ``autopar.runtime.train.run``), so one launch covers many parity cases.

A case's ``grad_norms`` (a path): its steps are run through ``Trainer`` directly and every
step's ``Trainer.last_grad_norm`` (the global gradient norm before clipping) is written there
(rank 0), as a list."""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from autopar.runtime.mesh import shutdown
from autopar.runtime.options import RunOptions
from autopar.runtime.train import Trainer, run

import capture_memo

capture_memo.install()      # one capture per model file, arguments and micro-batch in this process


def _norms_run(opts: RunOptions, path: Path) -> None:
    trainer = Trainer(opts)
    norms = []
    try:
        for step in range(trainer.first_step, opts.steps):
            trainer.step(step)
            norms.append(float(trainer.last_grad_norm))
        trainer.finish()
    finally:
        trainer.close_data()
        trainer.release_lock()
    if dist.get_rank() == 0:
        path.write_text(json.dumps(norms))


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    for case in cases:
        # "options": any further RunOptions fields of the case (paths as strings, betas as a list)
        extra = {k: (Path(v) if k.endswith(("_path", "_dir", "_file")) and isinstance(v, str) else
                     tuple(v) if k == "betas" else v)
                 for k, v in case.get("options", {}).items()}
        opts = RunOptions(plan_path=Path(case["plan"]), steps=case.get("steps", 5), timing_warmup_steps=1,
                          checkpoint_dir=Path(case["checkpoint_dir"]) if case.get("checkpoint_dir") else None,
                          checkpoint_every=case.get("checkpoint_every", 0), measured_path=Path(case["measured"]),
                          init=case.get("init", "auto"), profile=case.get("profile", False), **extra)
        if case.get("grad_norms"):
            _norms_run(opts, Path(case["grad_norms"]))
        else:
            run(opts)
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
