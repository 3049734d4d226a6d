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

import json
from importlib import resources
from pathlib import Path
from typing import NoReturn

from autopar.core import schema
from autopar.core.errors import UserError
from autopar.core.jsonfile import parse_json_text, read_text_bounded

_PACKAGE = "autopar.profiles"

DEVICE_KINDS = ("gpu", "cpu")
DTYPES = ("fp32", "tf32", "bf16", "fp16")            # required in peak_flops; others (fp8, fp64) may be added
EFFICIENCY_KINDS = ("linear", "matmul", "attention", "conv", "memory_bound")
LINK_LEVELS = ("intra", "inter")
GEMM_EPILOGUES = ("exposed", "overlapped")

REQUIRED_KEYS = ("name", "device", "memory_bytes", "memory_bandwidth_Bps", "peak_flops", "efficiency",
                 "collective_efficiency", "sources", "op_table", "collective_table", "measured_by")
# Optional top-level keys and what each must hold.  Link figures are optional so that a profile
# measured by `autopar profile` on a machine without them still loads; every bundled profile has
# them (tests/core/test_profiles.py), and a cluster file falls back on them for omitted links.
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
    # whether a GEMM kernel's output write follows its main loop ("exposed": Ampere cuBLAS) or
    # runs beside the next tile's main loop ("overlapped": Hopper persistent kernels)
    "gemm_epilogue": "epilogue",
    "host_adam_params_per_s": "positive",
    # a GPU variant (core/clocks.py; docs/profiles.md "GPU variants"): the board power limit the
    # figures hold at, and the SM clock the datasheet peaks are quoted at and the one the part holds
    # under sustained load at that limit (the peaks are scaled by their ratio)
    "power_limit_W": "positive",
    "boost_clock_MHz": "positive",
    "sustained_clock_MHz": "positive",
    # forward + backward rates of flash-attention kernels by mask, head dim and sequence length
    # (simulator/cost_model.py fused_attention_s; docs/profiles.md)
    "attention_kernels": "object",
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
    schema.check(PROFILE_SCHEMA, data, _ProfileReport(source))


class _ProfileReport:
    """A profile's one-paragraph errors (``schema.Reporter``)."""

    def __init__(self, source: str):
        self.source = source

    def bad_value(self, path: str, value: object, must: str) -> NoReturn:
        raise ProfileError(f"profile {self.source}: field {path or '(top level)'} is {value!r}; it must be {must}. "
                           f"See docs/profiles.md for the schema.")

    def unknown_key(self, path: str, key: object, hint: str, allowed: tuple[str, ...]) -> NoReturn:
        raise ProfileError(f"profile {self.source}: unknown key {schema.join_path(path, key)}.{hint} "
                           f"Allowed keys here: {', '.join(allowed)}.")

    def missing_keys(self, path: str, missing: list[str], required: tuple[str, ...]) -> NoReturn:
        also = f" (also missing: {', '.join(schema.join_path(path, m) for m in missing[1:])})" if missing[1:] else ""
        raise ProfileError(f"profile {self.source}: missing key {schema.join_path(path, missing[0])}{also}. "
                           f"Required keys here: {', '.join(required)}; see docs/profiles.md.")


def _is_shape(value: object) -> bool:
    if not isinstance(value, list):
        return False
    return all((isinstance(v, int) and not isinstance(v, bool) and v >= 0) or _is_shape(v) for v in value)


def _sync_points(row: dict, path: str, report: schema.Reporter) -> None:
    """The measured points the simulator reads (cost_model.meeting_wait), when present."""
    gaps, extra = row.get("gaps_s"), row.get("extra_s")
    if gaps is None and extra is None:
        return
    if not (isinstance(gaps, list) and isinstance(extra, list) and len(gaps) == len(extra) >= 2):
        report.bad_value(f"{path}.gaps_s", gaps, "two lists gaps_s and extra_s of equal length >= 2")
    for j, (g, e) in enumerate(zip(gaps, extra)):
        schema.check(_POSITIVE, g, report, f"{path}.gaps_s[{j}]")
        schema.check(_NON_NEGATIVE, e, report, f"{path}.extra_s[{j}]")


def _rows(row_keys: dict[str, str], must: str, then=None) -> schema.Mapping:
    """A measured row: ``row_keys`` (key -> kind of ``_ROW_KINDS``) required, further keys free."""
    return schema.Mapping({k: _ROW_KINDS[kind] for k, kind in row_keys.items()}, must, extra=schema.ANY, then=then)


def _table(names: tuple[str, ...], value: schema.Leaf, *, extra: bool) -> schema.Mapping:
    return schema.Mapping({n: value for n in names}, "an object with the keys " + ", ".join(names),
                          extra=value if extra else None)


_POSITIVE = schema.number_leaf(positive=True)
_NON_NEGATIVE = schema.number_leaf(positive=False)
_FRACTION = schema.number_leaf(positive=True, upper=1.0, must="a number in (0, 1] (a fraction of the peak)")
_SHAPE = schema.Leaf(_is_shape, "a list of whole numbers >= 0, or a list of such lists")
# kinds of the measured rows' keys (OP_ROW_KEYS, SYNC_ROW_KEYS, COLLECTIVE_ROW_KEYS)
_ROW_KINDS = {"text": schema.text(), "level": schema.one_of(LINK_LEVELS),
              "count": schema.whole(lower=1, must="a whole number of at least 1"),
              "shape": _SHAPE, "amount": _NON_NEGATIVE, "time": _POSITIVE}
# kinds of the optional top-level keys (OPTIONAL_KEYS)
_OPTIONAL_KINDS = {
    "text": schema.text(),
    "positive": _POSITIVE,
    "non_negative": _NON_NEGATIVE,
    "whole": schema.whole(lower=0, must="a whole number >= 0"),
    "tile": schema.Leaf(lambda v: isinstance(v, list) and len(v) == 2 and _is_shape(v) and min(v) >= 1,
                        "a list of two whole numbers >= 1 (tile rows, tile columns)"),
    "object": schema.Leaf(lambda v: isinstance(v, dict), "a JSON object"),
    "epilogue": schema.one_of(GEMM_EPILOGUES),
    "any": schema.ANY,
    "overheads": schema.Mapping({}, "an object mapping an overhead name (op_launch_s, ...) to seconds >= 0",
                                extra=_NON_NEGATIVE),
    "sync_rows": schema.ListOf(_rows(SYNC_ROW_KEYS, "an object with the keys " + ", ".join(SYNC_ROW_KEYS),
                                     then=_sync_points),
                               "a list of rows {processes, per_compute, ...}"),
}

PROFILE_SCHEMA = schema.Mapping(
    {
        "name": schema.text(),
        "device": schema.one_of(DEVICE_KINDS),
        "memory_bytes": _POSITIVE,
        "memory_bandwidth_Bps": _POSITIVE,
        "peak_flops": _table(DTYPES, _POSITIVE, extra=True),
        "efficiency": _table(EFFICIENCY_KINDS, _FRACTION, extra=False),
        "collective_efficiency": _table(LINK_LEVELS, _FRACTION, extra=False),
        "sources": schema.Leaf(lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                               "an object mapping a field path (e.g. 'peak_flops.bf16') to a text"),
        "op_table": schema.ListOf(_rows(OP_ROW_KEYS, "an object with the keys " + ", ".join(OP_ROW_KEYS)),
                                  "a list of measured rows with the keys " + ", ".join(OP_ROW_KEYS)),
        "collective_table": schema.ListOf(
            _rows(COLLECTIVE_ROW_KEYS, "an object with the keys " + ", ".join(COLLECTIVE_ROW_KEYS)),
            "a list of measured rows with the keys " + ", ".join(COLLECTIVE_ROW_KEYS)),
        "measured_by": schema.Leaf(lambda v: v is None or isinstance(v, str),
                                   "null or the command that produced the measured tables"),
    },
    "a JSON object with the keys " + ", ".join(REQUIRED_KEYS),
    optional={key: _OPTIONAL_KINDS[kind] for key, kind in OPTIONAL_KEYS.items()},
)
