"""Check the run's outputs can be written before any work: ``--checkpoint-dir`` and ``--measured``.

Each is probed by writing (and removing) a small file where the output will go -- the one test
that also holds for root, for read-only file systems and for a path through a regular file --
and an unwritable one is a ``UserError`` (exit code 2) naming the flag and the path.
``--checkpoint-dir`` is created if missing (it is the run's output); for ``--measured`` only
the nearest existing folder on its path is probed, so nothing is created for it before the end.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from autopar.core.errors import UserError
from autopar.core.output_file import check_not_input, is_special
from autopar.runtime.options import RunOptions


def _probe(folder: Path, flag: str, target: Path) -> None:
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
        _probe(d, "--checkpoint-dir", d)
    measured = Path(opts.measured_file)
    check_not_input(measured, "--measured")
    if is_special(measured):                          # /dev/null, a FIFO: written in place
        if not os.access(measured, os.W_OK):
            raise UserError(f"--measured {measured} is not writable; give a path you can write to.")
        return
    if measured.is_dir():
        raise UserError(f"--measured {measured} is a folder; give a file path (e.g. {measured / 'measured.json'}).")
    base = _nearest_existing(measured.parent)
    if not base.is_dir():
        raise UserError(f"--measured {measured} cannot be written: {base} is a file, not a folder. Give a path "
                        f"in a folder you can write to.")
    _probe(base, "--measured", measured)
