"""The single-process reference trainer the parity tests compare against.

Same model file, same initial weights (the same init source as the runtime: the model file's
own init under ``torch.manual_seed(seed)``, or the per-module init), same global batch per step
(``train.global_batch``), same AdamW settings -- and no parallelism: one forward and backward
over the whole global batch per step.  fp32 only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.core.plan import Plan
from autopar.runtime.materialize import build_meta_model, choose_source, materialize
from autopar.runtime.options import ADAM_BETAS, ADAM_EPS, DEFAULT_LR, DEFAULT_SEED, WEIGHT_DECAY
from autopar.runtime.plan_check import CheckedPlan
from autopar.runtime.train import global_batch


@dataclass
class ReferenceRun:
    losses: list[float]
    params: dict[str, torch.Tensor]        # final parameters by FQN (CPU, fp32)
    model: nn.Module
    grad_abs_max: dict[str, torch.Tensor]  # per element, the largest |gradient| over the steps


def train_reference(checked: CheckedPlan, steps: int, *, lr: float = DEFAULT_LR, seed: int = DEFAULT_SEED,
                    init: str = "auto") -> ReferenceRun:
    plan: Plan = checked.plan
    args = dict(plan.model.args)
    model = build_meta_model(checked.model_file, args)
    _, source = choose_source(init, checked.model_file, args, seed, model)
    materialize(model, torch.device("cpu"), source)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    grad_abs_max = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for step in range(steps):
        inputs, target = global_batch(checked, seed, step)
        loss = checked.model_file.loss(model(*inputs), target)
        loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.maximum(grad_abs_max[n], p.grad.abs(), out=grad_abs_max[n])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ReferenceRun(losses=losses, params=params, model=model, grad_abs_max=grad_abs_max)
