"""Change envelope: one database change in Debezium's JSON form, so real Debezium or Flink
CDC can write the same topics as `streamtune cdc`.

Kafka key: the row's primary key as a JSON object. Value:

    {"before": {...} | null, "after": {...} | null, "op": "c" | "u" | "d" | "r",
     "ts_ms": <capture time>, "source": {"connector": "postgresql" | "mongodb", "name": ...,
     "db": ..., ...the fields its source kind requires (core.sources)...},
     "key_fields": [primary key columns]}

What a source must carry, how its changes are ordered and how lineage names them belongs to
its source kind (core/sources/), found by `source.connector`.

>>> e = ChangeEnvelope.from_dict({"op": "c", "before": None, "after": {"id": 1}, "ts_ms": 6,
...     "source": {"connector": "postgresql", "name": "pg", "db": "app", "schema": "public",
...     "table": "t", "lsn": 90, "sequence": '["100","90"]', "ts_ms": 5}})
>>> e.position(), e.table, e.source_id, e.row_key(["id"])
((100, 90, 0), 'app.public.t', 'postgres:public.t', 'postgresql/pg/app.public.t/[1]')
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, model_validator

from core.errors import InvalidMessage
from core.messages.base import Message
from core.sources import SourceKind, kind_for_connector

OPS = ("c", "u", "d", "r")


class ChangeSource(Message):
    """Debezium's `source` block; fields other than these are kept as they came."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    connector: str
    name: str = ""
    db: str
    ts_ms: Optional[int] = None
    snapshot: str = "false"
    # PostgreSQL (`schema` would shadow a BaseModel attribute: spelled `schema` on the wire)
    schema_: Optional[str] = Field(default=None, alias="schema")
    table: Optional[str] = None
    lsn: Optional[int] = None
    sequence: Optional[str] = None       # '["<commit lsn>","<change lsn>"]'
    tx_index: Optional[int] = None
    # MongoDB
    collection: Optional[str] = None
    resume_token: Optional[str] = None
    ord: Optional[int] = None
    txnNumber: Optional[int] = None
    # both
    txId: Optional[int] = None

    @property
    def kind(self) -> type[SourceKind]:
        return kind_for_connector(self.connector)


    def field(self, name: str) -> Any:
        """A source field by its wire name (`schema`, not `schema_`)."""
        return getattr(self, "schema_" if name == "schema" else name, None)


class ChangeEnvelope(Message):
    model_config = ConfigDict(extra="allow", frozen=True)

    op: Literal["c", "u", "d", "r"]
    before: Optional[dict[str, Any]] = None
    after: Optional[dict[str, Any]] = None
    source: ChangeSource
    ts_ms: int = 0
    key_fields: Optional[list[str]] = None

    @model_validator(mode="after")
    def _complete(self) -> "ChangeEnvelope":
        try:
            kind = self.source.kind
        except KeyError:
            raise ValueError(f"unknown source connector {self.source.connector!r}") from None
        missing = [f for f in kind.change_fields if self.source.field(f) is None]
        if missing:
            raise ValueError(f"{kind.connector} sources need {', '.join(kind.change_fields)}; missing {missing}")
        if self.op in ("c", "r") and self.after is None:
            raise ValueError(f"op {self.op} needs an `after` object")
        try:  # row changes are ordered and named by it downstream: unreadable is a dead letter here
            self.position(), self.position_text()
        except (TypeError, ValueError, ArithmeticError, RecursionError) as e:
            raise ValueError(f"{kind.connector} change position unreadable: {e}") from None
        return self

    @classmethod
    def from_dict(cls, data: Any) -> "ChangeEnvelope":
        if not isinstance(data, dict) or data.get("op") not in OPS or not isinstance(data.get("source"), dict):
            raise InvalidMessage("not_a_change_event",
                                 "expected a Debezium envelope {before, after, op: c|u|d|r, source}")
        try:
            return super().from_dict(data)
        except InvalidMessage as e:
            raise InvalidMessage("not_a_change_event", e.detail) from None

    def to_json(self) -> str:
        """Debezium's shape: `before` and `after` always present (null when absent)."""
        return json.dumps({"before": self.before, "after": self.after,
                           **self.model_dump(mode="json", by_alias=True, exclude_none=True)},
                          separators=(",", ":"), default=str)

    @property
    def image(self) -> Optional[dict[str, Any]]:
        """The row as it is after the change, or as it was before a delete."""
        return self.after if self.after is not None else self.before

    @property
    def table(self) -> str:
        """db.schema.table (PostgreSQL) or db.collection (MongoDB)."""
        return self.source.kind.table_of(self.source)

    @property
    def source_id(self) -> str:
        """The same id as FinetuneSpec.source_id for a spec naming this table or collection."""
        return self.source.kind.change_source_id(self.source)

    def position(self) -> tuple:
        """A total order on one source's changes: a repeat is at or below an applied one."""
        return self.source.kind.position(self.source)

    def position_text(self) -> str:
        return self.source.kind.position_text(self.source)

    def origin(self, row_key: str) -> "ChangeOrigin":
        return ChangeOrigin(row_key=row_key, op=self.op, table=self.table, **self.source.kind.lineage(self.source))

    def row_key(self, key_fields: list[str]) -> str:
        """Stable identity of the changed row: connector/name/table/[primary key values]."""
        image = self.image or {}
        values = [_plain(image.get(f)) for f in key_fields]
        return self.row_key_from(json.dumps(values, separators=(",", ":")))

    def row_key_from(self, key: str) -> str:
        """The row identity from a Kafka key (Debezium: the primary key as JSON)."""
        return f"{self.source.connector}/{self.source.name}/{self.table}/{key}"


class ChangeOrigin(Message):
    """Where a sample made from a change came from, carried into version lineage."""

    row_key: str
    op: Literal["c", "u", "d", "r"]
    table: str
    # PostgreSQL
    commit_lsn: Optional[str] = None
    lsn: Optional[str] = None
    txId: Optional[int] = None
    # MongoDB
    resume_token: Optional[str] = None
    cluster_time: Optional[list[int]] = None
    # set in version lineage: the sample this change became
    sample_id: Optional[str] = None


class Retraction(Message):
    """A row deleted (or no longer passing the mapping's filter): drop its untrained sample."""

    row_key: str
    origin: ChangeOrigin


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
