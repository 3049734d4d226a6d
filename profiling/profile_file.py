"""Assemble a profile (the schema of ``autopar.profiles``) from measured tables and write it.

When the output file already exists, the new measurement is merged into it: table rows
measured again replace the old rows of the same sweep -- (kind, variant, dtype) for ops,
(op, group size, level) for collectives -- and the figures estimated from the tables are
re-estimated; everything else (a memory size from a datasheet, collectives over 4 ranks
from an earlier run, the efficiency of a kind not measured) is kept, ``sources`` says which
is which and ``measured_by`` lists every command whose rows remain.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from autopar.core.jsonfile import read_json_object
from autopar.core.plan import write_text_atomic
from autopar.profiling import estimate

DEFAULT_EFFICIENCY = {"linear": 1.0, "matmul": 1.0, "attention": 1.0, "conv": 1.0, "memory_bound": 1.0}
DEFAULT_COLLECTIVE_EFFICIENCY = {"intra": 1.0, "inter": 1.0}


def read_profile_json(path: str | Path) -> dict:
    return read_json_object(path, what="profile file", if_invalid="; fix it or choose another -o path.")


def build_profile(*, base: dict | None, name: str, device_kind: str, description: str, machine: dict, measured_by: str,
                  op_rows: list[dict] | None, collective_rows: list[dict] | None,
                  memory_bytes: int | None, overheads: dict[str, float] | None = None,
                  sync_wait: dict | None = None) -> dict:
    """A profile dict: ``base`` (an existing profile or None) updated with what was measured."""
    prof = json.loads(json.dumps(base)) if base else {}
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sources = dict(prof.get("sources", {}))
    prof.setdefault("name", name)
    prof.setdefault("device", device_kind)                  # "gpu" or "cpu" (autopar.profiles.DEVICE_KINDS)
    prof.setdefault("description", description)
    if memory_bytes and not prof.get("memory_bytes"):
        prof["memory_bytes"] = int(memory_bytes)
        sources["memory_bytes"] = f"measured: device memory reported on this machine ({stamp})"
    prof.setdefault("peak_flops", {})
    prof["efficiency"] = {**DEFAULT_EFFICIENCY, **prof.get("efficiency", {})}
    prof["collective_efficiency"] = {**DEFAULT_COLLECTIVE_EFFICIENCY, **prof.get("collective_efficiency", {})}

    commands = []
    if op_rows is not None:
        op_rows = _merge_table(prof, sources, "op_table", op_rows, _op_key, measured_by, stamp, commands)
        peaks = estimate.peak_flops(op_rows)
        for dt, (rate, why) in peaks.items():
            prof["peak_flops"][dt] = rate
            sources[f"peak_flops.{dt}"] = why
        if "fp32" in peaks and "tf32" not in peaks and machine.get("device_type") == "cpu":
            prof["peak_flops"]["tf32"] = peaks["fp32"][0]
            sources["peak_flops.tf32"] = "CPU: no TF32 mode, equal to the measured fp32 peak"
        bw = estimate.memory_bandwidth(op_rows)
        if bw is not None:
            prof["memory_bandwidth_Bps"] = bw[0]
            sources["memory_bandwidth_Bps"] = bw[1]
        effs = estimate.efficiency(op_rows, {k: v[0] for k, v in peaks.items()}, bw[0] if bw else None)
        for kind, (value, why) in effs.items():
            prof["efficiency"][kind] = value
            sources[f"efficiency.{kind}"] = why
    elif prof.get("op_table"):
        commands.append(prof.get("measured_by"))          # the old op table stays
    if overheads is not None:
        prof["framework_overheads"] = {k: float(v) for k, v in overheads.items()}
        sources["framework_overheads"] = (f"measured by `{measured_by}` ({stamp}): tiny plain vs framework "
                                          f"closures, per call (profiling/overheads.py)")
        if machine.get("device_type") == "cpu" and int(machine.get("world_size") or 1) > 1:
            sources["framework_overheads"] += (
                "; tensor-parallel module and FSDP unit on pairs of ranks in step against the same arithmetic "
                "with its collectives called directly (profiling/cpu_overheads_in_step.py)")
    if sync_wait is not None:
        # one row per number of processes; a new measurement replaces the row of its count
        rows = [r for r in prof.get("sync_wait", []) if r.get("processes") != sync_wait["processes"]]
        prof["sync_wait"] = sorted(rows + [{**sync_wait, "measured_by": measured_by, "measured_at": stamp}],
                                   key=lambda r: r["processes"])
        sources[f"sync_wait.{sync_wait['processes']}"] = (
            f"measured by `{measured_by}` ({stamp}): extra time of a 128 KiB all-reduce after bursts of "
            f"matmuls against the bursts alone, per burst length (gaps_s, extra_s; the line fixed + per_compute x "
            f"burst for information) (profiling/cpu_sync_wait.py)")
    if collective_rows is not None:
        collective_rows = _merge_table(prof, sources, "collective_table", collective_rows, _coll_key,
                                       measured_by, stamp, commands)
        links = estimate.fitted_links(collective_rows)
        if links:
            prof["fitted_links"] = links
    elif prof.get("collective_table"):
        commands.append(prof.get("measured_by"))          # the old collective table stays
    for key in ("fp32", "tf32", "bf16", "fp16"):
        if key not in prof["peak_flops"] and "fp32" in prof["peak_flops"]:
            prof["peak_flops"][key] = prof["peak_flops"]["fp32"]
            sources[f"peak_flops.{key}"] = f"not measured ({key}): assumed equal to fp32"
    prof.setdefault("op_table", [])
    prof.setdefault("collective_table", [])
    prof["sources"] = sources
    prof["machine"] = machine
    # every command whose rows the tables still hold, in the order they ran
    prof["measured_by"] = _commands_holding_rows(prof, commands, measured_by)
    prof["measured_at"] = stamp
    return prof


def _op_key(row: dict) -> tuple:
    """Rows of one sweep: a new measurement of (kind, variant, dtype) replaces the old one."""
    return row["kind"], row.get("variant"), row["dtype"]


def _coll_key(row: dict) -> tuple:
    """Rows of one sweep: (op, group size, level, processes busy at once, timing)."""
    return row["op"], row["group_size"], row["level"], int(row.get("processes", row["group_size"])), \
        row.get("timing", "")


def _commands_holding_rows(prof: dict, commands: list, measured_by: str) -> str:
    """The commands whose rows the tables (and the meeting-wait rows) still hold, in the order
    they ran, then this one.

    Every row this module writes names its command (``measured_by``); rows of older files do
    not, and for them the file's old list is kept whole (``commands``)."""
    rows = list(prof.get("op_table", [])) + list(prof.get("collective_table", []))
    rows += [r for r in prof.get("sync_wait", []) if r.get("measured_by")]
    parts: list[str] = []
    if any("measured_by" not in r for r in rows):
        parts += [c for cmd in commands if cmd for c in cmd.split(" ; ")]
    stamped = sorted({(r.get("measured_at", ""), r["measured_by"]) for r in rows
                      if r.get("measured_by") and r["measured_by"] != measured_by})
    parts += [cmd for _, cmd in stamped]          # "YYYY-MM-DD HH:MM UTC" stamps sort by time
    return " ; ".join(dict.fromkeys(parts + [measured_by]))


def _table_source(old: str | None, measured_by: str, stamp: str) -> str:
    new = f"measured by `{measured_by}` ({stamp})"
    return f"{old}; rows not re-measured kept; then {new}" if old else new


def write_profile(prof: dict, path: str | Path) -> None:
    """Atomic write; the result is checked by the profile loader when it is available."""
    write_text_atomic(path, json.dumps(prof, indent=1, sort_keys=False) + "\n")


def _merge_table(prof: dict, sources: dict, table: str, rows: list, key, measured_by: str, stamp: str,
                 commands: list) -> list:
    """Replace the re-measured rows of ``prof[table]``, keep the others; note whose rows stay."""
    new_keys = {key(r) for r in rows}
    kept = [r for r in prof.get(table, []) if key(r) not in new_keys]
    merged = kept + [{**r, "measured_by": measured_by, "measured_at": stamp} for r in rows]
    prof[table] = merged
    if all("measured_by" in r for r in kept):
        runs = dict.fromkeys((r["measured_by"], r.get("measured_at", "?")) for r in merged)
        sources[table] = "; then ".join(f"measured by `{c}` ({t})" for c, t in runs)
    else:
        sources[table] = _table_source(sources.get(table) if kept else None, measured_by, stamp)
    if kept:
        commands.append(prof.get("measured_by"))
    return merged
