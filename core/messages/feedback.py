"""Feedback sample: one training example for one model, on the feedback topic.

The Kafka record timestamp is the event time and equals `ts`; the key is the model id.

| field        | type                                   | required | notes                              |
|--------------|----------------------------------------|----------|------------------------------------|
| model_id     | string (core.messages.base.MODEL_ID)   | yes      | routes the sample to its model     |
| sample_id    | string, 1..256 chars                   | yes      | recorded in the version's lineage  |
| prompt       | string                                 | yes      | not trained on (labels masked)     |
| completion   | string, non-empty                      | yes      | the target text                    |
| label        | accepted / corrected / rejected        | no       | rejected samples get weight 0      |
| weight       | number in [0, 10], default 1           | no       | scales the sample's loss           |
| ts           | integer, epoch milliseconds            | yes      |                                    |
| origin       | object (ChangeOrigin)                  | no       | set by CDC: the row and change     |
| request_id   | string                                 | no       | the served response it judges      |
| pseudo_confidence | number in [0, 1]                  | no       | pseudo-labels only (below)         |

A pseudo-label is made inside the job from an inference-log response
(operators/pseudo_labels.py): its completion is the model's own output, `sample_id` is
`pseudo:<request_id>`, and `pseudo_confidence` the model's mean token probability for it.

>>> s = FeedbackSample(model_id="bot", sample_id="s1", prompt="x=1;y=", completion="2",
...                    label="rejected", ts=0)
>>> s.effective_weight, s.to_json()
(0.0, '{"model_id":"bot","sample_id":"s1","prompt":"x=1;y=","completion":"2","label":"rejected","weight":1.0,"ts":0}')
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from core.messages.base import MODEL_ID, Message
from core.messages.change import ChangeOrigin


class FeedbackSample(Message):
    model_id: str = Field(pattern=MODEL_ID)
    sample_id: str = Field(min_length=1, max_length=256)
    prompt: str
    completion: str = Field(min_length=1)
    label: Optional[Literal["accepted", "corrected", "rejected"]] = None
    weight: float = Field(default=1.0, ge=0.0, le=10.0)
    ts: int = Field(ge=0)
    origin: Optional[ChangeOrigin] = None
    request_id: Optional[str] = Field(default=None, max_length=256)  # cites a `streamtune serve` response
    # Set only on a pseudo-label (the model's own completion as target): its mean token probability.
    pseudo_confidence: Optional[float] = Field(default=None, ge=0.0, le=1.0)

    @property
    def effective_weight(self) -> float:
        return 0.0 if self.label == "rejected" else self.weight
