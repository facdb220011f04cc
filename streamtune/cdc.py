"""`streamtune cdc`: capture a PostgreSQL table set or a MongoDB collection into Kafka.

    streamtune cdc --source 'postgres://u@host:5432/db?table=public.feedback&table=policies&password_env=PG_PASSWORD'
    streamtune cdc --source 'mongodb://host:27017/?db=shop&collection=reviews' --topic shop.reviews

Each change becomes one Kafka record (key: the row's identity, value: a Debezium envelope,
core.messages.ChangeEnvelope) on `--topic`. The capture runs as a process of its own, not as a
PyFlink job: PyFlink has no Python sources and gives Python functions no checkpoint-complete
hook, so a Flink job could not tell PostgreSQL that a change is durable. Here durability is
Kafka's acknowledgement (acks=all): the slot is confirmed, and the Mongo resume token stored,
only for changes Kafka has acknowledged. A crash (kill -9) therefore re-sends at most what
was in flight; `jobs/cdc_retrain.py` drops those repeats by source position.

No secret goes on this command line (`ps` shows it to every user): a `--source` with a
password is refused, and its secret reference (`password_env=VAR`, `password_file=PATH`) is
read here, from this process's environment or the file, when the connection is made.

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
| --bootstrap-server| the local stack's Kafka          |                                               |
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import time

from kafka import KafkaProducer

from connectors.kafka import create_topic, read_to_end
from core import defaults, transport
from core.errors import CaptureError
from core.messages import ChangeEnvelope
from core.sources import SourceKind, source_for
from core.options import add_bootstrap_option

log = logging.getLogger("streamtune.cdc")


def last_offsets(bootstrap: str, offsets_topic: str, name: str) -> dict:
    """The newest position record stored for connector `name` ({} when none)."""
    found = {}
    for record in read_to_end(bootstrap, offsets_topic):
        if record.key == name.encode():
            found = json.loads(record.value)
    return found


def capture_loop(source: SourceKind, linger_s: float):
    """The source kind's capture loop (core.sources: `capture = "module:Class"`)."""
    if source.capture is None:
        raise CaptureError(f"{source.scheme}:// sources have no change capture: they are read as they are")
    module, _, name = source.capture.partition(":")
    return getattr(importlib.import_module(module), name)(source, linger_s)


class Capture:
    """Source → Kafka with acknowledged writes before any position moves.

    The source kind's loop (connectors/) reads changes and calls back: `send` each event,
    `flush(position)` when a consistent position is reached, `batch_open()` to ask whether
    more may join the batch, `progress` for the log line every 10 s.
    """

    def __init__(self, source: SourceKind, bootstrap: str, topic: str, offsets_topic: str,
                 snapshot: bool = False, max_batch: int = 500, linger_ms: int = 5):
        self.source, self.bootstrap, self.topic, self.offsets_topic = source, bootstrap, topic, offsets_topic
        self.snapshot, self.max_batch, self.linger_s = snapshot, max_batch, linger_ms / 1000
        self.unflushed = 0
        self.first_unflushed = 0.0
        self.counts = {"c": 0, "u": 0, "d": 0, "r": 0}
        self.stopping = False
        self.last_stored = 0.0

    def run(self, loop) -> None:
        """Run the source kind's `loop` (see capture_loop) until SIGTERM, resuming after transient errors."""
        # Transient: e.g. the slot still held by the walsender of a capture that just died.
        retryable = (ConnectionError, *loop.retryable)
        for t in (self.topic, self.offsets_topic):
            create_topic(self.bootstrap, t)
        self.stored = last_offsets(self.bootstrap, self.offsets_topic, self.source.name)
        # acks=all + one request in flight: acknowledged means durable and in order.
        self.producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=0,
                                      max_in_flight_requests_per_connection=1, retries=10,
                                      key_serializer=str.encode, value_serializer=str.encode,
                                      **transport.kafka_python_kwargs())
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        log.info("capturing %s into %s (stored position: %s)", self.source.name, self.topic, self.stored or "none")
        self.last_progress = time.monotonic()
        backoff = 0.5
        try:
            while not self.stopping:
                try:
                    loop.run(self)
                    return
                except retryable as e:
                    log.warning("%s: %s; retrying in %.1f s from the last durable position",
                                self.source.name, str(e).strip().splitlines()[0], backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
                    self.stored = last_offsets(self.bootstrap, self.offsets_topic, self.source.name)
        finally:
            self.producer.close(timeout=10)

    def _stop(self, *_):
        self.stopping = True

    # -- Kafka ------------------------------------------------------------------------
    def batch_open(self) -> bool:
        """More events may join the unflushed batch: under --max-batch and --linger-ms."""
        return self.unflushed < self.max_batch and time.monotonic() - self.first_unflushed < self.linger_s

    def send(self, event: ChangeEnvelope) -> None:
        if self.unflushed == 0:
            self.first_unflushed = time.monotonic()
        image = event.image or {}
        # Debezium's key: the primary key columns as a JSON object.
        key = json.dumps({f: image.get(f) for f in event.key_fields or []}, sort_keys=True, separators=(",", ":"),
                         default=str)
        self.producer.send(self.topic, key=key, value=event.to_json())
        self.unflushed += 1
        self.counts[event.op] += 1

    def flush(self, position: dict | None) -> None:
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

    def progress(self, where: str) -> None:
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
    p.add_argument("--offsets-topic", default=defaults.CDC_OFFSETS_TOPIC)
    p.add_argument("--max-batch", type=int, default=500)
    p.add_argument("--linger-ms", type=int, default=5)
    add_bootstrap_option(p, help="Kafka bootstrap servers (default: the local stack's Kafka)")
    p.set_defaults(func=cmd_cdc)


def cmd_cdc(args: argparse.Namespace) -> int:
    """Errors (a bad --source, a missing table, a lost resume token) raise CaptureError: exit 2."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    try:
        source = source_for(args.source, args.name)
    except ValueError as e:
        raise CaptureError(str(e)) from None
    if args.snapshot and not source.snapshots:
        raise CaptureError(f"--snapshot: {source.scheme}:// sources cannot read existing rows; their capture "
                           "starts with the changes after its first start")
    capture = Capture(source, args.bootstrap or defaults.kafka_bootstrap(), args.topic or source.default_topic,
                      args.offsets_topic, snapshot=args.snapshot, max_batch=args.max_batch, linger_ms=args.linger_ms)
    capture.run(capture_loop(source, capture.linger_s))
    return 0
