"""Reading a JSON file that must hold one object, with the project's errors.

Plans, measured.json and profile outputs are all JSON objects written by one of the verbs; a
missing file, broken JSON or another top-level type is the user's to fix, so each becomes a
``UserError`` (or the caller's subclass) that names the file and what to do.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from autopar.core.errors import UserError


def read_json_object(path: str | os.PathLike, *, what: str, error: type[UserError] = UserError,
                     if_missing: str = "", if_invalid: str = ".", kind: str = "") -> dict:
    """The object in ``path``.  Messages read "``what`` PATH does not exist``if_missing``",
    "``what`` PATH is not valid JSON (why)``if_invalid``" and "``what`` PATH holds a list, not a
    ``kind`` object." (``kind`` defaults to ``what``'s first word)."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p} does not exist{if_missing}")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{what} {p} is not valid JSON ({e}){if_invalid}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {p} holds a {type(data).__name__}, not a {kind or what.split()[0]} object.")
    return data
