"""Inference log: one record per response served (`streamtune serve`, key: model_id).

Feedback events cite `request_id`, so online metrics per arm (champion / candidate) join
the two streams (sql/serving_metrics.sql); pseudo-labels read `completion` and
`mean_logprob` (its confidence).

>>> r = InferenceRecord(request_id="r1", model_id="bot", version=3, alias="champion", arm="champion",
...     prompt="x=1;y=", completion="2", mean_logprob=-0.1, latency_ms=4.2, ts=1000)
>>> InferenceRecord.from_json(r.to_json()).version
3
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from core.messages.base import MODEL_ID, Message


class InferenceRecord(Message):
    request_id: str
    model_id: str = Field(pattern=MODEL_ID)
    version: Optional[int] = None         # MLflow version; None when the base model answered
    alias: Optional[str] = None           # the alias the request was routed through, if any
    arm: Literal["champion", "candidate", "pinned", "base"]
    user: Optional[str] = None
    prompt: str
    completion: str
    mean_logprob: float
    latency_ms: float
    ts: int                               # epoch ms when the response was produced
