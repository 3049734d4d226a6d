"""Writing the files the tool produces: checked before the work, written atomically.

``check_writable(path, flag)`` runs before a verb does its work (a search, a simulation, a
report), so an output path that cannot be written fails at once with a ``UserError`` instead of
after minutes of work.  It leaves nothing behind: it creates and removes one empty probe file
in the directory (the only test that also holds for root and read-only mounts).

``write_text_atomic`` / ``write_bytes_atomic`` write to a temporary file in the target's
directory and rename it over the target (``os.replace``, atomic on POSIX), so a crash never
leaves a half-written file.  The new file keeps the permission bits of the file it replaces
(``mkstemp`` creates 0600); a new file gets the usual 0666 less the process's umask.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from autopar.core.errors import UserError


def check_writable(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a Path if it can be written (its directory exists or can be made, and is
    writable; it is not a directory); else a UserError naming ``flag`` and what to do."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{flag} {p} is a directory; give the path of a file to write.")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} {p} exists and is not writable; choose another path or change its permissions.")
    parent = p.parent if str(p.parent) else Path(".")
    ancestor = parent
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{flag} {p}: {ancestor} is not a directory, so the file cannot be created there; "
                        f"choose another path.")
    try:                                   # the real test (permission bits say nothing to root, or on a
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", dir=ancestor)   # read-only mount)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = "the directory" if ancestor == parent else f"{parent} does not exist and its nearest existing parent"
        raise UserError(f"{flag} {p}: {what} {ancestor} is not writable ({e.strerror or e}); choose a path in a "
                        f"directory you can write to.") from None
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, keeping the mode of a file it replaces."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(p.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, keeping the mode of a file it replaces."""
    write_bytes_atomic(path, text.encode("utf-8"))
