"""Producing to a fine-tuning job's input topics from Python (demo, SDK ingest, tests).

The Kafka record timestamp is the sample's event time, so `send_samples` stamps each record
with the sample's `ts`.
"""

from __future__ import annotations

import json
from typing import Iterable

from kafka import KafkaProducer


def producer(bootstrap: str) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)


def send_config(bootstrap: str, topic: str, spec: dict, ts_ms: int) -> None:
    p = producer(bootstrap)
    try:
        p.send(topic, key=spec["model_id"].encode(), value=json.dumps(spec).encode(), timestamp_ms=ts_ms)
        p.flush()
    finally:
        p.close()


def send_samples(bootstrap: str, topic: str, samples: Iterable[dict]) -> int:
    """Send samples (dicts with at least model_id and ts); returns how many were sent."""
    p = producer(bootstrap)
    n = 0
    try:
        for s in samples:
            p.send(topic, key=str(s["model_id"]).encode(), value=json.dumps(s).encode(), timestamp_ms=int(s["ts"]))
            n += 1
        p.flush()
    finally:
        p.close()
    return n


def digit_samples(model_id: str, pairs: list[tuple[str, str]], start_ms: int, spacing_ms: float,
                  id_prefix: str = "s") -> list[dict]:
    """Feedback samples for (prompt, completion) pairs, `spacing_ms` apart in event time."""
    return [{"model_id": model_id, "sample_id": f"{id_prefix}{i}", "prompt": prompt, "completion": completion,
             "label": "corrected", "ts": start_ms + int(i * spacing_ms)}
            for i, (prompt, completion) in enumerate(pairs)]
