"""``autopar profile --disk PATH``: the sequential write and read bandwidth and the free space of
the disk under PATH, as the cluster file's ``nvme`` entry (core/cluster_file.py) takes them.

A scratch file of ``size_bytes`` is written in 8 MiB blocks and flushed to the disk (``os.fsync``,
inside the timed span), its pages are dropped from the page cache (``POSIX_FADV_DONTNEED``: clean
after the fsync, so the read that follows comes from the disk, not from memory), read back in the
same blocks and removed.  The file should be larger than the disk's own write cache (a few hundred
MB by default: ``DEFAULT_SIZE``).  Bandwidths are decimal GB/s, as the cluster file's.
"""
from __future__ import annotations

import errno
import os
import tempfile
import time
from pathlib import Path

from autopar.core.errors import UserError

DEFAULT_SIZE = 1 << 30          # 1 GiB: past the DRAM write cache of common NVMe drives
BLOCK = 8 << 20                 # 8 MiB per write / read call


def measure_disk(path: Path, size_bytes: int = DEFAULT_SIZE) -> dict:
    """{"path", "capacity_GB" (free now), "read_GBps", "write_GBps"} of the disk under ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--disk {path}: no such folder. Give a folder on the disk to time.")
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if size_bytes > free:
        raise UserError(f"--disk {path}: {size_bytes / 1e6:.0f} MB to time, but only {free / 1e6:.0f} MB are free "
                        f"there; free space or give a smaller --disk-size-mb.")
    block = os.urandom(min(BLOCK, size_bytes))
    try:
        fd, name = tempfile.mkstemp(prefix="autopar-disk-", dir=path)
    except OSError as e:
        raise UserError(f"--disk {path}: cannot create a file there ({os.strerror(e.errno)}).") from None
    try:
        t0 = time.perf_counter()
        left = size_bytes
        while left > 0:
            left -= os.write(fd, block[:min(len(block), left)])
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        buf = bytearray(len(block))
        t0 = time.perf_counter()
        got = 0
        while got < size_bytes:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            got += n
        read_s = time.perf_counter() - t0
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise UserError(f"--disk {path}: the disk filled while timing ({os.strerror(e.errno)}).") from None
        raise
    finally:
        os.close(fd)
        os.unlink(name)
    return {"path": str(path.resolve()), "capacity_GB": round(free / 1e9, 1),
            "read_GBps": round(got / read_s / 1e9, 3), "write_GBps": round(size_bytes / write_s / 1e9, 3)}


def nvme_entry(figures: dict) -> str:
    """The cluster file's ``nvme`` line for a group (per node: time every drive's folder, or the
    RAID volume the tier uses)."""
    return (f"nvme: {{path: {figures['path']}, capacity_GB: {figures['capacity_GB']}, "
            f"read_GBps: {figures['read_GBps']}, write_GBps: {figures['write_GBps']}}}")
