"""Train with your own loop and your own data, on a plan autopar made.

    autopar plan examples/gpt.py --model-arg size=tiny ... -o plan.json      # any plan for gpt.py
    torchrun --nproc-per-node 2 examples/own_loop.py plan.json --steps 50

(``--nproc-per-node``: the plan's world size.)  The data is this script's own: a tensor of token
sequences that follow a simple rule (each token is the previous one plus a fixed stride, modulo
the vocabulary), served by a ``torch.utils.data.DataLoader`` that every rank iterates in the same
order; each rank trains on its rows of every global batch (``job.local_rows``).  The loss falls
as the model learns the rule.  The loop logs the global loss, the learning rate and the gradient
norm, and saves a checkpoint at the end that ``autopar run`` and ``job.resume`` both read.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import autopar


def stride_sequences(count: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``count`` rows of ``seq + 1`` tokens: a random start and a random stride per row."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (count, 1), generator=g)
    stride = torch.randint(1, 4, (count, 1), generator=g)
    return (start + stride * torch.arange(seq + 1)) % vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--checkpoint-dir", default=None)
    a = ap.parse_args()

    job = autopar.prepare(a.plan, steps=a.steps, lr=3e-3, lr_schedule="cosine", lr_warmup=5, min_lr=3e-4,
                          grad_clip=1.0, weight_decay=0.01)
    from autopar.examples.gpt import resolve_config  # the plan was made for examples/gpt.py: its sizes

    dims = {k: v for k, v in job.plan.model.args.items() if k in ("size", "layers", "hidden", "heads", "seq", "vocab")}
    cfg = resolve_config(**dims)
    vocab, seq = cfg["vocab"], cfg["seq"]
    tokens = stride_sequences(job.plan.global_batch * a.steps, seq, vocab)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=job.plan.global_batch,
                        shuffle=False, drop_last=True)
    start = job.resume(a.checkpoint_dir) if a.checkpoint_dir else 0
    for step, (x, y) in enumerate(loader):
        if step < start:                             # a resumed run skips the batches already trained on
            continue
        loss = job.step(job.local_rows(x), job.local_rows(y))
        if step % 10 == 0 or step == a.steps - 1:
            mean = job.global_loss(loss)             # every rank calls it (an all-reduce)
            if torch.distributed.get_rank() == 0:
                print(f"step {step + 1}/{a.steps} loss {mean:.4f} lr {job.lr:.2e} "
                      f"grad_norm {float(job.grad_norm):.3f}", flush=True)
    if a.checkpoint_dir:
        path = job.save(a.checkpoint_dir)
        if torch.distributed.get_rank() == 0:
            print(f"saved {path}")
    job.close()


if __name__ == "__main__":
    main()
