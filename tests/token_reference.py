"""The tests' own reading of a token file by the rule docs/runtime.md states ("Data"), written
without autopar: numpy over the whole file, the permutation recomputed from its definition.

Sample j of a file of N = (tokens - 1) // S samples is x = tokens[j S : (j+1) S], y = the same
shifted by one; row r of step t's global batch (B rows) is position k = t B + r, in pass
p = k // N at index i = k mod N, and takes sample i -- or, with ``--shuffle SEED``, sample
perm_p[i], perm_p = torch.randperm(N, generator=torch.Generator().manual_seed(seed_p)), seed_p
the first 8 bytes (little-endian) of sha256("shuffle:SEED:p") shifted right by one bit.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

DTYPES = {"uint16": "<u2", "uint32": "<u4"}


def write_tokens(path: Path, ids, dtype: str = "uint16") -> Path:
    np.asarray(ids).astype(DTYPES[dtype]).tofile(path)
    return path


def pass_permutation(seed: int, p: int, n: int) -> list[int]:
    seed_p = int.from_bytes(hashlib.sha256(f"shuffle:{seed}:{p}".encode()).digest()[:8], "little") >> 1
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed_p)).tolist()


def global_batch(path: Path, seq: int, batch: int, step: int, shuffle: int | None = None, dtype: str = "uint16"):
    """((x,), y) of step ``step``'s global batch, int64 [batch, seq] tensors."""
    tokens = np.fromfile(path, dtype=DTYPES[dtype]).astype(np.int64)
    n = (len(tokens) - 1) // seq
    xs, ys = [], []
    for r in range(batch):
        k = step * batch + r
        j = k % n if shuffle is None else pass_permutation(shuffle, k // n, n)[k % n]
        xs.append(tokens[j * seq:(j + 1) * seq])
        ys.append(tokens[j * seq + 1:(j + 1) * seq + 1])
    return (torch.from_numpy(np.stack(xs)),), torch.from_numpy(np.stack(ys))


def batches(path: Path, seq: int, batch: int, shuffle: int | None = None):
    """``step -> global batch`` for ``plain_loop.train_plain(batches=...)``."""
    return lambda step: global_batch(path, seq, batch, step, shuffle)


def plain_val_loss(model, loss_fn, path: Path, seq: int, batch: int, num_batches: int) -> float:
    """The plain model's mean loss over the first ``num_batches`` global batches of a validation
    file (in order, no shuffle), forward only in eval mode."""
    model.eval()
    with torch.no_grad():
        losses = [float(loss_fn(model(*x), y)) for x, y in
                  (global_batch(path, seq, batch, b) for b in range(num_batches))]
    model.train()
    return sum(losses) / len(losses)
