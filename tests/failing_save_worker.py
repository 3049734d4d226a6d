"""``python -m autopar.runtime`` with a writer that fails like a full disk: the test double of
the checkpoint-save fault tests (``test_faults_runtime``).

``AUTOPAR_TEST_FULL_DISK="RANK:FOLDER"``: on rank RANK, DCP's file writer, asked to write
into a folder whose name starts with FOLDER, writes the first bytes of its shard and then
fails with ENOSPC ("No space left on device") -- what a full disk does to a write.  Every
other write goes through.  The arguments are ``python -m autopar.runtime``'s.
"""
import errno
import os
import sys
from pathlib import Path

from torch.distributed.checkpoint.filesystem import _FileSystemWriter

_write_data = _FileSystemWriter.write_data


def _full_disk_write(self, plan, planner):
    rank, folder = os.environ["AUTOPAR_TEST_FULL_DISK"].split(":", 1)
    where = Path(str(self.path))
    if int(os.environ.get("RANK", "0")) == int(rank) and where.name.startswith(folder):
        shard = where / f"{plan.storage_data.prefix}0.distcp"
        with open(shard, "wb") as f:
            f.write(b"\0" * 512)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(shard))
    return _write_data(self, plan, planner)


_FileSystemWriter.write_data = _full_disk_write

if __name__ == "__main__":
    from autopar.runtime.__main__ import main

    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
