"""One capture per model in a torchrun worker that runs several plan cases in one process.

Each case's ``Trainer`` checks its plan (runtime/plan_check.py ``check_plan``), which captures the
model file again to compare the plan's graph fingerprint: for a Hugging Face model a
``torch.export`` trace of seconds per rank and case, most of a small case's cost.  The capture is
a function of the file's text, the model arguments and the micro-batch (core/capture.py runs it
on meta under a fixed seed), so the workers keep it per (file, text, arguments, micro-batch) and
hand each later case a deep copy.  The fingerprint check, the plan's validation against the graph
and everything after it still run on every case; a model file that fails to capture fails every
time (nothing is kept), and a model built from functions (the Python API's ``build_model``) is
captured every time.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path


def install() -> None:
    import autopar.core.capture as capture

    original = capture.capture_loaded
    kept: dict[tuple, object] = {}

    def capture_loaded(mf, model_args=None, batch_size=8, t0=None, reuse=None):
        file = getattr(mf.module, "__file__", None)
        if reuse is not None or t0 is not None or not file or not Path(file).is_file():
            return original(mf, model_args, batch_size, t0=t0, reuse=reuse)
        key = (str(file), hashlib.sha256(Path(file).read_bytes()).hexdigest(),
               json.dumps(model_args or {}, sort_keys=True, default=repr), batch_size)
        if key not in kept:
            kept[key] = original(mf, model_args, batch_size)
        return copy.deepcopy(kept[key])

    capture.capture_loaded = capture_loaded
