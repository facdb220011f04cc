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

Learning quality is opt-in: without `evaluation` the registrar's loss rule promotes (a
version becomes `champion` when its loss_after is no worse than the champion's); with it,
the trainer scores each version and the champion on held-out data and decides
(operators/quality.py). `replay` mixes older samples into each step; `ewc` (online EWC)
pulls each step towards the previous version (weak: bench/forgetting.py);
`pseudo_labels` trains on the model's own confident answers from the inference log
(operators/pseudo_labels.py):

>>> q = spec.model_copy(update={"evaluation": EvaluationConfig(holdout_fraction=0.2, forgetting_tolerance=0.05),
...                             "replay": ReplayConfig(buffer_size=256, ratio=1.0)})
>>> q.evaluation.metric, q.evaluation.recent_size, q.replay.ratio, q.spec_hash() != spec.spec_hash()
('exact_match', 64, 1.0, True)
>>> spec.model_copy(update={"pseudo_labels": PseudoLabelConfig(threshold=0.8)}).pseudo_labels.weight
1.0
>>> PseudoLabelConfig.from_dict({"threshold": 0})
Traceback (most recent call last):
...
core.errors.InvalidMessage: threshold: Input should be greater than 0
>>> EvaluationConfig.from_dict({"tolerance": 0.1})
Traceback (most recent call last):
...
core.errors.InvalidMessage: (root): Value error, evaluation needs an eval set: holdout_fraction > 0, eval_uri, or both
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
    # Off: loss_before is each sample's loss in the first pass that trains on it (progressive
    # validation) and loss_after the last pass's training loss, both free. On: two extra
    # forward passes over the window, before and after training (about half a step's cost).
    exact_losses: bool = Field(default=False, description="measure loss before/after with extra forward passes")


class EvaluationConfig(Message):
    """Held-out evaluation and the promotion gate (operators/quality.py applies it).

    Eval sets: `recent` (the newest held-out samples, FIFO), `retained` (held-out samples
    that left `recent`: the forgetting guard's older data, a reservoir) and `fixed` (the
    JSONL file at eval_uri). A version is promoted when, on every non-empty set, it is not
    worse than the champion by more than `tolerance` (recent, fixed) or
    `forgetting_tolerance` (retained), in the metric's units. With no eval data yet, the
    loss rule decides, as without this section.
    """

    # Chosen by a hash of sample_id (of the row, for CDC samples): held out on every replay, never trained.
    holdout_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    # JSONL of {"prompt", "completion"} per line: a local path or file:// URI, read by every worker.
    eval_uri: Optional[str] = Field(default=None, pattern=r"^(file://)?/")
    metric: Literal["exact_match", "loss"] = "exact_match"  # exact_match: greedy decoding equals the completion
    recent_size: int = Field(default=64, ge=1, le=10_000)
    retained_size: int = Field(default=256, ge=0, le=10_000)
    fixed_size: int = Field(default=256, ge=1, le=10_000)  # lines of eval_uri used (a hash sample beyond it)
    tolerance: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    forgetting_tolerance: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _has_eval_set(self) -> "EvaluationConfig":
        if self.holdout_fraction == 0.0 and self.eval_uri is None:
            raise ValueError("evaluation needs an eval set: holdout_fraction > 0, eval_uri, or both")
        return self


class ReplayConfig(Message):
    """A per-model reservoir of trained samples, `ratio` of them replayed per new sample in each step."""

    buffer_size: int = Field(default=512, ge=1, le=100_000)
    ratio: float = Field(default=1.0, gt=0.0, le=16.0)


class EwcConfig(Message):
    """Online elastic weight consolidation: each step pulls the adapter towards its previous
    version, weighted by a running Fisher estimate (operators/lora_trainer.py). Measured weak
    against a conflicting task on the tiny model: see bench/forgetting.py."""

    strength: float = Field(gt=0.0, le=1e9, allow_inf_nan=False)  # lambda of the penalty
    fisher_decay: float = Field(default=0.9, ge=0.0, le=1.0)       # weight of the older Fisher estimate


class PseudoLabelConfig(Message):
    """Pseudo-labels from the inference log (operators/pseudo_labels.py): a served response
    becomes a training sample, its own completion the target, when the model's confidence in
    it (the mean token probability, exp(mean_logprob)) is at or above `threshold`; below it
    the response goes to the review topic. The comparison is made in log space
    (mean_logprob >= ln(threshold)), so a response logged with ln(threshold) is at it exactly.
    """

    threshold: float = Field(gt=0.0, le=1.0)                # a mean token probability
    weight: float = Field(default=1.0, ge=0.0, le=10.0)     # the loss weight of a pseudo-labelled sample


class FinetuneSpec(Message):
    model_id: str = Field(pattern=MODEL_ID)
    stream_source: str
    adapter_config: AdapterConfig
    trigger_policy: TriggerPolicy
    base_model: Optional[str] = None
    training: TrainingConfig = TrainingConfig()
    seed: int = 0
    evaluation: Optional[EvaluationConfig] = None
    replay: Optional[ReplayConfig] = None
    ewc: Optional[EwcConfig] = None
    pseudo_labels: Optional[PseudoLabelConfig] = None

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
        fields = self.model_dump(mode="json")
        for optional in ("evaluation", "replay", "ewc", "pseudo_labels"):  # absent sections leave the hash of older specs as it was
            if fields[optional] is None:
                del fields[optional]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
