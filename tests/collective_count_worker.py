"""torchrun worker: runs plans one after another (one process group) and counts, per plan, the
collectives each training step issues, split into forward and backward, and the bytes of the
tensors each passes (``bytes``).

The count is taken by a ``TorchDispatchMode`` entered around every step (outside any mode the
runtime enters, so it sees exactly the ops that run: an op a selective checkpoint replays from
its cache never reaches it).  A collective is an op of the ``c10d`` (in-place, process-group)
or ``_c10d_functional`` (functional) namespaces, ``wait_tensor`` excepted (it waits, it sends
nothing); an op runs in backward where the autograd engine is executing a graph task
(``torch._C._current_graph_task_id() != -1``).  Writes ``{"fwd"|"bwd": {op: n}}``, summed over
the steps (the final checkpoint's, where the case names a ``checkpoint_dir``, among the forward
ones), and ``saved_bytes``, what the first counted step's forward keeps for backward
(``SavedBytes``), to the case's ``counts`` path (rank 0).  A case's ``count_from`` leaves the steps before it uncounted (a pipeline's first step
also runs torch's shape inference, which gathers each unit once more)."""
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.mesh import shutdown
from autopar.runtime.options import RunOptions
from autopar.runtime.train import Trainer

import capture_memo

capture_memo.install()      # one capture per model file, arguments and micro-batch in this process

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


class CollectiveCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {"fwd": Counter(), "bwd": Counter()}
        self.bytes = {"fwd": Counter(), "bwd": Counter()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace in NAMESPACES and name not in NOT_COLLECTIVES:
            phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
            self.counts[phase][f"{func.namespace}.{name}"] += 1
            self.bytes[phase][f"{func.namespace}.{name}"] += _tensor_bytes(args)
        return func(*args, **(kwargs or {}))


def _tensor_bytes(args) -> int:
    """Bytes of the tensors a collective's arguments hold (its first argument's, for the in-place
    ``c10d`` ops: the list of tensors it reduces), in their own dtype."""
    first = args[0] if args else ()
    tensors = first if isinstance(first, (list, tuple)) else [first]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class SavedBytes:
    """The bytes autograd keeps for backward in one step's forward: every tensor its saved-tensor
    hooks pack, counted once per storage, this rank's shard of a DTensor, parameters left out
    (they are state, not activations).  A checkpoint's own hooks take precedence inside a
    recomputed region, so under recompute this sees only what is saved outside it."""

    def __init__(self, parts):
        self.params = {self._local(p).untyped_storage().data_ptr() for part in parts for p in part.parameters()}
        self.storages: dict[int, int] = {}
        self.done = False

    @staticmethod
    def _local(t):
        from torch.distributed.tensor import DTensor

        return t._local_tensor if isinstance(t, DTensor) else t

    def _add(self, t) -> None:
        t = self._local(t)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            # a wrapper subclass (a functional collective's AsyncCollectiveTensor): its inner tensors hold the bytes
            for name in t.__tensor_flatten__()[0]:
                self._add(getattr(t, name))
            return
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = t.untyped_storage().nbytes()

    def _pack(self, t):
        self._add(t)
        return t

    def hooks(self):
        """The saved-tensor hooks for the first step asked, nothing after it."""
        import contextlib

        if self.done:
            return contextlib.nullcontext()
        self.done = True
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def total(self) -> int:
        return sum(self.storages.values())


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    for case in cases:
        opts = RunOptions(plan_path=Path(case["plan"]), steps=case.get("steps", 2), timing_warmup_steps=0,
                          measured_path=Path(case["measured"]),
                          checkpoint_dir=Path(case["checkpoint_dir"]) if case.get("checkpoint_dir") else None)
        trainer = Trainer(opts)
        counter = CollectiveCounter()
        count_from = case.get("count_from", 0)     # a step before it runs uncounted (the first one's set-up)
        saved = SavedBytes(trainer.pm.parts)
        for step in range(trainer.first_step, opts.steps):
            if step < count_from:
                trainer.step(step)
                continue
            with counter, saved.hooks():
                trainer.step(step)
        trainer.finish()
        if dist.get_rank() == 0:
            out = {k: dict(v) for k, v in counter.counts.items()}
            out["bytes"] = {k: dict(v) for k, v in counter.bytes.items()}
            out["saved_bytes"] = saved.total()
            Path(case["counts"]).write_text(json.dumps(out))
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
