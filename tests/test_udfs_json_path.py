"""json_path (udfs/json_path.py), in Python: values, paths, and never an exception."""

from __future__ import annotations

import pytest

from udfs.json_path import extract, parse_path

pytestmark = pytest.mark.sql

DOC = ('{"model_id": "m-1", "n": 3, "x": 1.5, "ok": true, "nil": null, "a": {"b": [10, {"c": "deep"}, [1, 2]]},'
       ' "dotted.key": {"k": "v"}, "q\'uote": "s", "uni": "é✓"}')


@pytest.mark.parametrize("path, expected", [
    ("$.model_id", "m-1"),
    ("$.n", "3"),
    ("$.x", "1.5"),
    ("$.ok", "true"),
    ("$.nil", None),
    ("$.a.b[0]", "10"),
    ("$.a.b[1].c", "deep"),
    ("$.a.b[-1]", "[1,2]"),
    ("$.a.b[2][1]", "2"),
    ("$.a", '{"b":[10,{"c":"deep"},[1,2]]}'),
    ("$['dotted.key'].k", "v"),
    ('$["dotted.key"]["k"]', "v"),
    ("$['q\\'uote']", "s"),
    ("$.uni", "é✓"),
])
def test_values(path, expected):
    assert extract(DOC, path) == expected


def test_the_root_object_is_compact_json():
    assert extract('{"a": [1, {"b": null}], "c": "é"}', "$") == '{"a":[1,{"b":null}],"c":"é"}'


@pytest.mark.parametrize("path", ["$.missing", "$.a.b[3]", "$.a.b[-4]", "$.model_id[0]", "$.a.b.c", "$.n.x"])
def test_missing_paths_are_null(path):
    assert extract(DOC, path) is None


@pytest.mark.parametrize("doc, path", [
    (None, "$.a"), ("not json", "$.a"), ('{"a": 1', "$.a"), ("", "$.a"), (DOC, None), (DOC, "a.b"),
    (DOC, "$..a"), (DOC, "$.a["), (DOC, "$[x]"), (DOC, "$.a b"), (42, "$.a"), (b'{"a": 1}', "$.a"),
    ('{"a": NaN}', "$.b"),
])
def test_bad_input_is_null_never_an_error(doc, path):
    assert extract(doc, path) is None


def test_scalars_at_the_root():
    assert extract('"s"', "$") == "s"
    assert extract("[1, 2]", "$[1]") == "2"
    assert extract("null", "$") is None


def test_parse_path():
    assert parse_path("$.a.b[0]") == ("a", "b", 0)
    assert parse_path("$['x y'][-2]") == ("x y", -2)
    assert parse_path("$") == ()
    assert parse_path("a") is None
