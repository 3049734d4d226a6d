"""The global gradient norm and clipping (runtime/grad_norm.py) on one rank, against
``torch.nn.utils.clip_grad_norm_``: a tied parameter counts once, a parameter without a gradient
not at all, and the gradients are scaled as torch scales them.  (Every layout on 2 ranks:
tests/integration/test_runtime_api.py, test_runtime_parity.py, test_runtime_resume.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn


def _tied_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11, bias=False), nn.Linear(3, 3))
    m[2].weight = m[0].weight                     # tied head; m[3] gets no gradient
    x = torch.randint(0, 11, (4, 5))
    m[2](torch.tanh(m[1](m[0](x)))).square().mean().backward()
    return m


@pytest.mark.parametrize("max_norm", [None, 0.01, 1e6])
def test_norm_and_clip_match_torch(one_rank, max_norm):
    from autopar.runtime.grad_norm import GradNorm
    from autopar.runtime.state_names import StateNames
    from autopar.runtime.ties import find_ties

    mine, ref = _tied_model(0), _tied_model(0)
    norm = GradNorm.build([mine], StateNames.build(find_ties(mine), [], [0]), torch.device("cpu"))
    got = norm(max_norm)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm is not None else float("inf"))
    assert got.shape == () and got.item() == pytest.approx(want.item(), rel=1e-6)
    for p, q in zip(mine.parameters(), ref.parameters()):
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)
    assert norm.local_squares().item() == pytest.approx(got.item() ** 2 if max_norm is None else
                                                        min(got.item(), max_norm) ** 2, rel=1e-5)
