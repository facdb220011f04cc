"""Change events in Debezium's JSON envelope, so real Debezium or Flink CDC can replace ours.

One change event per Kafka record: key = the row's primary key (JSON), value =

    {"before": {...} | null, "after": {...} | null, "op": "c" | "u" | "d" | "r",
     "ts_ms": <capture time>, "source": {"connector": "postgresql" | "mongodb", "name": ...,
     "db": ..., "schema": ..., "table": ... | "collection": ..., "lsn": ..., "sequence": ...,
     "txId": ..., "ts_ms": <commit time>, "snapshot": "true" | "false"}}

PostgreSQL sources carry `lsn` (the change's own LSN) and `sequence` =
'["<commit lsn>","<change lsn>"]' as Debezium does; MongoDB sources carry `resume_token`
and `ord` (the change's clusterTime increment), plus `ts_ms` (clusterTime seconds × 1000).

`position(event)` orders the changes of one row: a redelivered change has a position no
greater than one already applied, which is how consumers drop duplicates.

>>> e = envelope("c", None, {"id": 1, "x": "a"}, postgres_source("pg", "db", "public", "t",
...              commit_lsn=100, lsn=90, tx_id=7, commit_ts_ms=5, snapshot=False), ts_ms=6)
>>> position(e), row_key(e, ["id"])
((100, 90, 0), 'postgresql/pg/db.public.t/[1]')
"""

from __future__ import annotations

import json
from typing import Any

OPS = ("c", "u", "d", "r")


class CdcError(Exception):
    """A clear, user-facing reason a capture cannot run as configured (exit 2, one line)."""


def lsn_text(lsn: int) -> str:
    """PostgreSQL's own spelling of an LSN: 16/B374D848."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def postgres_source(name: str, db: str, schema: str, table: str, *, commit_lsn: int, lsn: int,
                    tx_id: int | None, commit_ts_ms: int, snapshot: bool) -> dict:
    return {"connector": "postgresql", "name": name, "db": db, "schema": schema, "table": table,
            "lsn": lsn, "sequence": json.dumps([str(commit_lsn), str(lsn)]), "txId": tx_id,
            "ts_ms": commit_ts_ms, "snapshot": "true" if snapshot else "false"}


def mongo_source(name: str, db: str, collection: str, *, resume_token: str, cluster_time: tuple[int, int],
                 tx_number: int | None, snapshot: bool = False) -> dict:
    return {"connector": "mongodb", "name": name, "db": db, "collection": collection,
            "resume_token": resume_token, "ord": cluster_time[1], "txnNumber": tx_number, "txId": tx_number,
            "ts_ms": cluster_time[0] * 1000, "snapshot": "true" if snapshot else "false"}


def envelope(op: str, before: dict | None, after: dict | None, source: dict, ts_ms: int) -> dict:
    assert op in OPS, op
    return {"before": before, "after": after, "op": op, "source": source, "ts_ms": ts_ms}


def position(event: dict) -> tuple:
    """A total order on one source's changes (PostgreSQL: commit LSN, change LSN)."""
    src = event["source"]
    if src["connector"] == "postgresql":
        commit, lsn = json.loads(src["sequence"])
        return (int(commit), int(lsn), src.get("tx_index", 0))
    return (src["ts_ms"] // 1000, src["ord"], src.get("resume_token") or "")


def table_of(event: dict) -> str:
    src = event["source"]
    if src["connector"] == "postgresql":
        return f"{src['db']}.{src['schema']}.{src['table']}"
    return f"{src['db']}.{src['collection']}"


def row_key(event: dict, key_fields: list[str]) -> str:
    """Stable identity of the changed row: connector/name/table/[primary key values]."""
    src = event["source"]
    image = event["after"] if event["after"] is not None else event["before"]
    values = [_plain(image.get(f)) for f in key_fields]
    return f"{src['connector']}/{src['name']}/{table_of(event)}/{json.dumps(values, separators=(',', ':'))}"


def source_position_text(event: dict) -> dict:
    """What lineage records about a change: its LSNs or resume token."""
    src = event["source"]
    if src["connector"] == "postgresql":
        commit, lsn = json.loads(src["sequence"])
        return {"commit_lsn": lsn_text(int(commit)), "lsn": lsn_text(int(lsn)), "txId": src.get("txId")}
    return {"resume_token": src["resume_token"], "cluster_time": [src["ts_ms"] // 1000, src["ord"]]}


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
