"""Optimizer states in files on a local disk: the NVMe tier (ZeRO-Infinity, Rajbhandari et al.
2021, "infinity offload engine": optimizer states on NVMe, moved in and out around the step).

A layer whose plan says ``offload: "nvme"`` is sharded by FSDP2 with host offload
(``NvmeOffloadPolicy``, a ``CPUOffloadPolicy``: its parameters and gradients sit in host memory
and AdamW steps on the CPU, as for ``offload: "cpu"``), and AdamW's two moments of its
parameters (``exp_avg``, ``exp_avg_sq``) live in one file per optimizer and rank under
``--nvme-path``, memory-mapped:

* the file is created in a fresh folder under the path, given its full size on disk at once
  (``os.posix_fallocate``: a disk without room says so here, not by a SIGBUS in the middle of a
  step), mapped (``mmap.mmap``, shared) and unlinked at once, so the kernel removes it however
  the process ends; the moments are ``torch.frombuffer`` views of the mapping, put into the
  optimizer's state before its first step, so AdamW's own update writes them in place -- the
  same arithmetic as in memory, only the bytes' home differs;
* after each step the mapping's pages are dropped from the process (``MADV_DONTNEED``: the
  updated bytes go to the kernel's page cache of the file) and a background thread writes them
  to the disk (``os.fsync``, which releases the GIL) and drops them from the page cache
  (``POSIX_FADV_DONTNEED``) while the next step's forward and backward run;
* at the end of each forward the read of the file is started (``POSIX_FADV_WILLNEED``: kernel
  read-ahead), so it overlaps the backward; the step waits for the previous write first.

The kernel's page cache and read-ahead move the bytes (no swapper of autopar's own); torch's
``from_file`` maps a file too but gives no handle to drop or write back its pages, and
safetensors writes whole files, not an in-place update.  A checkpoint reads the moments through
the mapping (DCP saves their values, never the file); a load (resume, any layout) copies into
the mapping (``register_load_state_dict_post_hook``).
"""
from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from autopar.core.errors import UserError

MOMENTS = ("exp_avg", "exp_avg_sq")          # AdamW's per-parameter state besides its step count
# errors of a write the disk has no room for: full, over quota, over the file-size limit
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
PAGE = mmap.PAGESIZE


class NvmeOffloadPolicy(CPUOffloadPolicy):
    """FSDP2's host offload for a layer whose optimizer states live on the NVMe tier (the marker
    ``nvme_parameters`` looks for)."""


class NvmeSpaceError(UserError):
    """The NVMe path has no room for the optimizer states (exit 2)."""


def check_nvme_path(path: Path | None, where: str) -> Path:
    """The folder the states go under: it exists and this process may create files in it."""
    if path is None:
        raise UserError(f"{where} offloads optimizer states to NVMe, but no --nvme-path was given. Run with "
                        f"--nvme-path DIR (a folder on a local disk, e.g. the cluster file's nvme path).")
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--nvme-path {path}: no such folder. Create it (a folder on a local NVMe disk) or give "
                        f"another.")
    from autopar.runtime.output_paths import probe_writable

    probe_writable(path, "--nvme-path", path)             # a real file: permissions, a read-only mount
    return path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still allocate on the file system of ``path`` (statvfs)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _no_room(path: Path, need: int, why: str) -> NvmeSpaceError:
    return NvmeSpaceError(
        f"--nvme-path {path}: no room for the optimizer states ({need / 1e6:.1f} MB on this rank; {why}). Free "
        f"space there, give another --nvme-path, or plan with fewer NVMe-offloaded layers (offload cpu).")


def nvme_parameters(part: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``part`` in FSDP2 units offloaded with ``NvmeOffloadPolicy``, as the
    optimizer holds them (the sharded DTensors).  FSDP2 keeps a unit's policy on its parameter
    group only (torch 2.13 ``FSDPState._fsdp_param_groups``), so this reads it there."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], set()
    for module in part.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if isinstance(group.offload_policy, NvmeOffloadPolicy):
                for fp in group.fsdp_params:
                    p = fp.sharded_param
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class NvmeStates:
    """AdamW's moments of ``params`` in one memory-mapped file under ``folder`` (see the module
    docstring); ``attach`` puts them into ``optimizer``'s state and hooks its steps."""

    def __init__(self, folder: Path, params: list[nn.Parameter]):
        self.folder = Path(folder)
        self.params = list(params)
        shapes = [_local(p).shape for p in self.params]
        dtypes = [_local(p).dtype for p in self.params]
        offsets, at = [], 0
        for shape, dtype in zip(shapes, dtypes):
            n = shape.numel() * dtype.itemsize
            pair = []
            for _ in MOMENTS:                     # each moment page-aligned (madvise takes pages)
                pair.append(at)
                at += -(-n // PAGE) * PAGE
            offsets.append(pair)
        self.nbytes = max(at, PAGE)
        self.state_bytes = sum(2 * s.numel() * d.itemsize for s, d in zip(shapes, dtypes))
        free = free_bytes(self.folder)
        if self.nbytes > free:
            raise _no_room(self.folder, self.nbytes, f"its file system has {free / 1e6:.1f} MB free")
        fd, name = tempfile.mkstemp(prefix=f"autopar-adam-{os.getpid()}-", suffix=".bin", dir=self.folder)
        try:
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            except OSError as e:
                if e.errno in NO_ROOM:
                    raise _no_room(self.folder, self.nbytes, f"allocating the file failed: {os.strerror(e.errno)}") \
                        from None
                raise
            self.map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(name)
            raise
        os.unlink(name)                           # the kernel frees it when the process ends
        self.fd, self.file_name = fd, name
        # the file's space returns once the descriptor and the mapping are gone: at close(), or
        # when the trainer's model and optimizer are collected (a process running several plans)
        self._closer = weakref.finalize(self, os.close, fd)
        self.moments: list[dict[str, torch.Tensor]] = []
        for p, shape, dtype, pair in zip(self.params, shapes, dtypes, offsets):
            n = shape.numel()
            views = {k: torch.frombuffer(self.map, dtype=dtype, count=n, offset=off).view(shape)
                     for k, off in zip(MOMENTS, pair)}
            self.moments.append({k: self._as_param(p, v) for k, v in views.items()})
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None

    @staticmethod
    def _as_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local`` (zeros, this rank's shard) laid out as ``p``: a DTensor like an FSDP2 parameter's."""
        from torch.distributed.tensor import DTensor

        if isinstance(p, DTensor):
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return local

    # ---- the optimizer
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Give ``optimizer`` (an AdamW over a superset of ``params``, no step yet) these moments as
        its state, and hook its steps and loads."""
        for p, moments in zip(self.params, self.moments):
            optimizer.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32), **moments}
        optimizer.register_step_pre_hook(lambda *_: self.before_step())
        optimizer.register_step_post_hook(lambda *_: self.after_step())
        optimizer.register_load_state_dict_post_hook(lambda opt: self.rehome(opt))

    def rehome(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``: moments it put elsewhere are copied into the file
        and the optimizer's state points at the file again."""
        self.wait()
        for p, moments in zip(self.params, self.moments):
            state = optimizer.state.get(p)
            if not state:
                continue
            for k in MOMENTS:
                if k in state and state[k] is not moments[k]:
                    _local(moments[k]).copy_(_local(state[k]))
                    state[k] = moments[k]
        self.after_step()

    # ---- moving the bytes
    def prefetch(self) -> None:
        """Start reading the file back (kernel read-ahead; returns at once)."""
        os.posix_fadvise(self.fd, 0, self.nbytes, os.POSIX_FADV_WILLNEED)

    def before_step(self) -> None:
        self.wait()
        self.prefetch()                           # a no-op for pages the forward's call already read

    def after_step(self) -> None:
        """Drop the mapping's pages from the process and write them back in the background."""
        self.map.madvise(mmap.MADV_DONTNEED)
        self._writer = threading.Thread(target=self._write_back, name="autopar-nvme-write", daemon=True)
        self._writer.start()

    def _write_back(self) -> None:
        try:
            os.fsync(self.fd)
            os.posix_fadvise(self.fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)
        except BaseException as e:                # re-raised on the training thread (wait)
            self._write_error = e

    def wait(self) -> None:
        """Wait for the write-back in flight; a disk error there is raised here."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            e, self._write_error = self._write_error, None
            if isinstance(e, OSError) and e.errno in NO_ROOM:
                raise _no_room(self.folder, self.nbytes, f"writing the file back failed: {os.strerror(e.errno)}")
            raise e

    def close(self) -> None:
        self.wait()
        self.moments = []
        try:
            self.map.close()
        except BufferError:                       # a view still alive (the optimizer's state): the
            pass                                  # mapping goes with its last view
        self._closer()


def attach_nvme_tier(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], path: Path | None,
                     where: str) -> list[NvmeStates]:
    """For every part with NVMe-offloaded units: its AdamW moments in a file under a fresh folder
    of ``path`` (one per process, removed at ``close``), prefetched at the end of the part's
    forward.  [] when no unit offloads to NVMe."""
    pairs = [(part, opt, nvme_parameters(part)) for part, opt in zip(parts, optimizers)]
    if not any(params for _, _, params in pairs):
        return []
    root = check_nvme_path(path, where)
    folder = Path(tempfile.mkdtemp(prefix="autopar-nvme-", dir=root))
    tiers = []
    try:
        for part, opt, params in pairs:
            if params:
                tier = NvmeStates(folder, params)
                tier.attach(opt)
                part.register_forward_hook(lambda *_, t=tier: t.prefetch())
                tiers.append(tier)
    finally:
        folder.rmdir()                            # the files are unlinked once mapped
    return tiers
