"""Version record: one trained adapter version, emitted by the trainer for each fired window
through the exactly-once sink of the job's versions topic (read it with `read_committed`).

`version_id = <model>@<window_end>#<first partition:offset>-<last partition:offset>` names
the version; a replay after a crash emits the same record again, so every consumer is
idempotent by version_id. `seq` counts a model's versions from 1 with no gap.

>>> r = VersionRecord.model_validate(EXAMPLE)
>>> r.seq, r.metrics.loss_after, r.lineage.offsets[0].last, VersionRecord.from_json(r.to_json()) == r
(1, 0.5, 9, True)

With the spec's `evaluation` section the trainer adds its promotion decision, with the
numbers it compared (records without `gate` stay valid: the registrar's loss rule applies):

>>> g = VersionRecord.model_validate({**EXAMPLE, "gate": GATE_EXAMPLE}).gate
>>> g.promote, g.rule, [(s.name, s.candidate.exact_match, s.champion.exact_match, s.passed) for s in g.sets]
(False, 'eval', [('recent', 0.9, 0.1, True), ('retained', 0.2, 1.0, False)])
>>> g.sets[1].candidate.forgotten
0.8

With `trigger_policy.mode: adaptive` the record says which size the step was cut to and
which statistic chose it (older records, without `granularity`, stay valid):

>>> d = VersionRecord.model_validate({**EXAMPLE, "granularity": GRANULARITY_EXAMPLE}).granularity
>>> d.size, d.rule, d.statistic, d.bounds
(16, 'noise_scale', 15.7, (8, 64))
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from core.messages.base import MODEL_ID, Message
from core.messages.change import ChangeOrigin
from core.messages.spec import AdapterConfig, RetentionPolicy, TriggerPolicy


class VersionMetrics(Message):
    loss_before: float
    loss_after: float
    samples: int = Field(ge=0)
    tokens: int = Field(ge=0)
    step_seconds: float = Field(ge=0)
    operator_seconds: Optional[float] = None  # the whole operator step: state in, training, artifact out
    replayed: Optional[int] = None  # older samples from the replay buffer trained beside `samples`


class EvalScore(Message):
    exact_match: float = Field(ge=0.0, le=1.0)
    loss: float
    # The forgetting guard (retained set, metric exact_match): of the samples the champion
    # answers exactly, the share this version does not.
    forgotten: Optional[float] = Field(default=None, ge=0.0, le=1.0)


class EvalSetResult(Message):
    """One eval set, the new version and the champion scored on the same samples."""

    name: Literal["recent", "retained", "fixed"]
    size: int = Field(ge=1)
    candidate: EvalScore
    champion: Optional[EvalScore] = None  # none yet
    tolerance: float
    passed: bool


class GateDecision(Message):
    """Whether this version becomes `champion`, decided in the trainer (the same on replay)."""

    promote: bool
    # first_version: no champion yet; eval: the eval sets decided; loss: no eval data yet, loss_after decided.
    rule: Literal["first_version", "eval", "loss"]
    reason: str
    metric: Literal["exact_match", "loss"]
    champion_version_id: Optional[str] = None  # the champion it was compared with
    sets: list[EvalSetResult] = []


class GranularityDecision(Message):
    """With `trigger_policy.mode: adaptive`: the size this step was cut to, and why.

    `rule`: initial (no statistic yet: min_samples_per_window), noise_scale (the gradient
    noise scale B_simple of the steps before, clamped to the bounds), loss_shift (the loss
    of the window before rose `threshold` standard deviations above its running mean:
    min_samples_low). `statistic` is the value the rule compared, `threshold` what it was
    compared with (the bounds, for noise_scale). `measured_noise_scale` is this step's own
    estimate, which sizes the next step.
    """

    size: int = Field(ge=1)
    rule: Literal["initial", "noise_scale", "loss_shift"]
    statistic: Optional[float] = None
    threshold: Optional[float] = None
    bounds: tuple[int, int]
    reason: str
    measured_noise_scale: Optional[float] = None
    loss_z: Optional[float] = None  # this step's loss against the running mean, in standard deviations


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
    held_out: Optional[list[str]] = None  # samples that joined the eval sets since the last version (never trained)


class VersionRecord(Message):
    version_id: str = Field(min_length=1)
    model_id: str = Field(pattern=MODEL_ID)
    seq: int = Field(ge=1)
    window_start: int
    window_end: int
    # The artifact store URI of the immutable PEFT files (adapter_config.json +
    # adapter_model.safetensors + manifest.json), named by their sha256: readable from every machine.
    artifact_uri: str = Field(pattern=r"^[a-z][a-z0-9+.-]*://")
    # Of the artifact's manifest.json, which lists every file's sha256 (config and weights):
    # the whole artifact, checked file by file by every reader (connectors/artifact_store.py).
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    base_model: str
    config_version: int = Field(ge=1)
    fresh_adapter: bool
    adapter: AdapterConfig
    trigger_policy: TriggerPolicy
    metrics: VersionMetrics
    lineage: Lineage
    trigger: Literal["window", "max_samples", "forced"]
    gate: Optional[GateDecision] = None  # with the spec's evaluation section: the promotion decision
    retention: Optional[RetentionPolicy] = None  # the spec's; None: the default policy applies
    granularity: Optional[GranularityDecision] = None  # trigger_policy.mode adaptive: the step's size and why


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

GATE_EXAMPLE = {
    "promote": False, "rule": "eval", "metric": "exact_match", "champion_version_id": "bot@0#0:0-0:9",
    "reason": "worse than champion bot@0#0:0-0:9 on retained (forgetting guard): forgot 0.800 of the 64 "
              "answers the champion got right > 0.05",
    "sets": [{"name": "recent", "size": 16, "candidate": {"exact_match": 0.9, "loss": 0.3},
              "champion": {"exact_match": 0.1, "loss": 2.0}, "tolerance": 0.0, "passed": True},
             {"name": "retained", "size": 64, "candidate": {"exact_match": 0.2, "loss": 1.9, "forgotten": 0.8},
              "champion": {"exact_match": 1.0, "loss": 0.1}, "tolerance": 0.05, "passed": False}],
}

GRANULARITY_EXAMPLE = {
    "size": 16, "rule": "noise_scale", "statistic": 15.7, "bounds": [8, 64], "measured_noise_scale": 21.3,
    "reason": "gradient noise scale 15.7 within [8, 64]: steps of 16 samples",
}
