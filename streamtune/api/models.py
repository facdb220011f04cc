"""Request and response bodies of the control plane, and the feedback events it accepts.

Feedback events become feedback samples (core.messages.FeedbackSample):

| event type  | fields                                        | sample                                   |
|-------------|-----------------------------------------------|------------------------------------------|
| click       | prompt, completion                            | label accepted, weight 1                 |
| dwell       | prompt, completion, dwell_seconds             | label accepted, weight min(dwell/10, 3)  |
| correction  | prompt, corrected_completion (original ignored)| label corrected, completion = corrected, weight 1 |

Every event has event_id (→ sample_id), model_id and ts (epoch ms, → sample ts and the
Kafka record timestamp). POST /v1/feedback clamps the weight to its cap (1 by default) and
dead-letters events whose `ts` or cited `request_id` it refuses (streamtune.api.feedback_limits);
FeedbackAccepted says which: accepted + dead_lettered = events sent.

>>> event = DwellEvent(type="dwell", model_id="bot", event_id="e1", prompt="x=1;y=", completion="2",
...                    dwell_seconds=5, ts=0)
>>> to_sample(event).to_json()
'{"model_id":"bot","sample_id":"e1","prompt":"x=1;y=","completion":"2","label":"accepted","weight":0.5,"ts":0}'
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.messages import MODEL_ID, FeedbackSample

DWELL_UNIT_SECONDS = 10.0
DWELL_MAX_WEIGHT = 3.0


class ErrorBody(BaseModel):
    detail: str


class SubmitResponse(BaseModel):
    job_id: str
    model_id: str
    config_version: str = Field(description="the spec hash")
    submitted: bool = Field(description="true when this request submitted a new Flink job")


class EvalSetView(BaseModel):
    """One eval set of the promotion gate: the version and the champion on the same samples."""
    name: str
    size: Optional[int] = None
    exact_match: Optional[float] = None
    loss: Optional[float] = None
    champion_exact_match: Optional[float] = None
    champion_loss: Optional[float] = None
    forgotten: Optional[float] = Field(default=None, description="retained set: share of the champion's exact "
                                                                 "answers this version misses")
    tolerance: Optional[float] = None
    passed: Optional[bool] = None


class GateView(BaseModel):
    """The trainer's promotion gate on a version, from its MLflow tags (`streamtune.gate*`,
    `streamtune.eval.<set>.*`); absent on versions registered without a gate."""
    decision: str = Field(description="promoted | refused")
    rule: Optional[str] = None
    reason: Optional[str] = None
    metric: Optional[str] = None
    champion: Optional[str] = Field(default=None, description="version_id of the champion it was compared with")
    sets: list[EvalSetView] = []


class VersionInfo(BaseModel):
    version: int
    aliases: list[str]
    status: str
    run_id: Optional[str] = None
    source: Optional[str] = None
    created_ms: Optional[int] = None
    version_id: Optional[str] = None
    seq: Optional[int] = None
    window_start: Optional[int] = None
    window_end: Optional[int] = None
    samples: Optional[int] = None
    loss_after: Optional[float] = None
    gate: Optional[GateView] = None
    rollback: Optional[dict[str, Any]] = Field(default=None, description="the serving guard's decision on this "
                                                                         "version (tag streamtune.rollback)")


class ModelSummary(BaseModel):
    """A model registered in MLflow, however it was trained (a pipeline, `flink run`, the demo)."""
    model_id: str
    aliases: dict[str, int] = Field(default_factory=dict, description="alias -> version (champion, candidate, ...)")
    latest_version: Optional[int] = None
    latest_created_ms: Optional[int] = Field(None, description="when the newest version was registered (epoch ms)")
    pipeline: Optional[str] = Field(None, description="the pipeline that trains it, when the control plane has one")


class ModelsResponse(BaseModel):
    models: list[ModelSummary]


class VersionsResponse(BaseModel):
    model_id: str
    versions: list[VersionInfo]


class ArmView(BaseModel):
    """One arm of `streamtune serve` for a model. `requests`/`errors` count this server's
    requests since it started; the rest is the guard's: responses in the inference log and
    feedback citing them, all time, and the acceptance over its window for the arm's version."""
    arm: str = Field(description="champion | candidate | pinned | base")
    version: Optional[int] = None
    requests: int = 0
    errors: int = 0
    responses: Optional[int] = None
    judged: Optional[int] = None
    accepted: Optional[int] = None
    corrected: Optional[int] = None
    rejected: Optional[int] = None
    acceptance: Optional[float] = None
    correction_rate: Optional[float] = None
    window_events: Optional[int] = None
    window_acceptance: Optional[float] = None


class ServingResponse(BaseModel):
    """`GET /v1/models/{id}/serving` of `streamtune serve`, fetched by the control plane."""
    model_id: str
    serve_url: str
    candidate_fraction: float
    aliases: dict[str, int] = Field(description="routes the server acknowledged (alias -> version)")
    registry_aliases: dict[str, Any] = {}
    arms: list[ArmView]
    guard: dict[str, Any] = Field(description="enabled, margin, min_events, window")
    decisions: list[dict[str, Any]] = Field(description="rollback decisions with their numbers")


class Window(BaseModel):
    start: int
    end: int


class Counters(BaseModel):
    """The job's own counters since its last (re)start, read from its Flink metrics (job-wide:
    every model on the topic shares the job); None when the job is not running.
    `records_in` = `valid` + `dead_lettered`; valid samples end in `samples_trained`,
    `unknown_model_dead_lettered`, or a window still open."""
    records_in: Optional[int] = Field(default=None, description="records read (samples, configs, triggers)")
    valid: Optional[int] = Field(default=None, description="records that passed validation")
    dead_lettered: Optional[int] = Field(default=None, description="records rejected by validation (DLQ)")
    samples_trained: Optional[int] = Field(default=None, description="samples in fired windows")
    windows_fired: Optional[int] = Field(default=None, description="versions emitted by the trainer")
    unknown_model_dead_lettered: Optional[int] = Field(default=None, description="samples without a config in time")
    registered: Optional[int] = Field(default=None, description="versions registered in MLflow by the job")
    trained_samples: Optional[int] = Field(default=None, description="samples in this model's MLflow versions")


class StatusResponse(BaseModel):
    model_id: str
    topic: str
    job_id: str
    job_name: str
    job_state: Optional[str] = Field(description="Flink's job state; null when the cluster is unreachable")
    config_version: str
    spec: dict[str, Any]
    last_window: Optional[Window] = None
    last_version: Optional[VersionInfo] = None
    counters: Counters


class StopResponse(BaseModel):
    model_id: str
    job_id: str
    job_stopped: bool
    savepoint: Optional[str] = None


class AliasRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alias: str = Field(default="champion", pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
    version: int = Field(ge=1, le=2**31 - 1)

    @field_validator("alias")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v.lower() == "latest" or re.fullmatch(r"[vV]\d+", v):
            raise ValueError("'latest' and v<N> are reserved by MLflow")
        return v


class AliasResponse(BaseModel):
    model_id: str
    alias: str
    from_version: Optional[int]
    to_version: int


class Promotion(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    ts: int
    model_id: str
    alias: str
    from_: Optional[int] = Field(alias="from")
    to: int
    actor: str


class PromotionsResponse(BaseModel):
    model_id: str
    promotions: list[Promotion]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(pattern=MODEL_ID)
    event_id: str = Field(min_length=1, max_length=256, description="becomes the sample_id")
    prompt: str = Field(max_length=65536)
    ts: int = Field(ge=0, le=2**53, description="event time, epoch milliseconds")
    request_id: Optional[str] = Field(default=None, max_length=256,
                                      description="the `id` of the served response this event judges")


class ClickEvent(_Event):
    type: Literal["click"]
    completion: str = Field(min_length=1, max_length=65536)


class DwellEvent(_Event):
    type: Literal["dwell"]
    completion: str = Field(min_length=1, max_length=65536)
    dwell_seconds: float = Field(ge=0, le=86400)


class CorrectionEvent(_Event):
    type: Literal["correction"]
    corrected_completion: str = Field(min_length=1, max_length=65536)
    original_completion: Optional[str] = Field(default=None, max_length=65536)


FeedbackEvent = Annotated[Union[ClickEvent, DwellEvent, CorrectionEvent], Field(discriminator="type")]


class FeedbackDeadLetter(BaseModel):
    """An event of the request that was dead-lettered (to its model's job DLQ topic) instead
    of produced as a sample."""
    index: int = Field(description="position of the event in the request (0 for a single event)")
    event_id: str
    model_id: str
    reason: Literal["timestamp", "unsigned_response"]
    detail: str


class FeedbackAccepted(BaseModel):
    accepted: int = Field(description="events produced as samples")
    dead_lettered: int = Field(default=0, description="events dead-lettered; accepted + dead_lettered = events sent")
    dead_letters: list[FeedbackDeadLetter] = []
    topics: dict[str, str] = Field(description="model_id -> feedback topic")


def to_sample(event: Union[ClickEvent, DwellEvent, CorrectionEvent]) -> FeedbackSample:
    """The feedback sample an event becomes (the table above)."""
    if isinstance(event, CorrectionEvent):
        completion, label, weight = event.corrected_completion, "corrected", 1.0
    elif isinstance(event, DwellEvent):
        completion, label = event.completion, "accepted"
        weight = min(event.dwell_seconds / DWELL_UNIT_SECONDS, DWELL_MAX_WEIGHT)
    else:
        completion, label, weight = event.completion, "accepted", 1.0
    return FeedbackSample(model_id=event.model_id, sample_id=event.event_id, prompt=event.prompt,
                          completion=completion, label=label, weight=weight, ts=event.ts,
                          request_id=event.request_id)
