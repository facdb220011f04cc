"""`postgres://user@host:port/db?table=T[&table=T2][&slot=S][&publication=P][&password_env=VAR|&password_file=/PATH]`.

No password in the URI (core/sources/base.py): `password_env` / `password_file` name where
the capture reads it; without either, libpq's own defaults apply (PGPASSWORD, ~/.pgpass).

Tables are `schema.table` (a bare name is in `public`). Change events carry Debezium's
PostgreSQL source fields; they are ordered by (commit LSN, change LSN, index in the
transaction).

>>> src = source_for("postgres://h/app?table=answers&slot=my_slot")
>>> src.tables, src.slot, src.publication
(('public.answers',), 'my_slot', None)
>>> source_for("postgres://h/app?table=a&slot=x;DROP")
Traceback (most recent call last):
...
ValueError: slot must be a PostgreSQL identifier ([a-z_][a-z0-9_]*, at most 63 chars), got 'x;DROP'
>>> source_for("postgres://u@h/app?table=a&password=s3cret")
Traceback (most recent call last):
...
ValueError: a password in a source URI is refused (it would be stored, published and shown): name a secret reference instead, ?password_env=VAR or ?password_file=/run/secrets/FILE
>>> lsn_text(parse_lsn("16/B374D848"))
'16/B374D848'
"""

from __future__ import annotations

import json
import re
from typing import Any

from core.sources.base import SourceKind, register_source_kind, source_for  # noqa: F401 (doctest)

IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
TABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*(\.[A-Za-z_][A-Za-z0-9_$]*)?")


def lsn_text(lsn: int) -> str:
    """PostgreSQL's own spelling of an LSN: 16/B374D848."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def qualified(table: str) -> str:
    """schema.table; a bare name is in schema public."""
    return table if "." in table else f"public.{table}"


def table_source_id(table: str) -> str:
    """A PostgreSQL table as a source id.

    >>> table_source_id("answers")
    'postgres:public.answers'
    """
    return "postgres:" + qualified(table)


@register_source_kind
class PostgresSource(SourceKind):
    scheme = "postgres"
    aliases = ("postgresql",)
    example = "postgres://…?table=NAME"
    connector = "postgresql"
    change_fields = ("db", "schema", "table", "sequence", "ts_ms")  # ts_ms: the samples' event time
    capture = "connectors.postgres_wal:PostgresCapture"
    snapshots = True

    def _parse(self, parts, name):
        tables = self.query.get("table")
        if not tables:
            raise ValueError("postgres sources need ?table=NAME (repeat for more tables)")
        for t in tables:
            if not TABLE.fullmatch(t):
                raise ValueError(f"table must be NAME or SCHEMA.NAME, got {t!r}")
        self.tables = tuple(qualified(t) for t in tables)
        for option in ("slot", "publication"):
            value = self._one(option)
            if value is not None and not IDENTIFIER.fullmatch(value):
                raise ValueError(f"{option} must be a PostgreSQL identifier ([a-z_][a-z0-9_]*, at most 63 chars), "
                                 f"got {value!r}")
            setattr(self, option, value)
        self.db = parts.path.lstrip("/") or "postgres"
        self.dsn = self._connection_uri(parts, ("table", "slot", "publication"), scheme="postgresql")
        self.name = name or f"pg-{self.db}"

    @property
    def source_ids(self) -> tuple[str, ...]:
        return tuple(table_source_id(t) for t in self.tables)

    @classmethod
    def change_source(cls, name: str, db: str, schema: str, table: str, *, commit_lsn: int, lsn: int,
                      tx_index: int, tx_id: int | None, commit_ts_ms: int, snapshot: bool) -> dict[str, Any]:
        """Debezium's PostgreSQL `source` block (plus `tx_index`, the change's place in its transaction)."""
        return {"connector": cls.connector, "name": name, "db": db, "schema": schema, "table": table,
                "lsn": lsn, "sequence": json.dumps([str(commit_lsn), str(lsn)]), "tx_index": tx_index,
                "txId": tx_id, "ts_ms": commit_ts_ms, "snapshot": "true" if snapshot else "false"}

    @classmethod
    def table_of(cls, source: Any) -> str:
        return f"{source.db}.{source.field('schema')}.{source.table}"

    @classmethod
    def change_source_id(cls, source: Any) -> str:
        return f"postgres:{source.field('schema')}.{source.table}"

    @classmethod
    def position(cls, source: Any) -> tuple:
        commit, lsn = json.loads(source.sequence)
        return (int(commit), int(lsn), source.tx_index or 0)

    @classmethod
    def position_text(cls, source: Any) -> str:
        commit, lsn, index = cls.position(source)
        return f"{lsn_text(commit)}/{lsn_text(lsn)}/{index}"

    @classmethod
    def lineage(cls, source: Any) -> dict[str, Any]:
        commit, lsn, _ = cls.position(source)
        return {"commit_lsn": lsn_text(commit), "lsn": lsn_text(lsn), "txId": source.txId}
