"""The language-model head under tensor parallelism (core/sharding.py), against closed forms.

* A bf16 model whose logits are upcast to fp32 for the loss (``aten._to_copy`` between the head
  and the log-softmax, examples/llama.py with ``dtype=bfloat16``; many Hugging Face models call
  ``logits.float()``) gets its head split column-wise, as an fp32 model does: the cast is taken like
  a view on the way to the loss.  Before, the cast hid the loss and the head stayed whole on every
  tp rank (2.1B parameters of Llama 3 405B's head on each of 8 ranks).
* ``loss_parallel`` (torchtitan's loss on vocabulary-sharded logits): the logits, their cast and
  log-softmax hold vocab / tp columns on a rank (output bytes 1/tp), nothing gathers the logits, and
  the loss meets in three all-reduces of one fp32 value per token; without it the logits are
  all-gathered (vocab x tokens x 2 bytes).
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from autopar.core.sharding import megatron_styles, propagate

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "llama.py"
SEQ, VOCAB, TP = 16, 256, 4


@functools.lru_cache(maxsize=None)
def _llama(dtype: str):
    from autopar.core.capture import capture_model_file

    return capture_model_file(LLAMA, dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seq=SEQ, vocab=VOCAB,
                                          dtype=dtype), 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_is_split_whatever_the_logits_dtype(dtype):
    g = _llama(dtype)
    post = len(g.layers) - 1
    assert megatron_styles(g, post) == {"output": "colwise"}
    casts = [o for o in g.layer_ops(post) if "_to_copy" in str(o.target)]
    assert bool(casts) == (dtype == "bfloat16")          # the case the cast used to hide
    layout = propagate(g, post, {"output": "colwise"}, TP)
    assert layout.param_shard["output"] == TP


def test_loss_parallel_keeps_the_logits_sharded():
    g = _llama("bfloat16")
    post = len(g.layers) - 1
    ops = {o.name: o for o in g.layer_ops(post)}
    gathered = propagate(g, post, {"output": "colwise"}, TP)
    sharded = propagate(g, post, {"output": "colwise"}, TP, loss_parallel=True)
    logits_bytes = SEQ * VOCAB * 2.0                      # bf16 [tokens, vocab]
    assert [(c.kind, c.bytes) for c in gathered.collectives if c.pass_ == "fwd"] == [("all_gather", logits_bytes)]
    assert [(c.kind, c.bytes) for c in sharded.collectives if c.pass_ == "fwd"] == [("all_reduce", SEQ * 4.0)] * 3
    vocab_sized = [n for n, o in ops.items() if o.output_shape and o.output_shape[-1] == VOCAB]
    assert len(vocab_sized) == 4                          # the head, a view, the cast, the log-softmax
    for n in vocab_sized:
        assert sharded.output_shard[n] == TP and gathered.output_shard[n] == 1, n
    # the input gradient of the head is all-reduced either way (Shoeybi et al. 2019, Fig. 3 "f")
    assert [c.kind for c in sharded.collectives if c.pass_ == "bwd"] == ["all_reduce"]
