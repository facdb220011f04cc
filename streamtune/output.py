"""How read commands print what they got: `-o table|json|yaml`.

The default is a table when stdout is a terminal and JSON otherwise, so a person reads
columns and a script (or a pipe into jq) keeps getting the JSON it always got. A command
whose output was always a table (`streamtune stack status`) passes default="table".

Tables use rich when it is installed, plain aligned columns otherwise. A payload becomes:
a list of mappings: one row each; a mapping: key/value rows, with a list of mappings inside
it printed as its own table under the scalars.

>>> print(render([{"name": "a", "state": "RUNNING"}, {"name": "bb", "state": None}], "table", rich_ok=False))
name  state
----  -------
a     RUNNING
bb    -
>>> print(render({"model": "m", "versions": [1, 2]}, "yaml"), end="")
model: m
versions:
- 1
- 2
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

FORMATS = ("table", "json", "yaml")


def add_output_option(p: argparse.ArgumentParser, default: str | None = None) -> None:
    shown = default or "table on a terminal, else json"
    p.add_argument("-o", "--output", choices=FORMATS, default=default,
                   help=f"output format (default: {shown})")


def chosen_format(fmt: str | None, out: TextIO | None = None) -> str:
    """`fmt` as given, else table on a terminal and json otherwise."""
    if fmt:
        return fmt
    out = out or sys.stdout
    return "table" if out.isatty() else "json"


def emit(payload: Any, fmt: str | None, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    fmt = chosen_format(fmt, out)
    text = render(payload, fmt, rich_ok=fmt == "table" and out.isatty())
    if text:
        print(text, file=out)


def render(payload: Any, fmt: str, rich_ok: bool = True) -> str:
    if fmt == "json":
        return json.dumps(payload, indent=2)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(payload, sort_keys=False, allow_unicode=True)
    return "\n\n".join(_table(header, rows, rich_ok) for header, rows in _tables(payload))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _records_table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    header: list[str] = []
    for record in records:
        header += [k for k in record if k not in header]
    return header, [[_cell(r.get(k)) for k in header] for r in records]


def _tables(payload: Any) -> list[tuple[list[str], list[list[str]]]]:
    if _is_records(payload):
        return [_records_table(payload)]
    if isinstance(payload, dict):
        scalars = [[str(k), _cell(v)] for k, v in payload.items() if not _is_records(v)]
        tables = [(["key", "value"], scalars)] if scalars else []
        return tables + [_records_table(v) for v in payload.values() if _is_records(v)]
    if isinstance(payload, list):
        return [(["value"], [[_cell(v)] for v in payload])] if payload else []
    return [(["value"], [[_cell(payload)]])]


def _table(header: list[str], rows: list[list[str]], rich_ok: bool) -> str:
    if rich_ok:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            pass
        else:
            table = Table(*header)
            for row in rows:
                table.add_row(*row)
            console = Console(file=sys.stdout)
            with console.capture() as captured:
                console.print(table)
            return captured.get().rstrip("\n")
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
