"""``torch.export.export`` without the partial graph it prints on each failure.

When an export fails on an error that carries the graph traced so far (a data-dependent
guard, an unsupported op), torch prints that graph to stderr with a plain ``print`` before
re-raising (``torch/export/_trace.py``, the ``_log_export_wrapper``; two nested wrappers print
it twice).  Capture tries export as one of its paths and the planner's checks export a model
again and again, so a model that ends up captured another way fills the terminal with those
graphs.  ``export`` runs the export with ``sys.stderr`` collected: on success everything it
collected is written on; on failure everything but the partial graph is (what the model file
itself printed stays visible), and the exception is raised as torch raised it.
"""
from __future__ import annotations

import contextlib
import io
import sys


def quiet_export(module, args: tuple, **kwargs):
    import torch

    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            return torch.export.export(module, args, **kwargs)
    except BaseException as e:
        graph = getattr(e, "partial_fx_graph", None)
        text = buffer.getvalue()
        if graph is not None:
            text = text.replace(f"{graph}\n", "")
        buffer = io.StringIO(text)
        raise
    finally:
        left = buffer.getvalue()
        if left:
            sys.stderr.write(left)
