"""Kafka helpers for processes outside Flink (registrar, CLI, tests): topics and bounded reads.

Flink jobs use the Java KafkaSource/KafkaSink (see jobs/); these helpers use kafka-python.
"""

from __future__ import annotations

import time

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError


def create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    """Create a topic; a topic that already exists is left as it is."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    try:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()


def read_topic(bootstrap: str, topic: str, *, expect: int | None = None, timeout: float = 30.0,
               read_committed: bool = True, idle: float = 2.0) -> list:
    """Read a topic from the beginning without a consumer group.

    Stops once `expect` records arrived, or after `idle` seconds without new records when
    `expect` is None, or at `timeout`. Returns kafka-python ConsumerRecords in offset order
    per partition.
    """
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             isolation_level="read_committed" if read_committed else "read_uncommitted")
    try:
        deadline = time.monotonic() + timeout
        if not _from_beginning(consumer, topic, deadline):
            return []
        records, last_new = [], time.monotonic()
        while time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=200)
            for recs in batch.values():
                records.extend(recs)
            if batch:
                last_new = time.monotonic()
            if expect is not None and len(records) >= expect:
                break
            if expect is None and time.monotonic() - last_new >= idle:
                break
        return records
    finally:
        consumer.close()


def read_to_end(bootstrap: str, topic: str, timeout: float = 30.0) -> list:
    """Every record of `topic` up to the end offsets seen at the start, even while others write.

    On Tansu the reported end can be short of the true end (it answers the last batch's
    start + 1), so callers must treat the result as "at least this much", never as all.
    """
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        deadline = time.monotonic() + timeout
        tps = _from_beginning(consumer, topic, deadline)
        if not tps:
            return []
        end = consumer.end_offsets(tps)
        records = []
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} to offsets {end} took over {timeout} s")
            for recs in consumer.poll(timeout_ms=200).values():
                records.extend(r for r in recs if r.offset < end[TopicPartition(r.topic, r.partition)])
        return records
    finally:
        consumer.close()


def _from_beginning(consumer: KafkaConsumer, topic: str, deadline: float) -> list[TopicPartition]:
    """Assign every partition of `topic` at its first offset, once its metadata is known
    (until `deadline`); [] when the topic never showed up."""
    partitions = None
    while partitions is None and time.monotonic() < deadline:
        partitions = consumer.partitions_for_topic(topic)
        if partitions is None:
            time.sleep(0.2)
    if partitions is None:
        return []
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    consumer.seek_to_beginning()
    return tps
