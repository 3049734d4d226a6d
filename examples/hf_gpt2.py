"""A Hugging Face ``transformers`` GPT-2, built from a config with random weights (no download).

    autopar inspect examples/hf_gpt2.py --model-arg size=tiny

``fx.symbolic_trace`` cannot trace ``transformers`` models; autopar captures this one with
``torch.export`` on the meta device.  Model arguments: ``size`` (``tiny``: 2 layers, 64 wide,
4 heads, context 64, vocab 512; ``small``: the 124M GPT-2 of Radford et al. 2019 -- 12 layers,
768 wide, 12 heads, context 1024, vocab 50257), and ``layers``, ``hidden``, ``heads``,
``seq``, ``vocab`` to override.  The LM head is tied to the token embedding, as in GPT-2.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES = {
    "tiny": dict(layers=2, hidden=64, heads=4, seq=64, vocab=512),
    "small": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50257),
}


def _config(size: str, **overrides):
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = dict(SIZES[size])
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def build_model(size: str = "tiny", layers: int | None = None, hidden: int | None = None,
                heads: int | None = None, seq: int | None = None, vocab: int | None = None,
                dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = _config(size, layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    config = GPT2Config(n_layer=cfg["layers"], n_embd=cfg["hidden"], n_head=cfg["heads"],
                        n_positions=cfg["seq"], vocab_size=cfg["vocab"], resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                        bos_token_id=cfg["vocab"] - 1, eos_token_id=cfg["vocab"] - 1)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def make_batch(batch_size: int, size: str = "tiny", seq: int | None = None, vocab: int | None = None,
               **_ignored):
    """Random token ids and next-token targets, both [batch_size, seq] int64."""
    cfg = _config(size, seq=seq, vocab=vocab)
    tokens = torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"] + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, target_BS: torch.Tensor) -> torch.Tensor:
    logits = output.logits                                    # [b, s, vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), target_BS.flatten())
