"""`streamtune cdc`: capture a PostgreSQL table set or a MongoDB collection into Kafka.

    streamtune cdc --source 'postgres://u:p@host:5432/db?table=public.feedback&table=policies'
    streamtune cdc --source 'mongodb://host:27017/?db=shop&collection=reviews' --topic shop.reviews

Each change becomes one Kafka record (key: the row's identity, value: a Debezium envelope,
see connectors/debezium.py) on `--topic`. The capture runs as a process of its own, not as a
PyFlink job: PyFlink has no Python sources and gives Python functions no checkpoint-complete
hook, so a Flink job could not tell PostgreSQL that a change is durable. Here durability is
Kafka's acknowledgement (acks=all): the slot is confirmed, and the Mongo resume token stored,
only for changes Kafka has acknowledged. A crash (kill -9) therefore re-sends at most what
was in flight; `jobs/cdc_retrain.py` drops those repeats by source position.

Positions are also written to `--offsets-topic` (key: the connector name): PostgreSQL's
confirmed position can go back across a server restart (a lost confirmation), so
transactions at or below the stored commit LSN are skipped; MongoDB resumes after the
stored token.

| option            | default                          | meaning                                       |
|-------------------|----------------------------------|-----------------------------------------------|
| --source          | (required)                       | postgres://…?table=T[&table=T2][&slot=S][&publication=P], mongodb://…?db=D&collection=C |
| --topic           | streamtune.cdc.<name>            | change events                                 |
| --name            | pg-<db> / mongo-<db>-<collection>| connector name: slot, publication, offsets key|
| --snapshot        | off                              | first start: existing rows as op "r" events   |
| --offsets-topic   | streamtune.cdc-offsets           | last durable position per connector           |
| --max-batch       | 500                              | events per Kafka flush                        |
| --linger-ms       | 5                                | longest wait before a flush                   |
| --bootstrap       | the local stack's Kafka          |                                               |
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from kafka import KafkaProducer

from connectors.debezium import lsn_text
from connectors.kafka import create_topic, read_to_end

log = logging.getLogger("streamtune.cdc")


@dataclass(frozen=True)
class Source:
    kind: str                 # "postgres" | "mongodb"
    uri: str                  # the connection string the driver gets
    name: str
    tables: tuple[str, ...] = ()
    db: str = ""
    collection: str = ""
    slot: str | None = None
    publication: str | None = None

    @classmethod
    def parse(cls, url: str, name: str | None = None) -> "Source":
        parts = urlsplit(url)
        q = parse_qs(parts.query)
        rest = urlencode({k: v for k, v in q.items()
                          if k not in ("table", "slot", "publication", "db", "collection")}, doseq=True)
        uri = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, ""))
        if parts.scheme in ("postgres", "postgresql"):
            if not q.get("table"):
                raise ValueError("postgres sources need ?table=NAME (repeat for more tables)")
            db = parts.path.lstrip("/") or "postgres"
            return cls("postgres", uri.replace("postgres://", "postgresql://", 1), name or f"pg-{db}",
                       tuple(q["table"]), db=db, slot=_one(q, "slot"), publication=_one(q, "publication"))
        if parts.scheme == "mongodb":
            if not q.get("db") or not q.get("collection"):
                raise ValueError("mongodb sources need ?db=NAME&collection=NAME")
            db, coll = q["db"][0], q["collection"][0]
            return cls("mongodb", uri, name or f"mongo-{db}-{coll}", db=db, collection=coll)
        raise ValueError(f"unsupported CDC source {url!r}: use postgres://… or mongodb://…")

    @property
    def default_topic(self) -> str:
        return "streamtune.cdc." + re.sub(r"[^A-Za-z0-9._-]", "_", self.name)


def _one(q: dict, key: str) -> str | None:
    return q[key][0] if key in q else None


def last_offsets(bootstrap: str, offsets_topic: str, name: str) -> dict:
    """The newest position record stored for connector `name` ({} when none)."""
    found = {}
    for record in read_to_end(bootstrap, offsets_topic):
        if record.key == name.encode():
            found = json.loads(record.value)
    return found


def _retryable() -> tuple:
    import psycopg
    import pymongo.errors

    from connectors.postgres_wal import SlotBusy

    return (SlotBusy, ConnectionError, psycopg.OperationalError, pymongo.errors.ConnectionFailure)


class Capture:
    """Source → Kafka with acknowledged writes before any position moves."""

    def __init__(self, source: Source, bootstrap: str, topic: str, offsets_topic: str,
                 snapshot: bool = False, max_batch: int = 500, linger_ms: int = 5):
        self.source, self.bootstrap, self.topic, self.offsets_topic = source, bootstrap, topic, offsets_topic
        self.snapshot, self.max_batch, self.linger_s = snapshot, max_batch, linger_ms / 1000
        self.unflushed = 0
        self.first_unflushed = 0.0
        self.counts = {"c": 0, "u": 0, "d": 0, "r": 0}
        self.stopping = False
        self.last_stored = 0.0

    def run(self) -> None:
        retryable = _retryable()
        for t in (self.topic, self.offsets_topic):
            create_topic(self.bootstrap, t)
        self.stored = last_offsets(self.bootstrap, self.offsets_topic, self.source.name)
        # acks=all + one request in flight: acknowledged means durable and in order.
        self.producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=0,
                                      max_in_flight_requests_per_connection=1, retries=10,
                                      key_serializer=str.encode, value_serializer=str.encode)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        log.info("capturing %s into %s (stored position: %s)", self.source.name, self.topic, self.stored or "none")
        self.last_progress = time.monotonic()
        backoff = 0.5
        try:
            while not self.stopping:
                try:
                    if self.source.kind == "postgres":
                        self._run_postgres()
                    else:
                        self._run_mongo()
                    return
                except retryable as e:
                    # e.g. the slot is still held by the walsender of a capture that just died
                    log.warning("%s: %s; retrying in %.1f s from the last durable position",
                                self.source.name, str(e).strip().splitlines()[0], backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
                    self.stored = last_offsets(self.bootstrap, self.offsets_topic, self.source.name)
        finally:
            self.producer.close(timeout=10)

    def _stop(self, *_):
        self.stopping = True

    # -- PostgreSQL -------------------------------------------------------------------
    def _run_postgres(self) -> None:
        from connectors.postgres_wal import Heartbeat, PostgresWal, Transaction

        s = self.source
        wal = PostgresWal(s.uri, list(s.tables), name=s.name, slot=s.slot, publication=s.publication)
        created, snapshot_name, at = wal.prepare()
        if self.snapshot and not created and not self.stored.get("snapshot_done"):
            # A snapshot cut short by a crash cannot be resumed: start over with a new slot.
            log.warning("snapshot of %s did not complete before: recreating slot %s", s.name, wal.slot)
            wal.close()
            wal.drop_slot()
            created, snapshot_name, at = wal.prepare()
        if self.snapshot and created:
            rows = 0
            for key, event in wal.snapshot(snapshot_name, at):
                self._send(key, event)
                rows += 1
                if self.unflushed >= self.max_batch:
                    self._flush(None)  # no position yet: an interrupted snapshot starts over
            self._flush({"commit_lsn": at, "snapshot_done": True})
            log.info("snapshot of %s: %d rows at %s", s.name, rows, lsn_text(at))
        skip = int(self.stored.get("commit_lsn", 0))
        pending_end, pending_commit = 0, 0
        try:
            for item in wal.stream(skip_through=skip, idle_s=self.linger_s):
                if isinstance(item, Transaction):
                    for key, event in item.events:
                        self._send(key, event)
                    pending_end, pending_commit = item.end_lsn, item.commit_lsn
                    if self._batch_open():
                        continue
                if pending_end:
                    self._flush({"commit_lsn": pending_commit, "snapshot_done": True})
                    wal.confirm(pending_end)
                    pending_end = 0
                elif isinstance(item, Heartbeat):
                    wal.confirm(item.wal_end)
                self._progress(f"last commit {lsn_text(max(pending_commit, skip))}")
                if self.stopping:
                    break
        finally:
            wal.close()

    # -- MongoDB ----------------------------------------------------------------------
    def _run_mongo(self) -> None:
        from connectors.mongo_changes import Change, MongoChanges

        s = self.source
        changes = MongoChanges(s.uri, s.db, s.collection, name=s.name, idle_s=self.linger_s)
        token = self.stored.get("resume_token")
        last = token
        try:
            for item in changes.stream(token):
                if isinstance(item, Change):
                    self._send(["_id"], item.event)
                    last = item.token
                    if self._batch_open():
                        continue
                elif item is not None:
                    last = item.token
                # Events waiting: flush now. Only an idle token moved: store it now and then.
                if last is not None and last != token and (
                        self.unflushed or time.monotonic() - self.last_stored >= 1.0):
                    self._flush({"resume_token": last})
                    token = last
                self._progress(f"token {json.dumps(token)[:60] if token else 'none'}")
                if self.stopping:
                    break
        finally:
            changes.close()

    # -- Kafka ------------------------------------------------------------------------
    def _batch_open(self) -> bool:
        """More events may join the unflushed batch: under --max-batch and --linger-ms."""
        return self.unflushed < self.max_batch and time.monotonic() - self.first_unflushed < self.linger_s

    def _send(self, key_fields: list[str], event: dict) -> None:
        if self.unflushed == 0:
            self.first_unflushed = time.monotonic()
        image = event["after"] if event["after"] is not None else event["before"]
        # Debezium's key: the primary key columns as a JSON object.
        key = json.dumps({f: image.get(f) for f in key_fields}, sort_keys=True, separators=(",", ":"), default=str)
        self.producer.send(self.topic, key=key,
                           value=json.dumps({**event, "key_fields": key_fields}, sort_keys=True, default=str))
        self.unflushed += 1
        self.counts[event["op"]] += 1

    def _flush(self, position: dict | None) -> None:
        """Block until Kafka acknowledged every event sent, then record the position.

        The position record is not waited for: the events it covers are already durable,
        and losing it in a crash only means resuming from the previous one (repeats the
        job drops). One round trip per batch instead of two.
        """
        self.producer.flush()
        self.unflushed = 0
        if position is None:
            return
        self.producer.send(self.offsets_topic, key=self.source.name,
                           value=json.dumps({"name": self.source.name, **position, "ts_ms": int(time.time() * 1000)}))
        self.last_stored = time.monotonic()

    def _progress(self, where: str) -> None:
        if time.monotonic() - self.last_progress >= 10:
            self.last_progress = time.monotonic()
            log.info("%s: captured %s; %s", self.source.name,
                     ", ".join(f"{k}={v}" for k, v in self.counts.items()), where)


def add_parser(sub) -> None:
    p = sub.add_parser("cdc", help="capture PostgreSQL WAL or MongoDB change streams into Kafka",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True)
    p.add_argument("--topic")
    p.add_argument("--name")
    p.add_argument("--snapshot", action="store_true")
    p.add_argument("--offsets-topic", default="streamtune.cdc-offsets")
    p.add_argument("--max-batch", type=int, default=500)
    p.add_argument("--linger-ms", type=int, default=5)
    p.add_argument("--bootstrap")
    p.set_defaults(func=cmd_cdc)


def cmd_cdc(args: argparse.Namespace) -> int:
    from connectors.debezium import CdcError
    from streamtune.stack import StackConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    try:
        source = Source.parse(args.source, args.name)
    except ValueError as e:
        print(f"streamtune cdc: {e}")
        return 2
    if args.snapshot and source.kind != "postgres":
        print("streamtune cdc: --snapshot reads existing rows of PostgreSQL tables only; MongoDB capture starts "
              "with the changes after its first start")
        return 2
    bootstrap = args.bootstrap or StackConfig.from_env().kafka_bootstrap
    capture = Capture(source, bootstrap, args.topic or source.default_topic, args.offsets_topic,
                      snapshot=args.snapshot, max_batch=args.max_batch, linger_ms=args.linger_ms)
    try:
        capture.run()
    except CdcError as e:
        print(f"streamtune cdc: {e}")
        return 2
    return 0
