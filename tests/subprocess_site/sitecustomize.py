"""Imported at start-up by every Python process the test suite starts (tests/conftest.py puts
this folder on their ``PYTHONPATH``): installs the suite's capture memo (tests/capture_memo.py)
in the process as soon as it imports ``autopar.core.capture``, so that ranks and CLI processes
launched by ``autopar run`` or torchrun share the test session's captures.  Then runs the
``sitecustomize`` this one hides, if any."""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGET = "autopar.core.capture"


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Installs the memo when ``autopar.core.capture`` is imported (tests/conftest.py removes it
    from pytest's own processes: xdist's workers inherit the environment too)."""
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            sys.path.insert(0, os.path.dirname(_HERE))
            try:
                import capture_memo
            finally:
                sys.path.remove(os.path.dirname(_HERE))
            capture_memo.install(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("AUTOPAR_TEST_CAPTURE_DIR"):
    sys.meta_path.insert(0, _InstallAfterImport())

# the sitecustomize this file hides (a distribution's own), run as it would have been
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _HERE])
if _next is not None and _next.loader is not None:
    _module = importlib.util.module_from_spec(_next)
    try:
        _next.loader.exec_module(_module)
    except Exception:
        pass
