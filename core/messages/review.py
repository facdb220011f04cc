"""Review record: an inference-log response the model was not confident enough in to train on.

Written exactly-once by the fine-tuning job's pseudo-label step (operators/pseudo_labels.py)
to its review topic (`--review-topic`, key: model_id) when the response's confidence (the
mean token probability, exp(mean_logprob)) is below the spec's `pseudo_labels.threshold`.
A person (or a labelling tool) can answer it with a feedback sample citing `request_id`.

>>> from core.messages.inference import InferenceRecord
>>> r = InferenceRecord(request_id="r1", model_id="bot", arm="champion", prompt="x=1;y=", completion="2",
...     mean_logprob=-0.5, latency_ms=4.2, ts=1000)
>>> rv = ReviewRecord(reason="below_threshold", confidence=0.6065, threshold=0.8, inference=r,
...     source=SourcePosition(topic="log", partition=0, offset=3, timestamp=1000))
>>> ReviewRecord.from_json(rv.to_json()) == rv
True
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.messages.base import Message
from core.messages.dead_letter import SourcePosition
from core.messages.inference import InferenceRecord


class ReviewRecord(Message):
    reason: Literal["below_threshold"]
    confidence: float = Field(ge=0.0, le=1.0)   # exp(inference.mean_logprob)
    threshold: float = Field(gt=0.0, le=1.0)    # the spec's pseudo_labels.threshold it was held against
    inference: InferenceRecord                  # the response as read
    source: SourcePosition                      # where it was read
