"""One plain training step of a model file, to tell its own failures from the runtime's.

When the capture cannot trace a model (``core.capture``), or the planner's check on fake ranks
(``planner.runtime_check``) cannot run it even without any parallelism, either autopar cannot
handle the model or the model file itself is wrong.  ``own_failure`` settles which: it builds
the model on the CPU (with the file's own initialisation),
draws a real batch of ``batch_size`` rows and runs ``forward``, the loss and ``backward`` in
plain PyTorch -- no autopar transformation at all.  What fails there is the model file's
fault, and the ``ModelFileError`` says which function failed, what it was given or returned,
and what to fix: a batch on the meta device, a forward that returns None or fails on the batch
(mixed dtypes, wrong shapes), a loss that fails on the forward's output, a loss that does not
depend on the parameters.

Only models whose fp32 parameters fit in ``MAX_PARAM_BYTES`` are built for real; for larger
ones ``own_failure`` says nothing (None) and the caller keeps its own verdict.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Any

from autopar.core.errors import ModelFileError

MAX_PARAM_BYTES = 256 << 20      # as runtime.dry_run.REAL_TENSOR_BYTES: milliseconds on a CPU


def _describe(obj: Any) -> str:
    import torch

    if isinstance(obj, torch.Tensor):
        return f"Tensor{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')}" + (" on meta" if obj.is_meta else "")
    if isinstance(obj, (tuple, list)):
        return "(" + ", ".join(_describe(x) for x in obj) + ")"
    return type(obj).__name__


def _line(e: BaseException, path: Path) -> str:
    from autopar.core.modelfile import _line_in_file

    return _line_in_file(e, path)


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def own_failure(model_file, model_args: dict, batch_size: int) -> ModelFileError | None:
    """The model file's own failure on one plain CPU step, or None (it runs, or is too large to try)."""
    import torch

    from autopar.core.modelfile import check_batch_rows, user_code

    mf, p = model_file, model_file.path
    with torch.device("meta"):
        meta = mf.build(**model_args)
    params = list(meta.parameters())
    if not params:
        return no_parameters_error(p, type(meta).__name__)
    if sum(t.numel() * 4 for t in params) > MAX_PARAM_BYTES:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = mf.build(**model_args)
        inputs, target = mf.make_batch(batch_size, **model_args)
    if any(t.is_meta for t in model.parameters()):
        return None                                 # builds on meta by itself: nothing to run here
    meta_batch = meta_batch_error(p, batch_size, inputs, target)
    if meta_batch is not None:
        return meta_batch
    check_batch_rows(inputs, target, batch_size, p)
    given = f"make_batch({batch_size})'s inputs {_describe(inputs)}"
    try:
        with _quiet(), user_code(p, "running the model's forward"):
            out = model(*inputs)
    except ModelFileError as e:
        return e
    except Exception as e:  # noqa: BLE001 -- the model's own forward on its own batch
        return ModelFileError(
            f"{p}: the model's forward ({type(model).__name__}) raised {_first_line(e)}{_line(e, p)} on "
            f"{given}, in plain PyTorch on one CPU, before any parallelism. Fix build_model or make_batch so "
            f"that model(*inputs) runs.")
    if out is None:
        return ModelFileError(f"{p}: the model's forward ({type(model).__name__}) returned None on {given}. "
                              f"Return the output the loss is computed from (a Tensor, or a tuple whose first "
                              f"element is one).")
    try:
        with _quiet():
            loss = mf.loss(out, target)
    except ModelFileError as e:
        return e
    except Exception as e:  # noqa: BLE001
        what = "loss_fn" if mf.has_loss else ("the default loss (cross-entropy for an integer target, MSE "
                                              "otherwise)")
        return ModelFileError(
            f"{p}: {what} raised {_first_line(e)}{_line(e, p)} on the forward's output {_describe(out)} and "
            f"make_batch's target {_describe(target)}. Return a target that fits the output"
            f"{'' if mf.has_loss else ', or define loss_fn(output, target)'}.")
    if not mf.has_loss and loss is not None and getattr(out, "shape", None) is not None \
            and target.is_floating_point() and tuple(_main(out).shape) != tuple(target.shape):
        return ModelFileError(
            f"{p}: make_batch's target {_describe(target)} does not have the shape of the forward's output "
            f"{_describe(_main(out))}; the default MSE loss would broadcast them and train on the wrong "
            f"differences. Return a target of the output's shape, or define loss_fn(output, target).")
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        return ModelFileError(f"{p}: the loss is {_describe(loss)}, not a one-element Tensor. Make "
                              f"{'loss_fn' if mf.has_loss else 'the forward'} return a scalar loss.")
    if not loss.requires_grad:
        return ModelFileError(f"{p}: the loss does not depend on the model's parameters (it has no gradient), "
                              f"so training would change nothing. Compute the loss from the forward's output.")
    if not math.isfinite(float(loss.detach())):
        return None                                 # random weights can overflow; the run guards the loss
    try:
        loss.backward()
    except Exception as e:  # noqa: BLE001
        return ModelFileError(f"{p}: backward through the model raised {_first_line(e)}{_line(e, p)}. Fix the "
                              f"model's forward so that it is differentiable.")
    return None


def no_parameters_error(path, model_type: str) -> ModelFileError:
    """The model has no parameters: nothing to train (also the runtime's check, runtime/plan_check.py)."""
    return ModelFileError(f"{path}: build_model returned a {model_type} with no parameters, so there is nothing to "
                          f"train. Return the model whose weights training updates.")


def meta_batch_error(path, batch_size: int, inputs: Any, target: Any) -> ModelFileError | None:
    """A batch (drawn outside ``torch.device('meta')``) holding meta tensors, or None (also the
    runtime's check of every batch it draws, runtime/train.py)."""
    metas = [w for w, t in _tensors(inputs, target) if t.is_meta]
    if not metas:
        return None
    return ModelFileError(
        f"{path}: make_batch({batch_size}) returned {', '.join(metas)} on the meta device (no data), which "
        f"training cannot use. Create the batch with torch.randn / torch.randint (or load data) without "
        f"device='meta'; autopar itself calls make_batch under torch.device('meta') when it needs only shapes.")


def _main(out: Any):
    if hasattr(out, "logits") and not hasattr(out, "shape"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _tensors(inputs: Any, target: Any):
    from autopar.core.modelfile import _tensors as walk

    return [*walk(inputs, "inputs"), *walk(target, "target")]


@contextlib.contextmanager
def _quiet():
    """Python warnings off (torch's broadcasting warning would repeat what the error says)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
