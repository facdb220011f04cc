"""Registrar: version records from Kafka -> MLflow model registry -> broadcast topic.

The fine-tuning job emits one version record (core.messages.VersionRecord) per trained
adapter version into `streamtune.versions` through Flink's EXACTLY_ONCE Kafka sink.

Delivery is at-least-once: the local broker (Tansu) shows records of aborted transactions
to read_committed readers, and a replayed job publishes the same record again, so
registration is idempotent by version_id (connectors/mlflow_registry.py).

For each new version the registrar publishes an AdapterVersionBroadcast (core.messages) to
`streamtune.adapter-versions`, keyed by model_id.

A broadcast is sent when the version is created, or for a duplicate whose broadcast was never
confirmed (model version tag `streamtune.broadcast` is set only after the broker acked it):
a crash between registering and broadcasting is healed by the replay. Consumers of the
broadcast must therefore be idempotent by version_id too. The version's run gets its params
and metrics after the broadcast (connectors/mlflow_registry.finish_run). The consumer offset
is committed after each record. A record that can never succeed (bad JSON, wrong schema, missing adapter
file, sha256 mismatch) is logged, counted as invalid and skipped; any other error (MLflow or
Kafka down) leaves the record uncommitted and is retried.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import OffsetAndMetadata

from connectors.kafka import create_topic
from connectors.artifact_store import ArtifactStore
from connectors.mlflow_registry import RegistryCache, broadcast_for, finish_run, make_client, publish_version
from core import defaults, transport
from core.errors import ArtifactIntegrityError, InvalidMessage
from core.messages import VersionRecord

log = logging.getLogger(__name__)

BROADCAST_TAG = "streamtune.broadcast"
@dataclass
class RegistrarConfig:
    bootstrap: str
    tracking_uri: str
    versions_topic: str = defaults.VERSIONS_TOPIC
    broadcast_topic: str = defaults.ADAPTER_VERSIONS_TOPIC
    group_id: str = "streamtune-registrar"
    artifact_store: str = field(default_factory=defaults.artifact_store)


class Registrar:
    def __init__(self, config: RegistrarConfig, on_event: Callable[[str], None] | None = None):
        self.config = config
        self.on_event = on_event or (lambda line: None)
        self.counts = {"seen": 0, "registered": 0, "duplicates": 0, "invalid": 0}
        self.client = make_client(config.tracking_uri)
        self.registry_cache = RegistryCache()
        self.store = ArtifactStore(config.artifact_store, config.tracking_uri)
        for topic in (config.versions_topic, config.broadcast_topic):
            create_topic(config.bootstrap, topic)
        self.producer = KafkaProducer(bootstrap_servers=config.bootstrap, acks="all", **transport.kafka_python_kwargs())
        self.consumer = KafkaConsumer(
            config.versions_topic, bootstrap_servers=config.bootstrap, group_id=config.group_id,
            isolation_level="read_committed", enable_auto_commit=False, **transport.kafka_python_kwargs(),
            auto_offset_reset="earliest",
            # Tansu holds a group join for about half the session timeout, and kafka-python
            # 3.x keeps its 45 s default session timeout even when max_poll_interval_ms is
            # set: 6 s gives a ~3 s join instead of ~23 s. Few records per poll, so that
            # slow registrations stay well inside the 10 s poll interval.
            session_timeout_ms=6000, max_poll_interval_ms=10000, max_poll_records=10)

    def poll_once(self, timeout_ms: int = 1000) -> int:
        """Process what one poll returns; returns how many records were processed.

        On an error that may pass (MLflow, Kafka), the consumer is rewound to the failed
        record and the error is raised; the next poll retries it.
        """
        processed = 0
        batch = self.consumer.poll(timeout_ms=timeout_ms)
        pending = {tp: records[0].offset for tp, records in batch.items() if records}
        for tp, records in batch.items():
            for rec in records:
                try:
                    self._handle(rec)
                except Exception:
                    for ptp, offset in pending.items():  # fetched but not done: fetch again
                        self.consumer.seek(ptp, offset)
                    raise
                self.consumer.commit({tp: OffsetAndMetadata(rec.offset + 1, None, -1)})
                pending[tp] = rec.offset + 1
                processed += 1
            pending.pop(tp, None)
        return processed

    def run(self, stop: threading.Event, timeout_ms: int = 1000, backoff: float = 2.0) -> None:
        """Poll until `stop` is set; transient errors are reported and retried."""
        while not stop.is_set():
            try:
                self.poll_once(timeout_ms)
            except Exception as e:
                log.exception("registrar: processing failed, will retry")
                self.on_event(f"error: {type(e).__name__}: {e} (retrying in {backoff:.0f} s)")
                stop.wait(backoff)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()

    def __enter__(self) -> "Registrar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _handle(self, rec) -> None:
        self.counts["seen"] += 1
        where = f"{rec.topic}[{rec.partition}]@{rec.offset}"
        try:
            record = VersionRecord.from_json(rec.value)
            mv, created = publish_version(self.client, record, self.store, self.registry_cache)
        except (InvalidMessage, ArtifactIntegrityError) as e:
            self.counts["invalid"] += 1
            log.error("registrar: invalid version record at %s skipped: %s", where, e)
            self.on_event(f"invalid record at {where} skipped: {e}")
            return
        model_id, metrics = record.model_id, record.metrics
        if created:
            self.counts["registered"] += 1
            self.on_event(f"registered {model_id} v{mv.version} (version_id {record.version_id}) "
                          f"loss {metrics.loss_before:.2f} -> {metrics.loss_after:.2f}")
        else:
            self.counts["duplicates"] += 1
            self.on_event(f"duplicate {model_id} v{mv.version} (version_id {record.version_id}) "
                          f"at {where} skipped")
        if created or mv.tags.get(BROADCAST_TAG) != "sent":
            self._broadcast(record, mv)
        # After the broadcast: the run's params and metrics are for people, not inference.
        finish_run(self.client, record, mv.run_id, self.registry_cache, check=not created, store=self.store)

    def _broadcast(self, record: VersionRecord, mv) -> None:
        message = broadcast_for(record, mv)
        self.producer.send(self.config.broadcast_topic, key=record.model_id.encode(),
                           value=message.to_json().encode()).get(timeout=30)
        self.client.set_model_version_tag(record.model_id, mv.version, BROADCAST_TAG, "sent")
