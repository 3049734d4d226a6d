"""The NVMe tier's files (runtime/nvme_tier.py), one process: AdamW's moments live in a
memory-mapped file -- its size is the moments' bytes, they leave the process's resident memory
after each step, and the update is the in-memory AdamW's to the bit -- and a disk without room
or a missing folder is refused with one message naming the path (exit 2 through the CLI)."""
from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.core.errors import UserError
from autopar.runtime.nvme_tier import NvmeSpaceError, NvmeStates, check_nvme_path


def _rss(field: str = "VmRSS") -> int:
    """Bytes of this process's resident memory (``RssAnon``: its anonymous part), /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))     # 4.2 M parameters


def _steps(model, opt, steps: int = 2) -> int:
    """Train ``steps`` steps; the resident-memory growth over the optimizer steps (gradients exist
    before the first, so only the optimizer's own state and temporaries can add to it)."""
    torch.manual_seed(1)
    x = torch.randn(4, 1024)
    grow = 0
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        before = _rss()
        opt.step()
        grow += _rss() - before
    return grow


def measure(folder: str) -> dict:
    """The same model and AdamW in memory and on the tier, two steps each; the
    resident-memory growth over each one's optimizer steps, the file's facts, the results."""
    a, b = _model(0), _model(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    tier = NvmeStates(Path(folder), list(b.parameters()))
    tier.attach(opt_b)
    st = os.fstat(tier.fd)
    maps = Path("/proc/self/maps").read_text()
    out = {"moments": 2 * sum(p.numel() * p.element_size() for p in b.parameters()),
           "state_bytes": tier.state_bytes, "size": st.st_size, "allocated": st.st_blocks * 512,
           "listed": os.listdir(folder), "params": len(tier.params),
           "mapped": f"{folder}/autopar-adam-{os.getpid()}-" in maps and "(deleted)" in maps,
           "grow_nvme": _steps(b, opt_b)}
    tier.wait()
    out["grow_ram"] = _steps(a, opt_a)
    out["equal"] = all(torch.equal(p, q) and torch.equal(opt_a.state[p]["exp_avg_sq"], opt_b.state[q]["exp_avg_sq"])
                       for p, q in zip(a.parameters(), b.parameters()))
    opt_b.load_state_dict(opt_a.state_dict())         # a load (a resume) lands in the file
    q = next(b.parameters())
    out["reloaded_in_file"] = opt_b.state[q]["exp_avg"].data_ptr() == tier.moments[0]["exp_avg"].data_ptr()
    tier.close()
    return out


def test_moments_live_in_the_file_not_in_resident_memory(tmp_path):
    """glibc's mmap threshold fixed first (``mallopt(M_MMAP_THRESHOLD)``: blocks this large are
    mapped and unmapped, so resident memory counts what is alive, not what the allocator kept)."""
    import ctypes

    M_MMAP_THRESHOLD = -3                             # glibc malloc.h
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 16) == 1
    m = measure(str(tmp_path))
    moments = m["moments"]
    # the file: the moments' bytes (each moment page-aligned), allocated on the disk, unlinked at
    # once (nothing left behind however the process ends) and mapped from this folder
    assert m["state_bytes"] == moments
    assert moments <= m["size"] < moments + 2 * m["params"] * os.sysconf("SC_PAGE_SIZE")
    assert m["allocated"] >= moments and m["listed"] == [] and m["mapped"]
    assert m["grow_ram"] >= 0.9 * moments, m          # in memory: the moments stay resident
    assert m["grow_nvme"] < 0.25 * moments, m         # on the tier: they left after the step
    assert m["equal"] and m["reloaded_in_file"], m    # the same arithmetic, bit for bit; a load lands in the file


def test_a_disk_without_room_is_refused_naming_the_path(tmp_path):
    """The kernel refuses the file's allocation (RLIMIT_FSIZE: the same refusal of a write a full
    disk gives, EFBIG for ENOSPC, without filling a shared disk); the free-space check of statvfs
    refuses what does not fit before any file is made."""
    params = [nn.Parameter(torch.zeros(1 << 20))]                    # 8 MB of moments
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)              # an error, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(NvmeSpaceError, match=rf"--nvme-path {tmp_path}: no room.*File too large"):
            NvmeStates(tmp_path, params)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert list(tmp_path.iterdir()) == []                            # nothing half-written
    import autopar.runtime.nvme_tier as tier_mod

    free = tier_mod.free_bytes(tmp_path)
    huge = [nn.Parameter(torch.empty(0))]
    with pytest.MonkeyPatch.context() as mp:       # the free space statvfs reports, less than the need
        mp.setattr(tier_mod, "free_bytes", lambda _p: 4096)
        with pytest.raises(NvmeSpaceError, match=r"file system has 0.0 MB free"):
            NvmeStates(tmp_path, params)
    assert free > 0 and huge


def test_missing_or_unwritable_path_is_refused(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        check_nvme_path(tmp_path / "missing", "plan file p.json")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="no such folder"):
        check_nvme_path(tmp_path / "file", "plan file p.json")
    with pytest.raises(UserError, match="no --nvme-path was given"):
        check_nvme_path(None, "plan file p.json")
    assert check_nvme_path(tmp_path, "p") == tmp_path


def test_run_refuses_a_missing_nvme_path_before_launch(tmp_path):
    from cli_inprocess import run_cli
    from runtime_support import make_plan

    plan = make_plan(tmp_path / "plan.json", dp=2, micro_batch=2, zero=3, offload="nvme")
    out = run_cli("run", plan, "--steps", 1, "--nvme-path", tmp_path / "nope")
    assert out.returncode == 2, out.stderr
    text = " ".join(out.stderr.split())                   # the message is wrapped to the terminal
    assert f"--nvme-path {tmp_path / 'nope'}: no such folder" in text, text
    out = run_cli("run", plan, "--steps", 1)
    assert out.returncode == 2 and "no --nvme-path was given" in " ".join(out.stderr.split()), out.stderr
    plan = make_plan(tmp_path / "plan2.json", dp=2, micro_batch=2, zero=3, offload="nvme+params+grads")
    out = run_cli("run", plan, "--steps", 1)
    assert out.returncode == 2 and "no --nvme-path was given" in " ".join(out.stderr.split()), out.stderr


# ------------------------------------------------------------- parameters and gradients in the file

def _sharded(seed: int, offload: str):
    """``_model(seed)`` under FSDP2 on this process's one rank, each Linear a unit, ``offload``'s
    policy (runtime/apply_dp.py), AdamW as the runtime builds it, and the NVMe tier attached."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from autopar.runtime.apply_dp import offload_policy
    from autopar.runtime.nvme_tier import attach_nvme_tier

    model = _model(seed)
    mesh = init_device_mesh("cpu", (1,))
    policy = offload_policy(offload, torch.device("cpu"))
    for layer in model:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def _in_map(tier: NvmeStates, t: torch.Tensor) -> bool:
    start = torch.frombuffer(tier.map, dtype=torch.uint8, count=1).data_ptr()
    return start <= t.untyped_storage().data_ptr() < start + tier.nbytes


def test_parameters_and_gradients_live_in_the_file(tmp_path, one_rank):
    """offload "nvme+params+grads" under FSDP2: the sharded parameters and gradients are views of
    the tier's file (FSDP2's all-gather source, the module's parameter, the reduce-scatter's
    target), the process's anonymous memory does not hold them even after the backward, they
    leave its resident memory after the step, a ``load_state_dict`` keeps them in the file, and
    the training is the plain AdamW loop's to 1e-6."""
    import ctypes

    from autopar.runtime.nvme_tier import attach_nvme_tier

    M_MMAP_THRESHOLD = -3                             # glibc malloc.h (see the test above)
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 16) == 1
    plain = _model(0)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    torch.manual_seed(1)
    batches = [torch.randn(4, 1024) for _ in range(2)]
    for x in batches:                                 # the plain loop
        plain(x).square().mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()
    nbytes = sum(p.numel() * p.element_size() for p in plain.parameters())        # 16.8 MB
    del plain_opt
    _sharded(0, "cpu")                                # FSDP2's one-time allocations, outside the measure
    grow = {}
    for offload in ("cpu", "nvme+params+grads"):
        anon0, rss0 = _rss("RssAnon"), _rss()
        model, opt = _sharded(0, offload)
        tiers = attach_nvme_tier([model], [opt], tmp_path, "test") if offload != "cpu" else []
        for x in batches:
            model(x).square().mean().backward()
            after_backward = _rss("RssAnon") - anon0
            if tiers:
                t = tiers[0]
                fps = [fp for m in model for g in m._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params]
                assert len(fps) == 4 and all(_in_map(t, fp._sharded_param_data) and _in_map(t, p.to_local())
                                             and _in_map(t, p.grad.to_local())
                                             for fp, p in ((fp, fp.sharded_param) for fp in fps))
                assert t.param_bytes == t.grad_bytes == nbytes and t.state_bytes == 2 * nbytes
            opt.step()
            opt.zero_grad(set_to_none=True)
        grow[offload] = (after_backward, _rss() - rss0)
        for p, q in zip(plain.parameters(), model.parameters()):
            torch.testing.assert_close(q.full_tensor(), p, rtol=0, atol=1e-6)
        if tiers:
            sd = {k: v * 2 for k, v in model.state_dict().items()}      # a load lands in the file
            model.load_state_dict(sd)
            assert all(_in_map(tiers[0], p.to_local()) and torch.equal(p, sd[k])
                       for k, p in model.named_parameters())
            tiers[0].close()
        del model, opt, tiers
    in_memory, on_tier = grow["cpu"], grow["nvme+params+grads"]
    # in memory: parameters and gradients (and moments) in anonymous memory after the second
    # backward, parameters and moments resident after the step (at least two of each three: the
    # allocator may reuse what the plain loop freed)
    assert in_memory[0] >= 1.9 * nbytes and in_memory[1] >= 1.9 * nbytes, grow
    assert on_tier[0] < 0.25 * nbytes and on_tier[1] < 0.25 * nbytes, grow
