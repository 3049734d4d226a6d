"""A mixture-of-experts language model that returns its router's auxiliary loss, as Hugging
Face MoE models do: ``forward`` returns ``{"logits": [B, S, V], "aux_loss": 0-d tensor}`` and
``loss_fn`` adds the auxiliary loss to the cross-entropy.

``embed`` -> ``blocks`` (pre-norm residual MLPs) -> ``norm`` -> ``moe`` (a Switch layer:
each token goes to its top-1 expert, Fedus et al. 2022) -> ``head``.  The Switch layer's
load-balancing loss, ``experts * sum_i f_i * P_i`` (their eq. 4: ``f_i`` the fraction of
tokens sent to expert ``i``, ``P_i`` the mean router probability of expert ``i``), is the
auxiliary loss: one 0-d tensor per forward, computed on a pipeline's last stage.  The
experts' weights are stacked parameters of one ``Experts`` module called as transformers 5
calls its experts, ``experts(x, top_k_index, top_k_weights)``, gathered by index (static
shapes).

Model arguments: ``layers`` (2), ``hidden`` (32), ``ffn`` (64), ``experts`` (4), ``seq`` (8),
``vocab`` (64).  The auxiliary loss weighs ``AUX_WEIGHT`` = 0.01 in the loss (Fedus et al.'s
alpha).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

AUX_WEIGHT = 0.01


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Experts(nn.Module):
    """Stacked experts called as transformers 5 calls them (an index >= num_experts adds nothing)."""

    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.num_experts = experts
        self._is_expert_parallel = False
        self.w_in = nn.Parameter(torch.randn(experts, hidden, ffn) * hidden ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, hidden) * ffn ** -0.5)

    def forward(self, x, top_k_index, top_k_weights):
        present = top_k_index < self.num_experts                                # [T, k]
        chosen = torch.where(present, top_k_index, 0)
        xk = x.unsqueeze(1).expand(-1, chosen.shape[1], -1).reshape(-1, 1, x.shape[-1])
        y = torch.bmm(F.gelu(torch.bmm(xk, self.w_in[chosen.flatten()])), self.w_out[chosen.flatten()])
        gates = (top_k_weights * present.to(top_k_weights.dtype)).unsqueeze(-1)
        return (y.view(*chosen.shape, -1) * gates).sum(dim=1)


class Switch(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.num_experts = experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(hidden, ffn, experts)

    def forward(self, x_BSH):
        b, s, h = x_BSH.shape
        x = x_BSH.reshape(b * s, h)                                             # [T, h]
        probs = F.softmax(self.router(x), dim=-1)                               # [T, E]
        gate, chosen = probs.max(dim=-1)                                        # [T]
        y = self.experts(x, chosen.unsqueeze(-1), gate.unsqueeze(-1))           # [T, h]
        dispatched = F.one_hot(chosen, self.num_experts).float().mean(dim=0)    # f_i
        balance = self.num_experts * (dispatched * probs.mean(dim=0)).sum()     # 0-d
        return x_BSH + y.view(b, s, h), balance


class SwitchLM(nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, experts: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.moe = Switch(hidden, ffn, experts)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x, aux = self.moe(self.norm(x))
        return {"logits": self.head(x), "aux_loss": aux}


def build_model(layers: int = 2, hidden: int = 32, ffn: int = 64, experts: int = 4, seq: int = 8, vocab: int = 64):
    return SwitchLM(layers, hidden, ffn, experts, vocab)


def make_batch(batch_size: int, seq: int = 8, vocab: int = 64, **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output: dict, target_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output["logits"].flatten(0, 1), target_BS.flatten()) + AUX_WEIGHT * output["aux_loss"]
