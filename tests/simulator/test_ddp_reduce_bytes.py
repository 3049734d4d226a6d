"""DDP's gradient all-reduce priced at the bytes autopar's runtime sends.

Under bf16 mixed precision the runtime runs DDP as ``torch.autocast`` over fp32 parameters, so
autograd accumulates fp32 gradients and DDP all-reduces them in fp32: 4 bytes an element, the
same as an fp32 run; ``--grad-compression bf16`` (torch's compress hook) casts the bucket to 2.
A ring all-reduce of M bytes over n ranks sends 2 (n - 1) / n M from each rank (Patarasuk & Yuan
2009), so a plan's priced wire bytes per step are 2 (n - 1) / n G b, with G the model's
trainable elements counted from the torch model itself and b = 4, or 2 under the cast.  (What
the runtime really sends is counted in tests/integration/test_collective_counts.py.)
"""
import functools

import pytest

from runtime_support import GPT, MODEL_ARGS, graph
from sim_graphs import priced_dp_wire_bytes


@functools.lru_cache(maxsize=None)
def torch_trainable_numel() -> int:
    """G: the trainable elements of examples/gpt.py's model at MODEL_ARGS, from torch."""
    from plain_loop import load

    model = load(GPT).build_model(**MODEL_ARGS)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _plan(dp: int, precision: str, compression: str):
    from dataclasses import replace

    from autopar.core.plan import ModelRef, uniform_plan

    g = graph()
    ref = ModelRef(file=str(GPT), args=dict(MODEL_ARGS), name="gpt", fingerprint=g.fingerprint)
    plan = uniform_plan(model=ref, num_layers=len(g.layers), dp=dp, micro_batch=1, precision=precision)
    return replace(plan, grad_compression=compression)


@pytest.mark.parametrize("dp", [2, 8])
@pytest.mark.parametrize("precision,compression,element_bytes",
                         [("bf16", "none", 4), ("bf16", "bf16", 2), ("bf16", "fp16", 2), ("fp32", "none", 4),
                          ("fp32", "bf16", 2)])
def test_ddp_all_reduce_bytes_are_the_runtimes(dp, precision, compression, element_bytes):
    G = torch_trainable_numel()
    want = 2 * (dp - 1) / dp * G * element_bytes
    assert priced_dp_wire_bytes(graph(), _plan(dp, precision, compression)) == pytest.approx(want, rel=1e-12)
