"""Producing to a fine-tuning job's input topics from Python (demo, SDK ingest, tests).

Records are messages from core.messages, written as their `.to_json()`; the Kafka key is
the model id and the record timestamp the event time (a sample's `ts`).
"""

from __future__ import annotations

from typing import Iterable

from kafka import KafkaProducer

from core import transport
from core.messages import FeedbackSample, FinetuneSpec, RetrainTrigger


def producer(bootstrap: str) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, **transport.kafka_python_kwargs())


def send_config(bootstrap: str, topic: str, record: FinetuneSpec | RetrainTrigger, ts_ms: int) -> None:
    """A fine-tune spec (or a retrain trigger) to a job's config topic."""
    send_raw(bootstrap, topic, record.model_id, record.to_json(), ts_ms)


def send_raw(bootstrap: str, topic: str, key: str, value: str, ts_ms: int) -> None:
    """One record as given, valid or not (tests of the dead-letter path use it)."""
    p = producer(bootstrap)
    try:
        p.send(topic, key=key.encode(), value=value.encode(), timestamp_ms=ts_ms)
        p.flush()
    finally:
        p.close()


def send_samples(bootstrap: str, topic: str, samples: Iterable[FeedbackSample]) -> int:
    """Send samples, each stamped with its `ts`; returns how many were sent."""
    p = producer(bootstrap)
    n = 0
    try:
        for s in samples:
            p.send(topic, key=s.model_id.encode(), value=s.to_json().encode(), timestamp_ms=s.ts)
            n += 1
        p.flush()
    finally:
        p.close()
    return n


def digit_samples(model_id: str, pairs: list[tuple[str, str]], start_ms: int, spacing_ms: float,
                  id_prefix: str = "s") -> list[FeedbackSample]:
    """Feedback samples for (prompt, completion) pairs, `spacing_ms` apart in event time.

    >>> digit_samples("bot", [("x=1;y=", "2")], 1000, 10)[0].to_json()
    '{"model_id":"bot","sample_id":"s0","prompt":"x=1;y=","completion":"2","label":"corrected","weight":1.0,"ts":1000}'
    """
    return [FeedbackSample(model_id=model_id, sample_id=f"{id_prefix}{i}", prompt=prompt, completion=completion,
                           label="corrected", ts=start_ms + int(i * spacing_ms))
            for i, (prompt, completion) in enumerate(pairs)]
