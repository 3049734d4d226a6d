"""The weights of a checkpoint as files other tools load: ``autopar export CHECKPOINT_DIR -o OUT``.

Which checkpoint: CHECKPOINT_DIR is a ``--checkpoint-dir`` (its newest complete checkpoint is
exported) or one of its ``step_N`` folders.  It is verified as a resume verifies it
(runtime/checkpointing.py: the manifest, the files autopar writes, every file's size and
SHA-256) before DCP opens its ``.metadata`` pickle.

Which model: the manifest records the model file and its arguments (``model``, written by
every save since export exists).  A checkpoint saved before holds no such record: it is
refused unless ``--plan PLAN`` names the plan it was trained with (its model file and
arguments; its fingerprint must be the checkpoint's).  The model is built on the meta device
only, for its ``state_dict()`` names, its ties and, for transformers, its config.

What OUT holds:

* a transformers model (``build_model`` returns a ``PreTrainedModel``): a folder
  ``from_pretrained`` loads -- ``config.json`` (``model.config.save_pretrained``), the
  ``generation_config.json`` when the model has one, and the weights as safetensors,
  ``model.safetensors`` or, above ``max_shard_size``, ``model-0000i-of-0000n.safetensors``
  with ``model.safetensors.index.json`` (transformers' names and index: {"metadata":
  {"total_size"}, "weight_map"}).  A tied parameter is written once, under its first name
  (``ties.find_ties``), as ``save_pretrained`` leaves the tied copies out (GPT-2's
  ``lm_head.weight``); ``from_pretrained`` ties it again.
* any other model: ``model.safetensors`` keyed as the model's own ``state_dict()`` -- a tied
  parameter under each of its names, each key with its own copy of the values (safetensors
  stores no shared tensors), so ``load_state_dict`` takes it as it is (sharded likewise when
  larger than ``max_shard_size``).

Values are written in the checkpoint's dtype (the fp32 master weights).  The default shard size
is transformers 5's ``save_pretrained`` default, 50 GB (``max_shard_size="50GB"``).

Tensor by tensor: DCP's ``.metadata`` lists every key with its size and dtype; each tensor is
read alone (``dcp.load`` of one key, ``no_dist=True``: no process group) -- whatever layout
wrote it, DCP assembles the full tensor from the shards -- and appended to the open
safetensors file, whose header is written first from the sizes (the format: an 8-byte
little-endian header length, the JSON header, then the raw little-endian bytes; huggingface/
safetensors, "Format").  Peak memory: one tensor.

OUT must not exist, nor be or lie inside the checkpoint folder or any input; everything is
written into ``OUT.partial-XXXX`` beside it and renamed to OUT at the end, so an export that
fails leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from autopar.core.errors import UserError
from autopar.runtime import checkpointing as ck
from autopar.runtime.ties import find_ties
from autopar.runtime.weights_in import _ST_DTYPES, INDEX, SINGLE

# transformers 5 PreTrainedModel.save_pretrained(max_shard_size="50GB")
DEFAULT_MAX_SHARD_BYTES = 50 * 10**9
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_ALIGN = 8      # safetensors pads its header with spaces to a multiple of 8 bytes (the reference writer does)


class ExportError(UserError):
    """A checkpoint that cannot be exported, or an output that cannot be written."""


@dataclass
class Exported:
    out: Path
    step: int
    files: list[str]
    tensors: int
    total_bytes: int
    transformers: bool


def find_checkpoint(path: Path) -> Path:
    """The step folder to export: ``path`` itself, or the newest complete one under it."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path} is not a folder: give the --checkpoint-dir of an 'autopar run', or one of its "
                          f"step_N folders.")
    if ck._STEP_DIR.match(path.name) and (path / ck.MANIFEST).is_file():
        return path
    ck.check_directory(path)
    found = ck.latest_checkpoint(path)
    if found is None:
        raise ExportError(f"{path} holds no complete autopar checkpoint (no step_N folder with a {ck.MANIFEST}). "
                          f"Give the --checkpoint-dir of an 'autopar run' that saved one (--checkpoint-dir saves at "
                          f"the end of the run), or one of its step_N folders.")
    return found[1]


def model_record(path: Path, plan_path: Path | None) -> tuple[dict, dict]:
    """(the manifest, the model record {"file", "args"}): the manifest's, or the plan's."""
    manifest = ck.read_manifest(path)
    model, fingerprint = manifest.get("model"), manifest["model_fingerprint"]
    if plan_path is not None:
        from autopar.core.plan import load_plan

        plan = load_plan(plan_path)
        if plan.model.fingerprint != fingerprint:
            raise ExportError(f"--plan {plan_path} is for the model with fingerprint {plan.model.fingerprint}, but "
                              f"checkpoint {path} holds {fingerprint}: another model's plan. Give the plan the run "
                              f"was started with, or leave --plan out.")
        model_file = Path(plan.model.file)
        if not model_file.is_absolute():
            model_file = (Path(plan_path).parent / model_file)
        model = {"file": str(model_file), "args": dict(plan.model.args)}
    elif not isinstance(model, dict) or not isinstance(model.get("file"), str):
        raise ExportError(f"checkpoint {path} was saved by an autopar that did not record its model file in "
                          f"{ck.MANIFEST}. Give the plan it was trained with: autopar export {path} --plan PLAN -o OUT.")
    return manifest, model


def verify(path: Path, manifest: dict) -> None:
    """The checks resume makes (runtime/checkpointing.py), in one process."""
    fingerprint = manifest["model_fingerprint"]
    identity = ck.CheckpointIdentity(fingerprint=fingerprint, world_size=manifest.get("world_size"),
                                     mesh=manifest.get("mesh"), zero=manifest.get("zero"))
    ck.check_manifest(path, manifest, identity)
    ck.raise_file_problems(path, ck.file_problems(path, manifest, sorted(manifest["files"])))


def check_output(out: Path, checkpoint: Path, inputs: list[Path]) -> None:
    from autopar.core.output_file import check_not_input

    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ExportError(f"-o {out} exists; autopar export never overwrites. Remove it or give a new path.")
    resolved = out.resolve()
    for p in [checkpoint, checkpoint.parent, *inputs]:
        p = Path(p).resolve()
        if resolved == p or p in resolved.parents:
            raise ExportError(f"-o {out} is inside {p}, an input of this export (the checkpoint folder or the "
                              f"model's files). Give a path outside it.")
    if not resolved.parent.is_dir():
        raise ExportError(f"-o {out}: its folder {out.parent} does not exist. Create it first.")
    check_not_input(out, "-o")


def export(checkpoint_dir: Path, out: Path, *, plan_path: Path | None = None,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Exported:
    from torch.distributed.checkpoint import FileSystemReader

    from autopar.core.modelfile import load_model_file
    from autopar.runtime.materialize import build_meta_model

    path = find_checkpoint(Path(checkpoint_dir))
    manifest, model = model_record(path, plan_path)
    check_output(out, path, [Path(model["file"])] + ([Path(plan_path)] if plan_path else []))
    verify(path, manifest)                      # before DCP unpickles .metadata
    meta = build_meta_model(load_model_file(Path(model["file"])), dict(model.get("args") or {}))
    hf = _is_transformers(meta)
    keys = _output_keys(meta, hf)
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    entries = []
    for key, ck_key in keys:
        md = metadata.get(f"{ck.MODEL}.{ck_key}") if ck_key is not None else None
        if md is None or not hasattr(md, "size"):
            raise ExportError(f"checkpoint {path} has no tensor for the model's {key} (looked up as "
                              f"{ck.MODEL}.{ck_key}); it was written for another version of the model file "
                              f"{model['file']}. Export it with the model file it was trained with (--plan).")
        entries.append((key, f"{ck.MODEL}.{ck_key}", tuple(md.size), md.properties.dtype))
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.resolve().parent))
    try:
        files = _write_shards(path, tmp, entries, max_shard_bytes)
        if hf:
            meta.config.save_pretrained(tmp)
            generation = getattr(meta, "generation_config", None)
            if generation is not None and getattr(meta, "can_generate", lambda: False)():
                generation.save_pretrained(tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(_nbytes(size, dtype) for _, _, size, dtype in entries)
    return Exported(out=out, step=manifest["step"], files=files, tensors=len(entries), total_bytes=total,
                    transformers=hf)


def _is_transformers(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _output_keys(meta: nn.Module, hf: bool) -> list[tuple[str, str]]:
    """(output key, checkpoint key) of every entry written: the model's state_dict() keys, each
    read under its tie group's canonical name (runtime/state_names.py); for transformers the
    tied copies are left out."""
    ties = find_ties(meta)
    canonical = {n: g[0] for g in ties for n in g}
    out = []
    for key in meta.state_dict(keep_vars=True):
        if hf and canonical.get(key, key) != key:
            continue
        out.append((key, canonical.get(key, key)))
    return out


def _nbytes(size, dtype: torch.dtype) -> int:
    n = 1
    for s in size:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _write_shards(path: Path, folder: Path, entries: list, max_shard_bytes: int) -> list[str]:
    shards: list[list] = [[]]
    filled = 0
    for e in entries:                       # greedy, in state_dict order (huggingface_hub's split)
        n = _nbytes(e[2], e[3])
        if shards[-1] and filled + n > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(e)
        filled += n
    if len(shards) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_safetensors(path, folder / name, shard)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(e[2], e[3]) for e in entries)},
                 "weight_map": {e[0]: name for name, shard in zip(names, shards) for e in shard}}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names + ([INDEX] if len(shards) > 1 else [])


def _write_safetensors(checkpoint: Path, file: Path, entries: list) -> None:
    """A safetensors file of ``entries`` (key, checkpoint key, size, dtype), each tensor read from
    the checkpoint and written in turn."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, _, size, dtype in entries:
        if dtype not in _ST_NAMES:
            raise ExportError(f"checkpoint {checkpoint}: {key} has dtype {dtype}, which safetensors cannot hold.")
        n = _nbytes(size, dtype)
        header[key] = {"dtype": _ST_NAMES[dtype], "shape": list(size), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, ck_key, size, dtype in entries:
            value = _read_tensor(checkpoint, ck_key, size, dtype)
            f.write(value.contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b"")


def _read_tensor(checkpoint: Path, key: str, size, dtype: torch.dtype) -> torch.Tensor:
    """One full tensor of a DCP checkpoint, without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    model_key = key[len(ck.MODEL) + 1:]
    buf = torch.empty(size, dtype=dtype)
    with warnings.catch_warnings():           # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({ck.MODEL: {model_key: buf}}, storage_reader=FileSystemReader(str(checkpoint)), no_dist=True)
    return buf
