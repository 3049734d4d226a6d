"""Markers: a test that starts worker processes (``multiproc``: torchrun ranks or an
``autopar run``) is also ``slow``, so the quick subset ``pytest -m "not slow"`` is the
single-process tests (README, "Tests")."""
import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("multiproc") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
