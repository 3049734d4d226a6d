"""One place where a failure on any rank becomes the user's message and exit code.

When a rank fails, its peers soon fail too -- a collective with a dead process ends in
"Connection closed by peer" -- and every rank's traceback lands in the same terminal.  The
one that matters is the first.  ``report_failure`` (called by ``python -m autopar.runtime``
for any exception) settles which rank was first through the process group's store (the
torchrun agent's, which outlives the workers): the first failing rank claims the key
``autopar/first_failure`` with ``compare_set`` *before* it closes its connections, so a peer
that fails because of it finds the claim already there.

* The first rank records its message -- a ``UserError``'s one paragraph, prefixed with the
  rank and its place in the mesh, or the traceback of anything else (a bug) -- in
  ``$AUTOPAR_ERROR_FILE`` (set by ``autopar run``, which prints it once, after torchrun has
  stopped the other ranks) and in torchrun's own ``$TORCHELASTIC_ERROR_FILE``, so torchrun's
  summary names it as the root cause.  Without ``$AUTOPAR_ERROR_FILE`` (torchrun started by
  hand) the rank prints it itself.
* A later rank prints nothing and exits with the first rank's code.
* The store is the torchrun agent's (``MASTER_ADDR:MASTER_PORT``), so the claim works also
  before the process group exists: a model file whose ``build_model`` or ``make_batch`` fails
  on one rank only (while the others wait in the rendezvous) is reported by that rank.  Without
  torchrun (no store) every rank runs the same checks on the same files, so rank 0 alone prints.

``autopar run`` reads ``$AUTOPAR_ERROR_FILE`` after torchrun returns (``relaunch_exit``), prints
the message as the last paragraph and exits with its code: 2 for the user's mistakes, 4 for a
non-finite loss, 1 for anything else.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

from autopar.core.errors import UserError

ERROR_FILE_ENV = "AUTOPAR_ERROR_FILE"
_KEY = "autopar/first_failure"
INTERNAL_EXIT_CODE = 1


def _paragraph(text: str) -> str:
    from autopar.core.errors import paragraph          # the CLI's one-paragraph format

    return paragraph(text)


_cache: dict = {}


def _key() -> str:
    # one claim per attempt: the agent's store outlives the workers across --max-restarts (and,
    # in an elastic run, across rendezvous rounds: runtime/mesh.ATTEMPT_ENV)
    from autopar.runtime.mesh import ATTEMPT_ENV

    return f"{_KEY}/{os.environ.get(ATTEMPT_ENV) or os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store():
    """The torchrun agent's store (MASTER_ADDR:MASTER_PORT under torchrun, reachable before the
    process group exists and after a peer died), else the process group's, else None."""
    if "store" in _cache:
        return _cache["store"]
    store = None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port and os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        try:
            from datetime import timedelta

            import torch.distributed as dist

            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        except Exception:  # noqa: BLE001 -- the agent is gone: fall back below
            store = None
    if store is None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                from torch.distributed.distributed_c10d import _get_default_store

                store = _get_default_store()
            except Exception:  # noqa: BLE001 -- no store to agree on: every rank speaks for itself
                store = None
    _cache["store"] = store
    return store


def first_failure() -> dict | None:
    """The failure some rank already claimed in this attempt, or None."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([_key()]):
            return None
        got = store.get(_key())
        got = got.decode() if isinstance(got, bytes) else got
        return json.loads(got) if got else None
    except Exception:      # noqa: BLE001
        return None


_place: dict[str, str] = {}


def set_place(dp_rank: int, pp_rank: int, tp_rank: int) -> None:
    """Name this rank's place in the mesh in its messages (once the mesh is known)."""
    _place["coords"] = f"dp {dp_rank}, pp stage {pp_rank}, tp {tp_rank}"


def _where(rank: int) -> str:
    coords = _place.get("coords")
    return f"rank {rank}" + (f" ({coords})" if coords else "")


def _claim(store, record: dict) -> dict:
    """The first failure's record: ours if no rank claimed the key before us."""
    mine = json.dumps(record)
    try:
        got = store.compare_set(_key(), "", mine)
        got = got.decode() if isinstance(got, bytes) else got
        return json.loads(got)
    except Exception:      # noqa: BLE001 -- the store is gone (its host died): speak for ourselves
        return record


def _write_error_file(record: dict) -> bool:
    """The record for ``autopar run`` (``ERROR_FILE_ENV``), where it asked for one: whether it was written."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            from autopar.core.plan import write_text_atomic

            write_text_atomic(path, json.dumps(record) + "\n")
            return True
        except OSError:
            pass
    return False


def _write_records(record: dict) -> bool:
    """Both records (module docstring); whether ``autopar run``'s was written."""
    written = _write_error_file(record)
    elastic = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if elastic and not os.path.exists(elastic):
        # torchrun's error-file format (torch.distributed.elastic.multiprocessing.errors): the
        # message it prints as the root cause, with the failure time that orders the ranks
        data = {"message": {"message": record["message"],
                            "extraInfo": {"py_callstack": record["message"], "timestamp": str(int(record["time"]))}}}
        try:
            with open(elastic, "w") as f:
                json.dump(data, f)
        except OSError:
            pass
    return written


def set_model_file(path) -> None:
    """The model file this rank runs: an exception raised by its own code is its error."""
    _place["model_file"] = str(path)


def _model_files_own(exc: BaseException) -> UserError | None:
    """A ``ModelFileError`` for an exception whose innermost frame is in the model file (its
    forward, loss or batch raised by itself, e.g. ``raise ValueError``); None otherwise -- an
    error raised inside torch or autopar, even when called from the model, is not blamed on it."""
    import traceback as tb
    from pathlib import Path

    from autopar.core.errors import ModelFileError

    path = _place.get("model_file")
    frames = tb.extract_tb(exc.__traceback__) if path else []
    if not frames:
        return None
    try:
        if Path(frames[-1].filename).resolve() != Path(path).resolve():
            return None
    except OSError:
        return None
    text = " ".join(str(exc).split())[:300]
    return ModelFileError(f"{path}: the model file raised {type(exc).__name__}: {text} (at line {frames[-1].lineno}, "
                          f"in {frames[-1].name}) while training. Fix the model file.")


def report_failure(exc: BaseException) -> int:
    """Print (or not) this rank's failure as described above; returns the exit code."""
    if not isinstance(exc, UserError):
        exc = _model_files_own(exc) or exc
    user = isinstance(exc, UserError)
    code = exc.exit_code if user else INTERNAL_EXIT_CODE
    rank = int(os.environ.get("RANK", "0"))
    if user:
        message = f"autopar run: error: {_where(rank)}: {exc}"
    else:
        message = (f"autopar run: internal error on {_where(rank)}:\n"
                   + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
    record = {"rank": rank, "exit_code": code, "user_error": user, "message": message, "time": time.time()}
    store = _store()
    if store is None:
        # no store to agree through (not under torchrun): every rank checks the same inputs; rank 0 speaks
        if rank != 0 and user:
            return code
        if user:
            record["message"] = f"autopar run: error: {exc}"
        first = record
    else:
        first = _claim(store, record)
        if first.get("rank") != rank:
            return int(first.get("exit_code", code))
    if not _write_records(first):             # else autopar run prints it, once, at the end
        print(_paragraph(first["message"]) if user else first["message"], file=sys.stderr, flush=True)
    return code


def report_stop(exc) -> int:
    """A run stopped by a signal (``autopar.runtime.stop_signals.RunStopped``): every rank agreed
    on it, so rank 0 alone prints what was saved and how to resume; returns 128 + the signal."""
    rank = int(os.environ.get("RANK", "0"))
    failed = first_failure()
    if failed is not None:                    # torchrun stopped us because a peer failed: it spoke
        return int(failed.get("exit_code", exc.exit_code))
    if rank == 0:
        record = {"rank": 0, "exit_code": exc.exit_code, "user_error": True, "stopped": True,
                  "message": f"autopar run: {exc.message}", "time": time.time()}
        print(_paragraph(record["message"]), file=sys.stderr, flush=True)
        _write_error_file(record)
    return exc.exit_code


def relaunch_exit(returncode: int, error_file: str, stream=None) -> int:
    """``autopar run``'s exit code after torchrun returned ``returncode``: the first failing
    rank's code, and its message (which that rank recorded instead of printing) on ``stream``
    (default stderr)."""
    if returncode == 0:
        return 0
    try:
        record = json.loads(open(error_file).read())
    except (OSError, ValueError):
        return returncode
    if record.get("stopped"):                  # rank 0 just said it; nothing came between
        pass
    elif record.get("user_error"):
        print(_paragraph(record["message"]), file=stream or sys.stderr, flush=True)
    else:
        print(record["message"], file=stream or sys.stderr, flush=True)
    return int(record.get("exit_code", returncode))
