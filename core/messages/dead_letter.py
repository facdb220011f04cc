"""Dead letter: a record the job could not use, with the reason and where it came from.

Written exactly-once to the job's DLQ topic; read by sql/dlq_rate.sql and by people.

>>> d = DeadLetter(reason="bad_json", detail="not JSON", kind="sample", payload="{",
...                source=SourcePosition(topic="t", partition=0, offset=7, timestamp=1))
>>> DeadLetter.from_json(d.to_json()) == d, '"model_id":null' in d.to_json()
(True, True)
"""

from __future__ import annotations

from typing import Literal, Optional

from core.messages.base import Message

# Why a record was dead-lettered (the `reason` field).
REASONS = ("empty", "oversized", "bad_json", "schema", "unsupported_source", "unknown_model",
           "not_a_change_event", "no_row_key", "unmappable", "artifact_integrity", "no_pseudo_labels",
           "timestamp", "unsigned_response")


class SourcePosition(Message):
    """Where a record was read: topic, partition, offset and its Kafka timestamp (ms).

    An event the control plane refused before producing it (POST /v1/feedback) names the
    topic it was meant for, partition and offset -1 (never written there) and its `ts`."""

    topic: str
    partition: int
    offset: int
    timestamp: Optional[int] = None


class DeadLetter(Message):
    reason: Literal[REASONS]  # type: ignore[valid-type]
    detail: str
    kind: Literal["sample", "config", "trigger", "change", "version", "inference"]
    model_id: Optional[str] = None
    payload: Optional[str] = None  # the original record value, as read
    source: SourcePosition

    def to_json(self) -> str:
        """Every field, nulls included: a reader sees `model_id: null` when it was unknown."""
        return self.model_dump_json()
