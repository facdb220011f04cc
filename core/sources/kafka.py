"""`kafka://topic=NAME`: feedback samples produced straight to a Kafka topic.

>>> source_for("kafka://topic=feedback.v1").topic
'feedback.v1'
"""

from __future__ import annotations

import re

from core.sources.base import SourceKind, register_source_kind, source_for  # noqa: F401 (doctest)

TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


@register_source_kind
class KafkaSource(SourceKind):
    scheme = "kafka"
    example = "kafka://topic=NAME"

    def _parse(self, parts, name):
        spec = parts.netloc + parts.path
        topic = spec.split("=", 1)[1] if spec.startswith("topic=") else ""
        if not TOPIC.fullmatch(topic):
            raise ValueError("kafka sources look like kafka://topic=NAME")
        self.topic = topic
        self.name = name or topic

    @property
    def source_ids(self) -> tuple[str, ...]:
        return (f"kafka:{self.topic}",)
