"""A stacked experts module on an expert-parallel rank that no token chose (runtime/apply_ep.py,
``shard_stacked``): the module's own code is not handed an empty batch -- the zoo's ``moe``
experts reshape with ``view(t, k, -1)``, which cannot infer -1 from 0 elements -- and its
weights still take part in backward (zero gradients, as every rank's FSDP2 reduction expects).

Rank 0 of ep 2 holds experts 0 and 1 and every token picks experts 2 and 3, so on real ranks it
receives no row and gets its 12 (token, slot) rows back from rank 1.  The exchange is that of a
real 2-rank group, emulated in this process: the counts rank 0 receives are zeros, the dispatch
hands it no row, the combine hands back rank 1's results (zeros here, carrying the graph)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import plain_loop  # noqa: E402


def test_a_rank_whose_experts_get_no_rows_runs_and_backpropagates(monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime import apply_ep
    from autopar.runtime.dry_run import fake_world

    def counts_received(counts, state):           # nobody sends rank 0 a row
        return torch.zeros(state.ep, counts.numel() // state.ep, dtype=counts.dtype)

    def exchange(x, output_split_sizes, input_split_sizes, group):
        rows = sum(output_split_sizes)
        assert rows == 0 or x.shape[0] == 0       # dispatch: 0 rows come in; combine: 0 rows go out
        return x.new_zeros(rows, x.shape[1]) + 0 * x.sum()

    monkeypatch.setattr(apply_ep, "_exchange_counts", counts_received)
    monkeypatch.setattr(apply_ep, "all_to_all_single_autograd", exchange)
    zoo = plain_loop.load(ROOT / "tests" / "zoo" / "moe.py")
    torch.manual_seed(0)
    experts = zoo.Experts(hidden=8, ffn=16, experts=4)
    seen = []
    own = experts.forward
    experts.forward = lambda x, i, w, *a: (seen.append(x.shape[0]), own(x, i, w, *a))[1]
    tokens = 6
    x = torch.randn(tokens, 8, requires_grad=True)
    with fake_world(2, rank=0):
        state = apply_ep.build_expert_parallel(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), 2, (0, 1))
        apply_ep.shard_stacked(experts, state)
        out = experts(x, torch.tensor([[2, 3]] * tokens), torch.full((tokens, 2), 0.5))
        assert out.shape == (tokens, 8)
        out.sum().backward()
    assert seen == [1]                            # one sentinel row, not an empty batch
    for name, p in experts.named_parameters():
        assert p.grad is not None, name
        assert float(p.grad.to_local().abs().sum()) == 0.0, name
