"""autopar's command line run in the test process: ``autopar.cli.main(argv)`` (built to be called
repeatedly from Python) with its stdout and stderr captured and handed back as a subprocess would
hand them back.  A fresh interpreter per call costs seconds of imports (torch, transformers),
which the suite paid dozens of times; tests of what a process does at exit, on a signal or under
torchrun keep their subprocesses."""
from __future__ import annotations

import contextlib
import io
import subprocess


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    from autopar.cli import main

    out, err = io.StringIO(), io.StringIO()
    where = contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()
    with where, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:                    # argparse refusing a flag exits 2
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["autopar", *map(str, args)], code, out.getvalue(), err.getvalue())
