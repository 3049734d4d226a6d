"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): saved with a manifest, verified
before they are read, the newest ``keep`` kept.

Layout under ``--checkpoint-dir``::

    lock.json             the run using the folder (``checkpoint_lock``), while it runs
    step_00000012.partial/  a save in progress: renamed to step_00000012 once complete
    step_00000010/        one checkpoint
        .metadata         DCP's index of the shards (a pickle, see "trust" below)
        __<rank>_<n>.distcp  DCP's tensor shards, written by each rank
        zero1_rank<R>.pt  ZeRO-1 only, in checkpoints of older autopar versions: a rank's optimizer partition
        powersgd_rank<R>.pt  --grad-compression powersgd:R only: a rank's PowerSGD hook state
                          (runtime/powersgd_state.py), restored under the same layout
        manifest.json     autopar's record of the checkpoint, written last (with the model file and its
                          arguments, which ``autopar export`` builds the model from: runtime/export.py)
    latest.json           {"step": 10, "path": "step_00000010", "losses": [...]} for people and tools

``manifest.json`` says what the checkpoint holds -- the step, the model's graph fingerprint
(the one the plan was made for), the layout it was saved under (world size, mesh, ZeRO
stage), the global losses of the steps so far -- and the size and SHA-256 of every other file
in the folder.  It is written by rank 0 after every rank has written and hashed its own files,
and the folder is renamed from ``step_N.partial`` to ``step_N`` after it, so a ``step_N``
folder is complete; a write that fails on any rank (a full disk) removes the partial folder and
stops the run with one ``CheckpointError`` on every rank, the newest checkpoint being still the
last complete one.  (A ``step_N`` without a manifest -- an older autopar's interrupted save --
is skipped.)

Resume (``resume``) takes the newest ``step_*`` folder that has a manifest and, before DCP
reads anything, checks: the folder holds only files autopar writes; the manifest's model
fingerprint is the plan's; a ZeRO-1 checkpoint is loaded under its own layout; every file
listed is there with its size and checksum (the files are hashed by the ranks in turn, one
share each, and the verdict is gathered so every rank refuses alike).  Any failure is a
``CheckpointError`` (exit code 2) naming the file and what to do.

Trust: DCP's ``.metadata`` is a Python pickle, and unpickling runs code.  Its checksum is
checked against the JSON manifest before DCP opens it, which catches damage and a folder from
another tool, but whoever can write the checkpoint folder can also write a matching manifest:
only resume checkpoints that you, or jobs you trust, wrote.

Retention: after each save rank 0 deletes the oldest complete checkpoints beyond the newest
``keep`` (and interrupted saves older than the new one), so a run keeps ``keep`` checkpoints
to fall back on.

The model and optimizer state dicts come from ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict``) and are saved under canonical keys
(``state_names``): the un-pipelined model's fully-qualified names, one key per tied parameter
(its first name), a tied copy held by several pipeline stages written by the first of them.
Sharded tensors are DTensors, so a checkpoint written under one layout -- pipeline, ZeRO-3,
TP, DDP, any number of ranks -- loads under any other (a fused projection split per part over
tp is written and read as its full tensor: runtime/fused_tp.py); on load each part asks for its
entries' canonical keys (a stage holding the tied LM head reads the embedding's entry), and
what DCP cannot give a layout is a ``CheckpointError``, not DCP's traceback.  Pipeline ranks
each hold their stages' keys, and ZeRO-1's ranks (``ZeroRedundancyOptimizer``) the keys of
the parameters their partition updates; DCP merges them into one checkpoint.  (An older
autopar saved ZeRO-1's partitions beside the DCP files as ``zero1_rank<R>.pt``: such a
checkpoint still resumes, under its own layout only.)

The batches are functions of the step (synthetic batches are seeded by step; a token file's
samples follow from the step, runtime/token_data.py), so a resumed run continues exactly where
the checkpoint was taken.  The manifest records the data position (``"data"``: the step, the
token file's path, size and dtype, the shuffle seed) and the validation losses so far
(``"val_losses"``); the trainer refuses to resume a checkpoint whose data record differs from
the run's (runtime/train.py).
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.core.errors import UserError
from autopar.core.plan import write_text_atomic
from autopar.runtime.checkpoint_lock import LOCK
from autopar.runtime.fused_tp import checkpoint_value
from autopar.runtime.state_names import MODEL, OPTIM, StateNames, canonical_states

LATEST = "latest.json"
ELASTIC_DIR = "elastic"     # an elastic run's plans and switches (autopar run --elastic, elastic/switches.py)
MANIFEST = "manifest.json"
FORMAT = "autopar-checkpoint"
VERSION = 1
DEFAULT_KEEP = 3
_STEP_DIR = re.compile(r"step_(\d{8,})$")
_PARTIAL_SUFFIX = ".partial"
_PARTIAL_DIR = re.compile(r"step_(\d{8,})\.partial$")
# what a checkpoint folder may hold besides the manifest: DCP's index and shards, ZeRO-1 partitions
_CHECKPOINT_FILE = re.compile(r"(\.metadata|__\d+_\d+\.distcp|zero1_rank\d+\.pt|powersgd_rank\d+\.pt)$")
# write_text_atomic's temporary files (".latest.json.XXXX") left by a crash mid-write
_TEMP_FILE = re.compile(r"\.(latest|manifest)\.json\..+$")
_HASH_CHUNK = 1 << 20
# the manifest keys ``save_checkpoint``'s ``records`` may write (read back by ``resume``)
RECORD_KEYS = ("data", "val_losses", "lr_schedule", "powersgd")   # "lr_schedule": runtime/lr_schedule.py;
# "powersgd": the powersgd:R whose hook state the checkpoint's powersgd_rank<R>.pt files hold
# flat optimizer keys ("state.blocks.0.attn.qkv.weight.exp_avg") so several stage modules' and
# optimizers' states merge into one checkpoint without clashing
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(UserError):
    """A checkpoint folder that cannot be resumed: damaged, foreign, or for another model."""


@dataclass(frozen=True)
class CheckpointIdentity:
    """What a checkpoint must match to be resumed by a run: the model, and the layout it was
    saved under (which matters only for ZeRO-1's per-rank optimizer files)."""
    fingerprint: str
    world_size: int
    mesh: dict
    zero: int
    #: the model's other fingerprints (core/graph.OpGraph.fingerprints: the one written before
    #: parameter-free views were left out), which a checkpoint of the same model may carry
    also: tuple[str, ...] = ()
    #: the model file (absolute path) and its arguments, recorded for ``autopar export``
    model: dict | None = None

    @classmethod
    def of_plan(cls, plan, graph=None, model_file=None) -> "CheckpointIdentity":
        """``graph``: the plan's model as the runtime captured it; a checkpoint holding any of its
        fingerprints is this model's.  ``model_file``: the plan's model file as resolved."""
        m = plan.mesh
        also = tuple(f for f in graph.fingerprints if f != plan.model.fingerprint) if graph is not None else ()
        model = ({"file": str(Path(model_file).resolve()), "args": dict(plan.model.args), "name": plan.model.name}
                 if model_file is not None else None)
        return cls(fingerprint=plan.model.fingerprint, world_size=plan.world_size,
                   mesh={"dp": m.dp, "pp": m.pp, "tp": m.tp}, zero=plan.zero, also=also, model=model)


@dataclass(frozen=True)
class Resumed:
    step: int
    path: Path
    losses: list[float]
    #: the manifest's further records (``save_checkpoint``'s ``records``: "data", "val_losses")
    records: dict | None = None
    #: the layout it was saved under: {"world_size", "mesh", "zero"} (CheckpointIdentity's)
    layout: dict | None = None


def _is_zero1(opt: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(opt, ZeroRedundancyOptimizer)


def _local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters: ZeRO-1's partition (an AdamW over the
    parameters this rank updates), else the optimizer itself."""
    return opt.optim if _is_zero1(opt) else opt


def _state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], names: StateNames | None,
           *, for_save: bool, legacy_zero1: bool = False) -> tuple[dict, list[tuple[dict, dict, dict, dict]]]:
    """This rank's model and optimizer state under the checkpoint's canonical keys
    (``state_names``), and per part (its model state, model key map, optimizer state,
    optimizer key map) for ``load_checkpoint``.  ZeRO-1's partitions hold disjoint keys, so
    DCP joins them into the whole optimizer state like any other layout's.  ``legacy_zero1``:
    loading a checkpoint that holds ZeRO-1's partitions as ``zero1_rank<R>.pt`` files (an
    older autopar's) -- its DCP files hold no ZeRO-1 optimizer state."""
    names = names or StateNames(stages=tuple(range(len(parts))))
    model_states = [get_model_state_dict(part) for part in parts]
    optim_states = [{} if legacy_zero1 and _is_zero1(opt) else
                    get_optimizer_state_dict(part, _local_optimizer(opt), options=_FLAT)
                    for part, opt in zip(parts, optimizers)]
    model_sd, model_keys = canonical_states(names, MODEL, model_states, for_save=for_save)
    optim_sd, optim_keys = canonical_states(names, OPTIM, optim_states, for_save=for_save)
    # a fused projection split per part over tp is written and read whole (runtime/fused_tp.py)
    model_sd = {k: checkpoint_value(v, for_save=for_save) for k, v in model_sd.items()}
    optim_sd = {k: checkpoint_value(v, for_save=for_save) for k, v in optim_sd.items()}
    return {"model": model_sd, "optim": optim_sd}, list(zip(model_states, model_keys, optim_states, optim_keys))


def file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def _own_files(path: Path, rank: int) -> list[Path]:
    """The files this rank wrote into a checkpoint folder (DCP names shards ``__<rank>_<n>``;
    its coordinator, rank 0, writes ``.metadata``)."""
    own = (sorted(path.glob(f"__{rank}_*.distcp")) + sorted(path.glob(f"zero1_rank{rank}.pt"))
           + sorted(path.glob(powersgd_file(rank))))
    if rank == 0 and (path / ".metadata").is_file():
        own.append(path / ".metadata")
    return own


def powersgd_file(rank: int) -> str:
    """The name of rank ``rank``'s PowerSGD hook state in a checkpoint folder."""
    return f"powersgd_rank{rank}.pt"


def partial_dir(directory: Path, step: int) -> Path:
    """Where step ``step`` is written before it is renamed to ``step_dir`` (one name all ranks agree on)."""
    return Path(directory) / f"{step_dir(directory, step).name}{_PARTIAL_SUFFIX}"


def save_checkpoint(directory: Path, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                    identity: CheckpointIdentity, losses: list[float], keep: int = DEFAULT_KEEP,
                    names: StateNames | None = None, records: dict | None = None,
                    powersgd: dict | None = None) -> Path:
    """Save step ``step``, its manifest and latest.json, then drop checkpoints beyond ``keep``.
    ``records``: further JSON values written under their own keys into both (the data position:
    ``"data"``, ``"val_losses"``; runtime/train.py), read back as ``Resumed.records``.
    ``powersgd``: this rank's PowerSGD hook state (runtime/powersgd_state.py ``state_dict``),
    written as ``powersgd_rank<R>.pt`` beside DCP's files, hashed into the manifest like them.

    Every file is written into ``step_N.partial``; rank 0 writes the manifest there last and
    renames the folder to ``step_N`` (one atomic rename), so a ``step_N`` folder is always
    complete.  A write that fails on any rank (a full disk) removes the partial folder and
    raises the same ``CheckpointError`` on every rank: the newest checkpoint is still the
    last complete one."""
    directory = Path(directory)
    path, partial = step_dir(directory, step), partial_dir(directory, step)
    rank = dist.get_rank()
    if rank == 0:                                # an interrupted save of this step: start clean
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    try:
        dcp.save(_state(parts, optimizers, names, for_save=True)[0], checkpoint_id=str(partial))
    except CheckpointException as e:             # raised on every rank (DCP gathers the failures)
        _abandon(directory, step, partial, _first_failure(e))
    error, digests = None, {}
    if powersgd is not None:
        try:
            torch.save(powersgd, partial / powersgd_file(rank))
        except (OSError, RuntimeError) as e:     # (torch's writer raises RuntimeError on a full disk)
            error = f"rank {rank}: {_os_reason(e)}"
    try:
        dist.barrier()                           # every file is written (.metadata included)
        digests = {p.name: file_digest(p) for p in _own_files(partial, rank)}
    except OSError as e:
        error = error or f"rank {rank}: {_os_reason(e)}"
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (error, digests))
    errors = [e for e, _ in gathered if e]
    if errors:
        _abandon(directory, step, partial, errors[0])
    verdict: list = [None]
    if rank == 0:
        files = {name: d for _, mine in gathered for name, d in mine.items()}
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "model_fingerprint": identity.fingerprint,
                    "world_size": identity.world_size, "mesh": identity.mesh, "zero": identity.zero,
                    "losses": list(losses), **(records or {}), "files": dict(sorted(files.items()))}
        if identity.model is not None:
            manifest["model"] = identity.model
        try:
            write_text_atomic(partial / MANIFEST, json.dumps(manifest, indent=1) + "\n")
            if path.exists():                    # a folder of this step without a manifest (an older autopar's)
                shutil.rmtree(path)
            partial.rename(path)
        except OSError as e:
            verdict = [f"rank 0: {_os_reason(e)}"]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        _abandon(directory, step, partial, verdict[0])
    if rank == 0:
        try:
            write_text_atomic(directory / LATEST,
                              json.dumps({"step": step, "path": path.name, "losses": list(losses),
                                          **(records or {})}) + "\n")
            prune(directory, keep)
        except OSError as e:
            verdict = [f"rank 0: {_os_reason(e)}"]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise CheckpointError(
            f"checkpoint {path} was saved (its manifest is written), but then {LATEST} could not be updated or older "
            f"checkpoints pruned ({verdict[0]}). A rerun resumes from it; free space in {directory} first.")
    return path


def _os_reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{f': {e.filename}' if e.filename else ''}"
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _abandon(directory: Path, step: int, partial: Path, reason: str) -> None:
    """A save that failed: rank 0 removes its partial folder; every rank raises alike."""
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    found = latest_checkpoint(directory)
    kept = (f"The newest complete checkpoint, {found[1]}, is kept; a rerun resumes from it"
            if found else "No earlier checkpoint exists; a rerun starts afresh")
    raise CheckpointError(
        f"saving the checkpoint of step {step} into {directory} failed ({reason}); nothing of it was kept and "
        f"training stopped there. {kept}. Free space in {directory} (or give a --checkpoint-dir on a disk with "
        f"room) and rerun.")


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep``, folders without a manifest older
    than the newest complete one, and ``step_N.partial`` folders of saves that died before
    their rename; returns what was deleted."""
    complete, partial = _step_dirs(directory)
    gone = [p for _, p in complete[:-keep]] if keep > 0 else []
    if complete:
        newest = complete[-1][0]
        gone += [p for s, p in partial if s < newest]
    # saves that died before their rename (the folder is locked by this run: none is in progress)
    gone += sorted(p for p in Path(directory).iterdir() if _PARTIAL_DIR.match(p.name) and p.is_dir())
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _step_dirs(directory: Path) -> tuple[list[tuple[int, Path]], list[tuple[int, Path]]]:
    """(complete, interrupted) step folders, each sorted by step."""
    complete, partial = [], []
    for p in Path(directory).iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            (complete if (p / MANIFEST).is_file() else partial).append((int(m.group(1)), p))
    return sorted(complete), sorted(partial)


def check_directory(directory: Path) -> None:
    """Refuse a ``--checkpoint-dir`` that holds anything autopar does not write there (another
    tool's checkpoint, a DCP folder given directly, unrelated files); a missing or empty folder
    is a fresh start."""
    directory = Path(directory)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise CheckpointError(f"--checkpoint-dir {directory} is a file, not a folder. Give a new folder "
                              f"(it is created) or one an earlier 'autopar run' wrote.")
    foreign = sorted(p.name for p in directory.iterdir()
                     if not (p.name in (LATEST, LOCK) or _TEMP_FILE.match(p.name) or
                             (p.name == ELASTIC_DIR and p.is_dir()) or
                             ((_STEP_DIR.match(p.name) or _PARTIAL_DIR.match(p.name)) and p.is_dir())))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise CheckpointError(
            f"--checkpoint-dir {directory} holds files that autopar does not write there ({shown}): it is not "
            f"an autopar checkpoint folder. Give a new or empty folder, or one an earlier 'autopar run' wrote "
            f"(autopar never resumes another tool's checkpoint: DCP's .metadata is a pickle).")


def latest_checkpoint(directory: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    complete, _ = _step_dirs(directory)
    return complete[-1] if complete else None


def read_manifest(path: Path) -> dict:
    f = path / MANIFEST
    try:
        m = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} cannot be read ({e}). {_what_to_do(path)}") from None
    ok = (isinstance(m, dict) and m.get("format") == FORMAT and isinstance(m.get("step"), int)
          and isinstance(m.get("files"), dict) and isinstance(m.get("model_fingerprint"), str)
          and isinstance(m.get("losses"), list)
          and all(isinstance(d, dict) and isinstance(d.get("sha256"), str) and isinstance(d.get("bytes"), int)
                  for d in m["files"].values()))
    if not ok:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not an autopar checkpoint manifest. "
                              f"{_what_to_do(path)}")
    if m.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path} has manifest version {m.get('version')}; this autopar reads "
                              f"version {VERSION}. Resume it with the autopar that wrote it, or start afresh "
                              f"with a new --checkpoint-dir.")
    return m


def check_manifest(path: Path, manifest: dict, identity: CheckpointIdentity) -> None:
    """The checks that need no file read beyond the manifest."""
    step = int(_STEP_DIR.match(path.name).group(1))
    if manifest["step"] != step:
        raise CheckpointError(f"checkpoint {path}: its manifest says step {manifest['step']} but the folder is "
                              f"step {step}. {_what_to_do(path)}")
    if manifest["model_fingerprint"] not in (identity.fingerprint, *identity.also):
        raise CheckpointError(
            f"checkpoint {path} holds a model whose graph fingerprint is {manifest['model_fingerprint']}, but "
            f"this plan is for {identity.fingerprint}: it is another model's checkpoint (or the model changed). "
            f"Give this run a new --checkpoint-dir.")
    if ".metadata" not in manifest["files"]:
        raise CheckpointError(f"checkpoint {path}: its manifest lists no .metadata. {_what_to_do(path)}")
    names = set(manifest["files"])
    bad = sorted(n for n in names if not _CHECKPOINT_FILE.match(n) or "/" in n)
    if bad:
        raise CheckpointError(f"checkpoint {path}: its manifest lists files autopar does not write ({bad[0]}). "
                              f"{_what_to_do(path)}")
    zero1 = any(n.startswith("zero1_rank") for n in names)
    saved = (manifest.get("world_size"), manifest.get("mesh"), manifest.get("zero"))
    if zero1 and saved != (identity.world_size, identity.mesh, identity.zero):
        raise CheckpointError(
            f"checkpoint {path} was saved under ZeRO-1 with world size {saved[0]}, mesh {saved[1]}; its optimizer "
            f"partitions load only under that layout, and this plan has world size {identity.world_size}, mesh "
            f"{identity.mesh}, zero {identity.zero}. Resume it with the plan that wrote it, or start afresh with a "
            f"new --checkpoint-dir.")


def verify_files(path: Path, manifest: dict) -> None:
    """Sizes and SHA-256 of every listed file; the ranks hash one share each and all see the verdict
    (``autopar export``, one process, checks them all with ``file_problems``)."""
    names = sorted(manifest["files"])
    rank, world = dist.get_rank(), dist.get_world_size()
    found: list = [None] * world
    dist.all_gather_object(found, file_problems(path, manifest, names[rank::world]))
    raise_file_problems(path, sorted(p for share in found for p in share))


def file_problems(path: Path, manifest: dict, names: list[str]) -> list[tuple[str, str]]:
    """(file, what is wrong) for each of ``names`` whose size or SHA-256 is not the manifest's."""
    problems = []
    for name in names:
        f, want = path / name, manifest["files"][name]
        if not f.is_file():
            problems.append((name, "is missing"))
        elif f.stat().st_size != want["bytes"]:
            problems.append((name, f"has {f.stat().st_size} bytes where the manifest says {want['bytes']}"))
        elif file_digest(f)["sha256"] != want["sha256"]:
            problems.append((name, "does not match its SHA-256 checksum in the manifest (damaged or changed "
                                   "since it was saved)"))
    return problems


def raise_file_problems(path: Path, problems: list[tuple[str, str]]) -> None:
    if problems:
        name, what = problems[0]
        more = f" ({len(problems) - 1} more file(s) too)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {path}: file {name} {what}{more}; it was not loaded. "
                              f"{_what_to_do(path)}")


def _what_to_do(path: Path) -> str:
    complete, _ = _step_dirs(path.parent)
    older = [p for s, p in complete if p != path and s < int(_STEP_DIR.match(path.name).group(1))]
    if older:
        return (f"Delete {path} to resume from {older[-1].name} (the newest other checkpoint), or start afresh "
                f"with a new --checkpoint-dir.")
    return f"No other checkpoint is left: delete {path} (or give a new --checkpoint-dir) to start afresh."


def resume(directory: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
           identity: CheckpointIdentity, steps: int, names: StateNames | None = None,
           check_records=None) -> Resumed | None:
    """Load the newest checkpoint under ``directory`` after checking it (None: nothing to resume).
    Every rank calls it.  ``check_records(path, step, records)``: called before anything is read
    beyond the manifest, with its ``RECORD_KEYS`` entries, to refuse a checkpoint the run cannot
    continue (runtime/train.py: other data)."""
    check_directory(directory)
    found = latest_checkpoint(directory)
    if found is None:
        if (Path(directory) / LATEST).exists():
            # latest.json is written only after a manifest: its checkpoints were removed, or
            # written by an autopar without manifests
            raise CheckpointError(
                f"--checkpoint-dir {directory} has a {LATEST} but no checkpoint with a {MANIFEST} (its step folders "
                f"were deleted, or an older autopar wrote them without checksums); it cannot be verified, so it is "
                f"not resumed. Give a new --checkpoint-dir, or delete {directory} to start afresh there.")
        return None
    step, path = found
    if step >= steps:
        raise CheckpointError(
            f"--checkpoint-dir {directory} holds a checkpoint of step {step}, and --steps is {steps}: no step is "
            f"left to run. Pass --steps greater than {step} to train on from it, or a new --checkpoint-dir to "
            f"start afresh.")
    manifest = read_manifest(path)
    check_manifest(path, manifest, identity)
    records = {k: v for k, v in manifest.items() if k in RECORD_KEYS}
    if check_records is not None:
        check_records(path, step, records)
    verify_files(path, manifest)                 # before DCP unpickles .metadata
    load_checkpoint(path, parts, optimizers, names)
    return Resumed(step=step, path=path, losses=[float(x) for x in manifest["losses"]],
                   records=records, layout={k: manifest.get(k) for k in ("world_size", "mesh", "zero")})


def load_checkpoint(path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                    names: StateNames | None = None) -> None:
    legacy_zero1 = any(path.glob("zero1_rank*.pt"))
    state, per_part = _state(parts, optimizers, names, for_save=False, legacy_zero1=legacy_zero1)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded under this plan's layout: DCP could not read every entry this "
            f"rank holds into it ({_first_failure(e)}). Its files passed their checksums and its model is this "
            f"plan's, so the entries it lacks were not written by the layout that saved it. Resume it with the "
            f"plan that wrote it, or start afresh with a new --checkpoint-dir.") from None
    for part, opt, (model_own, model_keys, optim_own, optim_keys) in zip(parts, optimizers, per_part):
        model_sd = {k: _as_laid_out(state["model"][c], model_own[k]) for k, c in model_keys.items()}
        set_model_state_dict(part, model_sd, options=StateDictOptions(strict=False))
        if legacy_zero1 and _is_zero1(opt):
            opt.optim.load_state_dict(torch.load(path / f"zero1_rank{dist.get_rank()}.pt", weights_only=True))
        else:
            optim_sd = {k: _as_laid_out(state["optim"][c], optim_own[k]) for k, c in optim_keys.items()}
            set_optimizer_state_dict(part, _local_optimizer(opt), optim_sd, options=_FLAT)


def _first_failure(e: CheckpointException) -> str:
    """The first rank's exception inside DCP's (DCP keeps each as (exception, stack))."""
    for rank, failure in sorted(e.failures.items()):
        failure = failure[0] if isinstance(failure, tuple) and failure else failure
        return f"rank {rank}: {_os_reason(failure)}"
    return str(e).splitlines()[0][:300]


def _as_laid_out(loaded, own):
    """``loaded`` (a value DCP read) in the layout of ``own`` (this part's entry): itself where
    DCP read it into ``own`` or the layouts agree; else through the full tensor -- only a tied
    parameter held by two stages of one rank under different tensor-parallel layouts.  Every
    rank holding the part runs the same conversions, so the collectives match."""
    if loaded is own or not isinstance(own, torch.Tensor) or not isinstance(loaded, torch.Tensor):
        return loaded
    own_d, loaded_d = isinstance(own, DTensor), isinstance(loaded, DTensor)
    if own_d == loaded_d and (not own_d or (own.device_mesh == loaded.device_mesh
                                            and own.placements == loaded.placements)):
        return loaded
    full = loaded.full_tensor() if loaded_d else loaded
    if own_d:
        return distribute_tensor(full.to(own.device), own.device_mesh, own.placements)
    return full
