"""The independent reference of the parity tests: a plain single-process PyTorch training loop.

It never imports ``autopar.runtime`` (nor the rest of autopar): it imports the model file by
path, builds the model on the CPU under ``torch.manual_seed(seed)``, draws each step's global
batch with ``make_batch(global_batch, **args)`` under the step's seed, and trains with
``torch.optim.AdamW``.  The runtime promises the same three things in its documentation
(README "Runtime": initial weights are the model file's own init under the run seed;
step ``i``'s global batch is ``make_batch`` under ``batch_seed(seed, i)``; AdamW with the
defaults below), so a layout that matches this loop trains the model the user wrote.

``chunks`` > 1 runs the forward on ``chunks`` equal row blocks of the global batch and averages
their losses: the same gradient for models whose samples are independent, and the per-rank
(per-micro-batch) batch statistics of BatchNorm under data parallelism.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# The runtime's documented defaults (README "Runtime"; the parity tests check that
# autopar.runtime.options holds the same values).
SEED = 1234
LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1


def batch_seed(seed: int, step: int) -> int:
    """The seed under which step ``step``'s global batch is drawn (the runtime's documented rule)."""
    return int.from_bytes(hashlib.sha256(f"batch:{seed}:{step}".encode()).digest()[:8], "little") >> 1


@dataclass
class PlainRun:
    losses: list[float]
    params: dict[str, torch.Tensor]        # final parameters under every name they have (ties: several)
    grad_abs_max: dict[str, torch.Tensor]  # per element, the largest |gradient| over the steps
    model: nn.Module
    # per element, the smallest nonzero |gradient| over the steps (inf: zero at every step)
    grad_abs_min: dict[str, torch.Tensor] | None = None
    # per step, the global gradient norm before clipping (torch.nn.utils.get_total_norm)
    grad_norms: list[float] | None = None


def load(path: str | Path):
    path = Path(path).resolve()
    name = "plain_loop_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:10]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _accepted(fn, args: dict) -> dict:
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(args)
    return {k: v for k, v in args.items() if k in params}


def draw_batch(module, global_batch: int, args: dict, seed: int, step: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(batch_seed(seed, step))
        inputs, target = module.make_batch(global_batch, **_accepted(module.make_batch, args))
    return (inputs if isinstance(inputs, (tuple, list)) else (inputs,)), target


def _loss(module, output, target):
    if hasattr(module, "loss_fn"):
        return module.loss_fn(output, target)
    if not target.is_floating_point():
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)


def train_plain(model_file: str | Path, args: dict, global_batch: int, steps: int, *, seed: int = SEED,
                lr: float = LR, chunks: int = 1, initial: dict[str, torch.Tensor] | None = None,
                batches=None, lr_at=None, grad_clip: float | None = None, betas=BETAS,
                weight_decay: float = WEIGHT_DECAY, first_step: int = 0, ranks: int = 1,
                reduce=None) -> PlainRun:
    """``initial``: starting values by parameter name, copied over the model file's own init
    (the caller's choice of another init; ties are kept: the model's parameters are written
    in place).

    ``batches``: ``step -> (inputs tuple, target)``, the global batch of a step, in place of
    ``make_batch`` under the step's seed (a test's own reading of a data file).  ``lr_at``:
    ``step -> learning rate`` set on the optimizer before each step (a closed-form schedule
    written in the test).  ``grad_clip``: ``torch.nn.utils.clip_grad_norm_`` over the whole
    model's parameters (each tied one once) before each step.  ``first_step``: the step number
    of the first step run (the batches and learning rates of a run that starts later).

    ``reduce``: ``(step, grads) -> grads``, a test's own gradient reduce over ``ranks`` data-
    parallel ranks written out: ``grads[r][i]`` is rank r's gradient of the i-th parameter of
    ``model.parameters()`` from the r-th of ``ranks`` equal row blocks of the global batch (the
    mean loss over its rows); the result, one gradient per parameter, is what the optimizer
    steps on (a rounding before the average, a compression).  The step's loss is the mean of the
    ranks' losses."""
    module = load(model_file)
    torch.manual_seed(seed)
    model = module.build_model(**args)
    if initial is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(initial[name])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(betas), eps=EPS, weight_decay=weight_decay)
    named = list(model.named_parameters(remove_duplicate=False))
    grad_abs_max = {id(p): torch.zeros_like(p) for _, p in named}
    grad_abs_min = {id(p): torch.full_like(p, float("inf")) for _, p in named}
    losses, grad_norms = [], []
    for step in range(first_step, first_step + steps):
        if batches is not None:
            inputs, target = batches(step)
        else:
            inputs, target = draw_batch(module, global_batch, args, seed, step)
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        total = 0.0
        if reduce is not None:
            total = _reduced_backward(module, model, inputs, target, ranks, lambda g: reduce(step, g))
        for i in range(chunks if reduce is None else 0):
            part = [x.chunk(chunks)[i] for x in inputs]
            loss = _loss(module, model(*part), target.chunk(chunks)[i]) / chunks
            loss.backward()
            total += float(loss.detach())
        for _, p in named:
            if p.grad is not None:
                torch.maximum(grad_abs_max[id(p)], p.grad.abs(), out=grad_abs_max[id(p)])
                nonzero = torch.where(p.grad == 0, float("inf"), p.grad.abs())
                torch.minimum(grad_abs_min[id(p)], nonzero, out=grad_abs_min[id(p)])
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return PlainRun(losses=losses, params={n: p.detach().clone() for n, p in named},
                    grad_abs_max={n: grad_abs_max[id(p)] for n, p in named}, model=model,
                    grad_abs_min={n: grad_abs_min[id(p)] for n, p in named}, grad_norms=grad_norms)


def _reduced_backward(module, model: nn.Module, inputs, target, ranks: int, reduce) -> float:
    """``train_plain``'s ``reduce``: each rank's gradient from its row block, then ``reduce``'s
    result as every parameter's gradient; returns the mean of the ranks' losses."""
    params = list(model.parameters())
    grads, total = [], 0.0
    for r in range(ranks):
        part = [x.chunk(ranks)[r] for x in inputs]
        loss = _loss(module, model(*part), target.chunk(ranks)[r])
        got = torch.autograd.grad(loss, params, allow_unused=True)
        grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, got)])
        total += float(loss.detach()) / ranks
    for p, g in zip(params, reduce(grads)):
        p.grad = g
    return total
