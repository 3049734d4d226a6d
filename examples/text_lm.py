"""A model file that brings its own data: a small GPT (examples/gpt.py) trained on a jsonl of
texts through its ``batches()`` function, with no token file.

    autopar plan examples/text_lm.py --model-arg data=texts.jsonl --model-arg seq=64 ...
    autopar run plan.json --steps 100          # no --data: the model file's batches() is read

``data``: a jsonl file, one ``{"text": ...}`` object a line.  ``tokenizer``: a ``tokenizers``
JSON file (``python -m autopar.examples.make_tokens --bpe V --tokenizer-out tok.json`` trains
one offline) used when ``tokenizers`` is installed; otherwise, or without one, the UTF-8 bytes
are the ids (a vocabulary of 256).  The texts are encoded, joined with an end-of-text id and
cut into samples of ``seq + 1`` tokens.

``batches(batch_size, dp_rank, dp_size, seed, start_step, **model_args)`` is the runtime's
hook for other data (docs/runtime.md, "Other data"): it yields this data-parallel rank's
``batch_size`` rows of each step's global batch of ``batch_size * dp_size`` rows, from step
``start_step`` on (a resumed run passes the step it resumes at).  Here row ``r`` of step
``t`` is sample ``perm_p[k mod N]`` with ``k = t B + r``, ``p = k // N`` and ``perm_p`` a
permutation of the N samples drawn from ``seed`` and ``p`` -- a pure function of the step,
so a resumed run reads what an uninterrupted one would, under any layout.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from autopar.examples.gpt import build_model as _build_gpt
from autopar.examples.gpt import loss_fn  # noqa: F401  (the runtime's loss for this model file)

BYTE_VOCAB = 256


def build_model(data: str = "", tokenizer: str = "", layers: int = 2, hidden: int = 64, heads: int = 4,
                seq: int = 64, dropout: float = 0.0):
    return _build_gpt(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab_size(tokenizer),
                      dropout=dropout)


def vocab_size(tokenizer: str = "", **_ignored) -> int:
    tok = _tokenizer(tokenizer)
    return tok.get_vocab_size() if tok is not None else BYTE_VOCAB


def make_batch(batch_size: int, tokenizer: str = "", seq: int = 64, **_ignored):
    """Random ids of the model's shape (what planning captures)."""
    tokens = torch.randint(0, vocab_size(tokenizer), (batch_size, seq + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def batches(batch_size: int, dp_rank: int, dp_size: int, seed: int, start_step: int, data: str = "",
            tokenizer: str = "", seq: int = 64, **_ignored):
    samples = _samples(data, tokenizer, seq)
    n, global_batch = len(samples), batch_size * dp_size
    if n == 0:
        raise ValueError(f"{data} holds fewer than {seq + 1} tokens: no sample of seq + 1 tokens")
    perms: dict[int, torch.Tensor] = {}
    step = start_step
    while True:
        ks = [step * global_batch + r for r in range(dp_rank * batch_size, (dp_rank + 1) * batch_size)]
        for p in {k // n for k in ks} - set(perms):
            perms[p] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + p))
        rows = samples[torch.stack([perms[k // n][k % n] for k in ks])]
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        step += 1


@lru_cache(maxsize=None)
def _tokenizer(path: str):
    if not path:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path)


@lru_cache(maxsize=None)
def _samples(data: str, tokenizer: str, seq: int) -> torch.Tensor:
    tok = _tokenizer(tokenizer)
    end = tok.token_to_id("<|endoftext|>") if tok is not None else None
    ids: list[int] = []
    for line in Path(data).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        text = json.loads(line)["text"]
        ids += tok.encode(text).ids if tok is not None else list(text.encode("utf-8"))
        ids.append(end if end is not None else 0)      # end of text (byte 0 in the byte-level fallback)
    n = (len(ids)) // (seq + 1)
    return torch.tensor(ids[:n * (seq + 1)], dtype=torch.long).view(n, seq + 1)
