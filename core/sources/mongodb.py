"""`mongodb://[user@]host:port/?db=NAME&collection=NAME[&replicaSet=…][&password_env=VAR|&password_file=/PATH]`.

No password in the URI (core/sources/base.py): the capture reads it from the secret reference.

Change events carry the resume token and the change's clusterTime (seconds in `ts_ms`,
increment in `ord`); they are ordered by (clusterTime, increment, token).

>>> src = source_for("mongodb://h:27017/?replicaSet=rs0&db=shop&collection=reviews")
>>> src.source_id, src.name, src.connection_uri
('mongodb:shop.reviews', 'mongo-shop-reviews', 'mongodb://h:27017/?replicaSet=rs0')
"""

from __future__ import annotations

import re
from typing import Any

from core.sources.base import SourceKind, register_source_kind, source_for  # noqa: F401 (doctest)

# MongoDB's own naming rules. A database name has no '.', so `db.collection` (a source id, a
# mapping's collection) reads one way only: db=a.b&collection=c would collide with a & b.c.
DB = re.compile(r'[^/\\. "$\x00]{1,63}')
COLLECTION = re.compile(r"(?!system\.)[^$\x00]{1,255}")


def collection_source_id(collection: str) -> str:
    """`db.collection` as a source id."""
    return f"mongodb:{collection}"


@register_source_kind
class MongoSource(SourceKind):
    scheme = "mongodb"
    example = "mongodb://…?db=NAME&collection=NAME"
    connector = "mongodb"
    change_fields = ("db", "collection", "resume_token", "ts_ms", "ord")
    capture = "connectors.mongo_changes:MongoCapture"

    def _parse(self, parts, name):
        db, collection = self._one("db"), self._one("collection")
        if not db or not collection:
            raise ValueError("mongodb sources need ?db=NAME&collection=NAME")
        if not DB.fullmatch(db):
            raise ValueError(f"db must be a MongoDB database name (no / \\ . space \" $ or NUL, at most 63 chars), "
                             f"got {db!r}")
        if not COLLECTION.fullmatch(collection):
            raise ValueError(f"collection must be a MongoDB collection name (no $ or NUL, not system.*), "
                             f"got {collection!r}")
        self.db, self.collection = db, collection
        self.connection_uri = self._connection_uri(parts, ("db", "collection"))
        self.name = name or f"mongo-{db}-{collection}"

    @property
    def source_ids(self) -> tuple[str, ...]:
        return (collection_source_id(f"{self.db}.{self.collection}"),)

    @classmethod
    def change_source(cls, name: str, db: str, collection: str, *, resume_token: str,
                      cluster_time: tuple[int, int], tx_number: int | None) -> dict[str, Any]:
        """Debezium's MongoDB `source` block: clusterTime seconds in `ts_ms`, increment in `ord`."""
        return {"connector": cls.connector, "name": name, "db": db, "collection": collection,
                "resume_token": resume_token, "ord": cluster_time[1], "txnNumber": tx_number, "txId": tx_number,
                "ts_ms": cluster_time[0] * 1000, "snapshot": "false"}

    @classmethod
    def table_of(cls, source: Any) -> str:
        return f"{source.db}.{source.collection}"

    @classmethod
    def change_source_id(cls, source: Any) -> str:
        return collection_source_id(cls.table_of(source))

    @classmethod
    def position(cls, source: Any) -> tuple:
        return (source.ts_ms // 1000, source.ord, source.resume_token or "")

    @classmethod
    def position_text(cls, source: Any) -> str:
        return f"{source.ts_ms // 1000}.{source.ord}"

    @classmethod
    def lineage(cls, source: Any) -> dict[str, Any]:
        return {"resume_token": source.resume_token, "cluster_time": [source.ts_ms // 1000, source.ord]}
