"""Initial weights from a file (``--init-from PATH``): each rank reads only the slices it holds.

What PATH may be (``WeightsFile.open``):

* a safetensors file;
* a folder holding ``model.safetensors.index.json`` (shards named by its ``weight_map``, as
  ``save_pretrained`` writes a large model), or ``model.safetensors`` -- a ``save_pretrained``
  folder --, or ``pytorch_model.bin`` (an older ``save_pretrained``);
* a torch state dict (``.pt`` / ``.bin``: a flat dict of tensors), read with
  ``torch.load(weights_only=True, mmap=True)`` so only the pages a rank reads are touched.

Only the headers are read to check the file (``check``): the names, shapes and dtypes of the
model's ``state_dict()`` against the file's.  Which keys must be present:

* every parameter.  A tied parameter (``runtime/ties.py``: one Parameter under several names)
  needs one of its names: ``save_pretrained`` leaves the tied copies out (GPT-2's
  ``lm_head.weight``), a torch state dict lists every name;
* buffers are optional: a buffer the file lacks keeps the model file's own value (rotary
  tables, causal masks: ``materialize.per_module_source``'s buffers, which never build the
  parameters); one it holds must match like a parameter;
* a key the model does not have is refused, except those the model itself declares ignorable
  (transformers' ``_keys_to_ignore_on_load_unexpected`` patterns).  A file written without the
  model's ``base_model_prefix`` (a bare ``GPT2Model`` checkpoint for ``GPT2LMHeadModel``) is
  matched with the prefix added, as ``from_pretrained`` does.

dtypes: a floating-point value is cast to the model's floating-point dtype (a bf16 file into
an fp32 model), as ``from_pretrained`` casts to the model's dtype, with a note; any other
difference (integer vs float, integer widths, bool) is refused.

Reading (``WeightsSource.read_local``): for a DTensor the rank's block is computed from its
placements by torch's own ``compute_local_shape_and_global_offset`` (what DCP writes a
DTensor's shard with: FSDP2's ``Shard(0)`` with its uneven last chunks, TP's ``Shard(d)``,
FSDP2's ``_StridedShard`` over a TP shard of the same dim, expert parallelism's ``Shard(0)`` of
stacked experts) and read as one safetensors slice (``get_slice(name)[...]``) -- or, where the block is one byte
range of the file (a ``Shard(0)``'s rows, a whole tensor) and the rank's tensor a CPU tensor
of the file's dtype, with one ``pread`` straight into it (``WeightsFile.read_into``).  A fused
projection split per part over tp (``runtime/fused_tp.py``: ``_StridedShard`` alone on its dim)
is read as its ``k`` part slices, concatenated.  A plain tensor (DDP, a pipeline stage's
whole parameter, a buffer) is read whole.  Where the local block computed does not match the
rank's local tensor (a placement torch cannot describe as one block) the full tensor is read
and cut (``distribute_tensor``), as the host init does -- no plan of the runtime's reaches
that path today; it is kept as the safe answer.  Experts kept as an ``nn.ModuleList`` hold
only their own experts under their global names, so a rank reads only those.

Peak host memory while loading: the rank's own shards, plus one tensor's slice in flight
where it is read through safetensors' memory map (then also the file pages the slice touches,
which count in the process's resident set: a slice on dim 1 of a row-major tensor touches
every row's page).  ``benchmarks/init_from_memory.py`` measures it.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from autopar.core.errors import UserError
from autopar.runtime.ties import find_ties

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TORCH_BIN = "pytorch_model.bin"
# safetensors' dtype names (the format's spec: huggingface/safetensors, "Format")
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_SHOWN = 3


class WeightsError(UserError):
    """A weights file that does not fit the model, or cannot be read."""


@dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path
    start: int | None = None      # a safetensors tensor's first byte in its file


@dataclass
class WeightsFile:
    """The tensors of a weights file (or folder): their headers, and slices read on demand."""
    path: Path
    entries: dict[str, Entry]
    _torch: dict[Path, dict] = field(default_factory=dict)
    _open: dict[Path, object] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | Path) -> "WeightsFile":
        path = Path(path)
        if not path.exists():
            raise WeightsError(f"--init-from {path}: no such file or folder. Give a safetensors file, a folder "
                               f"written by save_pretrained (or holding {INDEX}), or a torch state dict (.pt/.bin).")
        if path.is_dir():
            if (path / INDEX).is_file():
                return cls(path, _index_entries(path / INDEX))
            for name in (SINGLE, TORCH_BIN):
                if (path / name).is_file():
                    return cls.open_file(path / name, shown_as=path)
            found = sorted(p.name for p in path.iterdir())[:5]
            raise WeightsError(f"--init-from {path}: the folder holds neither {INDEX}, {SINGLE} nor {TORCH_BIN} "
                               f"(it holds {', '.join(found) or 'nothing'}). Give the folder save_pretrained wrote, "
                               f"or one weights file.")
        return cls.open_file(path)

    @classmethod
    def open_file(cls, file: Path, shown_as: Path | None = None) -> "WeightsFile":
        out = cls(shown_as or file, {})
        if _is_safetensors(file):
            out.entries = _safetensors_entries(file)
        else:
            state = _torch_load(file)
            out._torch[file] = state
            out.entries = {k: Entry(tuple(v.shape), v.dtype, file) for k, v in state.items()}
        return out

    def read_into(self, key: str, index: tuple[slice, ...], out: torch.Tensor) -> bool:
        """Read the block ``index`` of ``key`` straight into ``out`` with one ``pread`` where the
        block is one byte range of a safetensors file (the rows of a ``Shard(0)``, a whole
        tensor) and ``out`` a contiguous CPU tensor of the file's dtype: no copy, and no page of
        the file mapped into the process.  False where that does not apply."""
        entry = self.entries[key]
        span = _byte_range(entry.shape, index)
        if (entry.start is None or span is None or out.device.type != "cpu" or out.dtype != entry.dtype
                or not out.is_contiguous()):
            return False
        first, count = span
        if count != out.numel():
            return False
        size = out.element_size()
        buf = out.detach().reshape(-1).view(torch.uint8).numpy() if count else None
        if buf is None:
            return True
        with open(entry.file, "rb") as f:
            got = os.preadv(f.fileno(), [buf], entry.start + first * size)
        if got != count * size:
            raise WeightsError(f"--init-from {self.path}: tensor {key} ends past the end of {entry.file}; the "
                               f"file is truncated. Write or copy it again.")
        return True

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``key`` (or its block ``index``), as stored."""
        entry = self.entries[key]
        if entry.file in self._torch or not _is_safetensors(entry.file):
            if entry.file not in self._torch:
                self._torch[entry.file] = _torch_load(entry.file)
            t = self._torch[entry.file][key]
            return (t[index] if index else t).clone()
        from safetensors import safe_open

        try:
            handle = self._open.get(entry.file)
            if handle is None:
                handle = self._open[entry.file] = safe_open(str(entry.file), framework="pt")
            return handle.get_slice(key)[index] if index else handle.get_tensor(key)
        except Exception as e:                  # noqa: BLE001 -- safetensors' own error type is internal
            raise WeightsError(f"--init-from {self.path}: tensor {key} cannot be read from {entry.file} "
                               f"({type(e).__name__}: {e}). The file is damaged; write it again.") from None


# --------------------------------------------------------------------------- file headers
def _byte_range(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, int] | None:
    """(first element, element count) of the block ``index`` of a row-major tensor of ``shape``
    when the block is one contiguous run: a range on one dim, one index on every dim before it,
    every dim after it whole.  None otherwise."""
    if not shape:
        return 0, 1
    bounds = [(sl.start or 0, shape[d] if sl.stop is None else sl.stop) for d, sl in enumerate(index)]
    bounds += [(0, shape[d]) for d in range(len(index), len(shape))]
    cut = [d for d, (lo, hi) in enumerate(bounds) if (lo, hi) != (0, shape[d])]
    if cut:
        k = cut[-1]
        if any(hi - lo != 1 for lo, hi in bounds[:k]):
            return None
    first, stride = 0, 1
    for d in reversed(range(len(shape))):
        first += bounds[d][0] * stride
        stride *= shape[d]
    count = 1
    for lo, hi in bounds:
        count *= max(hi - lo, 0)
    return first, count



def _is_safetensors(file: Path) -> bool:
    return file.suffix == ".safetensors"


def _safetensors_entries(file: Path) -> dict[str, Entry]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for key in f.keys():
                s = f.get_slice(key)
                dtype = _ST_DTYPES.get(s.get_dtype())
                if dtype is None:
                    raise WeightsError(f"--init-from {file}: tensor {key} has dtype {s.get_dtype()}, which autopar "
                                       f"does not read. Save it as a float or integer dtype.")
                out[key] = Entry(tuple(s.get_shape()), dtype, file)
        # the format (huggingface/safetensors, "Format"): an 8-byte little-endian header length N,
        # N bytes of JSON giving each tensor's [begin, end) byte offsets after the header
        with open(file, "rb") as raw:
            n = struct.unpack("<Q", raw.read(8))[0]
            header = json.loads(raw.read(n))
        return {k: Entry(e.shape, e.dtype, file, 8 + n + int(header[k]["data_offsets"][0])) for k, e in out.items()}
    except WeightsError:
        raise
    except Exception as e:                      # noqa: BLE001 -- SafetensorError is not importable by name
        raise WeightsError(f"--init-from {file} is not a readable safetensors file ({e}); it may be truncated "
                           f"(an interrupted copy or download). Write or copy it again.") from None


def _torch_load(file: Path) -> dict:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:                      # noqa: BLE001 -- torch.load raises many types on a bad file
        raise WeightsError(f"--init-from {file} cannot be read as a torch state dict ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}); it may be truncated or not a weights file. Give a "
                           f"safetensors file or a torch.save'd state dict (a flat dict of tensors).") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise WeightsError(f"--init-from {file} holds a {type(state).__name__} that is not a flat dict of tensors "
                           f"(a training checkpoint with the model under a key?). Save model.state_dict() alone.")
    return state


def _index_entries(index: Path) -> dict[str, Entry]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except Exception as e:                      # noqa: BLE001
        raise WeightsError(f"--init-from {index} is not a safetensors index (a JSON object with a 'weight_map': "
                           f"{type(e).__name__}). Write the folder again with save_pretrained.") from None
    out: dict[str, Entry] = {}
    by_file: dict[str, dict[str, Entry]] = {}
    for key, name in weight_map.items():
        shard = index.parent / str(name)
        if "/" in str(name) or not shard.is_file():
            raise WeightsError(f"--init-from {index.parent}: its index names shard {name} (for {key}), which is "
                               f"not in the folder. Copy the whole folder again.")
        if name not in by_file:
            by_file[name] = _safetensors_entries(shard) if _is_safetensors(shard) else \
                {k: Entry(tuple(v.shape), v.dtype, shard) for k, v in _torch_load(shard).items()}
        if key not in by_file[name]:
            raise WeightsError(f"--init-from {index.parent}: its index puts {key} in {name}, which does not hold "
                               f"it. Write the folder again with save_pretrained.")
        out[key] = by_file[name][key]
    return out


# --------------------------------------------------------------------------- the check
@dataclass
class Match:
    """The file's key of every model entry it provides, and the notes of the check."""
    key_of: dict[str, str]
    notes: list[str]


def check_weights(weights: WeightsFile, meta_model: nn.Module) -> Match:
    """Names, shapes and dtypes of ``meta_model.state_dict()`` against the file's headers (module
    docstring); a ``WeightsError`` naming the first keys that differ, else the key map."""
    expected = meta_model.state_dict(keep_vars=True)
    params = {n for n, _ in meta_model.named_parameters(remove_duplicate=False)}
    tied = {n: g for g in find_ties(meta_model) for n in g}
    prefix = getattr(meta_model, "base_model_prefix", "") or ""
    key_of, missing, shapes, dtypes, cast = {}, [], [], [], set()
    for name, t in expected.items():
        candidates = [name, *[n for n in tied.get(name, ()) if n != name]]
        if prefix:
            candidates += [c[len(prefix) + 1:] for c in candidates if c.startswith(prefix + ".")]
        key = next((c for c in candidates if c in weights.entries), None)
        if key is None:
            if name in params:
                missing.append(name)
            continue
        e = weights.entries[key]
        if e.shape != tuple(t.shape):
            shapes.append(f"{key} {list(e.shape)} (the model's {name} is {list(t.shape)})")
        elif e.dtype != t.dtype:
            if e.dtype.is_floating_point and t.dtype.is_floating_point:
                cast.add((e.dtype, t.dtype))
            else:
                dtypes.append(f"{key} {_dt(e.dtype)} (the model's {name} is {_dt(t.dtype)})")
        key_of[name] = key
    ignore = [re.compile(p) for p in getattr(meta_model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    used = set(key_of.values())
    unexpected = [k for k in weights.entries if k not in used and not any(p.search(k) for p in ignore)]
    problems = []
    if missing:
        problems.append(f"the model's parameter(s) {_first(missing)} are not in it")
    if unexpected:
        problems.append(f"it holds key(s) the model does not have: {_first(unexpected)}")
    if shapes:
        problems.append(f"shapes differ: {_first(shapes)}")
    if dtypes:
        problems.append(f"dtypes differ (only float-to-float is cast): {_first(dtypes)}")
    if missing and unexpected and _is_transformers(meta_model):
        problems.append("transformers 5 writes some architectures (Mixtral's experts, for one) in their original "
                        "checkpoint layout and converts them inside from_pretrained, while autopar reads the model's "
                        "own state_dict() names: load the folder with from_pretrained and write it again with "
                        "save_pretrained(..., save_original_format=False)")
    if problems:
        raise WeightsError(
            f"--init-from {weights.path} does not fit the model ({type(meta_model).__name__}, "
            f"{len(expected)} state_dict entries; the file has {len(weights.entries)} tensors): "
            f"{'; '.join(problems)}. Give the weights of this very model (same names and sizes as its "
            f"state_dict(), e.g. written by its save_pretrained or torch.save(model.state_dict())), or change "
            f"the model file's arguments to the model the weights are of. Nothing was trained.")
    notes = [f"--init-from {weights.path}: {_dt(a)} values cast to the model's {_dt(b)}" for a, b in sorted(cast, key=str)]
    return Match(key_of, notes)


def _is_transformers(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _first(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --------------------------------------------------------------------------- the source
class WeightsSource:
    """A ``materialize.FullSource`` over a weights file: ``read_local`` fills a rank's tensor
    with its own slice; calling it gives a full value (a buffer the file lacks comes from
    ``fallback``, the model file's own)."""

    def __init__(self, weights: WeightsFile, match: Match, fallback):
        self.weights, self.match, self.fallback = weights, match, fallback
        self.notes = list(match.notes)
        self.full_reads: list[str] = []          # entries read whole for a DTensor (no one block)

    def __call__(self, fqn: str) -> torch.Tensor:
        key = self.match.key_of.get(fqn)
        if key is None:
            return self.fallback(fqn)
        return self.weights.read(key)

    @torch.no_grad()
    def read_local(self, fqn: str, tensor: torch.Tensor) -> bool:
        """Fill ``tensor`` (this rank's entry ``fqn``) from the file; False when the file has no
        value for it or its block cannot be read as slices (the caller then cuts the full value)."""
        key = self.match.key_of.get(fqn)
        if key is None:
            return False
        if not isinstance(tensor, DTensor):
            if not self.weights.read_into(key, (), tensor):
                tensor.copy_(self.weights.read(key))
            return True
        local = tensor.to_local()
        block = local_block(tensor)
        if block is not None and len(block[1]) == 1 and self.weights.read_into(key, block[1][0], local):
            return True
        if block is None:
            self.full_reads.append(fqn)
            return False
        dim, pieces = block
        values = [self.weights.read(key, index) for index in pieces]
        value = values[0] if len(values) == 1 else torch.cat(values, dim=dim)
        if tuple(value.shape) != tuple(local.shape):
            self.full_reads.append(fqn)
            return False
        local.copy_(value)
        return True


def local_block(t: DTensor) -> tuple[int, list[tuple[slice, ...]]] | None:
    """The index blocks of the full tensor that ``t``'s local tensor holds, to concatenate along
    the returned dim (one block unless a per-part split), or None where they cannot be said."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from autopar.runtime.fused_tp import _strided_alone

    placements = list(t.placements)
    mesh, shape = t.device_mesh, tuple(t.shape)
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    if strided and _strided_alone(placements):
        # runtime/fused_tp.py: of each of the k parts (n rows on ``dim``), tp rank r holds rows
        # [r*n/tp, (r+1)*n/tp); the other placements cut the other dims as usual
        if len(strided) != 1:
            return None
        i = strided[0]
        dim, k = placements[i].dim, placements[i].split_factor
        size, coord = mesh.size(i), mesh.get_coordinate()
        if coord is None or shape[dim] % (k * size):
            return None
        placements[i] = Replicate()
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        base = [slice(o, o + s) for o, s in zip(offset, local_shape)]
        n = shape[dim] // k
        each = n // size
        pieces = []
        for part in range(k):
            lo = part * n + coord[i] * each
            index = list(base)
            index[dim] = slice(lo, lo + each)
            pieces.append(tuple(index))
        return dim, pieces
    try:
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    except Exception:                           # noqa: BLE001 -- a placement torch cannot place
        return None
    return 0, [tuple(slice(o, o + s) for o, s in zip(offset, local_shape))]


def weights_source(path: str | Path, meta_model: nn.Module, fallback) -> WeightsSource:
    weights = WeightsFile.open(path)
    return WeightsSource(weights, check_weights(weights, meta_model), fallback)
