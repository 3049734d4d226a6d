"""Writing the files the tool produces: checked before the work, written atomically.

``check_writable(path, flag)`` runs before a verb does its work (a search, a simulation, a
report), so an output path that cannot be written fails at once with a ``UserError`` instead of
after minutes of work.  It leaves nothing behind: it creates and removes one empty probe file
in the directory (the only test that also holds for root and read-only mounts).

``write_text_atomic`` / ``write_bytes_atomic`` write to a temporary file in the target's
directory and rename it over the target (``os.replace``, atomic on POSIX), so a crash never
leaves a half-written file.  The new file keeps the permission bits of the file it replaces
(``mkstemp`` creates 0600); a new file gets the usual 0666 less the process's umask.  A target
that is not a regular file -- a character device such as ``/dev/null`` or ``/dev/stdout``, a
FIFO -- is written in place (a rename would replace the device by a regular file).  A write that
fails (a full disk: ``ENOSPC``; a read-only mount) is an ``OutputFileError`` naming the path,
with nothing left behind.

No output overwrites an input of the same command.  The inputs are known two ways: the CLI notes
every argument that names an existing file (``note_arguments``), and the loaders note the files
they read (``note_input``: model, cluster, plan and measured files -- also those a plan names).
``check_writable`` refuses an output that is one of them (compared by device and inode, so a
symlink or another spelling of the path is caught), and the writers refuse it again at write time.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from autopar.core.errors import UserError


class OutputFileError(UserError, OSError):
    """An output that cannot be written (full disk, read-only, an input of the command).  Also
    an ``OSError``, so callers that tolerate a failed write of a by-product still do."""

    def __init__(self, message: str):
        UserError.__init__(self, message)


# (st_dev, st_ino) -> what the file is to this command ("model file m.py", "argument PLAN_JSON")
_INPUTS: dict[tuple[int, int, int], str] = {}
# (st_dev, st_ino) -> [(option strings, label)] of the arguments that name that existing file
_ARGUMENTS: dict[tuple[int, int, int], list[tuple[tuple[str, ...], str]]] = {}


def _key(path: str | os.PathLike) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    # the modification time too: a file deleted since (a test's temporary folder) frees its inode
    # for a new, unrelated file, which must not inherit the old one's protection
    return (st.st_dev, st.st_ino, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


def note_input(path: str | os.PathLike, what: str) -> None:
    """Record that this process read ``path`` as ``what`` (e.g. "model file"): no output may replace it."""
    key = _key(path)
    if key is not None:
        _INPUTS.setdefault(key, f"the {what} {path}")


def note_arguments(parser, args) -> None:
    """Record every argument of ``args`` (parsed by ``parser``, or by the sub-parser of its verb)
    that names an existing regular file, with the flag it came from."""
    import argparse

    actions = list(parser._actions)
    for a in parser._actions:                       # the chosen verb's own arguments
        if isinstance(a, argparse._SubParsersAction):
            verb = getattr(args, a.dest, None)
            if verb in a.choices:
                actions += a.choices[verb]._actions
    for a in actions:
        value = getattr(args, a.dest, None) if a.dest else None
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if not isinstance(v, (str, os.PathLike)):
                continue
            key = _key(v)
            if key is not None:
                label = max(a.option_strings, key=len) if a.option_strings else (a.metavar or a.dest)
                _ARGUMENTS.setdefault(key, []).append((tuple(a.option_strings), f"{label} {v}"))


def forget_inputs() -> None:
    """Start afresh (a test, or a process that runs several commands)."""
    _INPUTS.clear()
    _ARGUMENTS.clear()


def input_conflict(path: str | os.PathLike, flag: str | None = None) -> str | None:
    """What ``path`` is as an input of this command (another argument, or a file read), or None."""
    key = _key(path)
    if key is None:
        return None
    for options, label in _ARGUMENTS.get(key, []):
        if flag is None or flag not in options:
            return f"the argument {label}"
    return _INPUTS.get(key)


def check_not_input(path: str | os.PathLike, flag: str) -> None:
    """A UserError when the output ``flag PATH`` would overwrite an input of this command."""
    what = input_conflict(path, flag)
    if what is not None:
        raise _overwrite_error(path, flag, what)


def check_not_read(path: str | os.PathLike, flag: str, inputs: dict[str, str | os.PathLike | None]) -> None:
    """A UserError when the output ``flag PATH`` is one of ``inputs`` (what -> path: the files a
    Python call such as ``autopar.plan`` reads, which no command line noted)."""
    key = _key(path)
    for what, p in inputs.items():
        if key is not None and p is not None and _key(p) == key:
            raise _overwrite_error(path, flag, f"the {what} {p}")


def _overwrite_error(path, flag: str, what: str) -> OutputFileError:
    return OutputFileError(f"{flag} {path} is the same file as {what}, which this command reads; writing there "
                           f"would destroy it. "
                           f"Give another path for {flag}.")


def is_special(path: str | os.PathLike) -> bool:
    """True for an existing target that is not a regular file or directory (a device, a FIFO)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _write_failed(p: Path, e: OSError) -> OutputFileError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputFileError(f"cannot write {p}: the disk is full ({e.strerror}); nothing was written and any "
                               f"file that was there is unchanged. Free some space or write to another disk.")
    return OutputFileError(f"cannot write {p}: {e.strerror or e}; nothing was written and any file that was "
                           f"there is unchanged. Choose a path you can write to.")


def check_writable(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a Path if it can be written (its directory exists or can be made, and is
    writable; it is not a directory); else a UserError naming ``flag`` and what to do."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{flag} {p} is a directory; give the path of a file to write.")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} {p} exists and is not writable; choose another path or change its permissions.")
    check_not_input(p, flag)
    if is_special(p):                      # a device or FIFO is written in place (write_bytes_atomic)
        return p
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
    """Write ``data`` to ``path`` atomically, keeping the mode of a file it replaces; a device or
    FIFO in place.  Refuses an input of this command; a failed write is an ``OutputFileError``."""
    p = Path(path)
    key = _key(p)
    what = _INPUTS.get(key) if key is not None else None
    if what is not None:
        raise OutputFileError(f"{p} is {what}, which this command read; autopar does not overwrite its inputs. "
                              f"Give another output path.")
    if is_special(p):
        try:
            with open(p, "wb") as f:
                f.write(data)
        except OSError as e:
            raise _write_failed(p, e) from None
        return
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = stat.S_IMODE(p.stat().st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    except OSError as e:
        raise _write_failed(p, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _write_failed(p, e) from None
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, keeping the mode of a file it replaces."""
    write_bytes_atomic(path, text.encode("utf-8"))
