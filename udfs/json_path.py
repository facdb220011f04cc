"""`json_path(json_str, path)`: one value out of a JSON document, as STRING; never raises.

Paths: ``$`` followed by steps ``.name``, ``['name']`` / ``["name"]`` (any key, dots
included) and ``[index]`` (0-based; negative counts from the end), e.g. ``$.a.b[0]``,
``$['source']['topic']``, ``$.items[-1].id``.

Result: a JSON string as its text; a number or boolean as its JSON text (``1.5``,
``true``); an object or array as compact JSON. NULL when the input or path is NULL or not
valid, the JSON cannot be parsed, the path does not exist, or the value is JSON null.

    SELECT json_path(payload, '$.model_id') FROM dlq;   -- the model of a rejected sample

>>> extract('{"a": {"b": [7, {"c": "x"}]}}', '$.a.b[1].c')
'x'
>>> extract('{"a": {"b": [7, 8]}}', '$.a.b')
'[7,8]'
>>> extract('not json', '$.a') is None
True
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from pyflink.table import DataTypes
from pyflink.table.udf import udf

_STEP = re.compile(r"""\.([^.\[\]'"]+)|\[\s*(-?\d+)\s*\]|\[\s*'((?:[^'\\]|\\.)*)'\s*\]|\[\s*"((?:[^"\\]|\\.)*)"\s*\]""")


@lru_cache(maxsize=1024)
def parse_path(path: str) -> tuple | None:
    """`$.a[0]['b']` -> ('a', 0, 'b'); None when the path is not valid."""
    if not isinstance(path, str) or not path.startswith("$"):
        return None
    steps, pos = [], 1
    while pos < len(path):
        m = _STEP.match(path, pos)
        if m is None:
            return None
        name, index, single, double = m.groups()
        if index is not None:
            steps.append(int(index))
        else:
            key = name if name is not None else (single if single is not None else double)
            if name is None:
                key = re.sub(r"\\(.)", r"\1", key)
            steps.append(key)
        pos = m.end()
    return tuple(steps)


def extract(json_str: str | None, path: str | None) -> str | None:
    try:
        steps = parse_path(path)
        if steps is None or not isinstance(json_str, str):
            return None
        value = json.loads(json_str)
        for step in steps:
            if isinstance(step, int):
                if not isinstance(value, list) or not -len(value) <= step < len(value):
                    return None
                value = value[step]
            else:
                if not isinstance(value, dict) or step not in value:
                    return None
                value = value[step]
        if value is None:
            return None
        if isinstance(value, str):
            return value
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except Exception:  # never fail a query over one bad record
        return None


json_path = udf(extract, input_types=[DataTypes.STRING(), DataTypes.STRING()],
                result_type=DataTypes.STRING(), name="json_path")
