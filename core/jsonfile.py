"""Reading the files the tool is given, bounded and checked, with the project's errors.

Every input file (cluster YAML, plan, profile, measured.json, a trace) goes through
``read_text_bounded``: a missing path, a directory, a file larger than ``MAX_INPUT_BYTES`` or
text that is not UTF-8 becomes a ``UserError`` (or the caller's subclass) naming the file and
what to do, before any parser sees it.  JSON is parsed by ``read_json_object``, which also
refuses what ``json`` would otherwise let through: ``NaN``/``Infinity`` and numbers that
overflow to infinity (``1e999``), and nesting deeper than ``MAX_JSON_DEPTH`` (a
RecursionError inside the parser otherwise).

The bounds are far above what any file autopar writes reaches: the largest bundled profile
is ~0.3 MB and a plan for a 96-layer model ~30 KB; a Chrome trace of a profiled step is the
largest input, tens of MB, hence 256 MiB.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from autopar.core.errors import UserError

#: the largest input file read, bytes (see the module docstring)
MAX_INPUT_BYTES = 256 * 2**20
#: the deepest nesting of JSON arrays/objects accepted (a plan nests 4 deep, a trace 5)
MAX_JSON_DEPTH = 64


def read_text_bounded(path: str | os.PathLike, *, what: str, error: type[UserError] = UserError,
                      if_missing: str = "", limit: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of ``path``; ``error`` when it is missing, not a file, too large or unreadable."""
    p = Path(path)
    if not p.exists():
        raise error(f"{what} {p} does not exist{if_missing}")
    if not p.is_file():
        raise error(f"{what} {p} is {'a directory' if p.is_dir() else 'not a regular file'}; give the path of a file.")
    try:
        size = p.stat().st_size
        if size > limit:
            raise error(f"{what} {p} is {size / 2**20:.1f} MiB, more than the {limit / 2**20:.0f} MiB autopar reads "
                        f"from one input file; it is not a file autopar wrote. Give the right file.")
        with open(p, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise error(f"{what} {p} cannot be read ({e.strerror or e}); check the path and its permissions.") from None
    if len(raw) > limit:
        raise error(f"{what} {p} is larger than the {limit / 2**20:.0f} MiB autopar reads from one input file; "
                    f"give the right file.")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {p} is not UTF-8 text (byte {e.start}); give the text file autopar wrote.") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows; write a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is too large (it overflows to infinity)")
    return value


def _depth(value: object, limit: int) -> int:
    """Nesting depth of a parsed JSON value (iterative: a deep value cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json_text(text: str, *, source: str, error: type[UserError] = UserError, if_invalid: str = ".") -> object:
    """``json.loads`` that refuses NaN, Infinity, overflowing numbers and deep nesting (``error``)."""
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, ValueError) as e:
        raise error(f"{source} is not valid JSON ({e}){if_invalid}") from None
    except RecursionError:
        raise error(f"{source} nests arrays or objects deeper than JSON autopar reads{if_invalid}") from None
    if _depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise error(f"{source} nests arrays or objects more than {MAX_JSON_DEPTH} deep{if_invalid}")
    return data


def read_json_object(path: str | os.PathLike, *, what: str, error: type[UserError] = UserError,
                     if_missing: str = "", if_invalid: str = ".", kind: str = "") -> dict:
    """The object in ``path``.  Messages read "``what`` PATH does not exist``if_missing``",
    "``what`` PATH is not valid JSON (why)``if_invalid``" and "``what`` PATH holds a list, not a
    ``kind`` object." (``kind`` defaults to ``what``'s first word)."""
    p = Path(path)
    text = read_text_bounded(p, what=what, error=error, if_missing=if_missing)
    data = parse_json_text(text, source=f"{what} {p}", error=error, if_invalid=if_invalid)
    if not isinstance(data, dict):
        raise error(f"{what} {p} holds a {type(data).__name__}, not a {kind or what.split()[0]} object.")
    return data
