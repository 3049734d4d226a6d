"""Markers: a test that starts worker processes (``multiproc``: torchrun ranks or an
``autopar run``) is also ``slow``, so the quick subset ``pytest -m "not slow"`` is the
single-process tests (README, "Tests")."""
import sys
from pathlib import Path

import pytest

# tests/ on sys.path: the test files live in folders by package (tests/core, ..., tests/integration);
# the modules they share (plain_loop, runtime_support, sim_graphs, the torchrun workers) and the
# model folders zoo/ and plan_models/ stay here.  Test modules are imported under their file
# names (pytest's default prepend mode, no __init__.py), so file names are unique across folders.
TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


def pytest_configure(config):
    """One folder of captured graphs for the whole session, shared by every process the suite
    starts (tests/capture_memo.py): set here in the first pytest process (xdist's workers inherit
    its environment), removed when it ends."""
    import os
    import shutil
    import tempfile

    from capture_memo import DIR_ENV, uninstall_here

    uninstall_here()
    if os.environ.get(DIR_ENV):
        return
    _compile_sources()
    folder = tempfile.mkdtemp(prefix="autopar-captures-")
    os.environ[DIR_ENV] = folder
    site = str(TESTS_DIR / "subprocess_site")
    os.environ["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def _compile_sources() -> None:
    """The repository's bytecode, written once before the session's processes start: where the
    environment sets ``PYTHONDONTWRITEBYTECODE`` (this machine's image does), Python caches
    nothing, so every rank, agent and CLI process the suite starts would compile autopar's modules
    from source again (0.4 CPU-s for ``autopar.runtime.train`` and the CLI alone).  Python still
    reads ``__pycache__`` (ignored by git) and checks each file against its source's mtime and size."""
    import compileall

    root = TESTS_DIR.parent
    for path in sorted(root.iterdir()):     # the repository's own folders (not a venv made inside it)
        if path.suffix == ".py":
            compileall.compile_file(str(path), quiet=2)
        elif path.is_dir() and not path.name.startswith((".", "_")) and any(path.glob("**/*.py")) \
                and not (path / "pyvenv.cfg").exists() and path.name not in ("build", "dist"):
            compileall.compile_dir(str(path), quiet=2)


def pytest_collection_modifyitems(config, items):
    launches: dict[str, int] = {}
    for item in items:
        if item.get_closest_marker("multiproc") is not None:
            launches[item.nodeid.split("::")[0]] = launches.get(item.nodeid.split("::")[0], 0) + 1
            if item.get_closest_marker("slow") is None:
                item.add_marker(pytest.mark.slow)
    # the files with the most multi-process tests first, each file's tests in their own order: under
    # ``-n 2 --dist loadfile`` a long file then starts early instead of running alone at the end
    # (longest first: Graham 1969's LPT rule for two machines)
    items.sort(key=lambda item: -launches.get(item.nodeid.split("::")[0], 0))


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo process group in this process (for collective code: DCP's save and load,
    the gradient norm's all-reduce)."""
    import tempfile

    import torch.distributed as dist

    store = dist.FileStore(tempfile.mktemp(prefix="store", dir=tmp_path), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
