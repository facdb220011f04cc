"""The records streamtune reads, defined once and validated at the edge.

Feedback sample (JSON value on the feedback topic; the Kafka record timestamp is the
event time and should equal `ts`):

| field        | type                                   | required | notes                              |
|--------------|----------------------------------------|----------|------------------------------------|
| model_id     | string `[A-Za-z0-9._-]{1,128}`         | yes      | routes the sample to its model     |
| sample_id    | string, 1..256 chars                   | yes      | recorded in the version's lineage  |
| prompt       | string                                 | yes      | not trained on (labels masked)     |
| completion   | string, non-empty                      | yes      | the target text                    |
| label        | accepted / corrected / rejected        | no       | rejected samples get weight 0      |
| weight       | number in [0, 10], default 1           | no       | scales the sample's loss           |
| ts           | integer, epoch milliseconds            | yes      |                                    |

Fine-tune spec (JSON value on the config topic), e.g. the seed's example:

>>> spec = FinetuneSpec.model_validate({"model_id": "llama3-8b-streaming-v2",
...     "stream_source": "kafka://topic=user_feedback_v3",
...     "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
...     "trigger_policy": {"min_samples_per_window": 50, "window_seconds": 60}})
>>> spec.kafka_topic, spec.training.micro_batch_size
('user_feedback_v3', 8)
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal, Optional
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MODEL_ID = r"^[A-Za-z0-9._-]{1,128}$"

__all__ = ["FeedbackSample", "FinetuneSpec", "RetrainTrigger", "AdapterConfig", "TriggerPolicy", "TrainingConfig",
           "ValidationError", "describe_error"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def source_id(stream_source: str) -> str:
    """kafka://topic=t → kafka:t; postgres://…?table=t → postgres:public.t; mongodb://…?db=d&collection=c → mongodb:d.c"""
    parts = urlsplit(stream_source)
    q = parse_qs(parts.query)
    if parts.scheme == "kafka":
        return "kafka:" + (parts.netloc + parts.path).split("=", 1)[1]
    if parts.scheme in ("postgres", "postgresql"):
        return postgres_source_id(q["table"][0])
    return f"mongodb:{q['db'][0]}.{q['collection'][0]}"


def postgres_source_id(table: str) -> str:
    """A PostgreSQL table as a source id; a bare name is in schema public."""
    return "postgres:" + (table if "." in table else f"public.{table}")


class FeedbackSample(_Strict):
    model_id: str = Field(pattern=MODEL_ID)
    sample_id: str = Field(min_length=1, max_length=256)
    prompt: str
    completion: str = Field(min_length=1)
    label: Optional[Literal["accepted", "corrected", "rejected"]] = None
    weight: float = Field(default=1.0, ge=0.0, le=10.0)
    ts: int = Field(ge=0)
    # Where a sample made from a database change came from: row_key, op, table and the
    # change's position (lsn / commit_lsn or resume_token); carried into version lineage.
    origin: Optional[dict[str, Any]] = None

    @property
    def effective_weight(self) -> float:
        return 0.0 if self.label == "rejected" else self.weight


class AdapterConfig(_Strict):
    rank: int = Field(ge=1, le=512)
    alpha: float = Field(gt=0)
    target_modules: list[str] = Field(min_length=1)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)

    @field_validator("target_modules")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or any(not m for m in v):
            raise ValueError("target_modules must be distinct, non-empty names")
        return v

    @property
    def shape_key(self) -> str:
        """Rank and targets: what a saved adapter must match to be continued."""
        return f"r{self.rank}:" + ",".join(sorted(self.target_modules))


class TriggerPolicy(_Strict):
    min_samples_per_window: int = Field(ge=1)
    window_seconds: int = Field(ge=1, le=86400)
    max_samples_per_step: int = Field(default=1024, ge=1)

    @model_validator(mode="after")
    def _cap_above_min(self) -> "TriggerPolicy":
        if self.max_samples_per_step < self.min_samples_per_window:
            raise ValueError("max_samples_per_step must be >= min_samples_per_window")
        return self


class TrainingConfig(_Strict):
    lr: float = Field(default=1e-3, gt=0, le=1.0)
    micro_batch_size: int = Field(default=8, ge=1, le=4096)
    flush_every: int = Field(default=1, ge=1, le=1024, description="micro-batches per optimizer step")
    max_seq_len: int = Field(default=256, ge=8, le=32768)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    epochs: int = Field(default=1, ge=1, le=100, description="passes over each window's samples")


class FinetuneSpec(_Strict):
    model_id: str = Field(pattern=MODEL_ID)
    stream_source: str
    adapter_config: AdapterConfig
    trigger_policy: TriggerPolicy
    base_model: Optional[str] = None
    training: TrainingConfig = TrainingConfig()
    seed: int = 0

    @field_validator("stream_source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme == "kafka":
            if not re.fullmatch(r"topic=[A-Za-z0-9._-]+", parts.netloc + parts.path):
                raise ValueError("kafka sources look like kafka://topic=NAME")
        elif parts.scheme in ("postgres", "postgresql"):
            if "table" not in parse_qs(parts.query):
                raise ValueError("postgres sources need ?table=NAME")
        elif parts.scheme == "mongodb":
            q = parse_qs(parts.query)
            if "db" not in q or "collection" not in q:
                raise ValueError("mongodb sources need ?db=NAME&collection=NAME")
        else:
            raise ValueError("stream_source must be kafka://topic=..., postgres://...?table=... "
                             "or mongodb://...?db=...&collection=...")
        return v

    @property
    def kafka_topic(self) -> Optional[str]:
        parts = urlsplit(self.stream_source)
        return (parts.netloc + parts.path).split("=", 1)[1] if parts.scheme == "kafka" else None

    @property
    def source_id(self) -> str:
        """What a job serves: kafka:<topic>, postgres:<schema.table> or mongodb:<db.collection>."""
        return source_id(self.stream_source)

    def spec_hash(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class RetrainTrigger(_Strict):
    """A control record on the config topic: train a model's pending samples now.

    Emitted by SQL (sql/retrain_trigger.sql) or CDC trigger rules; the window it closes
    fires even below `min_samples_per_window`.
    """

    # Evidence fields (rates, counts, thresholds) may ride along; the job ignores them.
    model_config = ConfigDict(extra="ignore", frozen=True)

    model_id: str = Field(pattern=MODEL_ID)
    trigger: Literal["retrain"]
    reason: str = Field(min_length=1, max_length=1024)
    window_end: Optional[int] = None


def describe_error(err: ValidationError) -> str:
    """One line per failing field, e.g. `trigger_policy.window_seconds: Input should be ...`."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in err.errors())
