"""torchrun worker for the Python API's tests: runs several plans one after another in one process
group, each trained by a loop of its own through ``autopar.prepare`` (as a user's script would),
on the test's own token tensors (``own_batches``), not on make_batch.

Per case it resumes the newest checkpoint of its ``checkpoint_dir`` if there is one, trains up to
``stop_at`` (default: the run's ``steps``), saves the state there with ``job.save`` and writes
(rank 0) ``{"first_step", "losses", "grad_norms", "lrs", "rows", "data_ranks"}`` to the case's
``measured`` path.  A case's ``functions``: the model comes from functions (``build_model`` of
examples/gpt.py, imported here) rather than the plan's model file."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch


def own_batches(vocab: int, seq: int, global_batch: int, steps: int, seed: int = 7):
    """step -> (inputs tuple, target) of the global batch: random token rows, next-token targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (steps * global_batch, seq + 1), generator=g)

    def batch(step: int):
        rows = tokens[step * global_batch:(step + 1) * global_batch]
        return (rows[:, :-1].contiguous(),), rows[:, 1:].contiguous()
    return batch


def _gpt_functions(path: str):
    spec = importlib.util.spec_from_file_location("api_worker_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch.distributed as dist

    import autopar
    import capture_memo

    capture_memo.install()      # one capture per model file, arguments and micro-batch in this process

    cases = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")           # the script's own group: prepare joins it, close keeps it
    for case in cases:
        options = dict(case.get("options", {}))
        if "betas" in options:
            options["betas"] = tuple(options["betas"])
        extra = {}
        if case.get("functions"):
            extra["build_model"] = _gpt_functions(case["functions"]).build_model
        job = autopar.prepare(case["plan"], **extra, **options)
        a = job.plan.model.args
        batch = own_batches(a["vocab"], a["seq"], job.plan.global_batch, options["steps"])
        first = job.resume(case["checkpoint_dir"])
        losses, norms, lrs = [], [], []
        for step in range(first, case.get("stop_at", options["steps"])):
            inputs, target = batch(step)
            loss = job.step(tuple(job.local_rows(x) for x in inputs), job.local_rows(target))
            losses.append(job.global_loss(loss))
            norms.append(float(job.grad_norm))
            lrs.append(job.lr)
        job.save(case["checkpoint_dir"])
        if dist.get_rank() == 0:
            Path(case["measured"]).write_text(json.dumps({"first_step": first, "losses": losses, "grad_norms": norms, "lrs": lrs,
                                                          "rows": job.rows, "data_ranks": job.data_ranks}))
        job.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
