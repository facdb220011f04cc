"""Kafka helpers for processes outside Flink (registrar, CLI, servers, tests): topics, bounded
reads, and following topics from their beginning.

Flink jobs use the Java KafkaSource/KafkaSink (see jobs/); these helpers use kafka-python.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from core import transport


def create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    """Create a topic; a topic that already exists is left as it is."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000, **transport.kafka_python_kwargs())
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
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                             isolation_level="read_committed" if read_committed else "read_uncommitted",
                             **transport.kafka_python_kwargs())
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
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                             **transport.kafka_python_kwargs())
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


def read_tail(bootstrap: str, topic: str, limit: int, timeout: float = 10.0, idle: float = 0.5) -> list:
    """About the last `limit` records of each partition of `topic`, read_committed, oldest first
    ([] for a missing topic). On Tansu the end offset can fall short of the true end, so a
    few newer records may come too."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed",
                             auto_offset_reset="earliest", **transport.kafka_python_kwargs())
    try:
        deadline = time.monotonic() + timeout
        tps = _from_beginning(consumer, topic, deadline)
        if not tps:  # no such topic: end_offsets([]) would raise
            return []
        for tp, end in consumer.end_offsets(tps).items():
            consumer.seek(tp, max(0, end - limit))
        records, last_new = [], time.monotonic()
        while tps and time.monotonic() < deadline and time.monotonic() - last_new < idle:
            for recs in consumer.poll(timeout_ms=100).values():
                records.extend(recs)
                last_new = time.monotonic()
        return sorted(records, key=lambda r: r.timestamp)
    finally:
        consumer.close()


def seek_to_first(consumer: KafkaConsumer, partitions) -> None:
    """Position `partitions` at offset 0, for reading them from their start.

    Not `seek_to_beginning`: the local broker (Tansu) once answered a partition's earliest
    offset past its first four records (a versions topic first written by four transactional
    producers at once), and a reader that asked for it skipped them. On a broker whose log
    starts later (retention), offset 0 is out of range and the consumer's `auto_offset_reset`,
    which must be "earliest", moves it to the true start.
    """
    if consumer.config["auto_offset_reset"] != "earliest":
        raise ValueError("seek_to_first needs a consumer with auto_offset_reset='earliest'")
    for tp in partitions:
        consumer.seek(tp, 0)


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
    seek_to_first(consumer, tps)
    return tps


def follow_topics(bootstrap: str, wanted: Callable[[str], bool], on_record: Callable[[str, bytes], None],
                  stop: threading.Event, on_poll: Callable[[bool], None] = lambda got_records: None,
                  on_error: Callable[[str], None] = lambda message: None, refresh_s: float = 2.0) -> None:
    """Read every topic `wanted` names, each from its beginning, until `stop` is set.

    Partitions are assigned, with no consumer group: every process reads everything (the
    broadcast and log topics are small and durable). Topics that appear later are picked up
    within `refresh_s`. After each poll, `on_poll(got_records)` runs (for idle detection and
    periodic work). A broker outage (or an exception from a callback) is reported through
    `on_error` and retried every second; reading then resumes after the last record
    `on_record` returned from (the one that raised comes again), not from the beginning: each
    record reaches `on_record` once per call, except that one.
    """
    positions: dict[TopicPartition, int] = {}  # next offset to read, kept across reconnections
    while not stop.is_set():
        consumer = None
        try:
            # auto_offset_reset: a kept position past a partition's end (a broker that lost its
            # topics) reads that partition again from its start.
            consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                                     isolation_level="read_committed", fetch_max_wait_ms=50,
                                     **transport.kafka_python_kwargs())
            assigned: set = set()
            next_refresh = 0.0
            while not stop.is_set():
                if time.monotonic() >= next_refresh:
                    partitions = {TopicPartition(t, p) for t in consumer.topics() if wanted(t)
                                  for p in (consumer.partitions_for_topic(t) or ())}
                    new = partitions - assigned
                    if new:
                        assigned |= new
                        consumer.assign(sorted(assigned))
                        fresh = [tp for tp in new if tp not in positions]
                        if fresh:
                            seek_to_first(consumer, fresh)
                        for tp in new - set(fresh):
                            consumer.seek(tp, positions[tp])
                    next_refresh = time.monotonic() + refresh_s
                batch = consumer.poll(timeout_ms=50)
                for tp, records in batch.items():
                    for record in records:
                        on_record(tp.topic, record.value)
                        positions[tp] = record.offset + 1
                on_poll(bool(batch))
        except Exception as e:  # a broker (or a callback's service) outage: report, back off, go on
            on_error(f"{type(e).__name__}: {e}")
            stop.wait(1.0)
        finally:
            if consumer is not None:
                try:
                    consumer.close()
                except Exception:
                    pass
