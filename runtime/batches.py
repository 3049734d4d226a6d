"""Where a step's batch comes from: this rank's rows of the global batch, on its device.

Three sources, one interface -- ``get(step) -> (inputs tuple, target)``, called in step order
inside the step clock, and ``close()``:

* ``SyntheticBatches`` (no ``--data``): the model file's ``make_batch(global_batch)`` under a
  seed derived from the run seed and the step (``step_seed``), drawn whole on every rank
  before the clock starts (``prepare``), of which the rank keeps its rows.
* ``TokenBatches`` (``--data FILE``): the rank reads only its own rows of the token file
  (runtime/token_data.py has the sample rule), and under a pipeline only what its stages take:
  the first stage's ranks the inputs, the last stage's the targets, a middle stage nothing.
* ``ModelFileBatches``: the model file's ``batches(batch_size, dp_rank, dp_size, seed,
  start_step, **model_args)`` generator, which yields the rank's rows step after step.

The rank's rows are rows ``[d * rows, (d + 1) * rows)`` of the global batch, ``d`` its
data-parallel coordinate and ``rows = micro_batch * num_microbatches``: what the synthetic path
slices, so a token file and ``make_batch`` give the same layout of samples over the ranks.
Context parallelism slices each row's sequence afterwards (the trainer, runtime/apply_cp.py).

Reading overlaps the step (``Prefetcher``): a background thread prepares step ``t + 1``'s rows
on the host (gathered from the memory map as int64, in pinned memory on CUDA) while step ``t``
runs; ``get`` takes them (waiting only if they are not ready) and copies them to the device
with ``non_blocking=True`` (an asynchronous copy from pinned memory, ordered before the step's
kernels on the same stream).
"""
from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from autopar.runtime.batch_check import check_batch
from autopar.runtime.token_data import TokenFile, read_rows, sample_ids


def step_seed(seed: int, step: int) -> int:
    """The seed under which step ``step``'s synthetic global batch is drawn."""
    return int.from_bytes(hashlib.sha256(f"batch:{seed}:{step}".encode()).digest()[:8], "little") >> 1


def synthetic_global_batch(checked, seed: int, step: int):
    """Step ``step``'s synthetic global batch: ``make_batch(global_batch)`` under ``step_seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(step_seed(seed, step))
        batch = checked.model_file.make_batch(checked.plan.global_batch, **dict(checked.plan.model.args))
    check_batch(*batch, checked.plan.global_batch, checked.model_file.path)
    return batch


def local_slice(t: torch.Tensor, dp_rank: int, rows: int, device: torch.device) -> torch.Tensor:
    return t[dp_rank * rows:(dp_rank + 1) * rows].to(device)


def _to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(device, non_blocking=device.type == "cuda")


class SyntheticBatches:
    """``make_batch`` drawn whole on every rank (``prepare``, outside the step clock); ``get``
    keeps the rank's rows and moves them to the device."""

    def __init__(self, checked, seed: int, dp_rank: int, rows: int, device: torch.device):
        self.checked, self.seed, self.dp_rank, self.rows, self.device = checked, seed, dp_rank, rows, device
        self._drawn: tuple[int, tuple] | None = None

    def prepare(self, step: int) -> None:
        self._drawn = (step, synthetic_global_batch(self.checked, self.seed, step))

    def get(self, step: int):
        if self._drawn is None or self._drawn[0] != step:
            self.prepare(step)
        inputs, target = self._drawn[1]
        self._drawn = None
        return (tuple(local_slice(x, self.dp_rank, self.rows, self.device) for x in inputs),
                local_slice(target, self.dp_rank, self.rows, self.device))

    def close(self) -> None:
        pass


class Prefetcher:
    """``host(step)`` run one step ahead on a background thread: ``get(step)`` returns step
    ``step``'s host rows (computed now if they were not prefetched) and starts step ``step + 1``."""

    def __init__(self, host: Callable[[int], tuple], pin: bool):
        self.host, self.pin = host, pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-prefetch")
        self._next: tuple[int, Future] | None = None

    def _work(self, step: int):
        inputs, target = self.host(step)
        if self.pin:
            inputs = tuple(x.pin_memory() if x is not None else None for x in inputs)
            target = target.pin_memory() if target is not None else None
        return inputs, target

    def get(self, step: int):
        if self._next is not None and self._next[0] == step:
            out = self._next[1].result()
        else:
            if self._next is not None:
                self._next[1].cancel()
            out = self._work(step)
        self._next = (step + 1, self._pool.submit(self._work, step + 1))
        return out

    def close(self) -> None:
        if self._next is not None:
            self._next[1].cancel()
            self._next = None
        self._pool.shutdown(wait=True)


class TokenBatches:
    """The rank's rows of a token file (runtime/token_data.py), prefetched a step ahead.

    ``inputs`` / ``targets``: whether this rank reads them (a pipeline's first / last stage);
    what it does not read is ``()`` / None.  ``shuffle``: ``--shuffle SEED`` or None."""

    def __init__(self, file: TokenFile, seq: int, global_batch: int, dp_rank: int, rows: int,
                 device: torch.device, shuffle: int | None = None, inputs: bool = True, targets: bool = True,
                 prefetch: bool = True):
        self.file, self.seq, self.global_batch = file, seq, global_batch
        self.rows = range(dp_rank * rows, (dp_rank + 1) * rows)
        self.device, self.shuffle, self.inputs, self.targets = device, shuffle, inputs, targets
        self.tokens = file.tokens()
        self.n = file.num_samples(seq)
        self._perms: dict[int, torch.Tensor] = {}
        self._prefetch = Prefetcher(self.host_rows, pin=device.type == "cuda") if prefetch else None

    def samples(self, step: int) -> np.ndarray:
        return sample_ids(step, self.rows, self.global_batch, self.n, self.shuffle, self._perms)

    def host_rows(self, step: int):
        x, y = read_rows(self.tokens, self.samples(step), self.seq, inputs=self.inputs, targets=self.targets)
        return ((x,) if x is not None else ()), y

    def prepare(self, step: int) -> None:
        pass

    def get(self, step: int):
        inputs, target = self._prefetch.get(step) if self._prefetch is not None else self.host_rows(step)
        return tuple(_to_device(x, self.device) for x in inputs), _to_device(target, self.device)

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()


class ModelFileBatches:
    """The model file's ``batches`` generator (core/modelfile.py ``ModelFile.batches``), one item
    per step from ``start_step`` on, prefetched a step ahead."""

    def __init__(self, checked, seed: int, dp_rank: int, dp_size: int, rows: int, start_step: int,
                 device: torch.device):
        self.device = device
        self._items = checked.model_file.batches(rows, dp_rank, dp_size, seed, start_step,
                                                 **dict(checked.plan.model.args))
        self._expected = start_step
        self._prefetch = Prefetcher(self._host, pin=device.type == "cuda")

    def _host(self, step: int):
        if step != self._expected:
            raise RuntimeError(f"model-file batches are read in step order: step {step} asked, "
                               f"{self._expected} next")
        self._expected += 1
        inputs, target = next(self._items)
        return tuple(x.cpu() for x in inputs), target.cpu()

    def prepare(self, step: int) -> None:
        pass

    def get(self, step: int):
        inputs, target = self._prefetch.get(step)
        return tuple(_to_device(x, self.device) for x in inputs), _to_device(target, self.device)

    def close(self) -> None:
        self._prefetch.close()
