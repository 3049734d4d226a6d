"""``autopar profile``: measure op and collective costs on this machine into a profile file.

    autopar profile -o profiles/my-machine.json [--quick] [--dtypes fp32,bf16]
    autopar profile --disk /raid/nvme -o nvme.yaml     # a disk's bandwidth for the cluster file's nvme entry
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m autopar.cli profile -o profiles/local-cpu.json

Alone it times the op sweep on this machine's device (the first CUDA GPU, else the CPU).
Under torchrun (WORLD_SIZE > 1) every rank times the op sweep at the same time -- as ranks
compute during training, sharing the machine -- the rows hold the mean over ranks, and then
the collectives are timed over the process group (NCCL on CUDA, gloo on CPU); rank 0 writes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from autopar.core.errors import UserError

if TYPE_CHECKING:
    import torch

DTYPE_CHOICES = ("fp32", "tf32", "bf16", "fp16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, help="profile file to write (merged into it if it exists); "
                                                           "with --disk, the nvme entry's YAML file")
    from autopar.core import cli_types as T

    p.add_argument("--disk", type=Path, default=None, metavar="PATH",
                   help="only time the sequential write and read of the disk under PATH and write the cluster "
                        "file's nvme entry to -o (profiling/disk_speed.py)")
    p.add_argument("--disk-size-mb", type=T.positive, default=None, metavar="MB",
                   help="size of --disk's scratch file (default 1024; larger than the disk's write cache)")

    p.add_argument("--quick", action="store_true", help="a few small shapes and short repeats (seconds, for tests)")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated compute dtypes to sweep (fp32, tf32, bf16, fp16); "
                        "default fp32 on CPU, fp32,tf32,bf16 on CUDA")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device to profile (default: auto)")
    p.add_argument("--name", default=None, help="profile name (default: the output file's stem)")
    p.add_argument("--target-s", type=T.positive_number, default=None, metavar="S",
                   help="seconds of timed samples per point (default 0.05, --quick 0.01); raise it on a busy machine")
    p.add_argument("--passes", type=T.positive, default=1, metavar="N",
                   help="sweep the ops N times and keep each row's fastest pass (a shared machine's slow "
                        "spells last minutes; default 1)")
    p.add_argument("--skip-ops", action="store_true", help="time only the collectives; keep the file's op table")
    p.add_argument("--skip-collectives", action="store_true", help="time only the ops; keep the file's collective table")
    p.add_argument("--skip-overheads", action="store_true",
                   help="do not time the framework overheads (op dispatch, tensor-parallel module, FSDP unit, "
                        "optimizer tensor); keep the file's figures")
    p.add_argument("--skip-sync-wait", action="store_true",
                   help="on a CPU under torchrun, do not time how much meeting the other ranks costs per second of "
                        "compute (profiling/cpu_sync_wait.py); keep the file's figure")


def main(args: argparse.Namespace) -> int:
    if args.disk is not None:
        return _disk(args)
    from autopar.profiling.profile_run import ProfileOptions, run_profile

    dtypes = _parse_dtypes(args.dtypes)
    if args.target_s is not None and args.target_s <= 0:
        raise UserError(f"--target-s {args.target_s}: give a positive number of seconds.")
    if args.passes < 1:
        raise UserError(f"--passes {args.passes}: give a whole number of sweeps >= 1.")
    device = _pick_device(args.device)
    if dtypes is None:
        dtypes = ["fp32", "tf32", "bf16"] if device.type == "cuda" else ["fp32"]
    if device.type != "cuda" and "tf32" in dtypes:
        dtypes = [d for d in dtypes if d != "tf32"]
        print("autopar profile: TF32 is a CUDA matmul mode; skipped on the CPU.", file=sys.stderr)
    out = Path(args.output)
    if out.exists() and out.is_dir():
        raise UserError(f"-o {out} is a directory; give a file path such as {out}/my-machine.json.")
    from autopar.core.output_file import check_writable

    check_writable(out, "-o")                         # before minutes of timing, not after
    check_merge_target(out)
    opts = ProfileOptions(output=out, quick=args.quick, dtypes=dtypes, device=device,
                          name=args.name or out.stem, measure_ops=not args.skip_ops,
                          measure_collectives=not args.skip_collectives,
                          measure_sync_wait=not args.skip_sync_wait,
                          measure_overheads=not args.skip_overheads, argv=tuple(_canonical_args(args)),
                          target_s=args.target_s, passes=args.passes)
    t0 = time.perf_counter()
    prof = run_profile(opts)
    if prof is not None:
        from autopar.profiling.profile_summary import print_summary

        print_summary(prof, out, time.perf_counter() - t0)
    return 0


def check_merge_target(out: Path) -> None:
    """An existing ``-o`` file is merged into (profiling/profile_file.py), so it must be a profile
    autopar reads: anything else (a plan, a cluster file, a damaged profile) is refused here,
    before the timing, not after it."""
    if not out.is_file():
        return
    from autopar.core.profile_schema import load_profile

    try:
        load_profile(out)
    except UserError as e:
        raise UserError(f"-o {out} already exists and is not a profile autopar can merge into: {_what_it_holds(out, e)}. "
                        f"autopar profile adds its measurements to an existing profile file, so nothing would "
                        f"be written after the profiling. Give -o a new path (or a profile written by autopar "
                        f"profile); nothing was measured and {out} is unchanged.") from None


def _what_it_holds(path: Path, error: UserError) -> str:
    import json

    try:
        data = json.loads(path.read_text(errors="replace")[: 1 << 20])
    except ValueError:
        data = None
    if isinstance(data, dict) and "mesh" in data and "layers" in data:
        return "it holds a plan (written by autopar plan)"
    if isinstance(data, dict) and "groups" in data and "inter_node" in data:
        return "it holds a cluster description"
    text = " ".join(str(error).split())
    return f"it does not read as one ({text if len(text) <= 300 else text[:297] + '...'})"


def _canonical_args(args: argparse.Namespace) -> list[str]:
    out = ["-o", str(args.output)]
    for flag in ("quick", "skip_ops", "skip_collectives", "skip_overheads", "skip_sync_wait"):
        if getattr(args, flag):
            out.append("--" + flag.replace("_", "-"))
    if args.passes != 1:
        out += ["--passes", str(args.passes)]
    for opt in ("dtypes", "name", "target_s"):
        if getattr(args, opt) is not None:
            out += ["--" + opt.replace("_", "-"), str(getattr(args, opt))]
    if args.device != "auto":
        out += ["--device", args.device]
    return out


def _parse_dtypes(text: str | None) -> list[str] | None:
    if text is None:
        return None
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPE_CHOICES]
    if bad or not dtypes:
        raise UserError(f"--dtypes {text!r}: unknown dtype {', '.join(bad) or '(empty)'}; "
                        f"give a comma-separated list of {', '.join(DTYPE_CHOICES)}.")
    return dtypes


def _pick_device(choice: str) -> torch.device:
    import torch   # here, not at import time: 'autopar --help' registers this verb without torch

    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("--device cuda, but torch sees no CUDA GPU here; use --device cpu or run on a GPU machine.")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _disk(args: argparse.Namespace) -> int:
    """``--disk``: time the disk and write its nvme entry (YAML) to -o."""
    from autopar.core.output_file import check_writable, write_text_atomic
    from autopar.profiling.disk_speed import DEFAULT_SIZE, measure_disk, nvme_entry

    out = Path(args.output)
    check_writable(out, "-o")
    size = args.disk_size_mb * 10**6 if args.disk_size_mb else DEFAULT_SIZE
    figures = measure_disk(args.disk, size)
    line = nvme_entry(figures)
    write_text_atomic(out, f"# autopar profile --disk {args.disk}: {size / 1e6:.0f} MB written (fsync) and read "
                           f"back; put this line in the node group of the cluster file\n{line}\n")
    print(line)
    print(f"wrote {out}")
    return 0
