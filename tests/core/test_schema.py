"""core/schema.py: the declarative checker both input-file validators use (cluster files,
profiles).  Each case names the first problem of a small document, found by hand."""
from __future__ import annotations

import pytest

from autopar.core import schema


class Problem(Exception):
    pass


class Report:
    def bad_value(self, path, value, must):
        raise Problem(("bad", path, value, must))

    def unknown_key(self, path, key, hint, allowed):
        raise Problem(("unknown", path, key, hint, allowed))

    def missing_keys(self, path, missing, required):
        raise Problem(("missing", path, missing, required))


ROW = schema.Mapping({"n": schema.whole(lower=1, must="a whole number >= 1")}, "a row", extra=schema.ANY)
DOC = schema.Mapping(
    {"name": schema.text(), "rows": schema.ListOf(ROW, "a list of rows", nonempty=True)},
    "a document",
    optional={"rate": schema.number_leaf(positive=True, upper=10.0)},
    then=lambda d, path, report: d.get("rate", 1) <= len(d["rows"]) or report.bad_value("rate", d["rate"],
                                                                                         "at most one per row"))


def first_problem(value):
    with pytest.raises(Problem) as e:
        schema.check(DOC, value, Report())
    return e.value.args[0]


def test_a_valid_document_passes():
    schema.check(DOC, {"name": "a", "rows": [{"n": 1, "note": "free"}], "rate": 1.0}, Report())


def test_unknown_key_comes_before_missing_and_suggests_the_spelling():
    assert first_problem({"nmae": "a"}) == ("unknown", "", "nmae", " Did you mean 'name'?", ("name", "rows", "rate"))


def test_missing_keys_are_listed_in_schema_order():
    assert first_problem({}) == ("missing", "", ["name", "rows"], ("name", "rows"))


def test_values_are_checked_in_schema_order_with_their_paths():
    assert first_problem({"name": " ", "rows": []}) == ("bad", "name", " ", "a non-empty text")
    assert first_problem({"name": "a", "rows": []}) == ("bad", "rows", [], "a list of rows")
    assert first_problem({"name": "a", "rows": [{"n": 1}, {"n": True}]}) == \
        ("bad", "rows[1].n", True, "a whole number >= 1")
    assert first_problem({"name": "a", "rows": [{"m": 1}]}) == ("missing", "rows[0]", ["n"], ("n",))


def test_number_bounds_and_the_cross_field_rule():
    assert first_problem({"name": "a", "rows": [{"n": 1}], "rate": 11}) == \
        ("bad", "rate", 11, "a number > 0 and at most 10")
    assert first_problem({"name": "a", "rows": [{"n": 1}], "rate": float("nan")})[:2] == ("bad", "rate")
    assert first_problem({"name": "a", "rows": [{"n": 1}], "rate": 2.0}) == ("bad", "rate", 2.0, "at most one per row")


def test_not_a_mapping_at_the_top():
    assert first_problem([1]) == ("bad", "", [1], "a document")
