"""Fine-tune spec: which model learns from which source, with which adapter and trigger
policy. Sent to a job's config topic (key: model_id); a newer spec is a hot update applied
at the next window.

The seed's example is the smallest valid spec:

>>> spec = FinetuneSpec.model_validate({"model_id": "llama3-8b-streaming-v2",
...     "stream_source": "kafka://topic=user_feedback_v3",
...     "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
...     "trigger_policy": {"min_samples_per_window": 50, "window_seconds": 60}})
>>> spec.source_id, spec.kafka_topic, spec.training.micro_batch_size
('kafka:user_feedback_v3', 'user_feedback_v3', 8)
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from core.messages.base import MODEL_ID, Message
from core.sources import SourceKind, source_for
from core.sources.kafka import KafkaSource


class AdapterConfig(Message):
    rank: int = Field(ge=1, le=512)
    alpha: float = Field(gt=0, allow_inf_nan=False)  # JSON 1e999 is inf: NaN weights, a null in versions
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


class TriggerPolicy(Message):
    min_samples_per_window: int = Field(ge=1)
    window_seconds: int = Field(ge=1, le=86400)
    max_samples_per_step: int = Field(default=1024, ge=1)

    @model_validator(mode="after")
    def _cap_above_min(self) -> "TriggerPolicy":
        if self.max_samples_per_step < self.min_samples_per_window:
            raise ValueError("max_samples_per_step must be >= min_samples_per_window")
        return self


class TrainingConfig(Message):
    lr: float = Field(default=1e-3, gt=0, le=1.0)
    micro_batch_size: int = Field(default=8, ge=1, le=4096)
    flush_every: int = Field(default=1, ge=1, le=1024, description="micro-batches per optimizer step")
    max_seq_len: int = Field(default=256, ge=8, le=32768)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    epochs: int = Field(default=1, ge=1, le=100, description="passes over each window's samples")


class FinetuneSpec(Message):
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
        source_for(v)  # ValueError names the accepted shapes
        return v

    @property
    def source(self) -> SourceKind:
        return source_for(self.stream_source)

    @property
    def source_id(self) -> str:
        """What a job serves: kafka:<topic>, postgres:<schema.table> or mongodb:<db.collection>."""
        return self.source.source_id

    @property
    def kafka_topic(self) -> Optional[str]:
        source = self.source
        return source.topic if isinstance(source, KafkaSource) else None

    def spec_hash(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
