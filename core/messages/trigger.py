"""Retrain trigger: a control record on a job's config topic, "train this model's pending
samples now", even below `min_samples_per_window`.

Written by SQL (sql/retrain_trigger.sql) and by CDC trigger rules (operators/row_changes.py).
Evidence fields (rates, counts, thresholds) may ride along; the job ignores them. A record
on the config topic with a `trigger` field is a trigger, otherwise a fine-tune spec.

>>> RetrainTrigger.from_json('{"model_id": "bot", "trigger": "retrain", "reason": "r", "rate": 0.4}').window_end
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field

from core.messages.base import MODEL_ID, Message


class RetrainTrigger(Message):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model_id: str = Field(pattern=MODEL_ID)
    trigger: Literal["retrain"] = "retrain"
    reason: str = Field(min_length=1, max_length=1024)
    # End of the window that decided it (SQL): a redelivered trigger repeats it and is ignored.
    window_end: Optional[int] = None
