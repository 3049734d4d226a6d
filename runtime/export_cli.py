"""``autopar export CHECKPOINT_DIR -o OUT``: a checkpoint's weights as safetensors (runtime/export.py)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from autopar.core.errors import UserError

# transformers' convert_file_size_to_int: "5GB" = 5 * 10**9, "5GiB" = 5 * 2**30
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR",
                        help="an 'autopar run' --checkpoint-dir (its newest complete checkpoint) or one step_N folder")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUT",
                        help="the folder to write (must not exist): a from_pretrained folder for a transformers "
                             "model, else model.safetensors keyed as the model's state_dict()")
    parser.add_argument("--plan", type=Path, default=None, metavar="PLAN_JSON",
                        help="the plan the checkpoint was trained with (only for checkpoints whose manifest does "
                             "not record the model file)")
    parser.add_argument("--max-shard-size", type=shard_size, default=None, metavar="SIZE",
                        help="largest safetensors file before the weights are split with an index "
                             "(default 50GB, transformers' save_pretrained default)")


def main(args: argparse.Namespace) -> int:
    from autopar.runtime.export import DEFAULT_MAX_SHARD_BYTES, export

    if args.plan is not None and not args.plan.is_file():
        raise UserError(f"--plan {args.plan}: no such file.")
    done = export(args.checkpoint, args.output, plan_path=args.plan,
                  max_shard_bytes=args.max_shard_size or DEFAULT_MAX_SHARD_BYTES)
    kind = "a from_pretrained folder" if done.transformers else "safetensors keyed as the model's state_dict()"
    print(f"autopar export: step {done.step}: {done.tensors} tensors, {done.total_bytes} bytes -> {done.out} "
          f"({kind}: {', '.join(done.files)})")
    return 0
