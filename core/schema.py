"""A small declarative checker for the input files autopar reads (cluster files, profiles).

A schema is a tree of three kinds of node -- ``Leaf`` (a test and the words for what the value
must be), ``Mapping`` (required and optional keys, each with its node) and ``ListOf`` -- and
``check`` walks a parsed file against it.  The first problem found is handed to a ``Reporter``,
which raises the file's own one-paragraph error (naming the file, the field path such as
``groups[0].intra_node.bandwidth_GBps``, the value and what is allowed), so each file keeps its
wording while the rules are written once.  Fields are checked in the order the schema lists
them, keys before values: unknown keys first (with the closest allowed spelling), then missing
ones.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Protocol, Union


class Reporter(Protocol):
    """Raises the file's own error; every method ends by raising."""

    def bad_value(self, path: str, value: object, must: str) -> NoReturn: ...

    def unknown_key(self, path: str, key: object, hint: str, allowed: tuple[str, ...]) -> NoReturn: ...

    def missing_keys(self, path: str, missing: list[str], required: tuple[str, ...]) -> NoReturn: ...


@dataclass(frozen=True)
class Leaf:
    """A value that passes ``test``; ``must`` says what it must be (``"a number > 0"``).
    ``explain``, when given, may return a more precise ``must`` for a failing value."""
    test: Callable[[object], bool]
    must: str
    explain: Callable[[object], Union[str, None]] | None = None


@dataclass(frozen=True)
class Mapping:
    """A mapping with the ``required`` and ``optional`` keys.  Other keys are refused unless
    ``extra`` is given, which then checks each of them.  ``then`` runs on the mapping once its
    own fields passed (rules that relate two fields)."""
    required: dict
    must: str
    optional: dict = field(default_factory=dict)
    extra: "Node | None" = None
    then: "Callable[[dict, str, Reporter], None] | None" = None

    @property
    def allowed(self) -> tuple[str, ...]:
        return tuple(self.required) + tuple(self.optional)


@dataclass(frozen=True)
class ListOf:
    """A list whose every item passes ``item`` (and, if ``nonempty``, at least one item)."""
    item: "Node"
    must: str
    nonempty: bool = False


Node = Union[Leaf, Mapping, ListOf]


def join_path(path: str, key: object) -> str:
    """The field path of ``key`` inside ``path`` (``"groups[0]"`` + ``"nodes"``)."""
    return f"{path}.{key}" if path else str(key)


def check(node: Node, value: object, report: Reporter, path: str = "") -> None:
    """Check ``value`` against ``node``; the first problem goes to ``report`` (which raises)."""
    if isinstance(node, Leaf):
        if not node.test(value):
            report.bad_value(path, value, (node.explain(value) if node.explain else None) or node.must)
    elif isinstance(node, ListOf):
        if not isinstance(value, list) or (node.nonempty and not value):
            report.bad_value(path, value, node.must)
        for i, item in enumerate(value):
            check(node.item, item, report, f"{path}[{i}]")
    else:
        _check_mapping(node, value, report, path)


def _check_mapping(node: Mapping, value: object, report: Reporter, path: str) -> None:
    if not isinstance(value, dict):
        report.bad_value(path, value, node.must)
    allowed = node.allowed
    if node.extra is None:
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                report.unknown_key(path, key, f" Did you mean {close[0]!r}?" if close else "", allowed)
    missing = [k for k in node.required if k not in value]
    if missing:
        report.missing_keys(path, missing, tuple(node.required))
    for key, sub in (*node.required.items(), *node.optional.items()):
        if key in value:
            check(sub, value[key], report, join_path(path, key))
    if node.extra is not None:
        for key in value:
            if key not in allowed:
                check(node.extra, value[key], report, join_path(path, key))
    if node.then is not None:
        node.then(value, path, report)


# ------------------------------------------------------------------------- common leaves

ANY = Leaf(lambda v: True, "anything")


def is_number(value: object) -> bool:
    """A finite int or float (a bool is not a number here, though Python counts it as one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number_leaf(*, positive: bool, upper: float | None = None, must: str | None = None,
           explain: Callable[[object], Union[str, None]] | None = None) -> Leaf:
    """A finite number > 0 (``positive``) or >= 0, at most ``upper`` when given."""
    def test(v: object) -> bool:
        return is_number(v) and (v > 0 if positive else v >= 0) and (upper is None or v <= upper)
    if must is None:
        must = f"a number {'>' if positive else '>='} 0" + (f" and at most {upper:g}" if upper is not None else "")
    return Leaf(test, must, explain)


def whole(*, lower: int, upper: int | None = None, must: str) -> Leaf:
    """A whole number in [lower, upper] (a bool is not one)."""
    return Leaf(lambda v: is_whole(v) and v >= lower and (upper is None or v <= upper), must)


def text() -> Leaf:
    """A text that is not empty or blank."""
    return Leaf(lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty text")


def one_of(values: tuple) -> Leaf:
    return Leaf(lambda v: v in values, "one of " + ", ".join(values))
