"""MongoDB change streams into Debezium-shaped change events, resumable by token.

`watch()` with `fullDocument=updateLookup` (the document as it is when the change is read)
and `fullDocumentBeforeChange=whenAvailable` (pre-images, when the collection has
`changeStreamPreAndPostImages` enabled). Every event carries its resume token; the capture
stores the token of the last event Kafka acknowledged, and a restart resumes after it:
what was in flight is read again (at least once) and consumers drop the repeats by
(collection, _id, clusterTime, token).

A `drop`, `rename` or `dropDatabase` invalidates the stream. The event is logged and the
watch starts again *after* the invalidate token, so a collection created again under the
same name keeps being captured.

    changes = MongoChanges("mongodb://host/?replicaSet=rs0", "shop", "reviews", name="mongo")
    for item in changes.stream(resume_token=None):
        if isinstance(item, Change): ...               # item.event: a Debezium envelope
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import pymongo
import pymongo.errors
from bson import json_util

from core import transport
from core.errors import CaptureError
from core.messages import ChangeEnvelope, ChangeSource
from core.sources.mongodb import MongoSource

log = logging.getLogger("streamtune.cdc.mongo")

OPS = {"insert": "c", "update": "u", "replace": "u", "delete": "d"}
INVALIDATING = {"drop", "rename", "dropDatabase"}


@dataclass
class Change:
    token: dict
    event: ChangeEnvelope


@dataclass
class TokenOnly:
    """A position with no event of ours (idle stream, or an invalidating event)."""
    token: dict


def plain(doc):
    """BSON → JSON-able values (relaxed extended JSON: ObjectId → {"$oid": …})."""
    return None if doc is None else json.loads(json_util.dumps(doc, json_options=json_util.RELAXED_JSON_OPTIONS))


class MongoChanges:
    def __init__(self, uri: str, db: str, collection: str, *, name: str, idle_s: float = 0.05,
                 password: str | None = None):
        # The password (the source's secret reference) is a client argument, never in the URI or argv.
        auth = {"password": password} if password else {}
        self.client = pymongo.MongoClient(uri, serverSelectionTimeoutMS=10000, **transport.pymongo_kwargs(), **auth)
        self.db, self.collection, self.name, self.idle_s = db, collection, name, idle_s

    def stream(self, resume_token: dict | None):
        try:
            yield from self._stream(resume_token)
        except pymongo.errors.OperationFailure as e:
            if e.code in (280, 286):  # ChangeStreamFatalError, ChangeStreamHistoryLost
                raise CaptureError(f"{self.db}.{self.collection}: the stored resume token is no longer in the oplog "
                               f"({e.details.get('errmsg', e) if e.details else e}); changes since were lost to "
                               "this capture: start it under a new --name, and backfill if needed") from None
            raise

    def _stream(self, resume_token: dict | None):
        coll = self.client[self.db][self.collection]
        start = {"resume_after": resume_token} if resume_token else {}
        while True:
            with coll.watch(full_document="updateLookup", full_document_before_change="whenAvailable",
                            max_await_time_ms=int(self.idle_s * 1000), **start) as changes:
                invalidated = None
                while changes.alive:
                    raw = changes.try_next()
                    if raw is None:
                        if changes.resume_token is not None:
                            yield TokenOnly(changes.resume_token)
                        else:
                            yield None
                        continue
                    kind = raw["operationType"]
                    if kind == "invalidate":
                        invalidated = raw["_id"]
                        yield TokenOnly(raw["_id"])
                        break
                    if kind in INVALIDATING:
                        log.warning("%s.%s: %s event (%s); the stream will be invalidated and restarted after it",
                                    self.db, self.collection, kind, raw.get("to") or "")
                        yield TokenOnly(raw["_id"])
                        continue
                    if kind not in OPS:
                        log.info("%s.%s: ignoring %s event", self.db, self.collection, kind)
                        yield TokenOnly(raw["_id"])
                        continue
                    yield Change(raw["_id"], self._event(raw))
            if invalidated is None:
                raise ConnectionError(f"change stream on {self.db}.{self.collection} closed")
            # start_after (not resume_after) is what MongoDB accepts after an invalidate.
            start = {"start_after": invalidated}

    def _event(self, raw: dict) -> ChangeEnvelope:
        op = OPS[raw["operationType"]]
        ct = raw["clusterTime"]
        before = plain(raw.get("fullDocumentBeforeChange"))
        after = plain(raw.get("fullDocument")) if op != "d" else None
        if op == "d" and before is None:
            before = plain(raw["documentKey"])
        if op == "u" and after is None:
            # updateLookup found no document (deleted since): keep at least the key.
            before = before or plain(raw["documentKey"])
        src = MongoSource.change_source(self.name, self.db, self.collection, resume_token=raw["_id"]["_data"],
                                        cluster_time=(ct.time, ct.inc), tx_number=raw.get("txnNumber"))
        return ChangeEnvelope(op=op, before=before, after=after, source=ChangeSource.model_validate(src),
                              ts_ms=int(time.time() * 1000), key_fields=["_id"])

    def close(self) -> None:
        self.client.close()


class MongoCapture:
    """The capture loop of one collection (`streamtune cdc`): changes to `sink`, then the token."""

    retryable = (pymongo.errors.ConnectionFailure,)  # resumed from the last stored token

    def __init__(self, source: MongoSource, linger_s: float):
        self.source, self.linger_s = source, linger_s

    def run(self, sink) -> None:
        s = self.source
        changes = MongoChanges(s.connection_uri, s.db, s.collection, name=s.name, idle_s=self.linger_s,
                               password=s.secret_password())
        token = sink.stored.get("resume_token")
        last = token
        try:
            for item in changes.stream(token):
                if isinstance(item, Change):
                    sink.send(item.event)
                    last = item.token
                    if sink.batch_open():
                        continue
                elif item is not None:
                    last = item.token
                # Events waiting: flush now. Only an idle token moved: store it now and then.
                if last is not None and last != token and (
                        sink.unflushed or time.monotonic() - sink.last_stored >= 1.0):
                    sink.flush({"resume_token": last})
                    token = last
                sink.progress(f"token {json.dumps(token)[:60] if token else 'none'}")
                if sink.stopping:
                    break
        finally:
            changes.close()
