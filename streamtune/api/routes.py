"""The endpoints of the control plane.

| endpoint                                | scope    | what it does                                  |
|-----------------------------------------|----------|-----------------------------------------------|
| POST   /v1/stream-finetune              | admin    | submit a job for the spec's topic, or hot-update |
| GET    /v1/stream-finetune/{model_id}   | read     | job state, spec hash in force, last version, counters |
| DELETE /v1/stream-finetune/{model_id}   | admin    | forget the model; last model: stop job with savepoint |
| GET    /v1/models                       | read     | every registered model: aliases, newest version |
| GET    /v1/models/{model_id}/versions   | read     | MLflow versions                               |
| POST   /v1/models/{model_id}/aliases    | admin    | move an alias (promote / roll back), logged   |
| GET    /v1/models/{model_id}/promotions | read     | the promotion log of that model               |
| GET    /v1/models/{model_id}/serving    | read     | streamtune serve's split and online metrics (proxied) |
| POST   /v1/feedback                     | feedback | click / dwell / correction events → feedback topic |

Tokens (streamtune.auth). An admin token (STREAMTUNE_API_TOKEN among others) passes every
check; a read token the reads; the feedback token (STREAMTUNE_API_FEEDBACK_TOKEN), meant for
pages that embed /feedback.js, POST /v1/feedback only: any other call answers 403 to it.
Without a token every call but /healthz answers 401, before any lookup: a stranger cannot
tell which models exist.

Jobs. One Flink job per Kafka source topic T, named `streamtune-T`, reading feedback from T
and configs from `T.configs`, writing versions to `T.versions` and dead letters to `T.dlq`.
A spec is idempotent by (model_id, spec hash): posting the spec in force again returns 200
with the first answer and publishes nothing. Only `kafka://` sources can be submitted here:
`postgres://` and `mongodb://` sources get 501 here: they are applied as pipelines, whose
`cdc` block maps rows to samples.

Errors from the stack (Flink cluster, Kafka, MLflow unreachable or failing) are answered
with a documented 503 and a one-line `detail`; nothing is recorded in that case.

Pipelines (streamtune/api/pipelines.py: POST/GET/DELETE /v1/pipelines) apply the same specs
and CDC sources too: the control plane then runs the capture and jobs/cdc_retrain.py.

Counters (GET status): the job's own Flink counters since its last start (job-wide, not
per model; streamtune.api.models.Counters); `trained_samples` is the sum of the `samples`
tag over the model's MLflow versions (per model, exact for registered versions).

Feedback. Events become feedback samples as `streamtune.api.models` describes. A request
holds one event or a JSON array of at most `max_feedback_batch` events (413 beyond); every
model must have a registered spec (404 otherwise) and nothing is produced unless the whole
request is valid. Feedback cannot steer production (streamtune.api.feedback_limits): each
token's events are rate limited (429 with Retry-After), weights clamped to a cap, and an
event whose `ts` lies beyond the skew or the retention (`timestamp`) or which cites a
response id no server of the deployment signed (`unsigned_response`) is dead-lettered to its
job's DLQ topic, never produced as a sample; the answer lists those events and why
(accepted + dead_lettered = events sent).
"""

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional, Union

from fastapi import APIRouter, Body, Depends, HTTPException, Path as PathParam, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import Field

from core import defaults, redaction
from core.messages import MODEL_ID, AliasMove, DeadLetter, FinetuneSpec, SourcePosition
from streamtune.auth import Principal, RequireScope

from .captures import CaptureSupervisor
from .feedback_limits import FeedbackLimits
from .gateway import (LIVE_STATES, MlflowNotFound, NotServed, StackGateway, StackUnavailable, job_name, job_topics,
                      unusable_job_topic)
from .jobs_file import JobsFile, PromotionLog
from .models import (AliasRequest, AliasResponse, Counters, ErrorBody, FeedbackAccepted, FeedbackDeadLetter,
                     FeedbackEvent, ModelsResponse, Promotion, PromotionsResponse, ServingResponse, StatusResponse, StopResponse,
                     SubmitResponse, VersionsResponse, Window, to_sample)


@dataclass
class ControlPlane:
    """What the routes work with; create_app keeps one in `app.state.control_plane`."""

    gateway: StackGateway
    jobs: JobsFile
    promotions: PromotionLog
    max_feedback_batch: int
    captures: CaptureSupervisor    # the CDC pipelines' captures
    pipelines_dir: Path            # their mapping files
    # Submitting and stopping read, change and write the jobs file: one at a time.
    jobs_lock: threading.Lock = field(default_factory=threading.Lock)
    # POST /v1/feedback's checks: signed response ids, event time, rate and weight cap.
    feedback_limits: FeedbackLimits = field(default_factory=FeedbackLimits)


def control_plane(request: Request) -> ControlPlane:
    return request.app.state.control_plane


Plane = Annotated[ControlPlane, Depends(control_plane)]


def _answer(status: int):
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status)

    return handler


# The gateway's errors and their answers (documented per route below).
EXCEPTION_HANDLERS = {StackUnavailable: _answer(503), MlflowNotFound: _answer(404), NotServed: _answer(404)}

# ---------------------------------------------------------------- auth
# Each route declares its scope here (streamtune.auth); AuthMiddleware enforces it before
# the route runs, and create_app refuses to build an app with a route that declares none.


def _actor(scope: str):
    def caller(principal: Annotated[Principal, Depends(RequireScope(scope))]) -> str:
        """Who called, as the promotion log names it (`scope:token id`, never the token)."""
        return principal.actor

    return caller


Writer = Annotated[str, Depends(_actor("admin"))]
Reader = Annotated[str, Depends(_actor("read"))]
FeedbackWriter = Annotated[str, Depends(_actor("feedback"))]

# ---------------------------------------------------------------- documented error answers


def _err(status: int, description: str) -> dict:
    return {status: {"model": ErrorBody, "description": description}}


AUTH_ERR = {**_err(401, "missing or wrong bearer token"),
            **_err(403, "a token of another scope (e.g. the feedback token, which only POST /v1/feedback accepts)")}
STACK_ERR = _err(503, "the Flink cluster, Kafka or MLflow is not reachable or failed")
NOT_FOUND = _err(404, "no such model")
TOO_LARGE = _err(413, "request body or batch too large")
BAD_BODY = _err(400, "the body cannot be parsed (not UTF-8 JSON)")

# ---------------------------------------------------------------- endpoints

log = logging.getLogger("streamtune.api")
router = APIRouter()
ModelIdPath = Annotated[str, PathParam(pattern=MODEL_ID)]


@router.post("/v1/stream-finetune", status_code=202, response_model=SubmitResponse,
             responses={200: {"model": SubmitResponse, "description": "the same spec is already in force"},
                        **AUTH_ERR, **BAD_BODY, **_err(409, "the model is registered on another source topic"),
                        **TOO_LARGE, **_err(501, "CDC sources (postgres, mongodb) are not submitted through the API"),
                        **STACK_ERR})
def submit(spec: FinetuneSpec, actor: Writer, plane: Plane):
    topic = spec.kafka_topic
    if topic is None:
        raise HTTPException(501, f"a {spec.stream_source.split(':', 1)[0]}:// source needs a mapping of rows to "
                                 "samples: apply it as a pipeline with a `cdc` block (POST /v1/pipelines, "
                                 "`streamtune apply -f pipeline.yaml`)")
    with plane.jobs_lock:
        return apply_spec(plane, spec)


def apply_spec(plane: ControlPlane, spec: FinetuneSpec) -> JSONResponse:
    """Submit the job for a kafka:// spec's topic or hot-update it (the caller holds jobs_lock)."""
    topic = spec.kafka_topic
    problem = unusable_job_topic(topic)
    if problem:  # the spec's schema allows it; the job's derived topics would not exist
        raise RequestValidationError([{"type": "value_error", "loc": ("body", "stream_source"), "msg": problem,
                                       "input": spec.stream_source}])
    spec_hash = spec.spec_hash()
    data = plane.jobs.load()
    entry = data["models"].get(spec.model_id)
    if entry and entry["spec_hash"] == spec_hash:
        return JSONResponse(entry["response"], status_code=200)
    if entry and entry["topic"] != topic:
        raise HTTPException(409, f"model {spec.model_id} is trained from topic {entry['topic']}; "
                                 "DELETE it first to move it to another source")
    job_id = plane.gateway.live_job(topic, data["jobs"].get(topic, {}).get("job_id"))
    submitted = job_id is None
    if submitted:
        job_id = plane.gateway.submit_job(topic)
        data["jobs"][topic] = {"job_id": job_id, "job_name": job_name(topic), "topics": job_topics(topic),
                               "submitted_at": _now_ms()}
    else:
        job = data["jobs"].setdefault(topic, {"job_name": job_name(topic), "topics": job_topics(topic),
                                              "submitted_at": None})
        job["job_id"] = job_id
    now = _now_ms()
    try:
        plane.gateway.produce(job_topics(topic)["configs"], [(spec.model_id, spec, now)])
    except StackUnavailable:
        if submitted:  # record the job so a retry hot-updates it instead of submitting another
            plane.jobs.save(data)
        raise
    response = SubmitResponse(job_id=job_id, model_id=spec.model_id, config_version=spec_hash,
                              submitted=submitted).model_dump()
    data["models"][spec.model_id] = {"topic": topic, "spec": spec.model_dump(mode="json"),
                                     "spec_hash": spec_hash, "job_id": job_id, "response": response,
                                     "registered_at": now}
    plane.jobs.save(data)
    return JSONResponse(response, status_code=202)


@router.get("/v1/stream-finetune/{model_id}", response_model=StatusResponse,
            responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR})
def status(model_id: ModelIdPath, actor: Reader, plane: Plane):
    data = plane.jobs.load()
    entry = _model_entry(data, model_id)
    topic = entry["topic"]
    job_id = _job_id(data, entry)
    try:
        job_state = plane.gateway.job_state(job_id)
    except StackUnavailable:
        job_state = None
    try:
        versions = plane.gateway.versions(model_id)
    except (StackUnavailable, MlflowNotFound):
        versions = []
    last = versions[-1] if versions else None
    job = plane.gateway.job_counters(job_id) if job_state == "RUNNING" else None
    counter = (lambda name: job.get(name, 0)) if job is not None else (lambda name: None)
    counters = Counters(records_in=counter("validate.records_in"), valid=counter("validate.valid"),
                        dead_lettered=counter("validate.dead_lettered"),
                        samples_trained=counter("lora-trainer.samples_trained"),
                        windows_fired=counter("lora-trainer.windows_fired"),
                        unknown_model_dead_lettered=counter("lora-trainer.unknown_model_dead_lettered"),
                        registered=counter("register-versions.registered"),
                        trained_samples=sum(v.samples or 0 for v in versions) if versions else None)
    window = Window(start=last.window_start, end=last.window_end) \
        if last and last.window_start is not None and last.window_end is not None else None
    return StatusResponse(model_id=model_id, topic=topic, job_id=job_id, job_name=job_name(topic),
                          job_state=job_state, config_version=entry["spec_hash"], spec=entry["spec"],
                          last_window=window, last_version=last, counters=counters)


@router.delete("/v1/stream-finetune/{model_id}", response_model=StopResponse,
               responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR})
def stop(model_id: ModelIdPath, actor: Writer, plane: Plane):
    with plane.jobs_lock:
        return stop_model(plane, model_id)


def stop_model(plane: ControlPlane, model_id: str) -> StopResponse:
    """Forget the model; stop its job with a savepoint when it was the last (caller holds jobs_lock)."""
    data = plane.jobs.load()
    entry = _model_entry(data, model_id)
    topic = entry["topic"]
    job_id = _job_id(data, entry)
    stopped, savepoint = False, None
    if not any(e["topic"] == topic for m, e in data["models"].items() if m != model_id):
        if plane.gateway.job_state(job_id) in LIVE_STATES:
            savepoint, stopped = plane.gateway.stop_with_savepoint(job_id), True
        data["jobs"].pop(topic, None)
    del data["models"][model_id]
    plane.jobs.save(data)
    return StopResponse(model_id=model_id, job_id=job_id, job_stopped=stopped, savepoint=savepoint)


@router.get("/v1/models", response_model=ModelsResponse, responses={**AUTH_ERR, **STACK_ERR})
def models(actor: Reader, plane: Plane):
    """Every model in the registry, however it was trained; `pipeline` names the control
    plane's pipeline for it, if any."""
    pipelines = set(plane.jobs.load()["pipelines"])
    found = plane.gateway.models()
    return ModelsResponse(models=[m.model_copy(update={"pipeline": m.model_id if m.model_id in pipelines else None})
                                  for m in found])


@router.get("/v1/models/{model_id}/versions", response_model=VersionsResponse,
            responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR})
def versions(model_id: ModelIdPath, actor: Reader, plane: Plane):
    return VersionsResponse(model_id=model_id, versions=plane.gateway.versions(model_id))


@router.post("/v1/models/{model_id}/aliases", response_model=AliasResponse,
             responses={**AUTH_ERR, **BAD_BODY, **_err(404, "no such model or version"), **TOO_LARGE, **STACK_ERR})
def move_alias(model_id: ModelIdPath, body: AliasRequest, actor: Writer, plane: Plane):
    from_version = plane.gateway.move_alias(model_id, body.alias, body.version)
    plane.promotions.append(model_id, body.alias, from_version, body.version, actor)
    # The registry moved: tell followers now rather than at their next poll (a hint only).
    move = AliasMove(model_id=model_id, alias=body.alias, version=body.version, from_version=from_version,
                     actor=actor, ts=int(time.time() * 1000))
    try:
        plane.gateway.ensure_topic(defaults.ALIAS_MOVES_TOPIC)
        plane.gateway.produce(defaults.ALIAS_MOVES_TOPIC, [(model_id, move, move.ts)])
    except StackUnavailable as e:  # followers still see the move at their next registry poll
        log.warning("alias move of %s not announced: %s", model_id, e)
    return AliasResponse(model_id=model_id, alias=body.alias, from_version=from_version, to_version=body.version)


@router.get("/v1/models/{model_id}/promotions", response_model=PromotionsResponse,
            responses={**AUTH_ERR})
def promotion_log(model_id: ModelIdPath, actor: Reader, plane: Plane):
    return PromotionsResponse(model_id=model_id,
                              promotions=[Promotion.model_validate(e) for e in plane.promotions.entries(model_id)])


@router.get("/v1/models/{model_id}/serving", response_model=ServingResponse,
            responses={**AUTH_ERR, **_err(404, "the server does not serve that model"),
                       **_err(503, "streamtune serve is not reachable at STREAMTUNE_SERVE_URL, or failed")})
def serving(model_id: ModelIdPath, actor: Reader, plane: Plane):
    """The inference server's split for the model, per-arm counters and online metrics, and the
    rollback decisions it took: fetched from `streamtune serve` (STREAMTUNE_SERVE_URL) by the
    control plane, so a browser needs no access to the server."""
    return plane.gateway.serving(model_id)


@router.post("/v1/feedback", status_code=202, response_model=FeedbackAccepted,
             responses={**AUTH_ERR, **BAD_BODY, **_err(404, "a model has no registered spec"), **TOO_LARGE,
                        **_err(429, "the token's feedback rate is spent (Retry-After: seconds)"), **STACK_ERR})
def feedback(body: Annotated[Union[FeedbackEvent, Annotated[list[FeedbackEvent], Field(min_length=1)]], Body()],
             actor: FeedbackWriter, plane: Plane, request: Request):
    """Events become samples on their model's topic, weights clamped to the cap; events with
    a `ts` outside the skew/retention or citing a response id no server of this deployment
    signed are dead-lettered to the job's DLQ topic instead (streamtune.api.feedback_limits)."""
    events = body if isinstance(body, list) else [body]
    if len(events) > plane.max_feedback_batch:
        raise HTTPException(413, f"{len(events)} events exceed the batch limit of {plane.max_feedback_batch}")
    limits = plane.feedback_limits
    wait = limits.admit(request.headers.get("authorization", ""), len(events))
    if wait:
        retry = "3600" if wait == float("inf") else str(max(1, math.ceil(wait)))
        raise HTTPException(429, f"{len(events)} events exceed this token's feedback rate "
                                 f"({limits.rate:g}/s, burst {limits.burst:g})", headers={"Retry-After": retry})
    models = plane.jobs.load()["models"]
    missing = sorted({e.model_id for e in events} - set(models))
    if missing:
        raise HTTPException(404, f"no registered spec for model(s) {', '.join(missing[:5])}")
    by_topic: dict[str, list] = {}
    refused: list[FeedbackDeadLetter] = []
    letters: dict[str, list] = {}  # DLQ topic -> records
    now = _now_ms()
    for i, e in enumerate(events):
        topic = models[e.model_id]["topic"]
        problem = limits.timestamp_problem(e.ts, now)
        reason = "timestamp"
        if problem is None:
            problem, reason = limits.response_problem(e.request_id), "unsigned_response"
        if problem is not None:
            refused.append(FeedbackDeadLetter(index=i, event_id=e.event_id, model_id=e.model_id, reason=reason,
                                              detail=problem))
            letter = DeadLetter(reason=reason, detail=problem, kind="sample", model_id=e.model_id,
                                payload=redaction.redact_at_edge(e.model_dump_json(exclude_none=True)),
                                source=SourcePosition(topic=topic, partition=-1, offset=-1, timestamp=e.ts))
            letters.setdefault(job_topics(topic)["dlq"], []).append((e.model_id, letter, now))
            continue
        sample = to_sample(e)
        sample = sample.model_copy(update={"weight": limits.cap(sample.weight)})
        by_topic.setdefault(topic, []).append((e.model_id, sample, e.ts))
    for dlq, records in letters.items():
        plane.gateway.ensure_topic(dlq)
        plane.gateway.produce(dlq, records)
    for topic, records in by_topic.items():
        plane.gateway.produce(topic, records)
    if refused:
        log.warning("feedback from %s: %d of %d events dead-lettered (%s)", actor, len(refused), len(events),
                    ", ".join(sorted({d.reason for d in refused})))
    return FeedbackAccepted(accepted=len(events) - len(refused), dead_lettered=len(refused), dead_letters=refused,
                            topics={e.model_id: models[e.model_id]["topic"] for e in events})


def _model_entry(data: dict, model_id: str) -> dict:
    """The jobs file's entry of the model; 404 when it has none."""
    entry = data["models"].get(model_id)
    if entry is None:
        raise HTTPException(404, f"model {model_id} has no registered spec")
    return entry


def _job_id(data: dict, entry: dict) -> str:
    """The id of the job serving the model: its topic's job on record, else the model's own."""
    return data["jobs"].get(entry["topic"], {}).get("job_id", entry["job_id"])


def _now_ms() -> int:
    return int(time.time() * 1000)
