"""The checks of ``--data`` / ``--val-data`` before training: in ``autopar run`` before torchrun
starts (so a bad file fails once, fast, with nothing written) and again on the ranks.

A token id must be below the model's vocabulary.  The vocabulary is the model file's
``vocab_size`` where it defines one (an int, or a function of the model args), else the
``num_embeddings`` of the first ``nn.Embedding`` the forward calls on the token ids (found by
forward pre-hooks during a forward on the meta device: the first embedding whose input is an
integer tensor with as many elements as the token batch), else unknown (not checked).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.core.errors import UserError
from autopar.runtime.token_data import DataFileError, TokenFile

# rows of the meta forward that finds the token embedding: 2, so that a [1, S] position-id
# embedding input cannot be mistaken for the [2, S] token ids
_PROBE_ROWS = 2


def data_files(opts) -> tuple[TokenFile | None, TokenFile | None]:
    """(training file, validation file) of the run's options (None where not given)."""
    train = TokenFile(opts.data_path, opts.data_dtype, "--data") if opts.data_path is not None else None
    val = TokenFile(opts.val_data_path, opts.data_dtype, "--val-data") if opts.val_data_path is not None else None
    return train, val


def check_options(opts) -> None:
    """What needs neither the plan nor a file read: the flags agree."""
    if opts.val_data_path is not None and opts.eval_every < 1:
        raise UserError(f"--val-data {opts.val_data_path} is given but --eval-every is {opts.eval_every}, so it "
                        f"would never be read. Pass --eval-every K (evaluate every K steps and at the end).")
    if opts.eval_every > 0 and opts.val_data_path is None:
        raise UserError(f"--eval-every {opts.eval_every} needs a validation token file: pass --val-data FILE.")
    if opts.shuffle_seed is not None and opts.data_path is None:
        raise UserError("--shuffle permutes the samples of --data; pass --data FILE with it (the synthetic "
                        "batches of make_batch are drawn per step and need no shuffling).")


def check_files(opts) -> None:
    """What needs no plan: each given file exists and holds whole tokens."""
    check_options(opts)
    for f in data_files(opts):
        if f is not None:
            f.check_file()


def check_for_plan(opts, checked, scan: bool = True) -> int | None:
    """What needs the plan: the model takes one token tensor, each file holds at least one
    global batch (an evaluation of more batches than the validation file holds wraps around to
    its start, as training does), and, with ``scan``, no id is outside the vocabulary.  Returns
    the vocabulary used (None: unknown or not scanned)."""
    train, val = data_files(opts)
    if train is None and val is None:
        return None
    plan = checked.plan
    seq = checked.graph.seq_len
    check_single_input(checked)
    vocab = model_vocab(checked) if scan else None
    for f in (train, val):
        if f is not None:
            f.check_for_plan(seq, plan.global_batch, vocab)
    return vocab


def check_single_input(checked) -> None:
    """``--data`` feeds the model one input, the token ids; a model whose ``make_batch`` gives
    more is refused."""
    args = dict(checked.plan.model.args)
    with torch.device("meta"):
        inputs, _ = checked.model_file.make_batch(_PROBE_ROWS, **args)
    ok = len(inputs) == 1 and not inputs[0].is_floating_point() and inputs[0].dim() == 2
    if not ok:
        shapes = ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in inputs)
        raise DataFileError(
            f"--data feeds the model one input, the token ids as an int64 [batch, seq] tensor, but "
            f"{checked.model_file.path}'s make_batch gives {len(inputs)} input(s) ({shapes}). Give the model "
            f"file a batches() function that yields its inputs (docs/runtime.md, 'Other data') and run "
            f"without --data, or make its forward take the token ids alone.")


def model_vocab(checked) -> int | None:
    """The model's vocabulary (module docstring), or None where it cannot be told."""
    args = dict(checked.plan.model.args)
    declared = checked.model_file.vocab_size(**args)
    if declared is not None:
        return declared
    with torch.device("meta"):
        model = checked.model_file.build(**args)
        (tokens,), _ = checked.model_file.make_batch(_PROBE_ROWS, **args)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None
    found: list[int] = []

    def hook(module, args_):
        x = args_[0] if args_ else None
        if (not found and isinstance(x, torch.Tensor) and not x.is_floating_point()
                and x.numel() == tokens.numel()):
            found.append(module.num_embeddings)

    handles = [m.register_forward_pre_hook(hook) for m in embeddings]
    try:
        with torch.no_grad():
            model(tokens)
    except Exception:  # noqa: BLE001 -- a forward meta cannot run: fall back to the first embedding
        pass
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else embeddings[0].num_embeddings
