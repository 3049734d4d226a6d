"""measured.json: what a run of a plan measured, defined once.

The runtime writes it at the end of a run (``autopar.runtime.measure``); the report, the
calibration and the accuracy benchmark read it (``autopar.report``).  Both sides go through
``Measured``: its fields are the file's keys, ``to_json`` writes them and ``from_json`` reads
and checks them, so a key is spelt in this module only.

The file is one JSON object:

* ``version``: ``MEASURED_VERSION``.  Files written before the schema carried a version have
  no ``version`` key and hold the same keys: they read as version 1.
* ``step_time_s`` (required): the median step time after the warm-up steps, seconds;
  ``step_times_s`` every step's time, ``warmup_steps`` how many lead it, ``first_step`` the
  step the run started at (after a resume, not 0).
* ``samples_per_s``, ``tokens_per_s``: global batch (times the sequence length, when the
  model has one) per ``step_time_s``.
* ``max_memory_bytes``, ``memory_per_rank_bytes``: the peak memory of the worst rank and of
  each rank; ``memory_kind`` says what was counted (``MEMORY_KINDS``).
* ``model_state_bytes_per_rank``: per rank, the bytes of its parameter, gradient and
  optimizer-state shards (``RankModelState``).
* ``fwd_s``, ``bwd_s``, ``comm_s``, ``optimizer_s``, ``profiled_steps``: with ``--profile``,
  the seconds per step of each phase, over ``profiled_steps`` steps (``BREAKDOWN_KEYS``;
  runtime/profile_breakdown.py), and ``trace_file``, rank 0's torch.profiler trace.
* ``losses``, ``fingerprint`` (the model's, as in the plan), ``world_size``, ``device``,
  ``device_kind``, ``global_batch``, ``init``, ``plan`` (the plan file's path),
  ``plan_identity`` (``Plan.identity`` of the plan that ran: a report checks it).
* ``val_losses``: ``[[step, loss], ...]``, the validation loss after each of those steps (a run
  with ``--val-data`` and ``--eval-every``); absent where the run evaluated nothing.
* ``float8``: for a plan with fp8 layers, what the float8 conversion did (runtime/apply_fp8.py):
  ``recipe``, ``fsdp_float8_all_gather`` (true or false), ``converted`` (the linears' module
  names) and ``left_bf16`` (module name -> why it stayed in bf16).

* ``switches``: an elastic run's (``autopar run --elastic``, elastic/) changes of plan, in
  order, one object each: why, the nodes before and after, the old and new plan and layout,
  the predicted step times, the steps lost since the last checkpoint, the predicted and the
  measured switch time (elastic/switches.py writes them); absent for a run that never switched.

Every field but ``step_time_s`` may be absent (a hand-made file, or a figure the run did not
measure); ``to_json`` leaves out what is None.  Keys the schema does not define are kept as
read, in ``extra`` (the accuracy benchmark notes the machine's load beside a run).

``from_json`` refuses a value of the wrong kind with ``MeasuredFileError`` (a ``UserError``:
one paragraph naming the file and the key, exit 2 from the CLI).

The profiler region names below are the vocabulary the runtime labels its phases with and
the report reads back from the trace; they live here so the report does not import the
runtime (and torch) to read a trace.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from autopar.core.errors import UserError

MEASURED_VERSION = 1
#: what ``memory_per_rank_bytes`` counts: CUDA's caching-allocator peak of live tensors, or on
#: a CPU the growth of the process's peak resident set size (runtime/measure.py)
CUDA_ALLOCATED = "cuda_max_memory_allocated"
CPU_RSS_GROWTH = "cpu_peak_rss_growth"
MEMORY_KINDS = (CUDA_ALLOCATED, CPU_RSS_GROWTH)
#: the per-step phase figures of a ``--profile`` run, named as in the plan's ``predicted`` block
BREAKDOWN_KEYS = ("fwd_s", "bwd_s", "comm_s", "optimizer_s")
#: the scalar figures of a run, named as in the plan's ``predicted`` block (what the report
#: compares and calibration fits)
FIGURE_KEYS = ("step_time_s",) + BREAKDOWN_KEYS + ("max_memory_bytes", "samples_per_s", "tokens_per_s")

# Profiler event names by phase: the runtime's own regions (record_function) and the calls
# that communicate (collectives and point-to-point, and the interleaved pipeline's send/recv).
COMM_PATTERN = re.compile(r"^(c10d::|nccl:|gloo:|record_param_comms)|^PP:\d+(SEND|RECV)")
FORWARD_PATTERN = re.compile(r"^autopar\.forward$")
BACKWARD_PATTERN = re.compile(r"^autopar\.backward$")
OPTIMIZER_PATTERN = re.compile(r"^autopar\.optimizer$")
STEP_REGION = "autopar.step"

_REDO = "; it should be the measured.json 'autopar run' wrote: measure the plan again."


class MeasuredFileError(UserError):
    """A measured.json that is missing, is not JSON, or does not follow the schema."""


@dataclass(frozen=True)
class RankModelState:
    """The bytes of model state one rank holds (runtime/model_state.py)."""
    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    optimizer_step_bytes: int


@dataclass(frozen=True)
class Measured:
    """One run's measurements; the fields are measured.json's keys (module docstring)."""
    step_time_s: float
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    max_memory_bytes: float | None = None
    memory_per_rank_bytes: tuple[float, ...] | None = None
    memory_kind: str | None = None
    losses: tuple[float, ...] | None = None
    step_times_s: tuple[float, ...] | None = None
    warmup_steps: int | None = None
    first_step: int | None = None
    fingerprint: str | None = None
    world_size: int | None = None
    device: str | None = None
    device_kind: str | None = None
    global_batch: int | None = None
    init: str | None = None
    plan: str | None = None
    plan_identity: str | None = None
    model_state_bytes_per_rank: tuple[RankModelState, ...] | None = None
    fwd_s: float | None = None
    bwd_s: float | None = None
    comm_s: float | None = None
    optimizer_s: float | None = None
    profiled_steps: int | None = None
    trace_file: str | None = None
    float8: Mapping[str, Any] | None = None
    val_losses: tuple[tuple[int, float], ...] | None = None
    switches: tuple[Mapping[str, Any], ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    version: int = MEASURED_VERSION

    def figures(self) -> dict[str, float]:
        """The scalar figures this run measured (``FIGURE_KEYS`` that are not None): step time,
        the phase breakdown, peak memory, throughput."""
        return {k: getattr(self, k) for k in FIGURE_KEYS if getattr(self, k) is not None}

    @property
    def has_breakdown(self) -> bool:
        return any(getattr(self, k) is not None for k in BREAKDOWN_KEYS)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of measured.json: ``version`` first, None left out, ``extra`` last."""
        out: dict[str, Any] = {"version": self.version}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("version", "extra") or v is None:
                continue
            if f.name == "model_state_bytes_per_rank":
                v = [{g.name: getattr(row, g.name) for g in fields(RankModelState)} for row in v]
            elif f.name == "val_losses":
                v = [[step, loss] for step, loss in v]
            elif f.name == "switches":
                v = [dict(x) for x in v]
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    def to_json_text(self) -> str:
        import json

        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: Any, source: str = "measured.json") -> "Measured":
        """A ``Measured`` from the JSON object of a measured.json; ``MeasuredFileError`` naming
        ``source`` and the key when a value is of the wrong kind."""
        if not isinstance(data, dict):
            raise MeasuredFileError(f"measured file {source} holds a JSON {type(data).__name__}, not an object{_REDO}")
        version = data.get("version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise MeasuredFileError(f"measured file {source}, field version: the value is {version!r}, not a whole "
                                    f"number >= 1{_REDO}")
        if version > MEASURED_VERSION:
            raise MeasuredFileError(f"measured file {source} is version {version}, written by a newer autopar; this "
                                    f"one reads version {MEASURED_VERSION}. Report with the autopar that ran the plan, "
                                    f"or measure the plan again with this one.")
        if "step_time_s" not in data:
            raise MeasuredFileError(f"measured file {source} has no 'step_time_s'; it should be the measured.json a "
                                    f"run wrote.")
        values: dict[str, Any] = {}
        for name, kind in _FIELD_KINDS.items():
            if name in data and data[name] is not None:
                values[name] = _checked(source, name, data[name], kind)
        nested = data.get("breakdown")              # files of runtimes that also nested the breakdown
        if nested is not None:
            if not isinstance(nested, dict):
                raise MeasuredFileError(f"measured file {source}, field breakdown: the value is {nested!r}, not an "
                                        f"object{_REDO}")
            for name in BREAKDOWN_KEYS + ("profiled_steps",):
                if name not in values and nested.get(name) is not None:
                    values[name] = _checked(source, f"breakdown.{name}", nested[name], _FIELD_KINDS[name])
        extra = {k: v for k, v in data.items() if k not in _FIELD_KINDS and k not in ("version", "breakdown")}
        return cls(**values, extra=extra, version=version)


def read_measured(path: str | os.PathLike) -> Measured:
    """measured.json at ``path``, read (bounded, strict JSON) and checked."""
    from autopar.core.jsonfile import read_json_object

    data = read_json_object(path, what="measured file", error=MeasuredFileError,
                            if_missing="; 'autopar run PLAN.json' writes measured.json beside the plan.")
    from autopar.core.output_file import note_input

    note_input(path, "measured file")
    return Measured.from_json(data, source=str(path))


# field -> kind of value: "amount" a number >= 0; "count" a whole number >= 0; "positive" a whole
# number >= 1; "text"; "amounts" a list of numbers >= 0; "numbers" a list of numbers; "step_losses"
# a list of [step (a whole number >= 1), loss (a number)] pairs;
# "model_state" a list of RankModelState objects; "objects" a list of JSON objects
_FIELD_KINDS = {
    "step_time_s": "amount", "samples_per_s": "amount", "tokens_per_s": "amount", "max_memory_bytes": "amount",
    "memory_per_rank_bytes": "amounts", "memory_kind": "text", "losses": "numbers", "step_times_s": "amounts",
    "warmup_steps": "count", "first_step": "count", "fingerprint": "text", "world_size": "positive",
    "device": "text", "device_kind": "text", "global_batch": "positive", "init": "text", "plan": "text",
    "plan_identity": "text",
    "model_state_bytes_per_rank": "model_state", "fwd_s": "amount", "bwd_s": "amount", "comm_s": "amount",
    "optimizer_s": "amount", "profiled_steps": "count", "trace_file": "text", "float8": "float8",
    "val_losses": "step_losses", "switches": "objects",
}
assert set(_FIELD_KINDS) == {f.name for f in fields(Measured)} - {"extra", "version"}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_whole(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _checked(source: str, key: str, v: Any, kind: str) -> Any:
    def fail(want: str) -> MeasuredFileError:
        return MeasuredFileError(f"measured file {source}, field {key}: the value is {v!r}, not {want}{_REDO}")

    if kind == "amount":
        if not (_is_number(v) and v >= 0):
            raise fail("a number >= 0")
        return v
    if kind in ("count", "positive"):
        least = 0 if kind == "count" else 1
        if not _is_whole(v, least):
            raise fail(f"a whole number >= {least}")
        return v
    if kind == "text":
        if not isinstance(v, str):
            raise fail("a text")
        return v
    if kind in ("amounts", "numbers"):
        if not (isinstance(v, list) and all(_is_number(x) and (kind == "numbers" or x >= 0) for x in v)):
            raise fail("a list of numbers >= 0" if kind == "amounts" else "a list of numbers")
        return tuple(v)
    if kind == "step_losses":
        if not (isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and _is_whole(p[0], 1)
                                            and _is_number(p[1]) for p in v)):
            raise fail("a list of [step, loss] pairs (a whole number >= 1 and a number)")
        return tuple((p[0], p[1]) for p in v)
    if kind == "objects":
        if not (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
            raise fail("a list of objects")
        return tuple(dict(x) for x in v)
    if kind == "float8":
        if not (isinstance(v, dict) and isinstance(v.get("recipe"), str)
                and isinstance(v.get("fsdp_float8_all_gather"), bool)
                and isinstance(v.get("converted"), list) and all(isinstance(x, str) for x in v["converted"])
                and isinstance(v.get("left_bf16"), dict)
                and all(isinstance(x, str) for x in v["left_bf16"].values())):
            raise fail("an object with recipe (a text), fsdp_float8_all_gather (true or false), converted (a list "
                       "of texts) and left_bf16 (an object of texts)")
        return dict(v)
    assert kind == "model_state", kind
    names = [g.name for g in fields(RankModelState)]
    if not (isinstance(v, list) and all(isinstance(r, dict) and all(_is_whole(r.get(n), 0) for n in names)
                                        for r in v)):
        raise fail("a list of objects with the whole numbers >= 0 " + ", ".join(names))
    return tuple(RankModelState(**{n: r[n] for n in names}) for r in v)
