"""runtime/recompute.py's selective wrapper under ``torch.compile`` (a plan's ``compile: true``
compiles each block after its checkpoint wrapper): compile requires the checkpoint's
``context_fn`` to return two ``TorchDispatchMode``s, which the wrapper's recompute context (the
cached mode with the in-place collectives' replay) must stay.  The gradients are the plain
block's, computed without the runtime (AOT autograd's eager backend: no C++ compile)."""
import pytest
import torch
import torch.nn as nn

from autopar.runtime.recompute import wrap_for_recompute


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


@pytest.mark.parametrize("rerun_groups", [(), ("a cp group",)])
def test_selective_recompute_compiles_and_keeps_the_gradients(rerun_groups):
    torch.manual_seed(0)
    block, plain = _Block(), _Block()
    plain.load_state_dict(block.state_dict())
    wrapped = wrap_for_recompute(block, "selective", rerun_groups=rerun_groups)
    wrapped.compile(backend="aot_eager")
    x = torch.randn(4, 16)
    wrapped(x.clone().requires_grad_()).sum().backward()
    plain(x.clone().requires_grad_()).sum().backward()
    for (name, p), q in zip(block.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
