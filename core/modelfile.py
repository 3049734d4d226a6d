"""Load a user's model file: a plain ``.py`` file with ``build_model`` and ``make_batch``.

The contract (docs/design.md, "Contracts")::

    def build_model(**model_args) -> torch.nn.Module      # called under torch.device("meta")
    def make_batch(batch_size: int, **model_args) -> (inputs, target)
    def loss_fn(output, target) -> scalar Tensor          # optional
    def batches(batch_size, dp_rank, dp_size, seed, start_step, **model_args)
        -> iterator of (inputs, target)                    # optional: the training data (docs/runtime.md)
    vocab_size = V  (or def vocab_size(**model_args) -> int)   # optional: token ids --data may hold

``load_model_file`` imports the file by path under a module name of its own (so two model
files with the same stem never collide), checks the functions, and returns a ``ModelFile``
whose methods call them and turn every failure into a ``ModelFileError``: one paragraph
naming the file, the function and what to do -- never a bare traceback.

The user's code runs inside ``user_code``: what it prints goes to stderr (stdout carries
``--json`` output), and a ``sys.exit()`` in it -- a ``SystemExit``, which ``except Exception``
does not catch -- becomes a ``ModelFileError`` instead of ending autopar silently.  In the CLI
each call is bounded in time (``bound_user_code``): a call still running after 30 s prints what
autopar waits on, one past the limit is a ``ModelFileError``.  An ``os.chdir`` in the file stays
the file's own (its calls run where it moved to, autopar's paths resolve where autopar started).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

from autopar.core.errors import ModelFileError, UserError

REQUIRED_FUNCTIONS = ("build_model", "make_batch")
LOSS_FUNCTION = "loss_fn"
BATCHES_FUNCTION = "batches"
VOCAB_SIZE = "vocab_size"


# ---------------------------------------------------------------------------- arguments
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every verb that reads a model file shares (inspect, simulate, plan)."""
    parser.add_argument("model_file", metavar="MODEL_FILE",
                        help="a .py file defining build_model(**args) and make_batch(batch_size, **args)")
    parser.add_argument("--model-arg", dest="model_args", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="argument passed to build_model and make_batch (repeatable); "
                             "values are parsed as int, float, bool (true/false) or string")
    parser.add_argument("--batch-size", type=int, default=8, metavar="N",
                        help="samples per step the model is captured with (default: 8)")


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """``["size=gpt2-small", "layers=4"]`` -> ``{"size": "gpt2-small", "layers": 4}``."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UserError(
                f"--model-arg {item!r} is not of the form KEY=VALUE with KEY a Python identifier; "
                f"write for example --model-arg size=gpt2-small.")
        out[key] = _parse_value(raw.strip())
    return out


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


# ---------------------------------------------------------------------------- the file
@dataclass
class ModelFile:
    """An imported model file and checked access to its functions."""

    path: Path
    module: ModuleType

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def has_loss(self) -> bool:
        return callable(getattr(self.module, LOSS_FUNCTION, None))

    @property
    def has_batches(self) -> bool:
        return callable(getattr(self.module, BATCHES_FUNCTION, None))

    def batches(self, batch_size: int, dp_rank: int, dp_size: int, seed: int, start_step: int,
                **model_args: Any) -> Iterator[tuple[tuple, Any]]:
        """The rank's rows step after step from the file's ``batches`` generator, starting at step
        ``start_step``: each item checked as ``make_batch``'s (inputs as a tuple, target) with
        ``batch_size`` rows; the generator's end, or a failure in it, is a ``ModelFileError``."""
        fn = self.module.batches
        names, var_kw = _signature_names(fn)
        kwargs = model_args if var_kw else {k: v for k, v in model_args.items() if k in names}
        args = (batch_size, dp_rank, dp_size, seed, start_step)
        it = iter(self._call(BATCHES_FUNCTION, fn, args, kwargs))
        step = start_step
        while True:
            try:       # runs in the runtime's prefetch thread: not under user_code (process-wide)
                item = next(it)
            except StopIteration:
                raise ModelFileError(
                    f"{self.path}: batches({_fmt_args(args, kwargs)}) ended before step {step}; it must yield a "
                    f"batch for every step of the run (loop over the data again, as a new pass).") from None
            except UserError:
                raise
            except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's generator failed
                raise ModelFileError(f"{self.path}: batches(...) raised {type(e).__name__}: {e}"
                                     f"{_line_in_file(e, self.path)} at step {step}. Fix the model file.") from None
            inputs, target = self._pair(item, f"batches(...) at step {step}")
            check_batch_rows(inputs, target, batch_size, self.path, f"batches(...) at step {step}")
            yield inputs, target
            step += 1

    def vocab_size(self, **model_args: Any) -> int | None:
        """The file's ``vocab_size`` (an int, or a function of the model args), or None."""
        v = getattr(self.module, VOCAB_SIZE, None)
        if callable(v):
            names, var_kw = _signature_names(v)
            v = self._call(VOCAB_SIZE, v, (), model_args if var_kw else
                           {k: x for k, x in model_args.items() if k in names})
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelFileError(f"{self.path}: vocab_size is {v!r}; it must be a positive int (the number of "
                                 f"token ids the model embeds), or a function of the model args returning one.")
        return v

    # ------------------------------------------------------------------ model args
    def accepted_args(self) -> tuple[list[str], bool]:
        """(names build_model accepts, whether it also takes **kwargs)."""
        return _signature_names(self.module.build_model)

    def check_args(self, model_args: dict[str, Any]) -> None:
        names, var_kw = self.accepted_args()
        unknown = sorted(k for k in model_args if k not in names)
        if unknown and not var_kw:
            accepted = ", ".join(names) if names else "none"
            raise ModelFileError(
                f"{self.path}: build_model does not accept the model argument"
                f"{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}. "
                f"It accepts: {accepted}. Fix the --model-arg names, or add the argument to "
                f"build_model's signature.")

    # ------------------------------------------------------------------ calls
    def build(self, **model_args: Any):
        """Call ``build_model(**model_args)``; checks the arguments and the result type."""
        import torch

        self.check_args(model_args)
        model = self._call("build_model", self.module.build_model, (), model_args)
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.path}: build_model returned {type(model).__name__}, not a torch.nn.Module. "
                f"Return the model instance from build_model.")
        return model

    def make_batch(self, batch_size: int, **model_args: Any) -> tuple[tuple, Any]:
        """Call ``make_batch``; returns (inputs as a tuple, target)."""
        if batch_size < 1:
            raise UserError(f"--batch-size must be a positive integer, got {batch_size}.")
        fn = self.module.make_batch
        names, var_kw = _signature_names(fn)
        kwargs = model_args if var_kw else {k: v for k, v in model_args.items() if k in names}
        result = self._call("make_batch", fn, (batch_size,), kwargs)
        return self._pair(result, "make_batch")

    def _pair(self, result: Any, fname: str) -> tuple[tuple, Any]:
        import torch

        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise ModelFileError(
                f"{self.path}: {fname} returned {type(result).__name__}; it must return a pair "
                f"(inputs, target) where inputs is a Tensor or a tuple of Tensors.")
        inputs, target = result
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        elif isinstance(inputs, list):
            inputs = tuple(inputs)
        if not isinstance(inputs, tuple) or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise ModelFileError(
                f"{self.path}: {fname}'s inputs must be a Tensor or a tuple of Tensors, "
                f"got {type(inputs).__name__}.")
        return inputs, target

    def loss(self, output: Any, target: Any):
        """``loss_fn(output, target)`` if the file defines one, else the default loss."""
        if self.has_loss:
            return self._call(LOSS_FUNCTION, self.module.loss_fn, (output, target), {})
        try:
            return default_loss(output, target)
        except Exception as e:  # noqa: BLE001 -- the model's output and target do not fit the default loss
            raise ModelFileError(
                f"{self.path}: the default loss (cross-entropy for an integer target, MSE otherwise) failed on "
                f"the forward's output and make_batch's target: {type(e).__name__}: {' '.join(str(e).split())[:300]}. "
                f"Return a target that fits the output, or define loss_fn(output, target).") from None

    def _call(self, fname: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            with user_code(self.path, f"calling {fname}({_fmt_args(args, kwargs)})"):
                return fn(*args, **kwargs)
        except UserError:
            raise
        except Exception as e:  # the user's code failed: say where, without a traceback
            where = _line_in_file(e, self.path)
            raise ModelFileError(
                f"{self.path}: {fname}({_fmt_args(args, kwargs)}) raised "
                f"{type(e).__name__}: {e}{where}. Fix the model file or the --model-arg values "
                f"and try again.") from None


def _tensors(obj: Any, where: str):
    import torch

    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{where}[{k!r}]")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{where}[{i}]")


def check_batch_rows(inputs: Any, target: Any, batch_size: int, model_path: Any, fname: str | None = None) -> None:
    """Every input tensor and the target hold ``batch_size`` rows along dim 0 (see
    ``autopar.runtime.batch_check``); else a ModelFileError."""
    for where, t in [*_tensors(inputs, "inputs"), *_tensors(target, "target")]:
        rows = t.shape[0] if t.dim() else None
        if rows != batch_size:
            got = "a 0-d tensor" if rows is None else f"{rows} rows"
            raise ModelFileError(
                f"{model_path}: {fname or f'make_batch({batch_size})'} returned {where} with {got} (shape "
                f"{tuple(t.shape)}); every input and the target must have batch_size = {batch_size} rows along "
                f"dim 0. Make {(fname or 'make_batch').split('(')[0]} build its tensors from its batch_size argument.")


def default_loss(output: Any, target: Any):
    """Cross-entropy for integer targets (logits flattened to [N, classes]), MSE otherwise."""
    import torch
    import torch.nn.functional as F

    if hasattr(output, "logits") and not isinstance(output, torch.Tensor):
        output = output.logits
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not target.is_floating_point():
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    if tuple(output.shape) != tuple(target.shape):   # mse_loss would broadcast them, with a warning only
        raise ValueError(f"the output has shape {tuple(output.shape)} and the target {tuple(target.shape)}; MSE "
                         f"needs the same shape")
    return F.mse_loss(output, target)


def load_model_file(path: str | os.PathLike) -> ModelFile:
    """Import a model file by path and check that it defines the required functions."""
    p = Path(path).expanduser()
    if not p.is_file():
        hint = " (it is a directory)" if p.is_dir() else ""
        raise ModelFileError(
            f"model file {p} does not exist{hint}. Give the path to a .py file that defines "
            f"build_model(**model_args) and make_batch(batch_size, **model_args), e.g. "
            f"examples/gpt.py.")
    p = p.resolve()
    import torch  # noqa: F401  (imported here, not inside the model file's bounded import: it takes seconds)

    from autopar.core.output_file import note_input

    note_input(p, "model file")
    digest = hashlib.sha1(str(p).encode()).hexdigest()[:10]
    module_name = f"autopar_model_{_identifier(p.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"model file {p} cannot be imported as Python; give a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        with user_code(p, "importing it", importing=True):
            spec.loader.exec_module(module)
    except ModelFileError:
        sys.modules.pop(module_name, None)
        raise
    except SyntaxError as e:
        sys.modules.pop(module_name, None)
        raise ModelFileError(
            f"model file {p} has a syntax error at line {e.lineno}: {e.msg}. "
            f"Fix the file so that `python {p}` runs.") from None
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ModelFileError(
            f"model file {p} failed to import: {type(e).__name__}: {e}{_line_in_file(e, p)}. "
            f"Fix the file (or install what it imports) so that `python {p}` runs.") from None
    for fname in REQUIRED_FUNCTIONS:
        fn = getattr(module, fname, None)
        if fn is None:
            raise ModelFileError(
                f"model file {p} does not define {fname}. A model file needs "
                f"build_model(**model_args) -> nn.Module and make_batch(batch_size, **model_args) "
                f"-> (inputs, target); add {fname}.")
        if not callable(fn):
            raise ModelFileError(
                f"model file {p}: {fname} is a {type(fn).__name__}, not a function; "
                f"define it with `def {fname}(...)`.")
    loss = getattr(module, LOSS_FUNCTION, None)
    if loss is not None and not callable(loss):
        raise ModelFileError(f"model file {p}: {LOSS_FUNCTION} is not a function; define it with "
                             f"`def {LOSS_FUNCTION}(output, target)` or remove it.")
    return ModelFile(path=p, module=module)


# ---------------------------------------------------------------------------- helpers
# The model file's calls are bounded in time where the caller asks (the CLI verbs, which run
# them on the meta device: seconds even for a 175B model); the runtime's real builds are not.
TIME_LIMIT_ENV = "AUTOPAR_MODEL_CALL_TIMEOUT_S"
DEFAULT_TIME_LIMIT_S = 300.0
# A bounded call still running after this long gets one line on stderr saying what autopar
# waits on and when it gives up (a user otherwise sees a silent terminal for minutes); one such
# line per process at most (a slow machine must not repeat it for every call).
PROGRESS_AFTER_S = 30.0
# A model file that catches the timeout (a bare ``except:`` in a retry loop) and goes on gets
# this long after it; then the process prints the error and exits 2 (nothing is written yet).
HARD_STOP_GRACE_S = 5.0
_guard: dict[str, Any] = {"depth": 0, "pid": None, "limit_s": None, "prog": "autopar", "phase": None,
                          "doing": "", "path": None, "t0": 0.0, "cwd": {}, "progress_said": False}


def bound_user_code(limit_s: float | None, prog: str = "autopar") -> None:
    """Bound each later call into a model file to ``limit_s`` seconds (None: unbounded);
    ``prog`` ("autopar plan") prefixes the lines printed from the timer."""
    _guard.update(limit_s=limit_s, prog=prog, progress_said=False)


def default_time_limit_s() -> float:
    import math

    try:
        value = float(os.environ.get(TIME_LIMIT_ENV, DEFAULT_TIME_LIMIT_S))
    except ValueError:
        value = DEFAULT_TIME_LIMIT_S
    return value if math.isfinite(value) and value > 0 else DEFAULT_TIME_LIMIT_S


class _ModelExit(BaseException):
    """os._exit called by the model file (raised instead of ending the process)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _ModelTimeout(BaseException):
    """A call into the model file ran past its time limit."""


def _exit_guard(code: int = 0) -> None:
    """``os._exit`` while model code runs: in this process, a ``_ModelExit``; elsewhere (a
    child forked by the model's code) the real exit."""
    import posix

    if _guard["depth"] > 0 and os.getpid() == _guard["pid"]:
        raise _ModelExit(code)
    posix._exit(code)


def _timeout_message(path: Path | str, doing: str, limit: float, where: str = "") -> str:
    return (f"model file {path} did not return within {limit:g} s while {doing}{where}; it loops or waits "
            f"forever there. Fix the model file; if it is only slow, raise the limit with {TIME_LIMIT_ENV}=SECONDS.")


def _say(text: str) -> None:
    """A line on stderr from the timer (straight to the descriptor: the interrupted code may be
    in the middle of a print)."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError, RuntimeError):
        pass
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def _on_alarm(signum, frame) -> None:
    """The bounded call's timer: a progress line, then the timeout, then -- where the model file
    swallowed the timeout -- the error and exit code 2 without it."""
    import signal
    import time

    limit, phase = _guard["limit_s"], _guard["phase"]
    path = Path(str(_guard["path"]))
    if phase == "progress":
        waited = time.monotonic() - _guard["t0"]
        _guard["progress_said"] = True
        _say(f"{_guard['prog']}: still {_guard['doing']} in {path.name} after {waited:.0f} s; autopar stops it "
             f"after {limit:g} s ({TIME_LIMIT_ENV} sets the limit).\n")
        _guard["phase"] = "limit"
        signal.setitimer(signal.ITIMER_REAL, max(limit - waited, 0.001))
        return
    if phase == "limit":
        _guard["phase"] = "hard"
        signal.setitimer(signal.ITIMER_REAL, HARD_STOP_GRACE_S)
        raise _ModelTimeout()
    import posix

    from autopar.core.errors import paragraph

    _say(paragraph(f"{_guard['prog']}: error: {_timeout_message(path, _guard['doing'], limit)} It also caught "
                   f"autopar's stop and went on, so autopar ends here.") + "\n")
    posix._exit(2)


def _sigint_received() -> bool:
    from autopar.core.interrupts import sigint_received

    return sigint_received()


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:                       # the folder was removed under the process
        return None


def _chdir(path: str | None) -> None:
    if path is not None:
        try:
            os.chdir(path)
        except OSError:
            pass


@contextlib.contextmanager
def user_code(path: Path | str, doing: str, *, importing: bool = False) -> Iterator[None]:
    """Run the model file's code: its prints go to stderr, and ``sys.exit()`` or ``os._exit()``
    becomes a ModelFileError, as do a ``KeyboardInterrupt`` it raises itself (no Ctrl-C was
    pressed) and, where a limit is set (``bound_user_code``), a call that does not return.

    The model file's ``os.chdir`` stays its own: its calls run in the folder it last moved to
    (its import starts from autopar's), and autopar's own relative paths (the model file, -o,
    --checkpoint-dir) keep resolving from the folder autopar was started in."""
    import signal
    import threading
    import time

    outer = _guard["depth"] == 0
    real_exit, armed, previous, limit = os._exit, False, None, _guard["limit_s"]
    home = _cwd() if outer else None
    if outer:
        _guard["pid"] = os.getpid()
        os._exit = _exit_guard
        if not importing and _guard["cwd"].get(str(path)) not in (None, home):
            _chdir(_guard["cwd"][str(path)])
        if limit and threading.current_thread() is threading.main_thread():
            _guard.update(doing=doing, path=str(path), t0=time.monotonic(),
                          phase="progress" if limit > PROGRESS_AFTER_S and not _guard["progress_said"] else "limit")
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, PROGRESS_AFTER_S if _guard["phase"] == "progress" else limit)
            armed = True
    _guard["depth"] += 1
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except SystemExit as e:
        raise ModelFileError(
            f"model file {path} called sys.exit({e.code!r}) while {doing}{_line_in_file(e, Path(path))}; "
            f"autopar runs the model file inside its own process, so the file must not exit. Remove the "
            f"sys.exit()/exit() call (raise an exception with a message instead).") from None
    except _ModelExit as e:
        raise ModelFileError(
            f"model file {path} called os._exit({e.code!r}) while {doing}{_line_in_file(e, Path(path))}; "
            f"autopar runs the model file inside its own process, so the file must not end it. Remove the "
            f"os._exit() call (raise an exception with a message instead).") from None
    except _ModelTimeout as e:
        raise ModelFileError(_timeout_message(path, doing, limit, _line_in_file(e, Path(path)))) from None
    except KeyboardInterrupt as e:
        if _sigint_received():
            raise
        raise ModelFileError(
            f"model file {path} raised KeyboardInterrupt while {doing}{_line_in_file(e, Path(path))}, but no "
            f"Ctrl-C was pressed; remove the raise (raise an exception with a message instead).") from None
    finally:
        _guard["depth"] -= 1
        if outer:
            os._exit = real_exit
            if armed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                _guard["phase"] = None
            now = _cwd()
            if home is not None and now != home:
                _guard["cwd"][str(path)] = now
                _chdir(home)


def _signature_names(fn: Callable) -> tuple[list[str], bool]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [], True
    names, var_kw = [], False
    for prm in sig.parameters.values():
        if prm.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
        elif prm.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.append(prm.name)
    return names, var_kw


def _line_in_file(exc: BaseException, path: Path) -> str:
    """' (at line N)' for the deepest traceback frame inside ``path``, or ''."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        try:
            if Path(frame.filename).resolve() == path:
                line = frame.lineno
        except OSError:
            continue
    return f" (at line {line} of {path.name})" if line is not None else ""


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def _fmt_args(args: tuple, kwargs: dict) -> str:
    parts = [repr(a) if not hasattr(a, "shape") else type(a).__name__ for a in args]
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) < 120 else text[:117] + "..."
