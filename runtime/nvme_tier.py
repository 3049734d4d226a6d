"""Optimizer states, and where the plan says so parameters and gradients, in files on a local disk:
the NVMe tier (ZeRO-Infinity, Rajbhandari et al. 2021, "infinity offload engine": optimizer
states, gradients and parameters on NVMe, moved in and out around their use).

A layer whose plan says ``offload: "nvme"`` (or "nvme+params", "nvme+grads",
"nvme+params+grads"; core/rules.py ``nvme_states``) is sharded by FSDP2 with host offload
(``NvmeOffloadPolicy``, a ``CPUOffloadPolicy``: its parameters and gradients sit in host memory
and AdamW steps on the CPU, as for ``offload: "cpu"``), and one file per optimizer and rank
under ``--nvme-path`` holds, memory-mapped:

* AdamW's two moments of its parameters (``exp_avg``, ``exp_avg_sq``): ``torch.frombuffer``
  views of the mapping, put into the optimizer's state before its first step, so AdamW's own
  update writes them in place;
* with "params": FSDP2's sharded parameter of each unit -- the padded flat shard it all-gathers
  from (``FSDPParam._sharded_param_data``) and the DTensor's local tensor, a view of it -- moved
  into the file once after materialisation (values copied, then the two attributes set as FSDP2's
  own ``reset_sharded_param`` sets them when a shard gets new storage): the module and the
  optimizer keep the same parameter object, its local tensor now over the file, so the
  all-gather reads and AdamW's in-place update writes the file.
  FSDP2's own re-padding (``reset_sharded_param``: after a ``load_state_dict``, at its lazy init)
  finds the padded shard and the local tensor on one storage and leaves them there;
* with "grads": the sharded gradient of each parameter: before each step's first forward the
  file's slot is zeroed and set as the parameter's ``.grad``, so FSDP2's reduce-scatter adds
  into it (``foreach_reduce`` accumulates where a sharded gradient exists) and clipping and
  AdamW read it there.

The file:

* is created in a fresh folder under the path, given its full size on disk at once
  (``os.posix_fallocate``: a disk without room says so here, not by a SIGBUS in the middle of a
  step), mapped (``mmap.mmap``, shared) and unlinked at once, so the kernel removes it however
  the process ends;
* after each step, the mapping's pages are dropped from the process (``MADV_DONTNEED``: the
  updated bytes go to the kernel's page cache of the file) and a background thread writes them
  to the disk (``os.fsync``, which releases the GIL) and drops them from the page cache
  (``POSIX_FADV_DONTNEED``) while the next step's forward and backward run;
* is read ahead (``POSIX_FADV_WILLNEED``: kernel read-ahead) where the bytes are next needed:
  the parameters and gradients at the start of each forward, the moments at its end (so their
  read overlaps the backward); the step waits for the previous write first.  Within a step the
  pages stay mapped (the backward's re-gather reads them again without the disk); they are
  file pages, which the kernel may evict under memory pressure, not memory the process pins.

The kernel's page cache and read-ahead move the bytes (no swapper of autopar's own); torch's
``from_file`` maps a file too but gives no handle to drop or write back its pages, and
safetensors writes whole files, not an in-place update.  A checkpoint reads the states through
the mapping (DCP saves their values, never the file); a load (resume, any layout) copies into
the mapping (the model's ``load_state_dict`` copies into the parameters in place; the
optimizer's through ``register_load_state_dict_post_hook``).
"""
from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from autopar.core.errors import UserError

MOMENTS = ("exp_avg", "exp_avg_sq")          # AdamW's per-parameter state besides its step count
# errors of a write the disk has no room for: full, over quota, over the file-size limit
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
PAGE = mmap.PAGESIZE


@dataclass
class NvmeOffloadPolicy(CPUOffloadPolicy):
    """FSDP2's host offload for a layer whose optimizer states live on the NVMe tier (the marker
    ``nvme_units`` looks for), and whether its sharded parameters and gradients do too."""

    params: bool = False
    grads: bool = False


class NvmeSpaceError(UserError):
    """The NVMe path has no room for the states of the NVMe tier (exit 2)."""


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
        f"--nvme-path {path}: no room for the NVMe tier's states ({need / 1e6:.1f} MB on this rank; {why}). Free "
        f"space there, give another --nvme-path, or plan with fewer states on the tier (offload nvme: the "
        f"moments only) or fewer NVMe-offloaded layers (offload cpu).")


def nvme_units(part: nn.Module) -> tuple[list[nn.Parameter], list, list[nn.Parameter]]:
    """What of ``part`` goes to the NVMe tier, from its FSDP2 units offloaded with
    ``NvmeOffloadPolicy``: (the trainable parameters whose moments do, as the optimizer holds them
    -- the sharded DTensors; the ``FSDPParam`` of every parameter whose shard does; the trainable
    parameters whose sharded gradients do).  FSDP2 keeps a unit's policy on its parameter group
    only (torch 2.13 ``FSDPState._fsdp_param_groups``), so this reads it there."""
    from torch.distributed.fsdp import FSDPModule

    moments, shards, grads, seen = [], [], [], set()
    for module in part.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            policy = group.offload_policy
            if not isinstance(policy, NvmeOffloadPolicy):
                continue
            for fp in group.fsdp_params:
                p = fp.sharded_param
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if policy.params:
                    shards.append(fp)
                if p.requires_grad:
                    moments.append(p)
                    if policy.grads:
                        grads.append(p)
    return moments, shards, grads


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (each region page-aligned: madvise takes pages)."""
    return -(-nbytes // PAGE) * PAGE


class NvmeStates:
    """AdamW's moments of ``params``, the sharded parameters of ``shards`` (``FSDPParam`` objects) and
    the sharded gradients of ``grads`` in one memory-mapped file under ``folder`` (see the module
    docstring); ``attach`` puts the moments into ``optimizer``'s state and hooks its steps."""

    def __init__(self, folder: Path, params: list[nn.Parameter], shards: list = (), grads: list[nn.Parameter] = ()):
        self.folder = Path(folder)
        self.params = list(params)
        shards, grads = list(shards), list(grads)
        for fp in shards:
            if type(fp._sharded_param_data) is not torch.Tensor or type(fp.sharded_param._local_tensor) is not torch.Tensor:
                raise UserError(f"--nvme-path {self.folder}: the parameter {fp._param_fqn or fp._module_info.param_name}"
                                f" is a {type(fp.sharded_param._local_tensor).__name__} (a float8 layer?), which the NVMe "
                                f"tier cannot put in a file; plan its layer with offload nvme (moments only) or cpu.")
        at = 0

        def region(n: int) -> int:
            nonlocal at
            off, at = at, at + _pages(n)
            return off

        shapes = [_local(p).shape for p in self.params]
        dtypes = [_local(p).dtype for p in self.params]
        offsets = [[region(s.numel() * d.itemsize) for _ in MOMENTS] for s, d in zip(shapes, dtypes)]
        shard_offsets = [region(fp._sharded_param_data.numel() * fp._sharded_param_data.itemsize) for fp in shards]
        grad_offsets = [region(_local(p).numel() * _local(p).itemsize) for p in grads]
        self.nbytes = max(at, PAGE)
        self.state_bytes = sum(2 * s.numel() * d.itemsize for s, d in zip(shapes, dtypes))
        self.param_bytes = sum(fp._sharded_param_data.numel() * fp._sharded_param_data.itemsize for fp in shards)
        self.grad_bytes = sum(_local(p).numel() * _local(p).itemsize for p in grads)
        # [0, moments_end): the moments, read for the step; after them the parameters and gradients,
        # read at a forward
        self.moments_end = shard_offsets[0] if shards else (grad_offsets[0] if grads else self.nbytes)
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
            views = {k: self._view(dtype, shape, off) for k, off in zip(MOMENTS, pair)}
            self.moments.append({k: self._as_param(p, v) for k, v in views.items()})
        with torch.no_grad():
            for fp, off in zip(shards, shard_offsets):
                self._move_shard(fp, off)
        # (parameter, its gradient over the file as the parameter's DTensor, the file's view)
        self.grads = []
        for p, off in zip(grads, grad_offsets):
            view = self._view(_local(p).dtype, _local(p).shape, off)
            self.grads.append((p, self._as_param(p, view), view))
        self._fresh = True                        # no forward since the last step
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None

    def _view(self, dtype: torch.dtype, shape, offset: int) -> torch.Tensor:
        n = shape.numel()
        if n == 0:                                # an empty shard (uneven sharding): nothing to map
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=n, offset=offset).view(shape)

    def _move_shard(self, fp, offset: int) -> None:
        """FSDP2's padded flat shard of ``fp`` and its parameter's local tensor (a view at the
        shard's start) re-homed on the file at ``offset``, values copied -- the two assignments
        FSDP2's own ``reset_sharded_param`` makes when a shard gets new storage, then that method,
        which finds them on one storage and keeps them."""
        flat = fp._sharded_param_data
        if flat.numel() == 0:
            return
        local = fp.sharded_param._local_tensor    # the DTensor's own (to_local() gives an alias)
        if local.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() or local.storage_offset() != 0:
            raise AssertionError(f"FSDP2's sharded parameter {fp._param_fqn} is not a view at the start of its "
                                 f"padded shard")
        home = self._view(flat.dtype, flat.shape, offset)
        home.copy_(flat)
        fp._sharded_param_data = home
        fp.sharded_param._local_tensor = home.as_strided(local.size(), local.stride(), 0)
        fp.reset_sharded_param()

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
    def _read_ahead(self, start: int, end: int) -> None:
        if end > start:                           # (a length of 0 would mean "to the end of the file")
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_WILLNEED)

    def prefetch(self) -> None:
        """Start reading the moments back (kernel read-ahead; returns at once)."""
        self._read_ahead(0, self.moments_end)

    def before_forward(self) -> None:
        """At a step's first forward: start reading the parameters and gradients back and give
        each parameter its zeroed gradient in the file (FSDP2's reduce-scatter adds into it)."""
        if not self._fresh:
            return
        self._fresh = False
        self._read_ahead(self.moments_end, self.nbytes)
        with torch.no_grad():
            for p, grad, view in self.grads:
                if p.grad is None:
                    view.zero_()
                    p.grad = grad

    def before_step(self) -> None:
        self.wait()
        self.prefetch()                           # a no-op for pages the forward's call already read

    def after_step(self) -> None:
        """Drop the mapping's pages from the process and write them back in the background."""
        self.map.madvise(mmap.MADV_DONTNEED)
        self._fresh = True
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
        self.moments, self.grads = [], []
        try:
            self.map.close()
        except BufferError:                       # a view still alive (the optimizer's state): the
            pass                                  # mapping goes with its last view
        self._closer()


def attach_nvme_tier(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], path: Path | None,
                     where: str) -> list[NvmeStates]:
    """For every part with NVMe-offloaded units: its AdamW moments, and the sharded parameters and
    gradients its units' policies name, in a file under a fresh folder of ``path`` (one per
    process, removed at ``close``); the parameters and gradients read ahead at the start of the
    part's forward, the moments at its end.  Call it after materialisation (``to_empty`` gives
    FSDP2's shards new storage).  [] when no unit offloads to NVMe."""
    found = [(part, opt, nvme_units(part)) for part, opt in zip(parts, optimizers)]
    if not any(any(units) for _, _, units in found):
        return []
    root = check_nvme_path(path, where)
    folder = Path(tempfile.mkdtemp(prefix="autopar-nvme-", dir=root))
    tiers = []
    try:
        for part, opt, (moments, shards, grads) in found:
            if moments or shards or grads:
                tier = NvmeStates(folder, moments, shards, grads)
                tier.attach(opt)
                part.register_forward_pre_hook(lambda *_, t=tier: t.before_forward())
                part.register_forward_hook(lambda *_, t=tier: t.prefetch())
                tiers.append(tier)
    finally:
        folder.rmdir()                            # the files are unlinked once mapped
    return tiers
