"""Which micro-batch sizes a model cannot take.

Some models train at one batch size and not at another: BatchNorm in training mode cannot
normalise a channel from a single value (``torch.nn.functional.batch_norm`` raises "Expected
more than 1 value per channel when training" when batch x spatial size is 1), and a model may
squeeze the batch dimension away at one sample.  Such failures show below some size and not
above it, so ``refused_sizes`` runs the model file's forward and loss on the meta device (shapes
only, no data) at the sizes the search may use that are smaller than the size the model was
captured with, smallest first, and stops at the first size they run at: one forward for a
model that takes every size (half a second for GPT-3 175B's 96 blocks).  A size at which they
raise is one the model cannot take, with the error as the reason.  When they fail on meta at
the captured size too (data-dependent control flow, which the capture traces its own way), the
meta run cannot tell sizes apart and nothing is refused.  Sizes above the captured one are not
run.
"""
from __future__ import annotations

import warnings
from typing import Iterable


def refused_sizes(model_file, model_args: dict, captured: int, sizes: Iterable[int]) -> dict[int, str]:
    """{size: why} for the sizes in ``sizes`` below ``captured`` the model's forward and loss raise at
    on meta; ``why`` says what raised what ("the forward on make_batch(1)'s shapes raised ValueError: ...")."""
    import torch

    from autopar.core.errors import UserError
    from autopar.core.modelfile import user_code

    below = sorted(s for s in set(sizes) if s < captured)
    if not below:
        return {}
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = model_file.build(**model_args)
    model.train()

    def why(batch_size: int) -> str | None:
        doing = f"make_batch({batch_size})"
        try:
            with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), torch.device("meta"):
                warnings.simplefilter("ignore")
                inputs, target = model_file.make_batch(batch_size, **model_args)
                doing = f"the forward on make_batch({batch_size})'s shapes"
                with user_code(model_file.path, "running the model's forward"):
                    out = model(*inputs)
                doing = f"the loss on make_batch({batch_size})'s shapes"
                model_file.loss(out, target)
        except UserError as e:              # the model file's own wrapper (make_batch, loss_fn) named it
            return " ".join(str(e).split())
        except Exception as e:  # noqa: BLE001 -- the model's own forward at this batch size
            return f"{doing} raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        return None

    out = {}
    for size in below:
        reason = why(size)
        if reason is None:
            return out
        out[size] = reason
    return out if not out or why(captured) is None else {}
