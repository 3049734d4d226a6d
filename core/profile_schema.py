"""GPU profiles: per device type, peak throughput, memory, links, derates and measured tables.

Profiles are data (one JSON file per device type in the ``autopar.profiles`` package, schema in
docs/profiles.md); this module finds, reads and validates them.  It lives in ``core`` so that
the cluster reader (``core/cluster_file.py``) and the runtime reach it without importing
another package; ``autopar.profiles`` re-exports it.  Files are read through ``importlib.resources`` so
the bundled ones are found from an installed wheel as well as from a checkout.

    available_profiles() -> ["a100-80gb-sxm", "h100-sxm", "h200", "local-cpu"]
    load_profile("h100-sxm") or load_profile("path/to/measured.json") -> dict (validated)
    profile_path("h100-sxm") -> Path of the bundled file

Units are in the key names: ``*_bytes`` bytes, ``*_Bps`` bytes per second, ``*_GBps`` 10^9
bytes per second per direction, ``*_us`` microseconds, ``peak_flops`` floating-point operations
per second (dense, no structured sparsity).
"""
from __future__ import annotations

import difflib
import json
import math
from importlib import resources
from pathlib import Path

from autopar.core.errors import UserError
from autopar.core.jsonfile import parse_json_text, read_text_bounded

_PACKAGE = "autopar.profiles"

DEVICE_KINDS = ("gpu", "cpu")
DTYPES = ("fp32", "tf32", "bf16", "fp16")            # required in peak_flops; others (fp8, fp64) may be added
EFFICIENCY_KINDS = ("linear", "matmul", "attention", "conv", "memory_bound")
LINK_LEVELS = ("intra", "inter")

REQUIRED_KEYS = ("name", "device", "memory_bytes", "memory_bandwidth_Bps", "peak_flops", "efficiency",
                 "collective_efficiency", "sources", "op_table", "collective_table", "measured_by")
# Optional top-level keys and what each must hold.  Link figures are optional so that a profile
# measured by `autopar profile` on a machine without them still loads; every bundled profile has
# them (tests/test_profiles.py), and a cluster file falls back on them for omitted links.
OPTIONAL_KEYS = {
    "description": "text",
    "nvlink_GBps": "positive",            # intra-node GPU<->GPU, per GPU per direction
    "nvlink_latency_us": "non_negative",
    "pcie_GBps": "positive",              # host<->device, per GPU per direction
    "pcie_latency_us": "non_negative",
    "network_GBps_per_gpu": "positive",   # the GPU's share of the node's network, per direction
    # read by the simulator's cost model: SM count and GEMM tile for the wave-quantisation
    # factor, host Adam throughput for offloaded optimizer steps
    "num_sms": "whole",
    "gemm_tile": "tile",
    "host_adam_params_per_s": "positive",
    # written by `autopar profile`
    "machine": "object",
    "measured_at": "text",
    "fitted_links": "any",
    # per-call framework costs in seconds (OVERHEAD_KEYS below): op dispatch, DTensor module,
    # FSDP unit, optimizer parameter tensor
    "framework_overheads": "overheads",
    # CPU ranks: waiting per second of compute before each meeting of the ranks, one row per
    # number of processes (profiling/cpu_sync_wait.py; simulator/cost_model.py meeting_wait)
    "sync_wait": "sync_rows",
}
PROFILE_KEYS = REQUIRED_KEYS + tuple(OPTIONAL_KEYS)
#: the keys of ``framework_overheads``: what profiling/overheads.py measures and the cost model
#: reads (simulator/cost_model.py), in seconds per call
OVERHEAD_KEYS = ("op_launch_s", "op_backward_launch_s", "tp_module_fwd_s", "tp_module_bwd_s", "fsdp_unit_fwd_s",
                 "fsdp_unit_bwd_s", "fsdp_unit_fwd_per_byte_s", "fsdp_unit_bwd_per_byte_s", "optimizer_tensor_s",
                 "optimizer_dtensor_tensor_s", "dtensor_module_fwd_s", "dtensor_module_bwd_s",
                 "recompute_full_fwd_per_op_s", "recompute_full_bwd_per_op_s",
                 "recompute_selective_fwd_per_op_s", "recompute_selective_bwd_per_op_s",
                 "autograd_fwd_op_s", "autograd_fwd_per_byte_s", "sp_norm_fwd_s", "sp_norm_bwd_s")

# Rows of the measured tables: required key -> "text", "count" (whole number >= 1), "amount"
# (>= 0), "time" (> 0), "shape" (list of whole numbers or of such lists), "level".  A row may
# carry further keys (the profiler adds variant, num_samples, spread, ...).
OP_ROW_KEYS = {"kind": "text", "dtype": "text", "flops": "amount", "bytes": "amount", "seconds": "time",
               "shape": "shape"}
SYNC_ROW_KEYS = {"processes": "count", "per_compute": "amount"}
COLLECTIVE_ROW_KEYS = {"op": "text", "bytes": "amount", "group_size": "count", "level": "level", "seconds": "time"}


class ProfileError(UserError):
    """A profile file that is missing, is not JSON, or does not follow the schema."""


def available_profiles() -> list[str]:
    """Names of the bundled profiles (file names without ``.json``), sorted."""
    return sorted(p.name[:-len(".json")] for p in resources.files(_PACKAGE).iterdir()
                  if p.name.endswith(".json"))


def profile_path(name: str) -> Path:
    """The bundled file of profile ``name``; ProfileError listing the known names if there is none."""
    file = resources.files(_PACKAGE) / f"{name}.json"
    if not file.is_file():
        raise ProfileError(
            f"there is no bundled profile named {name!r}. Known profiles: {', '.join(available_profiles())}. "
            f"Use one of these names, or the path of a profile file written by `autopar profile`.")
    return Path(str(file))


def load_profile(name_or_path: str | Path | dict) -> dict:
    """Read a bundled profile by name, or any profile file by path, and validate it.

    A value ending in ``.json`` or naming an existing file is a path; anything else is a name.
    A dict is validated and returned as a copy (what ``autopar profile`` checks before writing).
    """
    if isinstance(name_or_path, dict):
        data = json.loads(json.dumps(name_or_path))
        validate_profile(data, source=f"object {name_or_path.get('name', '?')!r}")
        return data
    text = str(name_or_path)
    if text.endswith(".json") or Path(text).is_file():
        path = Path(text).expanduser()
        if not path.is_file():
            raise ProfileError(
                f"profile file {text} does not exist. Bundled profiles: {', '.join(available_profiles())}; "
                f"`autopar profile` writes a new one for the machine it runs on.")
    else:
        path = profile_path(text)
    data = parse_json_text(read_text_bounded(path, what="profile file", error=ProfileError),
                           source=f"profile file {path}", error=ProfileError,
                           if_invalid=". Fix the syntax (docs/profiles.md shows the schema).")
    validate_profile(data, source=str(path))
    return data


def validate_profile(data: object, *, source: str = "<profile>") -> None:
    """Raise ProfileError naming the first field of ``data`` that breaks the schema."""
    if not isinstance(data, dict):
        _fail(source, "(top level)", data, "a JSON object with the keys " + ", ".join(REQUIRED_KEYS))
    _check_keys(data, REQUIRED_KEYS, PROFILE_KEYS, source, "")
    _check_text(data["name"], source, "name")
    if data["device"] not in DEVICE_KINDS:
        _fail(source, "device", data["device"], "one of " + ", ".join(DEVICE_KINDS))
    for key in ("memory_bytes", "memory_bandwidth_Bps"):
        _check_number(data[key], source, key, positive=True)
    for key, names, upper, extra_ok in (("peak_flops", DTYPES, None, True),
                                        ("efficiency", EFFICIENCY_KINDS, 1.0, False),
                                        ("collective_efficiency", LINK_LEVELS, 1.0, False)):
        table = data[key]
        if not isinstance(table, dict):
            _fail(source, key, table, "an object with the keys " + ", ".join(names))
        _check_keys(table, names, tuple(table) if extra_ok else names, source, key + ".")
        for name in table:
            _check_number(table[name], source, f"{key}.{name}", positive=True, upper=upper)
    sources = data["sources"]
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        _fail(source, "sources", sources, "an object mapping a field path (e.g. 'peak_flops.bf16') to a text")
    for key, row_keys in (("op_table", OP_ROW_KEYS), ("collective_table", COLLECTIVE_ROW_KEYS)):
        rows = data[key]
        if not isinstance(rows, list):
            _fail(source, key, rows, "a list of measured rows with the keys " + ", ".join(row_keys))
        for i, row in enumerate(rows):
            _check_row(row, row_keys, source, f"{key}[{i}]")
    if data["measured_by"] is not None and not isinstance(data["measured_by"], str):
        _fail(source, "measured_by", data["measured_by"], "null or the command that produced the measured tables")
    for key, kind in OPTIONAL_KEYS.items():
        if key in data:
            _check_optional(data[key], kind, source, key)


def _check_optional(value: object, kind: str, source: str, key: str) -> None:
    if kind == "text":
        _check_text(value, source, key)
    elif kind in ("positive", "non_negative"):
        _check_number(value, source, key, positive=(kind == "positive"))
    elif kind == "whole":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            _fail(source, key, value, "a whole number >= 0")
    elif kind == "tile":
        if not (isinstance(value, list) and len(value) == 2 and _is_shape(value) and min(value) >= 1):
            _fail(source, key, value, "a list of two whole numbers >= 1 (tile rows, tile columns)")
    elif kind == "object" and not isinstance(value, dict):
        _fail(source, key, value, "a JSON object")
    elif kind == "overheads":
        if not isinstance(value, dict):
            _fail(source, key, value, "an object mapping an overhead name (op_launch_s, ...) to seconds >= 0")
        for name, seconds in value.items():
            _check_number(seconds, source, f"{key}.{name}", positive=False)
    elif kind == "sync_rows":
        if not isinstance(value, list):
            _fail(source, key, value, "a list of rows {processes, per_compute, ...}")
        for i, row in enumerate(value):
            _check_row(row, SYNC_ROW_KEYS, source, f"{key}[{i}]")
            # the measured points the simulator reads (cost_model.meeting_wait), when present
            gaps, extra = row.get("gaps_s"), row.get("extra_s")
            if gaps is not None or extra is not None:
                if not (isinstance(gaps, list) and isinstance(extra, list) and len(gaps) == len(extra) >= 2):
                    _fail(source, f"{key}[{i}].gaps_s", gaps, "two lists gaps_s and extra_s of equal length >= 2")
                for j, (g, e) in enumerate(zip(gaps, extra)):
                    _check_number(g, source, f"{key}[{i}].gaps_s[{j}]", positive=True)
                    _check_number(e, source, f"{key}[{i}].extra_s[{j}]", positive=False)


def _check_row(row: object, row_keys: dict[str, str], source: str, path: str) -> None:
    if not isinstance(row, dict):
        _fail(source, path, row, "an object with the keys " + ", ".join(row_keys))
    _check_keys(row, tuple(row_keys), tuple(row), source, path + ".")
    for key, kind in row_keys.items():
        value, where = row[key], f"{path}.{key}"
        if kind == "text":
            _check_text(value, source, where)
        elif kind == "level":
            if value not in LINK_LEVELS:
                _fail(source, where, value, "one of " + ", ".join(LINK_LEVELS))
        elif kind == "count":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(source, where, value, "a whole number of at least 1")
        elif kind == "shape":
            if not _is_shape(value):
                _fail(source, where, value, "a list of whole numbers >= 0, or a list of such lists")
        else:
            _check_number(value, source, where, positive=(kind == "time"))


def _is_shape(value: object) -> bool:
    if not isinstance(value, list):
        return False
    return all((isinstance(v, int) and not isinstance(v, bool) and v >= 0) or _is_shape(v) for v in value)


def _check_keys(table: dict, required: tuple[str, ...], allowed: tuple[str, ...], source: str, prefix: str) -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ProfileError(f"profile {source}: unknown key {prefix}{key}.{hint} "
                               f"Allowed keys here: {', '.join(allowed)}.")
    missing = [k for k in required if k not in table]
    if missing:
        raise ProfileError(f"profile {source}: missing key {prefix}{missing[0]}"
                           + (f" (also missing: {', '.join(prefix + m for m in missing[1:])})" if missing[1:] else "")
                           + f". Required keys here: {', '.join(required)}; see docs/profiles.md.")


def _check_text(value: object, source: str, path: str) -> None:
    if not isinstance(value, str) or not value.strip():
        _fail(source, path, value, "a non-empty text")


def _check_number(value: object, source: str, path: str, *, positive: bool, upper: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if positive else value >= 0) and (upper is None or value <= upper)
    if not ok:
        allowed = "a number > 0" if positive else "a number >= 0"
        if upper is not None:
            allowed = f"a number in (0, {upper:g}] (a fraction of the peak)"
        _fail(source, path, value, allowed)


def _fail(source: str, path: str, value: object, allowed: str) -> None:
    raise ProfileError(f"profile {source}: field {path} is {value!r}; it must be {allowed}. "
                       f"See docs/profiles.md for the schema.")
