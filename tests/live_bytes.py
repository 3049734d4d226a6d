"""An independent measurement of a training step's memory: the peak of live tensor bytes.

A ``TorchDispatchMode`` sees every tensor an op returns (forward, loss, autograd's backward ops,
the optimizer's); the first time it meets a storage it adds the storage's bytes and hangs a
``weakref.finalize`` on it (PyTorch keeps one Python object per storage alive as long as the
storage lives, so the finalizer fires when the storage is freed) that subtracts them.  Tensors
that exist before the mode (parameters, the batch) are registered with ``track``.  The peak is
read after each op, so it misses what an op allocates and frees inside itself (a kernel's
workspace) -- on CPU the ATen kernels of a Llama block allocate their outputs through the
dispatcher, which this sees.  It is a plain reference: it never imports autopar.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.phase = "setup"
        self.phase_peak: dict[str, int] = {}
        self.peak_op = ""                    # the op after which the peak was read
        self._seen = WeakIdKeyDictionary()

    def _free(self, n: int) -> None:
        self.live -= n

    def track(self, *tensors, op: str = "") -> None:
        for t in tree_flatten(tensors)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            s = t.untyped_storage()
            if s in self._seen:
                continue
            n = s.nbytes()
            self._seen[s] = n
            self.live += n
            weakref.finalize(s, self._free, n)
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, f"{self.phase}:{op}"
        self.phase_peak[self.phase] = max(self.phase_peak.get(self.phase, 0), self.live)

    def set_phase(self, name: str) -> None:
        self.phase = name
        self.phase_peak[name] = max(self.phase_peak.get(name, 0), self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out, op=str(func))
        return out


def measure_step(model, optimizer, inputs, target, loss_fn) -> LiveBytes:
    """Run one step (forward, loss, backward, optimizer step, zero_grad(set_to_none)) under the
    tracker; returns it with the peak of each phase."""
    t = LiveBytes()
    t.track(list(model.parameters()), list(model.buffers()), inputs, target,
            [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)])
    with t:
        t.set_phase("forward")
        out = model(*inputs)
        t.set_phase("loss")
        loss = loss_fn(out, target)
        del out
        t.set_phase("backward")
        loss.backward()
        del loss
        t.set_phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return t
