"""A token file (``--data``, ``--val-data``): what it holds, which samples a step reads, and the
checks that refuse a bad one before training.

Format: a flat little-endian array of token ids, ``uint16`` or ``uint32`` (``--data-dtype``),
no header -- the ``train.bin`` nanoGPT's ``prepare.py`` writes (``np.uint16`` ids, ``tofile``)
and the raw ``.bin`` of Megatron's indexed datasets.  It is read lazily through ``numpy.memmap``.

With ``S`` the plan's sequence length (dim 1 of the captured input, ``graph.seq_len``) and
``N = (tokens - 1) // S`` samples:

* sample ``j`` is ``x = tokens[j S : (j+1) S]``, ``y = tokens[j S + 1 : (j+1) S + 1]`` (the next
  token of each position), both int64;
* step ``t`` (counted from 0 over the whole run, resumes included) reads the samples at
  positions ``k = t B + r`` for rows ``r = 0 .. B-1`` of its global batch (``B`` the plan's global
  batch).  Position ``k`` lies in pass ``p = k // N`` at index ``i = k mod N``; without
  ``--shuffle`` the sample is ``i``; with ``--shuffle SEED`` it is ``perm_p[i]``, where
  ``perm_p = torch.randperm(N, generator=torch.Generator().manual_seed(shuffle_seed(SEED, p)))``
  and ``shuffle_seed(SEED, p)`` is the first 8 bytes (little-endian) of
  ``sha256(f"shuffle:{SEED}:{p}")``, shifted right by one bit (a non-negative int64).  Every
  pass is a permutation of all samples, different per pass, the same on every rank and in every
  run.

A validation file (``--val-data``) is read by the same rule without shuffling: evaluation batch
``b`` takes positions ``b B + r``.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from autopar.core.errors import UserError

TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
DEFAULT_DTYPE = "uint16"
# tokens scanned per chunk when checking the largest id (64 Mi tokens: 128-256 MiB of pages at a time)
SCAN_CHUNK = 1 << 26


class DataFileError(UserError):
    """A token file that cannot be trained on: missing, truncated, too short, ids out of range."""


def shuffle_seed(seed: int, epoch: int) -> int:
    """The seed of pass ``epoch``'s permutation under ``--shuffle seed`` (module docstring)."""
    return int.from_bytes(hashlib.sha256(f"shuffle:{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


def permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed(seed, epoch)))


def sample_ids(step: int, rows: range, global_batch: int, n: int, seed: int | None,
               perms: dict[int, torch.Tensor] | None = None) -> np.ndarray:
    """The sample index of each row in ``rows`` of step ``step``'s global batch (module
    docstring); ``perms``: a cache of the passes' permutations (pass -> permutation)."""
    pos = np.array([step * global_batch + r for r in rows], dtype=np.int64)
    idx = pos % n
    if seed is None:
        return idx
    epochs = pos // n
    out = np.empty_like(idx)
    for e in np.unique(epochs):
        e = int(e)
        if perms is None or e not in perms:
            perm = permutation(seed, e, n)
            if perms is not None:
                for old in [k for k in perms if k < e - 1]:     # keep the current and previous pass
                    del perms[old]
                perms[e] = perm
        else:
            perm = perms[e]
        sel = epochs == e
        out[sel] = perm.numpy()[idx[sel]]
    return out


@dataclass(frozen=True)
class TokenFile:
    """A token file and the flag that named it (for messages)."""
    path: Path
    dtype: str = DEFAULT_DTYPE
    flag: str = "--data"

    @property
    def np_dtype(self) -> np.dtype:
        return TOKEN_DTYPES[self.dtype]

    def identity(self) -> dict:
        """What a checkpoint records of the file: where it is, its size and its dtype."""
        return {"path": str(Path(self.path).resolve()), "bytes": os.path.getsize(self.path), "dtype": self.dtype}

    def tokens(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.np_dtype, mode="r")

    def num_tokens(self) -> int:
        return os.path.getsize(self.path) // self.np_dtype.itemsize

    def num_samples(self, seq: int) -> int:
        return max(0, (self.num_tokens() - 1) // seq)

    # ------------------------------------------------------------------ checks
    def check_file(self) -> None:
        """What needs no plan: the file exists, is a regular file, and holds whole tokens."""
        p = Path(self.path)
        what = f"{self.flag} {p}"
        if not p.exists():
            raise DataFileError(f"{what}: no such file. Give the path of a token file (a flat array of "
                                f"{self.dtype} token ids, e.g. nanoGPT's train.bin).")
        if not p.is_file():
            raise DataFileError(f"{what} is not a regular file. Give the path of a token file (a flat array "
                                f"of {self.dtype} token ids).")
        size = p.stat().st_size
        item = self.np_dtype.itemsize
        if size % item:
            other = [k for k, d in TOKEN_DTYPES.items() if k != self.dtype and size % d.itemsize == 0]
            hint = (f" If it holds {other[0]} ids, pass --data-dtype {other[0]}." if other else "")
            raise DataFileError(f"{what} has {size} bytes, which is not a whole number of {self.dtype} token ids "
                                f"({item} bytes each): it is truncated or not a token file of that dtype.{hint} "
                                f"Otherwise write it again (numpy: ids.astype(np.{self.dtype}).tofile(path)).")
        if not os.access(p, os.R_OK):
            raise DataFileError(f"{what} cannot be read (permission denied). Give a file you can read.")

    def check_for_plan(self, seq: int | None, global_batch: int, vocab: int | None, min_batches: int = 1) -> None:
        """What needs the plan: one global batch fits (``min_batches`` of them for evaluation)
        and no id is ``>= vocab`` (a chunked scan of the whole file; ``vocab`` None: not checked)."""
        what = f"{self.flag} {self.path}"
        if seq is None:
            raise DataFileError(f"{what}: the plan's model takes no token sequence (its captured inputs have no "
                                f"integer [batch, seq] tensor), so there is no sequence length to cut the file "
                                f"into samples. Use --data only with a language model, or give the model file a "
                                f"batches() function (docs/runtime.md, 'Other data').")
        n, tokens = self.num_samples(seq), self.num_tokens()
        if n < global_batch:
            need = global_batch * seq + 1
            raise DataFileError(f"{what} holds {tokens} tokens: {n} sample(s) of {seq} tokens (each with its next "
                                f"token), fewer than one global batch of {global_batch} samples ({need} tokens). "
                                f"Give a longer file, or plan with a smaller --global-batch.")
        if vocab is None:
            return
        bad = first_id_at_least(self.tokens(), vocab)
        if bad is not None:
            pos, value = bad
            raise DataFileError(f"{what}: token {pos} is id {value}, but the model's vocabulary has {vocab} ids "
                                f"(0 .. {vocab - 1}): the file was tokenized for another model, or --data-dtype "
                                f"is wrong. Tokenize it with this model's tokenizer, or build the model with a "
                                f"vocabulary of at least {value + 1}.")


def first_id_at_least(tokens: np.ndarray, vocab: int) -> tuple[int, int] | None:
    """(position, id) of the first token ``>= vocab``, or None: each chunk's max first (fast),
    searched only in a chunk that has one."""
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = tokens[start:start + SCAN_CHUNK]
        if len(chunk) and int(chunk.max()) >= vocab:
            i = int(np.argmax(chunk >= vocab))
            return start + i, int(chunk[i])
    return None


def read_rows(tokens: np.ndarray, samples: np.ndarray, seq: int, *, inputs: bool = True,
              targets: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(x, y)`` of the given samples as int64 [len(samples), seq] tensors (None where not asked)."""
    x = y = None
    if inputs:
        x = torch.from_numpy(np.stack([tokens[j * seq:(j + 1) * seq] for j in samples]).astype(np.int64))
    if targets:
        y = torch.from_numpy(np.stack([tokens[j * seq + 1:(j + 1) * seq + 1] for j in samples]).astype(np.int64))
    return x, y
