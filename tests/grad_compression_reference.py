"""Independent references for gradient compression: the reduces written out in plain PyTorch, to
be plugged into ``plain_loop.train_plain(..., ranks=, reduce=)``.  Nothing here imports autopar.

* ``CastMean``: each rank's gradient rounded to bf16 / fp16 and divided by the rank count, the
  rounded halves summed and rounded again, then widened back to fp32 -- what a reduce in the
  16-bit type computes (torch's DDP ``_compress_hook``, FSDP2's ``reduce_dtype``; with 2 ranks
  every division by the rank count is exact, so where the division happens does not matter).
* ``PowerSGD``: Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization" (NeurIPS), Algorithm 1 -- rank-r power iteration with error
  feedback and warm start -- with the choices torch's ``powerSGD_hook`` makes written in
  (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, torch 2.13):

  - steps before ``start_iter`` (2) average the plain gradients;
  - per rank, the gradient of the whole bucket plus the rank's error: M (error zero at first);
  - a tensor is viewed as a (shape[0], -1) matrix and compressed only where
    (n + m) * r * 2 < n * m, r = min(n, m, rank); the others (biases, norms) are averaged whole;
  - Q starts once from N(0, 1) drawn under ``torch.manual_seed(numpy RandomState(0).randint(1e9))``,
    one draw per matrix in the order of the matrices grouped by shape (first appearance), and is
    orthogonalised; later steps start from the last step's averaged Q, orthogonalised again
    (warm start);
  - P = sum over ranks of M_r Q (not averaged: it is orthogonalised next), orthogonalised by
    Gram-Schmidt (rank <= 2; torch takes QR above); Q = mean over ranks of M_r^T P; M~ = P Q^T;
  - each rank's new error: its M minus what it received (M~, or the average of the whole
    tensors).

  The bucket's tensors are in the order autograd readies their gradients (DDP rebuilds its
  bucket in that order after the first step): ``readiness_order``.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch


class CastMean:
    """The mean of the ranks' gradients reduced in ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, step: int, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        ranks = len(grads)
        out = []
        for per_rank in zip(*grads):
            acc = per_rank[0].to(self.dtype) / ranks
            for g in per_rank[1:]:
                acc = acc + g.to(self.dtype) / ranks          # each sum rounded to dtype
            out.append(acc.to(per_rank[0].dtype))
        return out


def gram_schmidt(a: torch.Tensor) -> torch.Tensor:
    """The columns of ``a`` (n x r) orthonormalised in order (classical Gram-Schmidt: normalise
    column i, remove its component from every later column)."""
    a = a.clone()
    for i in range(a.shape[1]):
        a[:, i] = a[:, i] / torch.norm(a[:, i])
        if i + 1 < a.shape[1]:
            a[:, i + 1:] -= (a[:, i:i + 1] * a[:, i + 1:]).sum(dim=0, keepdim=True) * a[:, i:i + 1]
    return a


def readiness_order(model: torch.nn.Module, loss: torch.Tensor) -> list[int]:
    """Indices (into ``model.parameters()``) of the parameters in the order their gradients are
    accumulated by ``loss.backward()``."""
    params = list(model.parameters())
    order: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i)) for i, p in enumerate(params)]
    loss.backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return order


class PowerSGD:
    """Algorithm 1 of Vogels et al. 2019 with error feedback and warm start, over one bucket of
    parameters in ``order`` (module docstring)."""

    def __init__(self, rank: int, order: list[int], start_iter: int = 2, seed: int = 0):
        self.rank, self.order, self.start_iter = rank, order, start_iter
        self.rng = np.random.RandomState(seed)
        self.errors: list[list[torch.Tensor]] | None = None     # per rank, per bucket tensor
        self.qs: dict[int, torch.Tensor] | None = None          # per compressed tensor, its Q (m x r)
        self.iter = 0

    def _compressed(self, shape) -> int:
        n, m = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
        r = min(n, m, self.rank)
        return r if (n + m) * r * 2 < n * m else 0

    def __call__(self, step: int, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        ranks = len(grads)
        if self.iter < self.start_iter:
            self.iter += 1
            return [sum(g / ranks for g in per_rank) for per_rank in zip(*grads)]
        # per rank, the bucket's tensors (in bucket order) plus the rank's error
        ms = [[grads[r][i] + (self.errors[r][k] if self.errors else 0.0) for k, i in enumerate(self.order)]
              for r in range(ranks)]
        shapes = [ms[0][k].shape for k in range(len(self.order))]
        ranks_of = [self._compressed(s) for s in shapes]
        out = [None] * len(self.order)
        for k, r in enumerate(ranks_of):
            if not r:
                out[k] = sum(ms[q][k] for q in range(ranks)) / ranks
        compressed = [k for k, r in enumerate(ranks_of) if r]
        by_shape: OrderedDict = OrderedDict()
        for k in compressed:
            by_shape.setdefault(tuple(shapes[k]), []).append(k)
        in_q_order = [k for ks in by_shape.values() for k in ks]
        if self.qs is None:
            self.qs = {}
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                for k in in_q_order:
                    m = ms[0][k].numel() // shapes[k][0]
                    self.qs[k] = gram_schmidt(torch.randn(m, ranks_of[k]))
        else:
            self.qs = {k: gram_schmidt(q) for k, q in self.qs.items()}
        for k in in_q_order:
            mats = [ms[q][k].reshape(shapes[k][0], -1) for q in range(ranks)]
            p = gram_schmidt(sum(mat @ self.qs[k] for mat in mats))
            q_new = sum(mat.T @ p for mat in mats) / ranks
            self.qs[k] = q_new
            out[k] = (p @ q_new.T).reshape(shapes[k])
        self.errors = [[ms[q][k] - out[k] for k in range(len(self.order))] for q in range(ranks)]
        result = [None] * len(grads[0])
        for k, i in enumerate(self.order):
            result[i] = out[k]
        return result


def compression_reference(model_file, args: dict, global_batch: int, steps: int, spec: str, ranks: int = 2):
    """``plain_loop.train_plain`` over ``ranks`` ranks whose reduce is ``spec``'s (bf16, fp16 or
    powersgd:R) written out above."""
    from plain_loop import SEED, _loss, draw_batch, load, train_plain

    if spec in ("bf16", "fp16"):
        reduce = CastMean(torch.bfloat16 if spec == "bf16" else torch.float16)
    else:
        module = load(model_file)
        torch.manual_seed(SEED)
        model = module.build_model(**args)
        inputs, target = draw_batch(module, global_batch, args, SEED, 0)
        out = model(*[x.chunk(ranks)[0] for x in inputs])
        loss = _loss(module, out, target.chunk(ranks)[0])
        reduce = PowerSGD(int(spec.split(":")[1]), readiness_order(model, loss))
    return train_plain(model_file, args, global_batch, steps, ranks=ranks, reduce=reduce)
