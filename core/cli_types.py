"""The argument types of every numeric flag, in one place.

Each is an ``argparse`` ``type=`` callable: a value out of range -- ``--lr nan``, ``--dp 0``,
``--seed -1``, ``--rdzv-endpoint host:abc`` -- is refused while the arguments are parsed, with
argparse's usage line and one sentence naming the flag, the value and the range ("autopar plan:
error: argument --seed: ..."), exit code 2, before any work and before any process starts.

* ``count(lo, hi)``: a whole number in [lo, hi] (``hi`` None: no upper bound);
* ``number(lo, hi, lo_open=...)``: a finite real number in the range (never nan or inf);
* ``host_port``: ``HOST:PORT`` with a port in 1..65535.

The bounds of the flags that need one beyond "positive" are named constants below, with why.
"""
from __future__ import annotations

import argparse
import math

# the largest global batch autopar plans: 2^40 samples per step is ~10^4 times the largest
# published LLM batches (GPT-3 175B: 3.2M tokens = 1,563 sequences of 2,048; Brown et al. 2020,
# Table 2.1); the bound keeps the planner's divisor enumeration (planner.space) instant
MAX_GLOBAL_BATCH = 2 ** 40
# seeds go to torch.manual_seed and numpy.random.default_rng, which both take 0 .. 2^64-1;
# 2^32-1 is also what numpy's legacy RandomState takes
MAX_SEED = 2 ** 32 - 1


def count(lo: int = 1, hi: int | None = None, what: str = "a whole number"):
    """A whole number ``lo <= n <= hi``."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            bound = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} {bound}; give one in that range.")
        return value
    parse.__name__ = "count"
    return parse


def number(lo: float = 0.0, hi: float | None = None, *, lo_open: bool = True, hi_open: bool = False,
           what: str = "a number"):
    """A finite real number in (lo, hi] (the ends open or closed as asked)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            value = math.nan
        ok = math.isfinite(value) and (value > lo if lo_open else value >= lo)
        if hi is not None:
            ok = ok and (value < hi if hi_open else value <= hi)
        if not ok:
            left = f"{'>' if lo_open else '>='} {lo:g}"
            right = f" and {'<' if hi_open else '<='} {hi:g}" if hi is not None else ""
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} {left}{right} (finite); give one in that range.")
        return value
    parse.__name__ = "number"
    return parse


def host_port(text: str) -> str:
    """``HOST:PORT``, the port a whole number from 1 to 65535."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port from 1 to 65535 "
                                         f"(e.g. node0:29500).")
    return text


positive = count(1)
non_negative = count(0)
seed = count(0, MAX_SEED, "a seed")
global_batch = count(1, MAX_GLOBAL_BATCH, "a global batch")
positive_number = number(0.0)


def grad_compression(text: str) -> str:
    """A gradient compression (core/grad_compression.py): none, bf16, fp16 or powersgd:R."""
    from autopar.core.grad_compression import GradCompression

    try:
        return str(GradCompression.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}.") from None
