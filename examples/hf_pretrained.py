"""A Hugging Face ``transformers`` causal language model built from a ``save_pretrained`` folder's
config: the architecture of your checkpoint, random weights (no download).

    autopar plan examples/hf_pretrained.py --model-arg path=./my-model --model-arg seq=128 ...
    autopar run plan.json --init-from ./my-model --data train.bin ...

``build_model`` reads only ``config.json`` (``AutoConfig.from_pretrained``) and builds the model
with ``AutoModelForCausalLM.from_config``, so the planner captures it on the meta device at no
memory cost; the weights come in at run time with ``autopar run --init-from PATH``, each rank
reading only its own shards.  Model arguments: ``path`` (the folder), ``seq`` (the training
sequence length, default 128; at most the config's context length).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _config(path: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def build_model(path: str, seq: int = 128):
    from transformers import AutoModelForCausalLM

    config = _config(path)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context is not None and seq > context:
        raise ValueError(f"seq={seq} is longer than the model's context ({context}) in {path}/config.json; "
                         f"pass --model-arg seq=N with N <= {context}")
    return AutoModelForCausalLM.from_config(config)


def make_batch(batch_size: int, path: str, seq: int = 128):
    """Random token ids and next-token targets, both [batch_size, seq] int64 (``autopar run
    --data`` replaces them with a token file's)."""
    vocab = _config(path).vocab_size
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(output, target_BS: torch.Tensor) -> torch.Tensor:
    logits = output.logits                                    # [b, s, vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), target_BS.flatten())
