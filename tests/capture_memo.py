"""One capture per model in the test suite's worker processes.

Each case's ``Trainer`` checks its plan (runtime/plan_check.py ``check_plan``), which captures the
model file again to compare the plan's graph fingerprint: for a Hugging Face model a
``torch.export`` trace of seconds per rank and case, most of a small case's cost.  The capture is
a function of the file's text, the model arguments and the micro-batch (core/capture.py runs it
on meta under a fixed seed), so the workers keep it per (file, text, arguments, micro-batch) and
hand each later case a deep copy.  The fingerprint check, the plan's validation against the graph
and everything after it still run on every case; a model file that fails to capture fails every
time (nothing is kept), and a model built from functions (the Python API's ``build_model``) is
captured every time.

Across processes: where ``AUTOPAR_TEST_CAPTURE_DIR`` names a folder (tests/conftest.py sets one
for the whole test session and puts ``subprocess_site`` on the subprocesses' ``PYTHONPATH``, so
every rank, torchrun agent and ``autopar`` CLI process the suite starts installs this memo), the
first process to capture a key writes the graph there (pickled, then renamed into place) under a
file lock, and every other process -- the ranks of one launch, later launches, the other xdist
worker's -- reads it.  A key holds the file's text (sha256), so a model file a test edits is
captured afresh; it does not hold the text of the modules the file imports (nothing in a test
session edits one).  A run with a fault injected (``AUTOPAR_FAULT_AT``) captures for itself.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import pickle
from pathlib import Path

DIR_ENV = "AUTOPAR_TEST_CAPTURE_DIR"


def _on_disk(key: tuple, capture):
    """``capture()``'s graph for ``key`` from the shared folder, captured and written there by
    the first process to ask (the others wait on the key's lock, then read it)."""
    folder = Path(os.environ[DIR_ENV])
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    path = folder / f"{name}.pkl"
    with open(folder / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.is_file():
                return pickle.loads(path.read_bytes())
            graph = capture()
            tmp = folder / f"{name}.{os.getpid()}.tmp"
            tmp.write_bytes(pickle.dumps(graph))
            os.replace(tmp, path)
            return graph
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def uninstall_here() -> None:
    """No memo in this process (pytest's own: its tests capture as a user's process does), even
    where ``subprocess_site`` is on its path (an xdist worker started with the session's
    environment)."""
    import sys

    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_InstallAfterImport"]
    module = sys.modules.get("autopar.core.capture")
    if module is not None and getattr(module.capture_loaded, "_test_memo", False):
        module.capture_loaded = module.capture_loaded._original


def install(capture_module=None, every_call: bool = False) -> None:
    """``every_call``: the planner's captures too (``capture_model_file``, which passes ``t0`` and
    ``reuse``), for a test module that plans the same models several times in its own process
    (``in_this_process``)."""
    if capture_module is None:
        import autopar.core.capture as capture_module
    if getattr(capture_module.capture_loaded, "_test_memo", False):
        return
    original = capture_module.capture_loaded
    kept: dict[tuple, object] = {}

    def capture_loaded(mf, model_args=None, batch_size=8, t0=None, reuse=None):
        file = getattr(mf.module, "__file__", None)
        if (((reuse is not None or t0 is not None) and not every_call) or not file or not Path(file).is_file()
                or os.environ.get("AUTOPAR_FAULT_AT")):
            return original(mf, model_args, batch_size, t0=t0, reuse=reuse)
        key = (str(file), hashlib.sha256(Path(file).read_bytes()).hexdigest(),
               json.dumps(model_args or {}, sort_keys=True, default=repr), batch_size)
        if key not in kept:
            fresh = lambda: original(mf, model_args, batch_size)    # noqa: E731
            kept[key] = _on_disk(key, fresh) if os.environ.get(DIR_ENV) else fresh()
        return copy.deepcopy(kept[key])

    capture_loaded._test_memo = True
    capture_loaded._original = original
    capture_module.capture_loaded = capture_loaded


@contextlib.contextmanager
def in_this_process():
    """A context in which this process captures each (file, text, arguments, micro-batch) once,
    the planner's captures included (``install(every_call=True)``); as before after it."""
    import autopar.core.capture as capture_module

    before = capture_module.capture_loaded
    capture_module.capture_loaded = getattr(before, "_original", before)     # whatever memo was on
    install(capture_module, every_call=True)
    try:
        yield
    finally:
        capture_module.capture_loaded = before


def captured(path, model_args: dict | None = None, micro_batch: int = 8):
    """``capture_model_file`` for a test that makes plans for ranks to run: through the session's
    folder, so the ranks' plan checks read the graph this process captured (or this process
    reads the one a rank or the other worker captured)."""
    from autopar.core.capture import capture_model_file

    with in_this_process():
        return capture_model_file(str(path), dict(model_args or {}), micro_batch)
