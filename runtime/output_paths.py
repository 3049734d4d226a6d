"""Check the run's outputs can be written before any work: ``--checkpoint-dir``, ``--measured``,
``--metrics`` and ``--tensorboard``.

Each is probed by writing (and removing) a small file where the output will go -- the one test
that also holds for root, for read-only file systems and for a path through a regular file --
and an unwritable one is a ``UserError`` (exit code 2) naming the flag and the path.
``--checkpoint-dir`` is created if missing (it is the run's output); for ``--measured`` only
the nearest existing folder on its path is probed, so nothing is created for it before the end;
so for ``--metrics`` (which must also not be the --measured file) and ``--tensorboard`` (whose
package must be installed).  None of them may be an input of the run.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from autopar.core.errors import UserError
from autopar.core.output_file import check_not_input, is_special
from autopar.runtime.options import RunOptions


def probe_writable(folder: Path, flag: str, target: Path) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=".autopar-probe.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise UserError(f"{flag} {target} cannot be written: {e.strerror or e} (in {folder}). Give a path in a "
                        f"folder you can write to.") from None


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output_paths(opts: RunOptions) -> None:
    if opts.checkpoint_dir is not None:
        d = Path(opts.checkpoint_dir)
        if d.exists() and not d.is_dir():
            raise UserError(f"--checkpoint-dir {d} is a file, not a folder. Give a new folder (it is created) or "
                            f"one an earlier 'autopar run' wrote.")
        base = _nearest_existing(d)
        if not base.is_dir():
            raise UserError(f"--checkpoint-dir {d} cannot be created: {base} is a file, not a folder. Give a path "
                            f"in a folder you can write to.")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--checkpoint-dir {d} cannot be created: {e.strerror or e}. Give a path in a folder "
                            f"you can write to.") from None
        probe_writable(d, "--checkpoint-dir", d)
    _check_file(Path(opts.measured_file), "--measured", "measured.json")
    if opts.metrics_path is not None:
        metrics = Path(opts.metrics_path)
        if _same_file(metrics, Path(opts.measured_file)):
            raise UserError(f"--metrics {metrics} is the file --measured writes; give --metrics another path "
                            f"(e.g. {metrics.with_name('metrics.jsonl')}).")
        _check_file(metrics, "--metrics", "metrics.jsonl")
    _check_tensorboard(opts)


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    return a.exists() and b.exists() and a.samefile(b)


def _check_file(path: Path, flag: str, example: str) -> None:
    """An output file: not an input, not a folder, in a folder that can be written to."""
    check_not_input(path, flag)
    if is_special(path):                              # /dev/null, a FIFO: written in place
        if not os.access(path, os.W_OK):
            raise UserError(f"{flag} {path} is not writable; give a path you can write to.")
        return
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file path (e.g. {path / example}).")
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise UserError(f"{flag} {path} cannot be written: {base} is a file, not a folder. Give a path "
                        f"in a folder you can write to.")
    probe_writable(base, flag, path)


def _check_tensorboard(opts: RunOptions) -> None:
    """--tensorboard DIR: the tensorboard package is installed and DIR is (or can be) a folder."""
    if opts.tensorboard_dir is None:
        return
    from autopar.runtime.metrics import tensorboard_available

    d = Path(opts.tensorboard_dir)
    if not tensorboard_available():
        raise UserError(f"--tensorboard {d}: TensorBoard event files need the tensorboard package, which this "
                        f"Python does not have. Install it (pip install tensorboard), or leave out --tensorboard "
                        f"(--metrics PATH.jsonl writes the same figures as JSON lines).")
    if d.exists() and not d.is_dir():
        raise UserError(f"--tensorboard {d} is a file, not a folder. Give a folder (it is created if missing).")
    base = _nearest_existing(d)
    if not base.is_dir():
        raise UserError(f"--tensorboard {d} cannot be created: {base} is a file, not a folder. Give a path in a "
                        f"folder you can write to.")
    probe_writable(base, "--tensorboard", d)
