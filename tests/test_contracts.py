"""sql/ddl.sql against the wire messages (core.messages), without a stack.

Each table reads one message's JSON: every physical column it declares must be a field of
that message with a Flink type that holds the field's values, every required field must be
declared (unless listed in NOT_DECLARED, with the reason), and a column holding one of fixed
values (a Literal field) lists exactly those values in its COMMENT. Metadata and computed
columns and the watermark are the table's own, not the message's.
"""

from __future__ import annotations

import inspect
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from core.messages import AdapterVersionBroadcast, DeadLetter, FeedbackSample, InferenceRecord, VersionRecord
from streamtune.sqlclient.scanner import split_statements

pytestmark = pytest.mark.sql

DDL = Path(__file__).resolve().parents[1] / "sql" / "ddl.sql"
TABLES: dict[str, type[BaseModel]] = {"feedback": FeedbackSample, "dlq": DeadLetter, "versions": VersionRecord,
                                      "adapter_versions": AdapterVersionBroadcast, "inference_log": InferenceRecord}
# Required message fields a table leaves out on purpose, by path, with the reason.
NOT_DECLARED = {
    # the sample ids and offsets of every trained sample: for the registrar and audits;
    # a per-version list of unbounded length, not a column to aggregate over
    "versions.lineage": "audit data, unbounded",
}
# Flink types that hold each Python type of a message field.
HOLDS = {str: {"STRING"}, int: {"BIGINT", "INT"}, float: {"DOUBLE"}, bool: {"BOOLEAN"}}


# ------------------------------------------------------------------------- reading the DDL

@dataclass(frozen=True)
class FlinkType:
    name: str                                 # STRING, BIGINT, ROW, ARRAY, TIMESTAMP_LTZ, ...
    fields: tuple["Column", ...] = ()         # of a ROW
    element: Optional["FlinkType"] = None     # of an ARRAY

    def __str__(self) -> str:
        if self.name == "ROW":
            return "ROW<" + ", ".join(f"{f.name} {f.type}" for f in self.fields) + ">"
        return f"ARRAY<{self.element}>" if self.name == "ARRAY" else self.name


@dataclass(frozen=True)
class Column:
    name: str
    type: FlinkType
    comment: Optional[str] = None


class Tokens:
    """Words, quoted names and strings, and brackets of one statement (other characters,
    e.g. operators of computed columns, are dropped: only their bracket depth matters)."""

    _TOKEN = re.compile(r"`(?:[^`]|``)*`|'(?:[^']|'')*'|[A-Za-z_][A-Za-z0-9_]*|\d+|[<>(),]")

    def __init__(self, text: str):
        self.items, self.pos = self._TOKEN.findall(text), 0

    def peek(self) -> str:
        return self.items[self.pos] if self.pos < len(self.items) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if expected is not None and token.upper() != expected:
            raise ValueError(f"expected {expected}, got {token!r} at token {self.pos}")
        self.pos += 1
        return token

    def skip_to_separator(self) -> None:
        """To the ',' or ')' that ends the current column definition (not taken)."""
        depth = 0
        while self.peek() and not (depth == 0 and self.peek() in (",", ")")):
            depth += {"(": 1, ")": -1}.get(self.take(), 0)


def unquote(token: str) -> str:
    if token[:1] == token[-1:] and token[:1] in ("`", "'"):
        return token[1:-1].replace(token[0] * 2, token[0])
    return token


def parse_type(tokens: Tokens) -> FlinkType:
    """One Flink type, e.g. `ROW<`topic` STRING, n INT NOT NULL>`, `ARRAY<STRING>`, `TIMESTAMP_LTZ(3)`."""
    name = tokens.take().upper()
    if name == "ROW":
        tokens.take("<")
        fields = []
        while True:
            field_name = unquote(tokens.take())
            field_type = parse_type(tokens)
            description = unquote(tokens.take()) if tokens.peek().startswith("'") else None
            fields.append(Column(field_name, field_type, description))
            if tokens.take() == ">":
                return FlinkType("ROW", fields=tuple(fields))
    if name == "ARRAY":
        tokens.take("<")
        element = parse_type(tokens)
        tokens.take(">")
        return FlinkType("ARRAY", element=element)
    if tokens.peek() == "(":  # precision, e.g. TIMESTAMP_LTZ(3)
        while tokens.take() != ")":
            pass
    if tokens.peek().upper() == "NOT":
        tokens.take("NOT")
        tokens.take("NULL")
    return FlinkType(name)


def physical_column(tokens: Tokens) -> Column | None:
    """The column definition at `tokens`, or None for a metadata or computed column, a
    watermark or a constraint; leaves the tokens at the separator after it."""
    first = tokens.take()
    if first.upper() in ("WATERMARK", "PRIMARY", "CONSTRAINT") or tokens.peek().upper() == "AS":
        tokens.skip_to_separator()
        return None
    column_type, comment, metadata = parse_type(tokens), None, False
    while tokens.peek() not in (",", ")"):
        word = tokens.take().upper()
        if word == "COMMENT":
            comment = unquote(tokens.take())
        metadata |= word == "METADATA"
    return None if metadata else Column(unquote(first), column_type, comment)


def create_tables(ddl: str) -> dict[str, list[Column]]:
    """The physical columns of every CREATE TABLE statement in `ddl`, by table name."""
    tables = {}
    for statement in split_statements(ddl):
        tokens = Tokens(statement)
        if tokens.peek().upper() != "CREATE" or "TABLE" not in (t.upper() for t in tokens.items[:3]):
            continue
        while tokens.take().upper() != "TABLE":
            pass
        if tokens.peek().upper() == "IF":
            for word in ("IF", "NOT", "EXISTS"):
                tokens.take(word)
        name = unquote(tokens.take())
        tokens.take("(")
        columns = []
        while True:
            column = physical_column(tokens)
            if column is not None:
                columns.append(column)
            if tokens.take() == ")":
                break
        tables[name] = columns
    return tables


# ------------------------------------------------------------------------- the contract

def wire_fields(model: type[BaseModel]) -> dict:
    """A message's fields by their JSON name."""
    return {info.alias or name: info for name, info in model.model_fields.items()}


def without_none(annotation) -> tuple[object, bool]:
    """(the type, whether None is allowed) of a field annotation."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else Union[tuple(args)]), len(args) < len(get_args(annotation))
    return annotation, False


def type_problems(where: str, flink: FlinkType, annotation) -> list[str]:
    """Why a column of type `flink` cannot hold the values of a field typed `annotation`."""
    annotation, _ = without_none(annotation)
    origin = get_origin(annotation)
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        if flink.name != "ROW":
            return [f"{where}: {flink} does not hold the object {annotation.__name__}"]
        return row_problems(where, flink.fields, annotation)
    if origin is list:
        if flink.name != "ARRAY":
            return [f"{where}: {flink} does not hold a list"]
        return type_problems(f"{where}[]", flink.element, get_args(annotation)[0])
    python_type = type(get_args(annotation)[0]) if origin is Literal else annotation
    if flink.name not in HOLDS.get(python_type, ()):
        return [f"{where}: {flink} does not hold {getattr(python_type, '__name__', python_type)}"]
    return []


def listed_values_problems(where: str, column: Column, annotation) -> list[str]:
    """A Literal field's column lists its values in its COMMENT: `a | b | c` (`| NULL` when
    it may be missing), then optionally `; more words`."""
    annotation, optional = without_none(annotation)
    if get_origin(annotation) is not Literal:
        return []
    expected = {*get_args(annotation), *(["NULL"] if optional else [])}
    listed = {v.strip() for v in column.comment.split(";")[0].split("|")} if column.comment else set()
    if listed != expected:
        return [f"{where}: COMMENT lists {sorted(listed)}, the message allows {sorted(expected)}"]
    return []


def row_problems(where: str, columns, model: type[BaseModel]) -> list[str]:
    """Columns (of a table or a ROW) against the fields of `model`, both ways."""
    fields, problems = wire_fields(model), []
    for column in columns:
        path = f"{where}.{column.name}"
        if column.name not in fields:
            problems.append(f"{path}: {model.__name__} has no field {column.name}")
            continue
        annotation = fields[column.name].annotation
        problems += type_problems(path, column.type, annotation) + listed_values_problems(path, column, annotation)
    declared = {c.name for c in columns}
    problems += [f"{where}: {model.__name__}.{name} is required but not declared"
                 for name, info in fields.items()
                 if info.is_required() and name not in declared and f"{where}.{name}" not in NOT_DECLARED]
    return problems


def contract_problems(ddl: str) -> list[str]:
    """Every way the tables of `ddl` differ from their messages (TABLES); [] when they agree."""
    tables = create_tables(ddl)
    problems = [f"{table}: not declared" for table in TABLES if table not in tables]
    for table, model in TABLES.items():
        problems += row_problems(table, tables.get(table, []), model) if table in tables else []
    return problems


# ------------------------------------------------------------------------- tests

def test_ddl_tables_declare_their_messages_fields():
    tables = create_tables(DDL.read_text())
    assert set(TABLES) <= set(tables)
    assert [c.name for c in tables["feedback"]][:2] == ["model_id", "sample_id"]  # metadata columns left out
    assert "event_time" not in {c.name for c in tables["dlq"]}                      # computed column left out
    assert contract_problems(DDL.read_text()) == []


def test_exclusions_name_real_required_fields():
    """NOT_DECLARED stays honest: each entry is a required field the table indeed leaves out."""
    tables = create_tables(DDL.read_text())
    for path in NOT_DECLARED:
        table, name = path.split(".")
        assert wire_fields(TABLES[table])[name].is_required(), path
        assert name not in {c.name for c in tables[table]}, path


@pytest.mark.parametrize("old, new, reported", [
    ("  sample_id STRING,", "  sample_key STRING,", "feedback.sample_key: FeedbackSample has no field sample_key"),
    ("  sample_id STRING,", "  sample_key STRING,", "feedback: FeedbackSample.sample_id is required but not declared"),
    ("  weight DOUBLE", "  weight BIGINT", "feedback.weight: BIGINT does not hold float"),
    ("  kind STRING", "  kind INT", "dlq.kind: INT does not hold str"),
    ("`offset` BIGINT, `timestamp`", "`offset` STRING, `timestamp`", "dlq.source.offset: STRING does not hold int"),
    (" | unsigned_response'", "'", "dlq.reason: COMMENT lists"),
    ("loss_after DOUBLE", "loss_after STRING", "versions.metrics.loss_after: STRING does not hold float"),
    ("target_modules ARRAY<STRING>", "target_modules STRING", "versions.adapter.target_modules: STRING does not hold a list"),
    ("  fresh_adapter BOOLEAN", "  fresh_adapter INT", "versions.fresh_adapter: INT does not hold bool"),
    ("  aliases ARRAY<STRING>", "  aliases ARRAY<INT>", "adapter_versions.aliases[]: INT does not hold str"),
    ("TABLE adapter_versions (", "TABLE adapter_version (", "adapter_versions: not declared"),
    ("  request_id STRING COMMENT 'the served", "  request_id BIGINT COMMENT 'the served",
     "feedback.request_id: BIGINT does not hold str"),
    ("'champion | candidate | pinned | base'", "'champion | candidate'", "inference_log.arm: COMMENT lists"),
    ("  latency_ms DOUBLE,", "  latency_ms BIGINT,", "inference_log.latency_ms: BIGINT does not hold float"),
])
def test_the_check_reports_a_drifted_ddl(old, new, reported):
    ddl = DDL.read_text()
    assert ddl.count(old) == 1, f"the example no longer matches ddl.sql: {old!r}"
    problems = contract_problems(ddl.replace(old, new))
    assert any(p.startswith(reported) for p in problems), problems


def test_the_check_reports_a_required_nested_field_left_out():
    ddl = DDL.read_text()
    assert ddl.count("window_seconds INT, ") == 1
    assert contract_problems(ddl.replace("window_seconds INT, ", "")) == [
        "versions.trigger_policy: TriggerPolicy.window_seconds is required but not declared"]
