"""Fine-tune spec: which model learns from which source, with which adapter and trigger
policy. Sent to a job's config topic (key: model_id); a newer spec is a hot update applied
at the next window.

The project's example is the smallest valid spec:

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

Every size in a spec has a cap, so one spec cannot make a TaskManager allocate without bound
(the fixed eval file's byte cap is the reader's, operators/quality.py):

| field                                   | accepted             | why the cap                                  |
|-----------------------------------------|----------------------|----------------------------------------------|
| adapter_config.rank                     | 1 .. 512             | adapter and optimizer state grow with it     |
| adapter_config.alpha                    | (0, 4096]            | a scale: larger only destabilises            |
| adapter_config.target_modules           | 1 .. 64 names, <= 128 chars | one adapter per module                |
| trigger_policy.min_samples_per_window   | 1 .. 100,000         | samples held in keyed state per window       |
| trigger_policy.window_seconds           | 1 .. 86,400          | samples held until the window closes         |
| trigger_policy.max_samples_per_step     | 1 .. 100,000         | one step's batch in memory                   |
| trigger_policy.adaptive.min_samples_low / _high | 2 .. 100,000, low >= 2 x micro_batch_size, high <= max_samples_per_step | one step's batch in memory |
| training.micro_batch_size               | 1 .. 4,096           | activations per forward pass                 |
| training.flush_every                    | 1 .. 1,024           | micro-batches accumulated per step           |
| training.max_seq_len (tokens)           | 8 .. 32,768          | activations grow with it                     |
| training.epochs                         | 1 .. 100             | passes per window: step time                 |
| evaluation.recent_size / retained_size  | .. 10,000            | eval samples kept in keyed state             |
| evaluation.fixed_size                   | 1 .. 10,000          | lines of eval_uri scored                     |
| evaluation.eval_uri                     | <= 4,096 chars; file <= 64 MiB (STREAMTUNE_EVAL_MAX_BYTES), under the eval roots | read by every worker |
| replay.buffer_size                      | 1 .. 100,000         | samples kept in keyed state                  |
| replay.ratio                            | (0, 16]              | replayed samples per new one                 |
| seed                                    | a signed 64-bit int  | what torch accepts                           |
| model_id / stream_source / base_model   | 128 / 2,048 / 1,024 chars | stored and published with every record  |
| retention.keep_last                     | 1 .. 100,000 (default 50) | versions kept in the registry besides the aliased ones |

>>> RetentionPolicy().keep_last, spec.model_copy(update={"retention": RetentionPolicy(keep_last=5)}).spec_hash() != spec.spec_hash()
(50, True)
>>> RetentionPolicy.from_dict({"keep_last": 0})
Traceback (most recent call last):
...
core.errors.InvalidMessage: keep_last: Input should be greater than or equal to 1
>>> TriggerPolicy.from_dict({"min_samples_per_window": 1, "window_seconds": 1, "max_samples_per_step": 10**6})
Traceback (most recent call last):
...
core.errors.InvalidMessage: max_samples_per_step: Input should be less than or equal to 100000

An eval file under /dev, /proc or /sys, or with `..` in its path, is refused here; the
reader confines it to the eval roots and caps what it reads (operators/quality.py):

>>> EvaluationConfig.from_dict({"eval_uri": "file:///dev/zero"})
Traceback (most recent call last):
...
core.errors.InvalidMessage: eval_uri: Value error, eval_uri must be a regular JSONL file, not under /dev, /proc or /sys

A stream_source with a password is refused without repeating it (core/sources/base.py):
the value pydantic reports back is redacted too.

>>> FinetuneSpec.from_dict({**spec.model_dump(), "stream_source": "postgres://u:hunter2@db/app?table=t"})
Traceback (most recent call last):
...
core.errors.InvalidMessage: stream_source: Value error, a password in a source URI is refused (it would be stored, published and shown): name a secret reference instead, ?password_env=VAR or ?password_file=/run/secrets/FILE
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from core.messages.base import MODEL_ID, Message
from core.sources import SourceKind, redact_uri, source_for, uri_has_secret
from core.sources.base import allow_uri_passwords
from core.sources.kafka import KafkaSource

# Never an eval set: devices and kernel files (/dev/zero, /dev/urandom never end).
SPECIAL_ROOTS = ("/dev", "/proc", "/sys")


class AdapterConfig(Message):
    rank: int = Field(ge=1, le=512)
    alpha: float = Field(gt=0, le=4096, allow_inf_nan=False)  # JSON 1e999 is inf: NaN weights, a null in versions
    target_modules: list[str] = Field(min_length=1, max_length=64)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)

    @field_validator("target_modules")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or any(not m or len(m) > 128 for m in v):
            raise ValueError("target_modules must be distinct, non-empty names of at most 128 characters")
        return v

    @property
    def shape_key(self) -> str:
        """Rank and targets: what a saved adapter must match to be continued."""
        return f"r{self.rank}:" + ",".join(sorted(self.target_modules))


class AdaptiveGranularity(Message):
    """Bounds and thresholds of `trigger_policy.mode: adaptive` (operators/granularity.py).

    Each step's size (samples) is the gradient noise scale B_simple = tr(Σ)/|G|² of
    McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", estimated from the
    LoRA gradients of the previous steps' micro-batches and clamped to
    [min_samples_low, min_samples_high]: consistent gradients, small steps; noisy ones,
    larger steps. A loss shift (the new window's loss `shift_z` standard deviations above
    its running mean) drops the size to min_samples_low at once.

    >>> AdaptiveGranularity(min_samples_low=8, min_samples_high=64).shift_z
    3.0
    >>> AdaptiveGranularity.from_dict({"min_samples_low": 64, "min_samples_high": 8})
    Traceback (most recent call last):
    ...
    core.errors.InvalidMessage: (root): Value error, trigger_policy.adaptive: min_samples_low (64) must be <= min_samples_high (8)
    """

    min_samples_low: int = Field(ge=2, le=100_000)
    min_samples_high: int = Field(ge=2, le=100_000)
    # Weight of the older estimate in the running means of |G|² and tr(Σ) (the paper's
    # estimators are unbiased but noisy one step at a time).
    noise_decay: float = Field(default=0.8, ge=0.0, lt=1.0)
    shift_z: float = Field(default=3.0, gt=0.0, le=1000.0, allow_inf_nan=False)
    loss_decay: float = Field(default=0.8, ge=0.0, lt=1.0)  # of the running loss mean and variance
    warmup_steps: int = Field(default=3, ge=1, le=1000)     # steps before a loss shift can be called

    @model_validator(mode="after")
    def _ordered(self) -> "AdaptiveGranularity":
        if self.min_samples_low > self.min_samples_high:
            raise ValueError(f"trigger_policy.adaptive: min_samples_low ({self.min_samples_low}) must be <= "
                             f"min_samples_high ({self.min_samples_high})")
        return self


class TriggerPolicy(Message):
    min_samples_per_window: int = Field(ge=1, le=100_000)
    window_seconds: int = Field(ge=1, le=86400)
    max_samples_per_step: int = Field(default=1024, ge=1, le=100_000)
    # None (absent) or "fixed": every window fires at min_samples_per_window, in steps of at
    # most max_samples_per_step. "adaptive": the step size follows the stream (`adaptive`),
    # starting at min_samples_per_window.
    mode: Optional[Literal["fixed", "adaptive"]] = None
    adaptive: Optional[AdaptiveGranularity] = None

    @model_validator(mode="after")
    def _cap_above_min(self) -> "TriggerPolicy":
        if self.max_samples_per_step < self.min_samples_per_window:
            raise ValueError("max_samples_per_step must be >= min_samples_per_window")
        if self.mode == "adaptive":
            a = self.adaptive
            if a is None:
                raise ValueError("trigger_policy.mode adaptive needs trigger_policy.adaptive "
                                 "{min_samples_low, min_samples_high}")
            if not a.min_samples_low <= self.min_samples_per_window <= a.min_samples_high:
                raise ValueError(f"trigger_policy.min_samples_per_window ({self.min_samples_per_window}), the first "
                                 f"step's size, must lie within adaptive [{a.min_samples_low}, {a.min_samples_high}]")
            if a.min_samples_high > self.max_samples_per_step:
                raise ValueError(f"trigger_policy.adaptive.min_samples_high ({a.min_samples_high}) must be <= "
                                 f"max_samples_per_step ({self.max_samples_per_step})")
        elif self.adaptive is not None:
            raise ValueError("trigger_policy.adaptive is set but mode is not adaptive: set mode: adaptive or drop it")
        return self

    @property
    def is_adaptive(self) -> bool:
        return self.mode == "adaptive"


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
    # Confined to the eval roots and read at most STREAMTUNE_EVAL_MAX_BYTES (operators/quality.py).
    eval_uri: Optional[str] = Field(default=None, pattern=r"^(file://)?/", max_length=4096)
    metric: Literal["exact_match", "loss"] = "exact_match"  # exact_match: greedy decoding equals the completion
    recent_size: int = Field(default=64, ge=1, le=10_000)
    retained_size: int = Field(default=256, ge=0, le=10_000)
    fixed_size: int = Field(default=256, ge=1, le=10_000)  # lines of eval_uri used (a hash sample beyond it)
    tolerance: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    forgetting_tolerance: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)

    @field_validator("eval_uri")
    @classmethod
    def _plain_file(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        path = v.removeprefix("file://")
        if "\0" in path or ".." in path.split("/"):
            raise ValueError("eval_uri must be an absolute path without '..'")
        if any(path == root or path.startswith(root + "/") for root in SPECIAL_ROOTS):
            raise ValueError("eval_uri must be a regular JSONL file, not under /dev, /proc or /sys")
        return v

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


class RetentionPolicy(Message):
    """Which registered versions of a model stay in MLflow (connectors/registry_retention.py):
    every version an alias points at, and the newest `keep_last`; the others are deleted from
    the registry, their runs and their files in the artifact store. Without the section the
    default applies (the newest 50): at 1 s windows a model would otherwise gain 86,400
    versions a day."""

    keep_last: int = Field(default=50, ge=1, le=100_000)


class FinetuneSpec(Message):
    model_id: str = Field(pattern=MODEL_ID)
    stream_source: str = Field(max_length=2048)
    adapter_config: AdapterConfig
    trigger_policy: TriggerPolicy
    base_model: Optional[str] = Field(default=None, max_length=1024)
    training: TrainingConfig = TrainingConfig()
    seed: int = Field(default=0, ge=-(2 ** 63), le=2 ** 63 - 1)
    evaluation: Optional[EvaluationConfig] = None
    replay: Optional[ReplayConfig] = None
    ewc: Optional[EwcConfig] = None
    pseudo_labels: Optional[PseudoLabelConfig] = None
    retention: Optional[RetentionPolicy] = None  # None: RetentionPolicy()'s default

    @model_validator(mode="after")
    def _adaptive_sees_micro_batches(self) -> "FinetuneSpec":
        adaptive = self.trigger_policy.adaptive if self.trigger_policy.is_adaptive else None
        if adaptive and adaptive.min_samples_low < 2 * self.training.micro_batch_size:
            raise ValueError(f"trigger_policy.adaptive.min_samples_low ({adaptive.min_samples_low}) must be at least "
                             f"2 x training.micro_batch_size ({self.training.micro_batch_size}): the gradient noise "
                             "statistic compares the micro-batches of a step")
        return self

    @model_validator(mode="before")
    @classmethod
    def _redact_refused_secret(cls, data):
        """A stream_source with a password is refused below; what pydantic reports back as
        the refused input (the API's 422 answer, logs) must not carry it: redact it first."""
        if isinstance(data, dict) and isinstance(data.get("stream_source"), str) and not allow_uri_passwords() \
                and uri_has_secret(data["stream_source"]):
            return {**data, "stream_source": redact_uri(data["stream_source"])}
        return data

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
        for optional in ("evaluation", "replay", "ewc", "pseudo_labels", "retention"):  # absent sections leave the hash of older specs as it was
            if fields[optional] is None:
                del fields[optional]
        for optional in ("mode", "adaptive"):  # the same for the trigger policy's adaptive mode
            if fields["trigger_policy"][optional] is None:
                del fields["trigger_policy"][optional]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
