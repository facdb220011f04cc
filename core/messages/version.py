"""Version record: one trained adapter version, emitted by the trainer for each fired window
through the exactly-once sink of the job's versions topic (read it with `read_committed`).

`version_id = <model>@<window_end>#<first partition:offset>-<last partition:offset>` names
the version; a replay after a crash emits the same record again, so every consumer is
idempotent by version_id. `seq` counts a model's versions from 1 with no gap.

>>> r = VersionRecord.model_validate(EXAMPLE)
>>> r.seq, r.metrics.loss_after, r.lineage.offsets[0].last, VersionRecord.from_json(r.to_json()) == r
(1, 0.5, 9, True)
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from core.messages.base import MODEL_ID, Message
from core.messages.change import ChangeOrigin
from core.messages.spec import AdapterConfig, TriggerPolicy


class VersionMetrics(Message):
    loss_before: float
    loss_after: float
    samples: int = Field(ge=0)
    tokens: int = Field(ge=0)
    step_seconds: float = Field(ge=0)
    operator_seconds: Optional[float] = None  # the whole operator step: state in, training, artifact out


class OffsetRange(Message):
    topic: str
    partition: int
    first: int
    last: int


class Lineage(Message):
    sample_ids: list[str]
    offsets: list[OffsetRange]
    origins: Optional[list[ChangeOrigin]] = None    # CDC: the change each sample came from
    retracted: Optional[list[ChangeOrigin]] = None  # CDC: rows retracted since the last version


class VersionRecord(Message):
    version_id: str = Field(min_length=1)
    model_id: str = Field(pattern=MODEL_ID)
    seq: int = Field(ge=1)
    window_start: int
    window_end: int
    # The artifact store URI of the immutable PEFT files (adapter_config.json +
    # adapter_model.safetensors), named by their sha256: readable from every machine.
    artifact_uri: str = Field(pattern=r"^[a-z][a-z0-9+.-]*://")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # of adapter_model.safetensors
    base_model: str
    config_version: int = Field(ge=1)
    fresh_adapter: bool
    adapter: AdapterConfig
    trigger_policy: TriggerPolicy
    metrics: VersionMetrics
    lineage: Lineage
    trigger: Literal["window", "max_samples", "forced"]


EXAMPLE = {
    "version_id": "bot@60000#0:0-0:9", "model_id": "bot", "seq": 1, "window_start": 0, "window_end": 60000,
    "artifact_uri": "s3://adapters/" + "0" * 64, "sha256": "0" * 64, "base_model": "/models/tiny",
    "config_version": 1, "fresh_adapter": True,
    "adapter": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "trigger_policy": {"min_samples_per_window": 10, "window_seconds": 60},
    "metrics": {"loss_before": 2.0, "loss_after": 0.5, "samples": 10, "tokens": 80, "step_seconds": 0.1},
    "lineage": {"sample_ids": [f"s{i}" for i in range(10)],
                "offsets": [{"topic": "feedback", "partition": 0, "first": 0, "last": 9}]},
    "trigger": "window",
}
