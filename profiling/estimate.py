"""The profile's summary figures, estimated from the measured tables.

* ``peak_flops[dtype]``: the best FLOP rate any measured linear/matmul reached in that dtype.
  It is a measured peak, below the datasheet's; the efficiency factors are relative to it.
* ``memory_bandwidth_Bps``: the best rate of the copy probe (bytes read + written per second)
  among its largest sizes (within 16x of the largest, 2 x 256 MiB on CPU): a small copy runs
  from the caches and would overstate the memory's bandwidth.
* ``efficiency[kind]``: the median over that kind's rows of the achieved rate over the peak
  (the roofline's derate where the cost model has no table row to interpolate);
  ``memory_bound`` the same with bytes over the copy bandwidth for norm, softmax,
  element-wise, embedding and the optimizer step.  The median, not a time-weighted mean: on
  a CPU the largest memory-bound rows pay page faults on freshly allocated outputs and would
  alone set a time-weighted figure.
* ``fitted_links[level]``: an alpha-beta fit t = alpha + bytes_on_wire / bandwidth of the
  all-reduce rows (Hockney 1994), bytes on the wire per rank = 2*(N-1)/N * M for a ring
  (Patarasuk & Yuan 2009) -- the figures a cluster file's link entry wants.
"""
from __future__ import annotations

import statistics

import numpy as np

MEMORY_BOUND_KINDS = ("norm", "softmax", "elementwise", "embedding", "optimizer")
PEAK_BOUND_KINDS = ("linear", "matmul", "attention", "conv")
PREFERRED_DTYPES = ("bf16", "fp16", "tf32", "fp32")   # the one training usually runs in first


def peak_flops(op_rows: list[dict]) -> dict[str, tuple[float, str]]:
    """dtype -> (FLOP/s, where from) for every dtype with linear/matmul rows."""
    best: dict[str, tuple[float, str]] = {}
    for r in op_rows:
        if r["kind"] not in ("linear", "matmul") or r["measured_seconds"] <= 0:
            continue
        rate = r["flops"] / r["measured_seconds"]
        if rate > best.get(r["dtype"], (0.0, ""))[0]:
            best[r["dtype"]] = (rate, f"measured: best {r['kind']} {'x'.join(map(str, r['shape']))} "
                                      f"{r['dtype']}, {rate / 1e9:.2f} GFLOP/s")
    return best


def memory_bandwidth(op_rows: list[dict]) -> tuple[float, str] | None:
    """Best copy rate among the largest copies (within 16x of the largest: past the caches)."""
    copies = [r for r in op_rows if r["kind"] == "copy" and r["measured_seconds"] > 0]
    if not copies:
        return None
    largest = max(r["bytes"] for r in copies)
    best: tuple[float, str] | None = None
    for r in copies:
        if r["bytes"] * 16 < largest:
            continue
        rate = r["bytes"] / r["measured_seconds"]
        if best is None or rate > best[0]:
            best = (rate, f"measured: best copy of {r['bytes'] / 2 / 2**20:.2f} MiB {r['dtype']}, "
                          f"{rate / 1e9:.2f} GB/s (read + write)")
    return best


def efficiency(op_rows: list[dict], peaks: dict[str, float], bandwidth_Bps: float | None) -> dict[str, tuple[float, str]]:
    """kind -> (fraction of peak, where from), for the kinds the rows inform."""
    dtypes = {r["dtype"] for r in op_rows if r["kind"] in PEAK_BOUND_KINDS}
    dtype = next((d for d in PREFERRED_DTYPES if d in dtypes and d in peaks), None)
    out: dict[str, tuple[float, str]] = {}
    if dtype is not None:
        for kind in PEAK_BOUND_KINDS:
            rows = [r for r in op_rows if r["kind"] == kind and r["dtype"] == dtype and r["flops"] > 0]
            if rows:
                achieved = statistics.median(r["flops"] / r["measured_seconds"] for r in rows)
                out[kind] = (min(1.0, achieved / peaks[dtype]),
                             f"measured: median over {len(rows)} {kind} shapes in {dtype}, "
                             f"{achieved / 1e9:.2f} GFLOP/s over the measured peak {peaks[dtype] / 1e9:.2f}")
    if bandwidth_Bps:
        rows = [r for r in op_rows if r["kind"] in MEMORY_BOUND_KINDS and r["bytes"] > 0]
        if rows:
            achieved = statistics.median(r["bytes"] / r["measured_seconds"] for r in rows)
            out["memory_bound"] = (min(1.0, achieved / bandwidth_Bps),
                                   f"measured: median over {len(rows)} memory-bound rows "
                                   f"({', '.join(MEMORY_BOUND_KINDS)}), {achieved / 1e9:.2f} GB/s over the copy "
                                   f"bandwidth {bandwidth_Bps / 1e9:.2f} GB/s")
    return out


def fitted_links(collective_rows: list[dict]) -> dict[str, dict]:
    """level -> {bandwidth_GBps, latency_us, group_size, source} from the all-reduce rows."""
    out = {}
    for level in sorted({r["level"] for r in collective_rows}):
        rows = [r for r in collective_rows if r["op"] == "all_reduce" and r["level"] == level]
        if not rows:
            continue
        n = max(r["group_size"] for r in rows)
        rows = [r for r in rows if r["group_size"] == n]
        if len(rows) < 2:
            continue
        wire_bytes = np.array([2.0 * (n - 1) / n * r["bytes"] for r in rows])
        seconds = np.array([r["measured_seconds"] for r in rows])
        a = np.stack([np.ones_like(wire_bytes), wire_bytes], axis=1)
        # weight by 1/t so that small and large messages count alike (relative error)
        w = 1.0 / seconds
        (alpha_s, inv_bw), *_ = np.linalg.lstsq(a * w[:, None], seconds * w, rcond=None)
        if inv_bw <= 0:
            continue
        out[level] = {"bandwidth_GBps": float(1.0 / inv_bw / 1e9), "latency_us": float(max(alpha_s, 0.0) * 1e6),
                      "group_size": n,
                      "source": f"least-squares alpha-beta fit of {len(rows)} all_reduce sizes over {n} ranks"}
    return out
