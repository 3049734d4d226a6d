"""Human-readable figures: each in the unit that shows it (a 200 KB model's state is "195 KiB",
not "0.0 GiB"; a CPU's rate "1.20 GFLOP/s", not "0 TFLOP/s").

Bytes use binary prefixes (IEC 80000-13: KiB = 2**10 B, MiB = 2**20 B, ...), FLOP counts and
rates decimal ones (SI: G = 1e9, T = 1e12), the conventions of memory sizes and of published
FLOP/s figures.  Three significant figures at most, never a scientific notation.
"""
from __future__ import annotations

import math

BYTE_UNITS = (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
FLOP_UNITS = (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3))
COUNT_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))


def _number(x: float) -> str:
    """2 decimals under 10, 1 under 100, none above: 8.20, 28.2, 282, 1000; 0 as "0"."""
    a = abs(x)
    if x == 0:
        return "0"
    return f"{x:.2f}" if a < 10 else f"{x:.1f}" if a < 100 else f"{x:.0f}"


def _scaled(x: float, units, base: str) -> str:
    if not math.isfinite(x):
        return f"{x} {base}"
    for unit, scale in units:
        if abs(x) >= scale:
            return f"{_number(x / scale)} {unit}{base}"
    return f"{_number(x)} {base}"


def fmt_bytes(n: float) -> str:
    """Bytes in B, KiB, MiB, GiB, TiB or PiB: 8396 -> '8.20 KiB', 85899345920 -> '80.0 GiB'."""
    n = float(n)
    if not math.isfinite(n):
        return f"{n} B"
    for unit, scale in BYTE_UNITS:
        if abs(n) >= scale:
            return f"{_number(n / scale)} {unit}"
    return f"{int(round(n))} B"


def byte_unit(largest: float) -> tuple[str, float]:
    """(name, bytes per unit) of the unit that shows ``largest`` -- for a table whose figures share
    one unit, named once in its title: 3e5 -> ('KiB', 1024)."""
    largest = float(largest) if math.isfinite(largest) else 0.0
    for unit, scale in BYTE_UNITS:
        if abs(largest) >= scale:
            return unit, float(scale)
    return "B", 1.0


def fmt_in(n: float, scale: float) -> str:
    """``n`` bytes as a number of units of ``scale`` bytes (``byte_unit``), without the unit."""
    return _number(float(n) / scale) if math.isfinite(n) else str(n)


def fmt_flops(n: float) -> str:
    """A FLOP count: 2.5e9 -> '2.50 GFLOP'."""
    return _scaled(float(n), FLOP_UNITS, "FLOP")


def fmt_flop_rate(flops_per_s: float) -> str:
    """A FLOP rate: 148e12 -> '148 TFLOP/s', 1.2e9 -> '1.20 GFLOP/s'."""
    return _scaled(float(flops_per_s), FLOP_UNITS, "FLOP/s")


#: SI submultiples of the second (SI Brochure, 9th edition, Table 7)
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))


def fmt_seconds(t: float) -> str:
    """A duration in s, ms, µs or ns, three significant figures: 2.375 -> '2.38 s',
    3.756e-4 -> '376 µs' (a CPU step of a tiny model is not '0.000 s')."""
    t = float(t)
    if not math.isfinite(t) or t == 0:
        return f"{t:g} s"
    t = float(f"{t:.3g}")                       # so 9.9996e-4 reads '1.00 ms', not '1000 µs'
    for unit, scale in TIME_UNITS:
        if abs(t) >= scale:
            return f"{_number(t / scale)} {unit}"
    return f"{_number(t / 1e-9)} ns"


def fmt_count(n: float) -> str:
    """An element count: 1.3e9 -> '1.30B' (parameters, the usual K/M/B/T)."""
    if not math.isfinite(n):
        return str(n)
    for unit, scale in COUNT_UNITS:
        if abs(n) >= scale:
            return f"{_number(n / scale)}{unit}"
    return f"{int(n)}"
