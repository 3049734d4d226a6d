"""A cp rank's causal attention by blocks (runtime/apply_cp.CPAttention._causal_blocks) against
plain causal SDPA over the whole sequence, read at the rank's head-tail positions.

The reference never enters the cp code: one ``F.scaled_dot_product_attention(is_causal=True)``
over all S tokens.  The blocks see the K/V as the all-gather hands them over (rank order).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.runtime.apply_cp import CPAttention, head_tail_positions


@pytest.mark.parametrize("cp,kv_heads", [(2, 4), (4, 4), (4, 2), (8, 1)])
def test_causal_blocks_equal_causal_attention_at_the_ranks_positions(cp, kv_heads):
    torch.manual_seed(0)
    b, heads, seq, d = 2, 4, 16 * cp, 8
    q = torch.randn(b, heads, seq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, seq, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, seq, d, dtype=torch.float64, requires_grad=True)
    gqa = kv_heads != heads
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # what the all-gather returns: every rank's tokens, rank after rank
    gathered = torch.cat([head_tail_positions(seq, cp, r) for r in range(cp)])
    keys, values = k.index_select(2, gathered), v.index_select(2, gathered)
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    total = 0.0
    for rank in range(cp):
        mode = CPAttention(None, cp, rank, seq, positions_from_arange=False)
        pos = head_tail_positions(seq, cp, rank)
        out = mode._causal_blocks(q.index_select(2, pos), keys, values, None, gqa)
        torch.testing.assert_close(out, ref.index_select(2, pos), rtol=0, atol=1e-12)
        total = total + out.square().sum()
    # the ranks' losses together are the whole sequence's: their gradients must be the reference's
    for got, want in zip(torch.autograd.grad(total, (q, k, v)), grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_blocks_compute_half_the_pairs_of_the_ranks_square():
    """The key prefixes the blocks read hold exactly the rank's causal pairs plus the diagonal
    chunks' masked halves: (k + 1) c keys for chunk k, against S / cp = 2c queries x S keys."""
    cp, seq = 4, 64
    c = seq // (2 * cp)
    for rank in range(cp):
        mode = CPAttention(None, cp, rank, seq, positions_from_arange=False)
        read = sum(c * (k + 1) * c for k in mode.query_chunks)
        assert read == c * c * (2 * cp + 1)          # the same on every rank: the head-tail balance
        assert read < (seq // cp) * seq * 0.6


def test_the_mode_is_made_and_runs_under_a_dispatch_mode():
    """A TorchDispatchMode active when the step makes the attention mode (a fake-tensor dry run,
    a profiler or a counter around a step) must not stop it: the blocks' lower-right masks are
    tensor subclasses, which cannot be created under such a mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    cp, seq = 2, 32
    q, k, v = (torch.randn(1, 2, seq, 8) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gathered = torch.cat([head_tail_positions(seq, cp, r) for r in range(cp)])
    with Passthrough():
        mode = CPAttention(None, cp, 1, seq, positions_from_arange=False)
        pos = head_tail_positions(seq, cp, 1)
        out = mode._causal_blocks(q.index_select(2, pos), k.index_select(2, gathered), v.index_select(2, gathered),
                                  None, False)
    torch.testing.assert_close(out, ref.index_select(2, pos))
